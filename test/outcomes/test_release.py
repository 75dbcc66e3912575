"""Donors let go at the commit: a donated tensor nobody refers to any more
(the loop rebound its name) dies when its step is committed, as raw
donation's old tensors die while tracing, not at the next barrier.  Its
verdict reads the buffer its entry kept, so it still comes out right:
REUSED when an output took the buffer, UNUSED (and warned) when none
could.  A donor the user still holds is kept and poisoned as before."""
import warnings
import weakref

import pytest
import torch
import torch_xla
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C

# What the step makes of the donor: an output of its size (the buffer is
# reused), or none (the donation is unused).
STEPS = {
    "reused": lambda x: x * 2 + 1,
    "unused": lambda x: x.sum(),
}


def _barrier(wait):
    if wait == "step_block":
        return  # the step block's own sync
    torch_xla.sync(wait=wait == "sync")


@pytest.mark.parametrize("wait", ["sync", "sync(wait=False)", "step_block"])
@pytest.mark.parametrize("fate", sorted(STEPS))
def test_a_dropped_donor_dies_at_the_commit_and_its_verdict_is_right(dev, fate, wait):
    x = materialize(torch.arange(16.0, device=dev))
    before = buffer_ptr(x)
    gone = weakref.ref(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_xla.step() if wait == "step_block" else _nothing():
            tdx.donate_buffer(x)
            x = STEPS[fate](x)  # the donor's last name rebound
            _barrier(wait)
        assert gone() is None, "the donor must die at the commit, not at the next barrier"
        tdx.settle()
    stats = _C.step_stats()
    unused_warned = [w for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    if fate == "reused":
        assert (stats["reused"], stats["unused"]) == (1, 0)
        assert buffer_ptr(x) == before  # the output lives in the donated buffer
        assert x.cpu().tolist() == [2.0 * i + 1 for i in range(16)]
        assert not unused_warned
    else:
        assert (stats["reused"], stats["unused"]) == (0, 1)
        assert len(unused_warned) == 1
        assert x.item() == sum(range(16))


@pytest.mark.parametrize("fate", sorted(STEPS))
def test_a_held_donor_is_kept_and_poisoned_until_its_verdict(dev, fate):
    x = materialize(torch.arange(16.0, device=dev))
    tdx.donate_buffer(x)
    old = x
    x = STEPS[fate](x)
    torch_xla.sync(wait=False)
    assert type(old) is not torch.Tensor  # the poisoned twin of its class
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        if fate == "reused":
            with pytest.raises(tdx.DonatedBufferError):
                old + 1
        else:
            assert (old + 1).cpu().tolist() == [i + 1.0 for i in range(16)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
