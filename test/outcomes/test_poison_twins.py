"""Poisoning's native twin and the Python one leave the same tensor.

A commit poisons a whole step's donors in one native call
(``C.disarm_and_poison``, csrc/outcomes/poison.cpp); ``poison.poison`` does
the same tensor by tensor (companions, lost buffers).  For each kind of
tensor, twins are poisoned one way each and compared: classes, record tags,
the dispatch key of the tensor torch_xla computes with, what a use raises,
and what ``unpoison`` gives back.  The ledger's ``Record.shape_string`` (C++)
is compared with ``dtypes.shape_string`` the same way.
"""
import gc
import re
import sys

import pytest
import torch
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate._base.dtypes import shape_string
from torch_xla_donate._base.native import C, Verdict
from torch_xla_donate._outcomes import poison


class Tagged(torch.Tensor):
    def tag(self):
        return "tagged"


KINDS = {
    "tensor": lambda t: t,
    "parameter": lambda t: torch.nn.Parameter(t),
    "subclass": lambda t: torch.Tensor._make_subclass(Tagged, t),
}


def _committed(t):
    """``t`` marked and committed to a step: its (entry, record), in flight."""
    C.mark(t, __file__, 1, tuple(t.shape), "f32", t.nbytes)
    step, tensors, records = C.begin_step([t])
    donors, held = C.split_committed(tensors, records, [False])
    assert not held and len(donors) == 1
    return donors, records[0]


def _state(t):
    """Everything poisoning changes, comparable between twins."""
    core = poison.inner(t)
    return {
        "class": type(t).__name__,
        "bases": [c.__name__ for c in type(t).__mro__[:3]],
        "core class": type(core).__name__,
        "tagged": (C.tagged_record(t) is not None, C.tagged_record(core) is not None),
        "python key": torch._C._dispatch_keys(core).has(torch._C.DispatchKey.Python),
        "donated key": C.has_donated_key(core),
        "poisoned": poison.is_poisoned(t),
        "record": poison.donation_record(t) is not None,
    }


def _use(t):
    try:
        torch.Tensor.add(t, 1)
    except tdx.DonatedBufferError as error:
        return re.sub(r"donation #\d+|step -?\d+", "N", str(error))
    return "no error"


@pytest.mark.parametrize("kind", list(KINDS))
def test_native_and_python_poisoning_leave_the_same_tensor(dev, kind, poison_path):
    native_t = KINDS[kind](materialize(torch.ones(4, device=dev)))
    python_t = KINDS[kind](materialize(torch.ones(4, device=dev)))
    before = _state(native_t)
    native_donors, native_record = _committed(native_t)
    python_donors, python_record = _committed(python_t)
    C.disarm_and_poison(native_donors)
    poison.poison(python_t, python_record)
    assert _state(native_t) == _state(python_t)
    state = _state(native_t)
    assert state["poisoned"] and (state["donated key"], state["python key"]) == (
        poison_path == "key", poison_path == "python")
    # Judged consumed: every use refuses, with the same words.
    C.settle(native_record, Verdict.REUSED)
    C.settle(python_record, Verdict.REUSED)
    assert _use(native_t) == _use(python_t) != "no error"
    assert re.sub(r"step \d+", "step N", repr(native_t)) == re.sub(r"step \d+", "step N", repr(python_t))
    # Given back (as after an unused donation): the same tensor as before.
    poison.unpoison(native_t)
    poison.unpoison(python_t)
    assert _state(native_t) == _state(python_t) == before
    if kind == "subclass":
        assert native_t.tag() == python_t.tag() == "tagged"


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_whole_step_of_donors_is_poisoned_alike_and_keeps_class_counts(dev, kind, poison_path):
    # After the first tensor of a class, native poisoning swaps classes
    # without Python's generic assignment (csrc/outcomes/poison.cpp
    # SwapClass): each donor must end up as the first one did, each holding
    # its twin class, and the twins as many references afterwards as before.
    ts = [KINDS[kind](materialize(torch.ones(4, device=dev))) for _ in range(4)]
    for i, t in enumerate(ts[1:]):  # attributes of its own (a managed dict's)
        t.note = i
    donors, records = [], []
    for t in ts:
        entries, record = _committed(t)
        donors += entries
        records.append(record)
    original = type(ts[0])
    twin = poison._poison_class_for(original)
    core_twin = poison._poison_class_for(type(poison.inner(ts[0])), True)

    def twin_counts():
        gc.collect()
        return sys.getrefcount(twin), sys.getrefcount(core_twin)

    counts = twin_counts()
    assert C.disarm_and_poison(donors) == []
    states = [_state(t) for t in ts]
    assert all(state == states[0] for state in states) and states[0]["poisoned"]
    assert all(type(t) is twin for t in ts)
    # The tensor torch_xla computes with takes a class only with the Python
    # key; with the donated key it has no Python object at all.
    core_objects = 4 if poison_path == "python" else 0
    assert twin_counts() == (counts[0] + 4, counts[1] + core_objects)
    for t, record in zip(ts, records):
        C.settle(record, Verdict.REUSED)
        assert _use(t) != "no error"
        poison.unpoison(t)
    assert all(type(t) is original for t in ts)
    assert twin_counts() == counts
    assert [t.note for t in ts[1:]] == [0, 1, 2] and not hasattr(ts[0], "note")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("shape", [(4,), (2, 3), (0,), (1, 1, 5)])
def test_the_ledgers_shape_string_is_the_pythons(dev, dtype, shape, fast_path_open):
    t = materialize(torch.zeros(shape, dtype=dtype, device=dev))
    assert C.try_mark(t, 1), "the native path reads dtype and shape itself"
    record = C.unmark(t)
    assert record.shape_string == shape_string(t)
    assert record.nbytes == t.nbytes
