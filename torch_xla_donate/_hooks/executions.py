"""Which torch_xla executions commit donation marks.

Example: every one of these commits the marks made before it::

    xm.mark_step(); torch_xla.sync()           # a step barrier
    with torch_xla.step(): ...                  # the sync that ends the block
    for batch in pl.MpDeviceLoader(loader, dev): ...  # each iteration's barrier

The problem
-----------
torch_xla honours its buffer-donor flags in every execution that syncs
device data: the step barrier ``_xla_step_marker`` (``xm.mark_step``,
``torch_xla.sync``, ``torch_xla.step()``/``compile``, ``MpDeviceLoader``),
``_xla_sync_multi(..., sync_xla_data=True)`` (``xm.unlazy``, ``xm.save``,
``gradient_accumulation``), ``_xla_sync_live_tensors``, and any execution
while ``_xla_set_enable_alias_with_buffer_donor_config(True)`` (the dynamo
bridge's warm-up).  A mark is the plugin's alone until an execution it
commits: commit.py arms the flags inside that execution and clears them when
its graph is built, so none of the others can take a marked buffer.

Which commit
------------
* a step barrier, except the ones torch_xla runs as part of something else:
  the flush ``torch_xla.step()``/``compile`` runs on entry (the marks made
  before the block are meant for the block's graph) and the syncs inside a
  torch.compile'd call (dynamo.py);
* the sync that ends a step block; if the block's body raised, its marks are
  abandoned there (STEP_FAILED, values kept: the outputs that would take the
  buffers are lost with the exception);
* a call of a ``torch.compile(backend="openxla")`` graph (dynamo.py).

``xm.unlazy``/``_xla_sync_multi`` and ``_xla_sync_live_tensors`` commit
nothing: they run part of the pending work, and another pending tensor may
still read a marked one, so its marks wait for the next step barrier.

How
---
Every hook on an ``_XLAC`` function is a native ``C.Trampoline``: torch_xla's
debug analysis (``PT_XLA_DEBUG``) sees its own caller as the innermost Python
frame, as without the plugin.  The step-block hook wraps the public
``torch_xla.compile`` (``torch_xla.step()`` calls it), a structural place
that needs no look at torch_xla's frames; a thread-local stack says which
sync of a block a barrier is.
"""
import contextlib
import functools
import sys
import threading

import torch_xla

from .._base import xla
from .._base.native import C
from .._outcomes import failures
from . import commit

__all__ = ["install", "uninstall", "installed", "context", "BLOCK_PROLOGUE", "COMPILED_CALL"]

# What the calling thread is inside of, innermost last: decides what its
# barriers commit.
BLOCK_PROLOGUE = "block prologue"  # the flush a step block starts with
BLOCK_BODY = "block body"
BLOCK_EXIT = "block exit"          # the sync that ends a step block
BLOCK_FAILED = "block failed"      # ... whose body raised
COMPILED_CALL = "compiled call"    # a torch.compile'd graph call (dynamo.py)

_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current():
    stack = _stack()
    return stack[-1] if stack else None


class context:
    """``with context(kind):`` the calling thread is inside ``kind``."""

    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        _stack().append(self.kind)
        return self

    def __exit__(self, *exc_info):
        _stack().pop()


def _set_current(kind) -> None:
    stack = _stack()
    if stack:
        stack[-1] = kind


# -- Step barriers ------------------------------------------------------------

def _barrier_before(*args, **kwargs):
    kind = current()
    if kind in (BLOCK_PROLOGUE, COMPILED_CALL):
        return commit.barrier_before(*args, commits=False, **kwargs)
    return commit.barrier_before(*args, abandon=kind == BLOCK_FAILED, **kwargs)


def barrier_trampoline(real):
    """The plugin's stand-in for the step barrier ``real`` (tests and
    benchmarks put their own ``real`` behind it)."""
    return _Wrapped(real, _barrier_before, commit.barrier_after)


# -- Step blocks: torch_xla.compile / torch_xla.step() --------------------------
#
# torch_xla runs a block as a contextlib context manager: its ``__enter__``
# flushes pending work (a barrier), the body runs, its ``__exit__`` syncs.
# The hook takes that very object and gives it a subclass whose ``__enter__``
# and ``__exit__`` are native trampolines around contextlib's own: they tell
# this thread's barriers which sync is the flush and which the end (and
# whether the body raised), and add no Python frame: torch_xla's debug
# analysis sees the same stack as without the plugin.

def _enter_before(cm):
    _stack().append(BLOCK_PROLOGUE)


def _enter_after(token, result, error):
    if error is not None:
        _stack().pop()
    else:
        _set_current(BLOCK_BODY)
    return result


def _exit_before(cm, typ, value, traceback):
    _set_current(BLOCK_FAILED if typ is not None else BLOCK_EXIT)


def _exit_after(token, result, error):
    _stack().pop()
    return result


class _StepBlock(contextlib._GeneratorContextManager):
    __enter__ = C.Trampoline(contextlib._GeneratorContextManager.__enter__, _enter_before,
                              _enter_after)
    __exit__ = C.Trampoline(contextlib._GeneratorContextManager.__exit__, _exit_before,
                             _exit_after)


class _Wrapped(C.Trampoline):
    """A trampoline that carries its function's name and docstring."""


def _body_before(*args, **kwargs):
    _set_current(BLOCK_BODY)


def _body_after(token, result, error):
    _set_current(BLOCK_FAILED if error is not None else BLOCK_EXIT)
    return result


def _call_before(*args, **kwargs):
    _stack().append(BLOCK_PROLOGUE)


def _call_after(token, result, error):
    _stack().pop()
    return result


def _compile(f=None, full_graph=False, name=None, max_different_graphs=None):
    """``torch_xla.compile`` with the plugin's step-block semantics."""
    if f is None:
        cm = _real_compile(None, full_graph, name, max_different_graphs)
        cm.__class__ = _StepBlock  # also what its decorator form recreates per call
        return cm
    if name is None:  # as torch_xla names it: the plugin's wrapper must not rename it
        name = getattr(f, "__name__", None) or str(f)
    body = functools.update_wrapper(_Wrapped(f, _body_before, _body_after), f)
    compiled = _real_compile(body, full_graph, name, max_different_graphs)
    return functools.update_wrapper(_Wrapped(compiled, _call_before, _call_after), f)


# -- Installing -----------------------------------------------------------------

_real_compile = None
# (name of the _XLAC function, before, after) of every trampoline.
_TRAMPOLINES = (
    ("_xla_step_marker", _barrier_before, commit.barrier_after),
    ("_xla_sync_multi", commit.flush_before, commit.flush_after),
    ("_xla_sync_live_tensors", commit.flush_before, commit.flush_after),
    ("_xla_wait_device_ops", failures.wait_before, failures.wait_after),
)


def install(extra=()) -> None:
    """Puts the trampolines (and those of ``extra``: (name, before, after))
    in place of torch_xla's functions, and the step-block hook in place of
    ``torch_xla.compile`` (idempotent)."""
    global _real_compile
    for name, before, after in _TRAMPOLINES + tuple(extra):
        current_fn = getattr(xla._XLAC, name, None)
        if current_fn is None or isinstance(current_fn, C.Trampoline):
            continue
        trampoline = _Wrapped(xla.real(name), before, after)
        trampoline.__name__ = name
        setattr(xla._XLAC, name, trampoline)
    if _real_compile is None:
        _real_compile = _module().compile
        _module().compile = _compile
        torch_xla.compile = _compile


def uninstall() -> None:
    global _real_compile
    for name in dir(xla._XLAC):
        fn = getattr(xla._XLAC, name, None)
        if isinstance(fn, C.Trampoline):
            setattr(xla._XLAC, name, fn.real)
    if _real_compile is not None:
        _module().compile = _real_compile
        torch_xla.compile = _real_compile
        _real_compile = None


def _module():
    """The module ``torch_xla/torch_xla.py``, whose ``step()`` calls its own
    ``compile``.  (The package attribute ``torch_xla.torch_xla`` is the
    package itself: ``from .torch_xla import *`` re-exports the name.)"""
    return sys.modules["torch_xla.torch_xla"]


def installed() -> bool:
    return isinstance(xla._XLAC._xla_step_marker, C.Trampoline)
