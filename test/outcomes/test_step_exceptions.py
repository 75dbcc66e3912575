"""Exceptions around a step: a donated input survives a step that raised
before its barrier, and an error after the barrier does not undo it.

* an exception in a step closure (``xm.add_step_closure``): closures run
  after the barrier, so the step itself succeeded; its donations are
  consumed and poisoned as usual, and the closure's error propagates.
* an exception in the body of ``with torch_xla.step():`` (or a function
  under ``torch_xla.compile``): torch_xla still syncs the half-built graph on
  the way out; the donations are abandoned, so a failed training step never
  eats the old parameters.
"""
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from failing_steps import (
    assert_next_step_works,
    assert_survived,
    marked_state,
    no_misleading_warnings,  # noqa: F401 - autouse
)
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C


def test_exception_in_a_step_closure_does_not_undo_the_step(dev):
    p, expected, ptr = marked_state(dev)
    new = p * 3
    seen = []

    def report():
        raise ValueError("closure failed")

    xm.add_step_closure(report)
    xm.add_step_closure(lambda: seen.append("later closure"))
    with pytest.raises(ValueError, match="closure failed"):
        xm.mark_step()
    # The barrier ran before the closures: the step succeeded and took the buffer.
    assert tdx.is_deleted(p) and buffer_ptr(new) == ptr
    assert torch.equal(new.cpu(), expected * 3)
    stats = _C.step_stats()
    assert (stats["reused"], stats["failed"], stats["in_flight"]) == (1, 0, 0)
    assert seen == []  # torch_xla drops the closures after the failing one
    q = materialize(torch.ones(4, device=dev))
    tdx.donate_buffer(q)
    r = q + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(q) and r.cpu().tolist() == [2.0] * 4


def test_step_closure_reading_a_donated_tensor_raises_there(dev):
    p, expected, ptr = marked_state(dev)
    new = p + 1
    xm.add_step_closure(lambda t: t.sum().item(), args=(p,))
    with pytest.raises(tdx.DonatedBufferError, match=r"f32\[64\]"):
        xm.mark_step()
    assert torch.equal(new.cpu(), expected + 1) and buffer_ptr(new) == ptr


def test_exception_in_a_step_block_abandons_its_donations(dev):
    p, expected, ptr = marked_state(dev)
    results = {}
    with pytest.raises(KeyError, match="bad batch"):
        with torch_xla.step():
            results["new"] = p * 0.5
            raise KeyError("bad batch")
    # torch_xla synced the partial graph on the way out, without the donation.
    assert torch.equal(results["new"].cpu(), expected * 0.5)
    assert buffer_ptr(results["new"]) != ptr
    assert_survived(p, expected, ptr, _C.current_step())
    assert_next_step_works(p, ptr)


def test_exception_in_a_compiled_function_abandons_its_donations(dev):
    p, expected, ptr = marked_state(dev)

    @torch_xla.compile
    def update(p):
        new = p - 1
        raise FloatingPointError("diverged")

    with pytest.raises(FloatingPointError):
        update(p)
    assert_survived(p, expected, ptr, _C.current_step())
    assert_next_step_works(p, ptr)


def test_a_clean_step_block_inside_an_except_clause_still_donates(dev):
    """Only the block's own exception abandons: a handler around it is no failure."""
    p, expected, ptr = marked_state(dev)
    try:
        raise ValueError("handled elsewhere")
    except ValueError:
        with torch_xla.step():
            new = p + 1
    assert tdx.is_deleted(p) and buffer_ptr(new) == ptr
    assert torch.equal(new.cpu(), expected + 1)
