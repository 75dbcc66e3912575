"""What automatic donation never takes: every holder kind the package knows keeps
its buffer and value with auto on (and the advisor does not list it), in every
context of the functional loop (test_auto.py's).  The one holder auto cannot see
is a DLPack capsule: PJRT refuses to donate a buffer with an external reference,
so the value is still kept; the step counts it as not reused."""
import threading

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.utils.dlpack as xla_dlpack
from helpers import buffer_ptr
from test_auto import CONTEXTS, N, _armed, _auto, _fresh, _plain_values, _step

import torch_xla_donate as tdx


def _graph(x):
    w = torch.ones_like(x).requires_grad_()
    return (x * w).sum(), w


def _read_graph(held):
    loss, w = held
    loss.backward()  # d(sum(x * w))/dw = x, from the tensor the graph saved
    return w.grad


def _closure(x):
    seen = []
    xm.add_step_closure(lambda: seen.append(x.cpu()))  # runs after the step's execution
    return seen


def _thread(x):
    release, box = threading.Event(), {}

    def hold(t=x):
        release.wait(60)
        box["value"] = t.cpu()

    worker = threading.Thread(target=hold)
    worker.start()
    return release, worker, box


def _read_thread(held):
    release, worker, box = held
    release.set()
    worker.join(60)
    return box["value"]


def _read_by_unwaited_step(x):
    y = x * 2  # a step still running reads x when the next one starts
    torch_xla.sync(wait=False)
    return x, y


# holder -> (make it from the input, the input's value read back through it)
HOLDERS = {
    "a Python name": (lambda x: x, lambda h: h),
    ".detach()": (lambda x: x.detach(), lambda h: h),
    ".data": (lambda x: x.data, lambda h: h),
    "nn.Parameter(x)": (torch.nn.Parameter, lambda h: h.detach()),
    "a view": (lambda x: x[:], lambda h: h),
    "an autograd graph": (_graph, _read_graph),
    "an optimizer": (lambda x: torch.optim.SGD([torch.nn.Parameter(x)], lr=0.1),
                     lambda h: h.param_groups[0]["params"][0].detach()),
    "a step closure": (_closure, lambda h: h[0]),
    "another thread": (_thread, _read_thread),
    "a step still running": (_read_by_unwaited_step, lambda h: h[0]),
    "a DLPack capsule": (xla_dlpack.to_dlpack, xla_dlpack.from_dlpack),
}
UNSEEN = {"a DLPack capsule"}  # auto arms it; PJRT keeps it (an external reference)
# torch_xla.step() syncs when the block opens, running the closure: no holder left at its close.
GONE_IN_STEP_BLOCKS = {"a step closure"}


@pytest.mark.parametrize("context", list(CONTEXTS.values()), ids=list(CONTEXTS))
@pytest.mark.parametrize("holder", list(HOLDERS))
@pytest.mark.parametrize("advising", [False, True], ids=["auto", "advise"])
def test_a_held_input_keeps_its_buffer_and_value(dev, holder, context, advising):
    make, read = HOLDERS[holder]
    expected = _plain_values(dev)
    xs = _fresh(dev)
    kept_value, kept_ptr = xs[0].cpu(), buffer_ptr(xs[0])
    held = make(xs[0])
    armed, reused = _armed()
    with (tdx.advise() if advising else _auto()) as advice:
        box = [xs]
        del xs
        xs = _step(box, context)
    still_held = not (holder in GONE_IN_STEP_BLOCKS and context is torch_xla.step)
    if advising:
        listed = sum(e.count for e in advice.entries)
        assert listed == (N if holder in UNSEEN or not still_held else N - 1)
        assert _armed() == (armed, reused)
    else:
        assert (kept_ptr not in {buffer_ptr(x) for x in xs}) == still_held
        took = _armed()[1] - reused
        assert took == (N - 1 if still_held else N), took  # every other input, not the held one
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))
    assert torch.equal(read(held).cpu(), kept_value), holder
