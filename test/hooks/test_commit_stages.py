"""One commit for every execution (commit.py): a step barrier and a call of a
``torch.compile``d graph take their marks through the same stages, so what
one stage decides holds for both.

* decide: a mark made before ``configure(enabled=False)`` is refused by the
  execution that takes it (DISABLED, value kept), the compiled call as the
  barrier, rather than left for a later one;
* fail: an execution that raises (a compiled call also while extracting its
  executable) keeps its donations (STEP_FAILED, value kept, no flag left
  armed) and marks the steps before it as possibly failed: an earlier
  donation nothing used, whose verdict is still open, settles "failed", not
  "unused" (no ``UnusedDonationWarning``).

The barrier fails for real (an output too large to allocate, see
test/outcomes/test_failed_steps.py); the compiled call's executable is
replaced by one that raises, as torch_xla's bridge gives no failure of its
own that surfaces at the call.
"""
import warnings

import pytest
import torch
import torch._dynamo
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _dynamo as dynamo

N = 64
UNALLOCATABLE_ELEMENTS = 2**46  # float32: 2**48 bytes, refused at once


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _double(x):
    return x * 2


# -- decide ---------------------------------------------------------------------

def _barrier(p):
    out = _double(p)
    torch_xla.sync(wait=True)
    return out


def _compiled_call(p):
    return torch.compile(_double, backend="openxla")(p)


EXECUTIONS = pytest.mark.parametrize("execution", [_barrier, _compiled_call],
                                     ids=["barrier", "compiled call"])


@EXECUTIONS
def test_a_mark_made_before_switching_off_is_refused_by_the_execution_taking_it(dev, execution):
    p = materialize(torch.arange(float(N), device=dev))
    expected = p.cpu()
    tdx.donate_buffer(p)
    previous = tdx.configure(enabled=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused quietly, as at a barrier
            out = execution(p)
        assert not tdx.is_donated(p), "the mark was left for a later execution"
        stats = _C.step_stats()
        assert stats["step"] == _C.current_step()
        assert (stats["donated"], stats["failed"], stats["reused"], stats["in_flight"]) == (
            1, 1, 0, 0)
    finally:
        tdx.configure(**previous)
    torch_xla.sync(wait=True)
    assert type(p) is torch.Tensor and not tdx.is_deleted(p)
    assert not torch_xla._XLAC._get_buffer_donation(p)
    assert torch.equal(p.cpu(), expected) and torch.equal(out.cpu(), expected * 2)


# -- fail -----------------------------------------------------------------------

def _failing_barrier(p):
    """A step that runs out of memory, reported by its waiting barrier.  Its
    outputs die with this frame: torch_xla fails any later barrier while one
    of them is alive."""
    new = p + 1
    huge = torch.zeros(UNALLOCATABLE_ELEMENTS, device=p.device) + 1
    torch_xla.sync(wait=True)


def _failing_compiled_call(p, extraction=False):
    variant = _failing_extraction if extraction else _failing_variant
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamo._CompiledGraph, "_variant", variant)
        torch.compile(_double, backend="openxla")(p)


def _failing_variant(graph, pattern, args, on, withheld=frozenset()):
    graph._static = frozenset()
    return _raise


def _failing_extraction(graph, pattern, args, on, withheld=frozenset()):
    """The call's own extraction (after its commit) raises."""
    if graph._static is None:  # the first call's look at the graph's own donors
        return _failing_variant(graph, pattern, args, on, withheld)
    _raise()


def _raise(*args):
    raise RuntimeError("Out of memory (simulated)")


def _drain():
    """torch_xla reports a waiting barrier's failure once more at the next wait."""
    try:
        xm.wait_device_ops()
    except RuntimeError as e:
        assert "Out of memory" in str(e)


@pytest.mark.parametrize(
    "failing",
    [_failing_barrier, _failing_compiled_call, lambda p: _failing_compiled_call(p, extraction=True)],
    ids=["barrier", "compiled call", "compiled call's extraction"])
def test_a_failed_execution_keeps_its_donations_and_fails_the_steps_before(dev, failing):
    p, q = materialize(torch.arange(float(N), device=dev), torch.ones(N // 2, device=dev))
    expected = p.cpu()
    # An earlier step's donation nothing used, its verdict still open.
    tdx.donate_buffer(q)
    other = torch.ones(3, device=dev) + 1
    torch_xla.sync(wait=False)
    q_step = _C.current_step()
    assert _C.step_stats(q_step)["in_flight"] == 1
    tdx.donate_buffer(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdx.UnusedDonationWarning)
        with pytest.raises(RuntimeError, match="Out of memory"):
            failing(p)
        p_step = _C.current_step()
        _drain()
        tdx.settle()
    assert p_step > q_step
    assert type(p) is torch.Tensor and not tdx.is_deleted(p) and not tdx.is_donated(p)
    assert not torch_xla._XLAC._get_buffer_donation(p)
    assert torch.equal(p.cpu(), expected)
    stats = _C.step_stats(p_step)
    assert (stats["donated"], stats["failed"], stats["reused"], stats["in_flight"]) == (1, 1, 0, 0)
    stats = _C.step_stats(q_step)
    assert (stats["failed"], stats["unused"], stats["in_flight"]) == (1, 0, 0)
    assert torch.equal(q.cpu(), torch.ones(N // 2)) and other.cpu().tolist() == [2.0] * 3
