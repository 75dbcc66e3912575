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


@pytest.mark.parametrize("fate", sorted(STEPS))
def test_a_poisoned_donor_dropped_after_its_step_goes_before_the_next_barrier(
        dev, fate, monkeypatch):
    """The loop held the old state through its barrier, then dropped it: the
    poisoned donor, in flight, is let go before the next real barrier (so
    torch_xla's walk does not meet it), and its verdict, read from the
    buffer, still comes out right."""
    from torch_xla_donate._outcomes import verdicts

    x = materialize(torch.arange(16.0, device=dev))
    tdx.donate_buffer(x)
    old = x
    x = STEPS[fate](x)
    torch_xla.sync(wait=False)
    gone = weakref.ref(old)
    del old
    assert gone() is not None, "kept in flight until the next barrier"
    seen = []
    release = verdicts.release_unheld

    def spy():
        release()
        seen.append(gone() is None)

    monkeypatch.setattr(verdicts, "release_unheld", spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = x + 1
        torch_xla.sync()
    assert seen == [True], "the dropped donor must go before the real barrier"
    stats = _C.step_stats(_C.current_step() - 1)
    unused_warned = [w for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    assert (stats["reused"], stats["unused"], stats["in_flight"]) == (
        (1, 0, 0) if fate == "reused" else (0, 1, 0))
    assert len(unused_warned) == (fate == "unused")
    assert y.cpu().tolist() == (x + 1).cpu().tolist()


def test_an_entry_unpacks_as_a_pair(dev):
    from torch_xla_donate._outcomes import verdicts

    x = materialize(torch.arange(4.0, device=dev))
    tdx.donate_buffer(x)
    old = x
    x = x * 2
    torch_xla.sync(wait=False)
    (entry,) = [e for e in verdicts._in_flight if e[0] is old]
    t, record = entry
    assert t is old and record is entry[1] and list(entry) == [old, record]
    tdx.settle()
