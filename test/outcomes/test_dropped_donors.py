"""A poisoned donor the loop drops takes torch_xla's tensor with it.

A donor the user holds through its barrier is poisoned, and its entry keeps
it weakly (c10's weak count on its TensorImpl) so that a verdict that gives
its value back can still lift the poison.  A weak count keeps the
TensorImpl's memory, and a functional wrapper's memory holds the tensor it
wraps, torch_xla's tensor and its place in torch_xla's registry of live
tensors.  So the entry lets go as the Python object dies (a finalizer of
the poisoned class, csrc/outcomes/poison.h ``WatchDeaths``), and ``del
old`` frees what it frees for a plain tensor, as raw donation's loop does,
instead of leaving the old step's tensors alive until the next barrier
(which cost the held loop of ``bench_async.py`` about 3% of its
throughput).  With the Python poison key the entry also keeps the inner
tensor's Python object, which goes at the next barrier."""
import contextlib
import random
import warnings

import pytest
import torch
import torch_xla
from helpers import collector_off, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _xla as xla
from torch_xla_donate._poison import is_poisoned

STEPS = {
    "reused": lambda x: x * 2 + 1,
    "unused": lambda x: x.sum(),
}
WAITS = ["sync", "sync(wait=False)", "step_block"]


class Sub(torch.Tensor):
    pass


FINALIZED = []  # the roles of the WithDel tensors whose __del__ ran


class WithDel(torch.Tensor):
    """Operators on it give WithDel results too (torch's default
    ``__torch_function__``): the donor carries a role to be told apart."""

    def __del__(self):
        FINALIZED.append(getattr(self, "role", "a result"))


def _with_del(t):
    d = torch.Tensor._make_subclass(WithDel, t)
    d.role = "the donor"
    return d


KINDS = {
    "Tensor": lambda t: t,
    "Parameter": lambda t: torch.nn.Parameter(t, requires_grad=False),
    "subclass": lambda t: torch.Tensor._make_subclass(Sub, t),
    "subclass with __del__": _with_del,
}



def _held_step(x, fate, wait):
    """Donates ``x`` and runs its step holding it: (the held donor, the
    step's result)."""
    with torch_xla.step() if wait == "step_block" else contextlib.nullcontext():
        tdx.donate_buffer(x)
        out = STEPS[fate](x)
        if wait != "step_block":
            torch_xla.sync(wait=wait == "sync")
    return x, out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("wait", WAITS)
@pytest.mark.parametrize("fate", sorted(STEPS))
def test_a_dropped_held_donor_leaves_torch_xla_with_it(dev, fate, wait, kind):
    FINALIZED.clear()
    with collector_off():
        old, out = _held_step(KINDS[kind](materialize(torch.arange(16.0, device=dev))), fate, wait)
        poisoned = is_poisoned(old)
        assert poisoned or fate == "unused", "a reused donor held through the barrier is poisoned"
        before = xla.live_tensor_count()
        del old
        at_once = xla.live_tensor_count()
        torch_xla.sync()
    assert at_once == before - 1, "torch_xla's tensor must die with the Python object"
    assert FINALIZED.count("the donor") == (kind == "subclass with __del__"), "__del__ ran once"
    tdx.settle()
    stats = _C.step_stats(_C.current_step() - 1 if wait != "sync" else -1)
    assert (stats["reused"], stats["unused"]) == ((1, 0) if fate == "reused" else (0, 1))
    expected = [2.0 * i + 1 for i in range(16)] if fate == "reused" else 120.0
    assert (out.cpu().tolist() if fate == "reused" else out.item()) == expected


@pytest.mark.parametrize("wait", ["sync(wait=False)", "step_block"])
def test_a_dropped_donor_a_cpp_owner_keeps_lives_until_that_owner_lets_go(dev, wait):
    """``leaf.grad = old`` makes autograd a C++ owner of the poisoned
    TensorImpl: ``del old`` then leaves the Python object alive (torch keeps
    it for that owner), still poisoned, and torch_xla's tensor with it; the
    entry lets go when that owner does."""
    leaf = materialize(torch.zeros(16, device=dev)).requires_grad_()
    with collector_off():
        old, out = _held_step(materialize(torch.arange(16.0, device=dev)), "reused", wait)
        leaf.grad = old
        before = xla.live_tensor_count()
        del old
        assert xla.live_tensor_count() == before
        assert is_poisoned(leaf.grad)
        with pytest.raises(tdx.DonatedBufferError):
            leaf.grad + 1
        leaf.grad = None
        assert xla.live_tensor_count() == before - 1
    assert out.cpu().tolist() == [2.0 * i + 1 for i in range(16)]


KEPT = []


class KeepsItself(torch.Tensor):
    def __del__(self):
        if getattr(self, "role", None) == "the donor":
            KEPT.append(self)  # a finalizer that brings the tensor back


def test_a_finalizer_that_keeps_the_donor_alive_keeps_it_poisoned(dev):
    """A ``__del__`` that stores the dying tensor brings it back: it stays
    poisoned (its entry let go of it, its record did not), and dies for
    good, with torch_xla's tensor, when the user drops it again."""
    KEPT.clear()
    with collector_off():
        x = torch.Tensor._make_subclass(KeepsItself, materialize(torch.arange(16.0, device=dev)))
        x.role = "the donor"
        old, out = _held_step(x, "reused", "sync(wait=False)")
        del x, old
        (back,) = KEPT
        KEPT.clear()
        with pytest.raises(tdx.DonatedBufferError):
            back * 2
        torch_xla.sync()
        tdx.settle()
        before = xla.live_tensor_count()
        del back
        assert xla.live_tensor_count() == before - 1
    assert out.cpu().tolist() == [2.0 * i + 1 for i in range(16)]


@pytest.mark.parametrize("dropped", ["before the barrier", "after the barrier"])
@pytest.mark.parametrize("wait", WAITS)
def test_a_donor_its_finalizer_brings_back_is_poisoned_and_not_blamed_on_a_copy(
        dev, dropped, wait):
    """Dropped before its barrier, the donor is not let go early: its
    ``__del__`` could bring it back after its buffer went.  Either way the
    one that comes back raises DonatedBufferError, and no warning blames a
    holder that does not exist."""
    KEPT.clear()
    with collector_off(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.Tensor._make_subclass(KeepsItself, materialize(torch.arange(16.0, device=dev)))
        x.role = "the donor"
        with torch_xla.step() if wait == "step_block" else contextlib.nullcontext():
            tdx.donate_buffer(x)
            out = x * 2 + 1
            if dropped == "before the barrier":
                del x
            if wait != "step_block":
                torch_xla.sync(wait=wait == "sync")
        if dropped == "after the barrier":
            del x
        tdx.settle()
        (back,) = KEPT
        KEPT.clear()
        with pytest.raises(tdx.DonatedBufferError):
            back * 2
    assert [str(w.message) for w in caught] == []
    assert tdx.last_step_report().reused == 1
    assert out.cpu().tolist() == [2.0 * i + 1 for i in range(16)]


def test_held_donors_dropped_in_any_order_over_steps_each_leave_at_once(dev):
    """Donors of several steps held at once, dropped one by one in a random
    order (seeded): each drop takes its torch_xla tensor with it, and the
    values come out right.  (The entries find a dying donor in a flat index
    whose keys come and go in any order, csrc/base/ptr_index.h.)"""
    rng = random.Random(8711)
    n = 12
    state = [materialize(torch.full((8,), float(i), device=dev)) for i in range(n)]
    held = []
    with collector_off():
        for _ in range(5):
            for p in state:
                tdx.donate_buffer(p)
            held.extend(state)
            state = [p * 2 + 1 for p in state]
            torch_xla.sync(wait=False)
            for _ in range(rng.randrange(len(held) + 1)):
                before = xla.live_tensor_count()
                del held[rng.randrange(len(held))]
                assert xla.live_tensor_count() == before - 1
        del held
        tdx.settle()
    assert [p.cpu().tolist() for p in state] == [[i * 32.0 + 31] * 8 for i in range(n)]
