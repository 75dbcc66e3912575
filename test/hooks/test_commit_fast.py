"""The common step's commit in one native pass (csrc/hooks/commit_fast.h).

``C.commit_fast`` begins the step and, when every donor is plain, checks,
walks and arms them in one pass; otherwise it must have changed nothing
but begun the step (no flag armed, no verdict settled), so that the Python
stages (split, sharing.screen, arm) decide with their reasons.  Each test
watches the pass through a spy on the commit's ``C``:

* a plain step is taken by the pass, with the same outcome as the stages
  give (poisoned donors, outputs in their buffers, values right);
* each kind of holder sends the step to the stages, with nothing armed;
* a flag torch_xla refuses half-way disarms the donors armed before it.

Which path decides is not timed here: benchmarks/bench_instructions.py
counts what the pass saves.
"""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import COPIES, buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate._base import arena, guards, xla
from torch_xla_donate._hooks import commit, install
from torch_xla_donate.errors import DroppedDonationWarning

N = 8


class _Spy:
    """The commit's ``C`` with ``commit_fast`` watched: each call's donors
    (None: sent to the stages) and the donor flags of its tensors right
    after it returned."""

    def __init__(self, real):
        self._real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def commit_fast(self):
        step, tensors, records, donors = self._real.commit_fast()
        # The pass makes no list or Record object for the stages it spared:
        # the entries make their records when asked.
        assert (records is None) == (tensors is None) == (donors is not None)
        pairs = list(zip(tensors, records)) if donors is None else [(t, r) for t, r in donors]
        flags = [xla.donor_flag(t) for t, _ in pairs]
        verdicts = [r.verdict for _, r in pairs]
        if pairs:  # a barrier with marks
            self.calls.append((donors is not None, flags, verdicts))
        return step, tensors, records, donors


@pytest.fixture
def spy(monkeypatch, dev):
    # The walk is decided at the first barrier that donates: decide it now,
    # so that every step below may take the pass.
    t = materialize(torch.ones(N, device=dev))
    tdx.donate_buffer(t)
    t = t * 2
    torch_xla.sync(wait=True)
    assert arena.in_use(), guards.state("walk")
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
    assert [taken for taken, _, _ in spy.calls] == [True]
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
def test_a_donor_that_is_not_plain_sends_the_step_to_the_stages(spy, dev, holder):
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
    taken, flags, verdicts = spy.calls[0]
    assert not taken, "the pass took a step with a donor that is not plain"
    assert not any(flags), "the pass left a flag armed when it sent the step on"
    assert all(v == _C.Verdict.IN_FLIGHT for v in verdicts), "the pass settled a verdict"
    # The stages decided: the odd donor was not donated, the others were.
    assert not tdx.is_deleted(odd)
    assert all(tdx.is_deleted(p) for i, p in enumerate(state) if i != 1)
    del kept, new


def test_a_flag_refused_half_way_disarms_those_armed_before_it(spy, dev, monkeypatch):
    state = _state(dev)
    refused = state[2]
    real = xla.NATIVE_HOOKS["set_donor"]

    def set_donor(t, donate):
        if donate and t is refused:
            return False  # as torch_xla answers for a tensor that is no device data
        return real(t, donate)

    monkeypatch.setitem(xla.NATIVE_HOOKS, "set_donor", set_donor)
    install.bind_native()
    try:
        for p in state:
            tdx.donate_buffer(p)
        new = [p * 3 for p in state]
        with pytest.warns(DroppedDonationWarning, match="torch_xla refused"):
            torch_xla.sync(wait=True)
        tdx.settle()
    finally:
        monkeypatch.undo()
        install.bind_native()
    taken, flags, _ = spy.calls[0]
    assert not taken
    assert not any(flags), "the donors armed before the refusal kept their flags"
    assert not tdx.is_deleted(refused)
    assert [tdx.is_deleted(p) for i, p in enumerate(state) if i != 2] == [True] * 3
    del new
