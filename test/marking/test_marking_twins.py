"""Marking's native fast path and its Python twin decide alike.

``C.try_mark``/``C.is_donatable`` (csrc/marking/marking.cpp) answer the
common case in one call; ``_marking/checks.py`` and ``marks.py`` decide
everything and word the errors.  Each tensor kind below is marked twice, on
twin tensors, with the fast path open and closed: the outcome (marked, or
the same exception with the same message) and the ledger record (shape,
dtype, bytes, call, line, version) must be the same, and the native check
may accept only what the Python checks accept.  Both with native reads of
torch_xla's answers (csrc/lazy/lazy_reads.h) and through ``_XLAC``
(``reads_path``).
"""
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import Guarded, Pinned, Tagged, Wrapper, materialize

import torch_xla_donate as tdx
from torch_xla_donate._base import fast_path
from torch_xla_donate._base.native import C
from torch_xla_donate._marking import checks


def _plain(dev, dtype=torch.float32):
    return materialize(torch.ones(4, 4, device=dev).to(dtype))


def _subclass(cls):
    return lambda dev: (torch.Tensor._make_subclass(cls, _plain(dev)), None)


def _data_alias(dev):
    t = _plain(dev)
    return t, t.data  # a second tensor on the same storage


def _wrapping_parameter(dev):
    t = _plain(dev)
    return torch.nn.Parameter(t), t  # the parameter shares the live tensor's storage


def _moved(dev):
    return torch.arange(16.0).reshape(4, 4).to(dev), None  # no step since


def _saved_for_backward(dev):
    w = torch.nn.Parameter(_plain(dev))
    loss = (w * w).sum()
    return w, loss  # the graph keeps w saved while the test holds loss


def _with_view(dev):
    t = _plain(dev)
    return t, t[0:2]


def _pending_after_barrier(dev):
    t = _plain(dev)
    return t, lambda: xm.optimization_barrier_([t])


def _copy_since_the_step(dev):
    source = _plain(dev)
    holder = []
    return source, lambda: holder.append(torch.empty_like(source).copy_(source)) or holder[0]


def _consumed(dev):
    t = _plain(dev)
    tdx.donate_buffer(t)
    new = t * 2
    torch_xla.sync()
    tdx.settle()
    return t, new


def _reshaped(change):
    """A plain tensor whose shape ``change(t, dev)`` changed in place, then a
    barrier: the record's shape is read natively from the copies of the
    sizes torch keeps (csrc/base/tensor_facts.cpp), and must be the one
    Python sees."""
    def make(dev):
        t = _plain(dev)
        change(t, dev)
        return materialize(t), None
    return make


def _set_data(t, dev):
    t.data = torch.ones(2, 8, device=dev)


def _swap(t, dev):
    torch.utils.swap_tensors(t, torch.ones(2, 8, device=dev))


# name -> (make(dev) -> (tensor, keep-alive), the fast path must accept it)
KINDS = {
    "f32": (lambda dev: (_plain(dev), None), True),
    "bf16": (lambda dev: (_plain(dev, torch.bfloat16), None), True),
    "s32": (lambda dev: (_plain(dev, torch.int32), None), True),
    "s64": (lambda dev: (_plain(dev, torch.int64), None), True),
    "bool": (lambda dev: (_plain(dev, torch.bool), None), True),
    "u8": (lambda dev: (_plain(dev, torch.uint8), None), True),
    "c64": (lambda dev: (_plain(dev, torch.complex64), None), True),
    "moved to the device": (_moved, False),
    "parameter": (lambda dev: (torch.nn.Parameter(_plain(dev)), None), True),
    "leaf requiring grad": (lambda dev: (_plain(dev).requires_grad_(), None), True),
    "zero-size": (lambda dev: (materialize(torch.empty(0, device=dev)), None), True),
    "subclass": (_subclass(Tagged), False),
    "subclass guarding its class": (_subclass(Guarded), False),
    "subclass pinning its class": (_subclass(Pinned), False),
    "wrapper subclass": (lambda dev: (Wrapper(_plain(dev)), None), False),
    "as_subclass": (lambda dev: (_plain(dev).as_subclass(Tagged), None), False),
    "0-dim": (lambda dev: (materialize(torch.ones((), device=dev) * 2), None), False),
    "view": (lambda dev: (_plain(dev)[0:2], None), False),
    "transpose": (lambda dev: (_plain(dev).t(), None), False),
    "expand": (lambda dev: (_plain(dev)[0:1].expand(3, 4), None), False),
    "permute": (lambda dev: (_plain(dev).permute(1, 0), None), False),
    ".data alias": (_data_alias, False),
    "parameter wrapping a live tensor": (_wrapping_parameter, False),
    "not a tensor": (lambda dev: ([1.0, 2.0], None), False),
    "None": (lambda dev: (None, None), False),
    "pending": (lambda dev: (torch.ones(4, device=dev) * 2, None), False),
    "cpu": (lambda dev: (torch.ones(4), None), False),
    "live view": (lambda dev: _with_view(dev), False),
    "saved for backward": (lambda dev: _saved_for_backward(dev), False),
    "consumed": (lambda dev: _consumed(dev), False),
    "resized in place, as many elements": (_reshaped(lambda t, dev: t.resize_(2, 8)), True),
    "resized in place, more elements": (_reshaped(lambda t, dev: t.resize_(8, 4)), True),
    "transposed in place": (_reshaped(lambda t, dev: t.resize_(2, 8).t_()), True),
    "unsqueezed in place": (_reshaped(lambda t, dev: t.unsqueeze_(0)), True),
    "another shape through .data": (_reshaped(_set_data), True),
    "another shape through set_": (_reshaped(lambda t, dev: t.set_(torch.ones(2, 8, device=dev))),
                                   True),
    "another shape through swap_tensors": (_reshaped(_swap), True),
    "resized by an out= op": (_reshaped(lambda t, dev: torch.add(torch.ones(2, 8, device=dev), 1,
                                                                  out=t)), True),
    "another shape through _replace_xla_tensor": (_reshaped(
        lambda t, dev: torch_xla._XLAC._replace_xla_tensor(t, torch.ones(2, 8, device=dev))), True),
}


# Kinds made by a last action after both twins exist: making the second
# twin syncs, which would run the first one's pending work.
# name -> make(dev) -> (base, finish() -> the tensor to donate)
LATE_KINDS = {
    "optimization barrier": _pending_after_barrier,
    "copy since the step": _copy_since_the_step,
}


def _twins(kind, dev):
    """(fast twin, slow twin, what keeps their holders alive)."""
    if kind in LATE_KINDS:
        (a, finish_a), (b, finish_b) = LATE_KINDS[kind](dev), LATE_KINDS[kind](dev)
        a2, b2 = finish_a(), finish_b()
        return (a2 if isinstance(a2, torch.Tensor) else a, b2 if isinstance(b2, torch.Tensor) else b,
                (a, b))
    make = KINDS[kind][0]
    (a, keep_a), (b, keep_b) = make(dev), make(dev)
    return a, b, (keep_a, keep_b)


@pytest.fixture
def fast_path_closed():
    """Closes the fast path for the block; ``refresh`` reopens it."""
    class Switch:
        def __enter__(self):
            C.set_fast_path_enabled(False)

        def __exit__(self, *exc):
            fast_path.refresh()
    yield Switch()
    fast_path.refresh()


def _outcome(mark):
    """What a marking call did: ("marked", record facts) or the error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t = mark()
        except Exception as error:  # noqa: BLE001 - the outcome is compared
            return (type(error).__name__, re.sub(r"step \d+", "step N", str(error)))
    record = C.unmark(t)
    if record is None:
        return ("not marked",)
    return ("marked", record.shape_string, record.nbytes, str(record.via), record.version)


@pytest.mark.parametrize("kind", list(KINDS) + list(LATE_KINDS))
def test_the_fast_path_and_the_python_path_decide_alike(dev, kind, fast_path_closed, reads_path):
    fast_accepts = KINDS[kind][1] if kind in KINDS else False
    fast_t, slow_t, keep = _twins(kind, dev)

    def donate(t):
        def mark():
            tdx.donate_buffer(t)
            return t
        return mark

    native = C.is_donatable(fast_t) if isinstance(fast_t, torch.Tensor) else False
    probe = _plain(dev)  # the fast arm really runs the fast path: it takes a plain tensor
    assert C.try_mark(probe, 1) is True, "the fast path is closed"
    C.unmark(probe)
    fast = _outcome(donate(fast_t))
    with fast_path_closed:
        slow = _outcome(donate(slow_t))
    assert fast == slow
    try:
        checks.check_donatable(slow_t)
        python_accepts = slow_t.dim() > 0
    except Exception:  # noqa: BLE001
        python_accepts = False
    assert not native or python_accepts, "the native check accepted what Python refuses"
    assert native == fast_accepts, "the fast path must take the common kinds"
    del keep


@pytest.mark.parametrize("kind", [k for k, (_, fast) in KINDS.items() if fast])
def test_a_tree_is_marked_alike_both_ways(dev, kind, fast_path_closed, reads_path):
    """``donate(tree)``'s all-or-nothing native call against the path by path."""
    make = KINDS[kind][0]
    fast_ts = [make(dev)[0] for _ in range(3)]
    slow_ts = [make(dev)[0] for _ in range(3)]
    assert tdx.donate(fast_ts) == 3
    with fast_path_closed:
        assert tdx.donate(slow_ts) == 3
    fast = [C.unmark(t) for t in fast_ts]
    slow = [C.unmark(t) for t in slow_ts]
    describe = lambda r: (r.shape_string, r.nbytes, str(r.via), r.version, r.where.split(":")[0])
    assert [describe(r) for r in fast] == [describe(r) for r in slow]
