"""The commit's split, natively, in one function (csrc/hooks/commit.cpp
Judge, through ``C.commit``): a plain step's marks all come back donors;
a donor with another holder is referred back (or, updated in place after
marking, settled), never armed, and the others are donated; a flag
torch_xla refuses is dropped alone.  Each test watches ``C.commit`` through
a spy on the commit's ``C`` and checks the outcome: poisoned donors,
outputs in their buffers, values right.
"""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import COPIES, buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _commit as commit
from torch_xla_donate import _guards as guards
from torch_xla_donate import _xla as xla
from torch_xla_donate.errors import DroppedDonationWarning

N = 8


class _Spy:
    """The commit's ``C`` with ``commit`` watched: each call's donors and
    referred entries, and the donor flags of its tensors right after it
    returned (nothing is armed before Python's arm stage)."""

    def __init__(self, real):
        self._real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def commit(self, only=None):
        step, donors, referred = self._real.commit(only)
        entries = list(donors) + [e for e, _, _ in referred]
        if entries:  # a barrier with marks
            self.calls.append((len(donors), [split for _, split, _ in referred],
                               [torch_xla._XLAC._get_buffer_donation(e[0]) for e in entries]))
        return step, donors, referred


@pytest.fixture
def spy(monkeypatch, dev):
    # The guards decided at a first donation, before the spy watches.
    t = materialize(torch.ones(N, device=dev))
    tdx.donate_buffer(t)
    t = t * 2
    torch_xla.sync(wait=True)
    assert xla.walk_in_use(), guards.state("walk")
    watched = _Spy(commit.C)
    monkeypatch.setattr(commit, "C", watched)
    return watched


def _state(dev, n=4):
    # 2-D: load_state_dict's copy needs a weight's shape.
    return list(materialize(*[torch.full((2, N // 2), float(i), device=dev) for i in range(n)]))


def test_a_plain_step_is_committed_in_one_pass(spy, dev):
    state = _state(dev)
    pointers = [buffer_ptr(p) for p in state]
    expected = [p.cpu() * 3 for p in state]
    for p in state:
        tdx.donate_buffer(p)
    old, state = state, [p * 3 for p in state]
    torch_xla.sync(wait=True)
    tdx.settle()
    assert [(n, referred, any(flags)) for n, referred, flags in spy.calls] == [(4, [], False)]
    assert all(tdx.is_deleted(p) for p in old)
    assert sorted(buffer_ptr(p) for p in state) == sorted(pointers)
    for p, want in zip(state, expected):
        assert torch.equal(p.cpu(), want)


def _view(t, dev):
    return t[:2]  # alive through the step


def _updated_in_place(t, dev):
    t.add_(1)  # after marking: an output of the step, not a donor
    return None


def _saved_for_backward(t, dev):
    w = torch.ones(2, N // 2, device=dev, requires_grad=True)
    return (w * t).sum()  # the graph saves t


def _clone_read_before_its_step(t, dev):
    c = t.clone()
    c.cpu()  # read before its first step: shares t's buffer for good
    return c


def _replaced(t, dev):
    s = materialize(torch.zeros(2, N // 2, device=dev))
    torch_xla._XLAC._replace_xla_tensor(t, s)  # t and s hold one XLA tensor
    xm.wait_device_ops()
    return s


HOLDERS = {"a view alive": _view, "updated in place after marking": _updated_in_place,
           "saved for backward": _saved_for_backward,
           "a clone read before its step": _clone_read_before_its_step,
           "_replace_xla_tensor": _replaced}


def _copy_in_the_step(make):
    return lambda t, dev: make(t)


HOLDERS.update({f"a copy made in the step ({name})": _copy_in_the_step(make)
                for name, make in COPIES.items()})


@pytest.mark.parametrize("holder", list(HOLDERS), ids=list(HOLDERS))
def test_a_donor_with_another_holder_is_referred_back_and_never_armed(spy, dev, holder):
    state = _state(dev)
    odd = state[1]
    if holder == "_replace_xla_tensor":
        kept = HOLDERS[holder](odd, dev)  # before marking: donate_buffer reads t as it is
    for p in state:
        tdx.donate_buffer(p)
    if holder != "_replace_xla_tensor":
        kept = HOLDERS[holder](odd, dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedDonationWarning)  # the stages' reasons
        new = [p * 3 for p in state]
        torch_xla.sync(wait=True)
    tdx.settle()
    assert len(spy.calls) == 1
    donors, referred, flags = spy.calls[0]
    # Updated in place after marking: settled at once, neither donor nor referred.
    assert donors == len(state) - 1 and len(referred) == (holder != "updated in place after marking")
    assert not any(flags), "a flag was armed before the arm stage"
    # Python judged what was referred: the odd donor was not donated, the others were.
    assert not tdx.is_deleted(odd)
    assert all(tdx.is_deleted(p) for i, p in enumerate(state) if i != 1)
    del kept, new


def test_a_flag_torch_xla_refuses_drops_that_donor_alone(spy, dev, monkeypatch):
    state = _state(dev)
    refused = state[2]
    real = xla.REAL["_set_buffer_donation"]

    def set_donor(t, donate):
        if donate and t is refused:
            return False  # as torch_xla answers for a tensor that is no device data
        return real(t, donate)

    monkeypatch.setitem(xla.REAL, "_set_buffer_donation", set_donor)
    for p in state:
        tdx.donate_buffer(p)
    new = [p * 3 for p in state]
    with pytest.warns(DroppedDonationWarning, match="torch_xla refused"):
        torch_xla.sync(wait=True)
    tdx.settle()
    assert not torch_xla._XLAC._get_buffer_donation(refused)
    assert not tdx.is_deleted(refused)
    assert [tdx.is_deleted(p) for i, p in enumerate(state) if i != 2] == [True] * 3
    del new
