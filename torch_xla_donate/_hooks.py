"""The hooks into torch_xla: installed when ``torch_xla_donate`` is imported,
taken out by ``uninstall`` (which cancels every mark: without the hooks
nothing would commit them).

* native trampolines (``C.Trampoline``) in place of torch_xla's step barrier
  (``_xla_step_marker``, which ``xm.mark_step``, ``torch_xla.sync``, the end
  of ``torch_xla.step()``/``compile`` and ``MpDeviceLoader`` go through),
  its partial syncs (``_xla_sync_multi``, ``_xla_sync_live_tensors``: they
  commit nothing) and its wait (``_xla_wait_device_ops``: failed steps).  A
  trampoline adds no Python frame, so torch_xla's ``PT_XLA_DEBUG`` analysis
  sees its own caller as without the plugin;
* the public ``torch_xla.compile`` (``torch_xla.step()`` calls it), which
  tells this thread's barriers which sync of a step block is the flush and
  which the end (_commit.py's context stack);
* the dynamo bridge's graph extraction (_dynamo.py);
* ``gradient_accumulation``: a model parameter or buffer marked before it
  would be destroyed (the loop passes them through as discarded outputs),
  so it is refused before anything runs (``ParameterDonationError``, marks
  kept);
* TorchScript: the interpreter turns the poison's ``DonatedBufferError``
  into a blank ``RuntimeError``; a call that raises with a consumed donated
  argument raises that tensor's ``DonatedBufferError`` instead.

>>> installed()
True
"""
import contextlib
import functools
import inspect
import sys
import threading

import torch
import torch_xla

from . import _commit as commit
from . import _config as config
from . import _dynamo as dynamo
from . import _holders as holders
from . import _marking as marking
from . import _messages as messages
from . import _poison as poison
from . import _verdicts as verdicts
from . import _xla as xla
from ._native import C, lock
from .errors import ParameterDonationError

__all__ = ["install", "uninstall", "installed", "barrier_trampoline", "bind_native"]

# -- Step barriers and step blocks -------------------------------------------------

def barrier_trampoline(real):
    """The plugin's stand-in for the step barrier ``real`` (tests and
    benchmarks put their own ``real`` behind it)."""
    return _Wrapped(real, commit.barrier_hook, commit.barrier_after)


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
    commit.context_stack().append(commit.BLOCK_PROLOGUE)


def _enter_after(token, result, error):
    if error is not None:
        commit.context_stack().pop()
    else:
        commit.set_current(commit.BLOCK_BODY)
    return result


def _exit_before(cm, typ, value, traceback):
    commit.set_current(commit.BLOCK_FAILED if typ is not None else commit.BLOCK_EXIT)


def _exit_after(token, result, error):
    commit.context_stack().pop()
    return result


class _StepBlock(contextlib._GeneratorContextManager):
    __enter__ = C.Trampoline(contextlib._GeneratorContextManager.__enter__, _enter_before,
                              _enter_after)
    __exit__ = C.Trampoline(contextlib._GeneratorContextManager.__exit__, _exit_before,
                             _exit_after)


class _Wrapped(C.Trampoline):
    """A trampoline that carries its function's name and docstring."""


def _body_before(*args, **kwargs):
    commit.set_current(commit.BLOCK_BODY)


def _body_after(token, result, error):
    commit.set_current(commit.BLOCK_FAILED if error is not None else commit.BLOCK_EXIT)
    return result


def _call_before(*args, **kwargs):
    commit.context_stack().append(commit.BLOCK_PROLOGUE)


def _call_after(token, result, error):
    commit.context_stack().pop()
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
    ("_xla_step_marker", commit.barrier_hook, commit.barrier_after),
    ("_xla_sync_multi", commit.flush_before, commit.flush_after),
    ("_xla_sync_live_tensors", commit.flush_before, commit.flush_after),
    ("_xla_wait_device_ops", verdicts.wait_before, verdicts.wait_after),
)


def _install_trampolines(extra=()) -> None:
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


def _uninstall_trampolines() -> None:
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
    """True while the hooks are in place."""
    return isinstance(xla._XLAC._xla_step_marker, C.Trampoline)


# -- gradient_accumulation ----------------------------------------------------------

_ga_lock = threading.Lock()
# (module, attribute name, original function) while installed.
_ga_patched = None


def _install_gradient_accumulation() -> None:
    """Wraps ``gradient_accumulation`` with the model-state check (idempotent)."""
    global _ga_patched
    with _ga_lock:
        if _ga_patched is not None:
            return
        from torch_xla.experimental import gradient_accumulation as module

        # The public function forwards to this private one, looked up at call
        # time: wrapping it also covers references taken before our import.
        name = ("_gradient_accumulation" if hasattr(module, "_gradient_accumulation")
                else "gradient_accumulation")
        original = getattr(module, name)
        setattr(module, name, _checking_model_state(original))
        _ga_patched = (module, name, original)


def _uninstall_gradient_accumulation() -> None:
    global _ga_patched
    with _ga_lock:
        if _ga_patched is not None:
            module, name, original = _ga_patched
            setattr(module, name, original)
            _ga_patched = None


def _checking_model_state(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        # A consumed tensor passed in: torch_xla (2.7) may trace the loop on
        # placeholders and hand the real tensors straight to C++, where no
        # poison can see them; refuse it here, on every release alike.
        poison.refuse_consumed(arguments.get("iterable_tensors"), arguments.get("carried_tensors"))
        if C.marked_count():
            model = arguments.get("model")
            if isinstance(model, torch.nn.Module):
                _refuse_marked_model_state(model)
        result = original(*args, **kwargs)
        holders.note_graph_holds_inputs()  # the next commit's graph holds its inputs
        return result

    wrapper.__torch_xla_donate_original__ = original
    return wrapper


def _refuse_marked_model_state(model: torch.nn.Module) -> None:
    """Raises ``ParameterDonationError`` if any parameter or buffer of
    ``model`` is marked; changes nothing."""
    marked = [
        (kind, name, t)
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
        for name, t in named
        if C.is_marked(t)
    ]
    if not marked:
        return
    shown = marked[:_SHOWN]
    items = ", ".join(f"{kind} '{name}' {messages.shape_string(t)}" for kind, name, t in shown)
    if len(marked) > _SHOWN:
        items += f" and {len(marked) - _SHOWN} more"
    raise ParameterDonationError(
        f"gradient_accumulation: {items} of the model {'is' if len(marked) == 1 else 'are'} "
        "marked by donate_buffer(). gradient_accumulation passes model parameters and "
        "buffers through its loop unchanged and returns no replacement for them, so the "
        "step would give their buffers to other outputs and destroy them. Nothing has "
        "run and the marks are still set: undonate(model) cancels them. If you replace these "
        "tensors with new ones after the call, donate the old ones after "
        "gradient_accumulation returns."
    )


_SHOWN = 4  # marked model tensors named in the error; the rest are counted


# -- TorchScript ----------------------------------------------------------------------

# (class, its original __call__) while installed.
_ts_patched = []


def _donated_argument(args, kwargs, method_self=None):
    """A consumed donated tensor among the arguments (or the scripted
    module's own tensors), or None."""
    owner = getattr(method_self, "owner", None)
    own = [list(getattr(owner, name, lambda: ())()) for name in ("parameters", "buffers")]
    return poison.first_consumed(args, kwargs, *own)


def _translating(real, is_method):
    def __call__(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except RuntimeError as error:
            t = _donated_argument(args, kwargs, self if is_method else None)
            if t is None:
                raise
            raise poison.donated_error(t) from error

    __call__.__wrapped__ = real
    return __call__


def _install_torchscript() -> None:
    if _ts_patched:
        return
    for cls, is_method in ((torch._C.ScriptFunction, False), (torch._C.ScriptMethod, True)):
        real = cls.__call__
        cls.__call__ = _translating(real, is_method)
        _ts_patched.append((cls, real))


def _uninstall_torchscript() -> None:
    while _ts_patched:
        cls, real = _ts_patched.pop()
        cls.__call__ = real


# -- Installing -----------------------------------------------------------------------

def bind_native() -> None:
    """Hands the native library every callable it calls back, in one call
    (once, at import; binding again replaces them)."""
    C.bind(tensor_type=torch.Tensor, on_refusal=marking.refused, **poison.NATIVE_HOOKS)


bind_native()


def install() -> None:
    """Routes torch_xla's executions through the plugin (idempotent)."""
    with lock:
        _install_trampolines(extra=dynamo.TRAMPOLINES)
        dynamo.install()
        _install_torchscript()
        _install_gradient_accumulation()
        config.hooks_in(True)


def uninstall() -> None:
    """Takes the hooks out and cancels every mark: without the hooks nothing
    would commit them, and nothing may be left for torch_xla to find."""
    with lock:
        for t in C.marked_tensors():
            C.unmark(t)
        _uninstall_gradient_accumulation()
        _uninstall_torchscript()
        dynamo.uninstall()
        _uninstall_trampolines()
        config.hooks_in(False)
