"""Buffers torch_xla shares between distinct tensors (sharing.py): a
donation never destroys a tensor that was not donated.

torch_xla backs some copies with their source's device buffer, also after a
barrier; donating either side would destroy the other.  With native reads
both sides are seen from the buffer's holder count; on the ``_XLAC`` path
the source of such a copy is seen (its buffer is filed under the copy) and
the copy itself with ``configure(check_sharing=True)``.  A copy made from a
marked tensor in the same step is seen with ``check_sharing`` on both
paths.  Each test runs on both reader paths (the ``reads_path`` fixture).
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
from torch_xla_donate._outcomes import sharing


@pytest.fixture
def check_sharing():
    def switch(on):
        previous.update(tdx.configure(check_sharing=on))
    previous = {}
    yield switch
    if previous:
        tdx.configure(**previous)


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
def test_the_source_of_a_copy_holding_its_buffer_is_not_donated(dev, copy, reads_path):
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


def test_a_target_network_copied_with_load_state_dict_is_named_and_kept(dev, reads_path):
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


def test_a_source_whose_copy_is_gone_is_donated(dev, monkeypatch, reads_path):
    """The copy died: nothing else holds the buffer, so the donation goes
    ahead.  Native reads see it from the buffer's count, without looking for
    holders; the ``_XLAC`` path looks for that dead owner once, not at every
    step."""
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](w)
    torch_xla.sync()
    del c
    looks = []
    real = sharing.live_sharers
    monkeypatch.setattr(sharing, "live_sharers", lambda *a: looks.append(1) or real(*a))
    new, dropped = _donate_and_step(w)
    looked = [1] if reads_path == "xlac" else []
    assert tdx.is_deleted(w) and not dropped and looks == looked
    # Undonated twice in a row (no output can take it): still one look.
    v = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](v)
    torch_xla.sync()
    del c
    for _ in range(2):  # warned once: the same line and shape (_outcomes/unused.py)
        before = tdx.summary().totals.unused
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
            tdx.donate_buffer(v)
            torch_xla.sync()
            tdx.settle()
        assert tdx.summary().totals.unused == before + 1 and not tdx.is_deleted(v)
    assert looks == looked * 2


@pytest.mark.parametrize("case", ["the copy", "a copy made after marking"])
def test_check_sharing_sees_what_the_source_does_not_say(dev, check_sharing, case, reads_path):
    check_sharing(True)
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


def test_check_sharing_donates_what_nothing_shares(dev, check_sharing, reads_path):
    check_sharing(True)
    p = materialize(torch.randn(8, 8, device=dev))
    other = materialize(torch.randn(8, 8, device=dev))
    new, dropped = _donate_and_step(p)
    assert tdx.is_deleted(p) and not dropped and not tdx.is_deleted(other)


@pytest.mark.parametrize("checked", [True, False], ids=["check_sharing", "default"])
def test_donors_of_one_step_may_share_a_buffer(dev, check_sharing, reads_path, checked):
    """Both sides donated together: nobody else holds the buffer, so it is
    donated and both are poisoned."""
    check_sharing(checked)
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["copy_"](w)
    torch_xla.sync()
    tdx.donate([w, c])
    new = w * 2 + 1
    torch_xla.sync()
    tdx.settle()
    assert tdx.is_deleted(w) and tdx.is_deleted(c)
    assert new.shape == (8, 8)


# -- The owner query's native twin ------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("slice_", [1, 3, 50])
@pytest.mark.parametrize("form", ["this release", "2.7 form"])
def test_owner_suspects_name_every_copy_source_and_nothing_else(dev, native, slice_, form,
                                                               monkeypatch):
    """Each kind of copy, among tensors that hold their own buffers and one
    uploaded that no graph read, across slice boundaries: the sources of
    copies are the suspects, under their copy's id, in both twins.  The 2.7
    form of torch_xla's query (no tensors handed back uncloned: ids compared)
    runs on every release."""
    from torch_xla_donate._base import xla

    monkeypatch.setattr(xla, "OWNER_QUERY_SLICE", slice_)
    if form == "2.7 form":
        monkeypatch.setattr(xla, "_DATA_NODES_TAKE_UNCLONED", False)
    own = [materialize(torch.randn(8, 8, device=dev)) for _ in range(7)]
    uploaded = torch.randn(8, 8).to(dev)
    sources = [materialize(torch.randn(8, 8, device=dev)) for _ in COPIES]
    copies = [copy(w) for copy, w in zip(COPIES.values(), sources)]
    torch_xla.sync()
    tensors = own[:3] + [sources[0], uploaded] + own[3:] + sources[1:]
    got = xla.owner_suspects(tensors, native=native)
    want = [(i, xla.tensor_id(c)) for i, w in enumerate(tensors) for s, c in zip(sources, copies)
            if w is s]
    assert got == want


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_owner_suspects_cannot_tell_which_of_a_shared_pair_owns_it(dev, native, monkeypatch):
    """A source and its copy in one query: torch_xla lists their buffer once,
    so the query says nothing about that slice (every tensor of it is a
    suspect with owner None) and still answers for the other slices."""
    from torch_xla_donate._base import xla

    monkeypatch.setattr(xla, "OWNER_QUERY_SLICE", 3)
    w = materialize(torch.randn(8, 8, device=dev))
    c = COPIES["to(copy=True)"](w)
    others = [materialize(torch.randn(8, 8, device=dev)) for _ in range(4)]
    torch_xla.sync()
    got = xla.owner_suspects([others[0], w, c] + others[1:], native=native)
    assert got == [(0, None), (1, None), (2, None)]


def test_owner_suspects_twins_agree_on_a_long_list(dev):
    """The shipped slice size, several slices, a few sources: the twins give
    the same list."""
    from torch_xla_donate._base import xla

    ts = [materialize(torch.randn(4, device=dev)) for _ in range(3 * xla.OWNER_QUERY_SLICE + 7)]
    copies = [COPIES["copy_"](ts[i]) for i in (0, xla.OWNER_QUERY_SLICE, len(ts) - 1)]
    torch_xla.sync()
    native = xla.owner_suspects(ts)
    assert native == xla.owner_suspects(ts, native=False)
    assert [i for i, _ in native] == [0, xla.OWNER_QUERY_SLICE, len(ts) - 1]
    assert [o for _, o in native] == [xla.tensor_id(c) for c in copies]
