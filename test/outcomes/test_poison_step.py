"""A commit poisons a whole step's donors in one native call
(``C.finish``, csrc/hooks/commit.cpp): each kind of tensor
ends up as ``poison.poison`` leaves one, what a use raises, and what
``unpoison`` gives back.  The ledger's ``Record.shape_string`` (C++) names
a tensor as ``dtypes.shape_string`` does.
"""
import gc
import re
import sys

import pytest
import torch
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate import _poison as poison
from torch_xla_donate._messages import shape_string
from torch_xla_donate._native import C, Verdict


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
    tdx.donate_buffer(t)
    step, donors, referred = C.commit([t])
    assert not referred and len(donors) == 1
    return donors, donors[0][1]


def _state(t):
    """Everything poisoning changes, comparable between twins."""
    core = poison.inner(t)
    return {
        "class": type(t).__name__,
        "bases": [c.__name__ for c in type(t).__mro__[:3]],
        "core class": type(core).__name__,
        "tagged": (C.tagged_record(t) is not None, C.tagged_record(core) is not None),
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
def test_a_committed_donor_and_a_companion_are_poisoned_alike(dev, kind):
    committed = KINDS[kind](materialize(torch.ones(4, device=dev)))
    companion = KINDS[kind](materialize(torch.ones(4, device=dev)))
    before = _state(committed)
    donors, record = _committed(committed)
    companion_donors, companion_record = _committed(companion)
    assert C.finish(donors)[1] == []
    poison.poison(companion, companion_record)
    assert _state(committed) == _state(companion)
    state = _state(committed)
    assert state["poisoned"] and state["donated key"]
    # Judged consumed: every use refuses, with the same words.
    C.settle(record, Verdict.REUSED)
    C.settle(companion_record, Verdict.REUSED)
    assert _use(committed) == _use(companion) != "no error"
    assert re.sub(r"step \d+", "step N", repr(committed)) == re.sub(r"step \d+", "step N",
                                                                      repr(companion))
    # Given back (as after an unused donation): the same tensor as before.
    poison.unpoison(committed)
    poison.unpoison(companion)
    assert _state(committed) == _state(companion) == before
    if kind == "subclass":
        assert committed.tag() == companion.tag() == "tagged"


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_whole_step_of_donors_is_poisoned_alike_and_keeps_class_counts(dev, kind):
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

    def twin_counts():
        gc.collect()
        return sys.getrefcount(twin)

    counts = twin_counts()
    assert C.finish(donors)[1] == []
    states = [_state(t) for t in ts]
    assert all(state == states[0] for state in states) and states[0]["poisoned"]
    assert all(type(t) is twin for t in ts)
    # The tensor torch_xla computes with has no Python object at all.
    assert twin_counts() == counts + 4
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
    assert C.try_mark(t) == 0, "the native path reads dtype and shape itself"
    record = C.unmark(t)
    assert record.shape_string == shape_string(t)
    assert record.nbytes == t.nbytes
