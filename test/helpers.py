"""Helpers shared by the tests (fixtures live in conftest.py)."""
import contextlib
import gc
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import torch
import torch_xla
import torch_xla.core.xla_model as xm

REPO = pathlib.Path(__file__).resolve().parents[1]  # this checkout


def child_env(**extra) -> dict:
    """``os.environ`` for a child Python on the CPU backend that imports this checkout's
    package (first on ``PYTHONPATH``, installed or not), with ``extra`` set."""
    env = dict(os.environ, PJRT_DEVICE="CPU", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# -- tensor subclasses the kind tests donate -----------------------------------


class Tagged(torch.Tensor):
    """A plain subclass: donated like a tensor, keeps its methods."""

    def tag(self):
        return "tagged"


class Guarded(torch.Tensor):
    """Guards its attributes: ``t.__class__ = ...`` raises."""

    def __setattr__(self, name, value):
        if name == "__class__":
            raise AttributeError("Guarded tensors keep their class")
        super().__setattr__(name, value)


class Pinned(torch.Tensor):
    """Says it is a plain tensor: no class can be given to it."""

    @property
    def __class__(self):
        return torch.Tensor


class Wrapper(torch.Tensor):
    """A wrapper subclass: no buffer of its own, every op refused."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


@contextlib.contextmanager
def collector_off():
    """Python's garbage collector run once, then held off for the block:
    for counts of the whole process (live XLA tensors, the collector's own
    count), which an earlier test's objects freed mid-block would move."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def materialize(*tensors):
    """Runs pending work so the tensors are plain device data, and waits for it."""
    torch_xla.sync()
    xm.wait_device_ops()
    return tensors[0] if len(tensors) == 1 else tensors


def settle_autograd():
    """``tdx.settle()``: what a run compared bit for bit with another does
    before each of its barriers (a run without donation especially).

    On an XLA device autograd's worker thread still holds lazy tensors of a
    finished backward a moment after ``torch.func.grad`` (or
    ``torch.autograd.grad``, ``backward()``) returns; a barrier then makes
    them extra outputs of the step's graph, another graph that may round
    differently, so a plain loop is not bit-repeatable from run to run.  A
    donating loop waits for that thread; ``settle()`` does for any loop
    (test/scenarios/test_repeatability.py)."""
    import torch_xla_donate as tdx

    tdx.settle()


def settled_sync(wait: bool = False):
    """``settle_autograd()``, then the step barrier (and, with ``wait``, the
    wait for its execution)."""
    settle_autograd()
    torch_xla.sync()
    if wait:
        xm.wait_device_ops()


def assert_untouched(t, expected=None):
    """Not marked, no armed donor flag, not poisoned, value as before: what a
    refused call must leave behind."""
    import torch

    import torch_xla_donate as tdx
    from torch_xla_donate import _C

    assert not tdx.is_donated(t) and not tdx.is_deleted(t)
    if t.device.type == "xla" and not t._is_view():
        assert not torch_xla._XLAC._get_buffer_donation(t)
    if expected is not None:
        assert torch.equal(t.detach().cpu(), expected)
    assert _C.marked_count() == 0


def buffer_ptr(t) -> int:
    """The device address of ``t``'s buffer, after all work has run."""
    xm.wait_device_ops()
    return torch_xla._XLAC._unsafe_buffer_pointer(t)


def run_python(code: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter: for process-global settings
    (environment switches, SPMD, peak memory).  Fails the test if it fails."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


# Copies torch_xla backs with their source's device buffer (a copy made since
# the last barrier holds the source's device-data node): name -> make(w), w 2-D.

def _copy_(w):
    return torch.empty_like(w).copy_(w)


def _to_copy(w):
    return w.to(w.device, copy=True)


def _tensor(w):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's advice to use clone()
        return torch.tensor(w)


def _setitem(w):
    x = torch.zeros_like(w)
    x[...] = w
    return x


def _load_state_dict(w):
    """The DQN hard update: target.load_state_dict(online.state_dict())."""
    out_features, in_features = w.shape
    source = torch.nn.Linear(in_features, out_features, bias=False).to(w.device)
    source.weight.data = w
    target = torch.nn.Linear(in_features, out_features, bias=False).to(w.device)
    target.load_state_dict(source.state_dict())
    return target.weight


COPIES = {"copy_": _copy_, "to(copy=True)": _to_copy, "torch.tensor": _tensor,
          "x[...] = t": _setitem, "load_state_dict": _load_state_dict}
