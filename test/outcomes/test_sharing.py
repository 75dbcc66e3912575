"""Buffers torch_xla shares between distinct tensors (sharing.py): a
donation never destroys a tensor that was not donated.

torch_xla backs some copies with their source's device buffer, also after a
barrier; donating either side would destroy the other.  Both sides are seen
from the buffer's holder count, and a copy made from a marked tensor in the
same step by the walk of torch_xla's live tensors.
Each case checks the ground truth: the other tensor keeps its value, and
the donation is dropped with a warning that names it and says what to do.
"""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import COPIES, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _holders as sharing


def _donate_and_step(t):
    """Donates ``t`` to a step that could reuse its buffer; returns the
    warnings the step gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdx.donate_buffer(t)
        new = t * 2
        torch_xla.sync()
        xm.wait_device_ops()
        tdx.settle()
    return new, [w for w in caught if issubclass(w.category, tdx.DroppedDonationWarning)]


@pytest.mark.parametrize("copy", list(COPIES))
@pytest.mark.usefixtures("native_reads")
def test_the_source_of_a_copy_holding_its_buffer_is_not_donated(dev, copy):
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES[copy](w)
    torch_xla.sync()  # the copy takes w's buffer as its own
    assert torch_xla._XLAC._get_tensors_handle([w]) == torch_xla._XLAC._get_tensors_handle([c])
    value = w.cpu()
    new, dropped = _donate_and_step(w)
    assert not tdx.is_deleted(w) and torch.equal(w.cpu(), value) and torch.equal(c.cpu(), value)
    assert torch.equal(new.cpu(), value * 2)
    assert len(dropped) == 1
    assert "shares its device buffer with" in str(dropped[0].message)
    assert ".clone()" in str(dropped[0].message)
    assert tdx.last_step_report().dropped == 1


@pytest.mark.usefixtures("native_reads")
def test_a_target_network_copied_with_load_state_dict_is_named_and_kept(dev):
    """A DQN target network (or an EMA copy): the policy network's update
    donates its parameters, the target keeps its copy."""
    policy = torch.nn.Linear(8, 8).to(dev)
    target = torch.nn.Linear(8, 8).to(dev)
    torch_xla.sync()
    target.load_state_dict(policy.state_dict())
    torch_xla.sync()
    kept = {k: v.detach().cpu() for k, v in target.state_dict().items()}
    with pytest.warns(tdx.DroppedDonationWarning) as caught:
        tdx.donate(policy)
        new = [p * 0.5 for p in policy.parameters()]
        torch_xla.sync()
        tdx.settle()
    said = " ".join(str(w.message) for w in caught)
    assert "the parameter 'weight' of Linear" in said and "the parameter 'bias' of Linear" in said
    for name, value in target.state_dict().items():
        assert torch.equal(value.cpu(), kept[name])
    assert not any(tdx.is_deleted(p) for p in policy.parameters())
    assert [t.cpu().shape for t in new] == [(8, 8), (8,)]


@pytest.mark.usefixtures("native_reads")
def test_a_source_whose_copy_is_gone_is_donated(dev, monkeypatch):
    """The copy died: nothing else holds the buffer, so the donation goes
    ahead.  Native reads see it from the buffer's count, without looking for
    holders."""
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](w)
    torch_xla.sync()
    del c
    looks = []
    real = sharing.live_sharers
    monkeypatch.setattr(sharing, "live_sharers", lambda *a: looks.append(1) or real(*a))
    new, dropped = _donate_and_step(w)
    assert tdx.is_deleted(w) and not dropped and not looks
    # Undonated twice in a row (no output can take it): still one look.
    v = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](v)
    torch_xla.sync()
    del c
    for _ in range(2):  # the warning ignored: counted each time
        before = tdx.summary().totals.unused
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
            tdx.donate_buffer(v)
            torch_xla.sync()
            tdx.settle()
        assert tdx.summary().totals.unused == before + 1 and not tdx.is_deleted(v)
    assert not looks


@pytest.mark.parametrize("case", ["the copy", "a copy made after marking"])
@pytest.mark.usefixtures("native_reads")
def test_the_copy_and_a_copy_made_after_marking_are_seen(dev, case):
    w = materialize(torch.randn(8, 8, device=dev))
    if case == "the copy":
        c = COPIES["copy_"](w)
        torch_xla.sync()
        keep, donor = w, c
    else:
        keep, donor = None, w
    value = w.cpu()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdx.donate_buffer(donor)
        if keep is None:
            keep = COPIES["copy_"](w)  # a copy of the marked tensor, since the barrier
        new = donor * 2
        torch_xla.sync()
        xm.wait_device_ops()
        tdx.settle()
    dropped = [w_ for w_ in caught if issubclass(w_.category, tdx.DroppedDonationWarning)]
    assert len(dropped) == 1 and "shares its device buffer with a tensor f32[8,8]" in str(
        dropped[0].message)
    assert torch.equal(keep.cpu(), value) and torch.equal(donor.cpu(), value)
    assert torch.equal(new.cpu(), value * 2)


@pytest.mark.usefixtures("native_reads")
def test_what_nothing_shares_is_donated(dev):
    p = materialize(torch.randn(8, 8, device=dev))
    other = materialize(torch.randn(8, 8, device=dev))
    new, dropped = _donate_and_step(p)
    assert tdx.is_deleted(p) and not dropped and not tdx.is_deleted(other)


@pytest.mark.usefixtures("native_reads")
def test_donors_of_one_step_may_share_a_buffer(dev):
    """Both sides donated together: nobody else holds the buffer, so it is
    donated and both are poisoned."""
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](w)
    torch_xla.sync()
    tdx.donate([w, c])
    new = w * 2 + 1
    torch_xla.sync()
    tdx.settle()
    assert tdx.is_deleted(w) and tdx.is_deleted(c)
    assert new.shape == (8, 8)


@pytest.mark.parametrize("copy", ["clone", "deepcopy"] + list(COPIES))
@pytest.mark.usefixtures("native_reads")
def test_a_same_step_clone_keeps_every_donation_and_a_copy_drops_it(dev, copy):
    """A loop logging its update with ``prev = p.clone()``: the clone gets a
    buffer of its own at the barrier, so every step's donation is reused; a
    copy torch_xla backs with p's buffer drops it.  Values equal the loop
    without donation either way."""
    import copy as copy_module

    make = {"clone": lambda t: t.clone(), "deepcopy": copy_module.deepcopy, **COPIES}[copy]

    def loop(donate):
        torch.manual_seed(0)
        p, g = torch.randn(16, 16).to(dev), torch.randn(16, 16).to(dev)
        logged, reused, dropped = [], 0, 0
        for i in range(8 if copy == "clone" else 2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                prev = make(p)
                if donate:
                    tdx.donate_buffer(p)
                p = p - 0.1 * (i + 1) * g
                torch_xla.sync()
                tdx.settle()
            logged.append((p - prev).norm().cpu())
            if donate:
                reused += tdx.last_step_report().reused
                dropped += sum(issubclass(w.category, tdx.DroppedDonationWarning)
                               for w in caught)
        return p.cpu(), logged, reused, dropped

    p, logged, reused, dropped = loop(True)
    p_plain, logged_plain, _, _ = loop(False)
    assert torch.equal(p, p_plain) and all(map(torch.equal, logged, logged_plain))
    steps = len(logged)
    if copy in ("clone", "deepcopy"):
        assert (reused, dropped) == (steps, 0)
    else:
        assert (reused, dropped) == (0, steps)
