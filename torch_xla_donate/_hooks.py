"""The hooks into torch_xla, installed when the package is imported: native trampolines around
its executions (docs/design.md, "State and who owns it"), the step blocks of ``torch_xla.compile``,
the dynamo bridge (_dynamo.py), ``gradient_accumulation`` and TorchScript.

>>> def train_step(): ...
>>> torch_xla.compile(train_step).__name__  # the hook keeps torch_xla's naming
'train_step'
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

__all__ = ["install", "uninstall", "installed"]

# -- Step blocks (torch_xla.compile, torch_xla.step()): ``__enter__`` flushes pending work, the
# body runs, ``__exit__`` syncs.  These trampolines tell this thread's barriers which sync is the
# flush and which the end (_commit.py's context stack) and, being native, add no Python frame.


def _prologue_before(*args, **kwargs):
    commit.context_stack().append(commit.BLOCK_PROLOGUE)


def _enter_after(token, result, error):
    if error is not None:
        commit.context_stack().pop()
    else:
        commit.set_current(commit.BLOCK_BODY)
    return result


def _exit_before(cm, typ, value, traceback):
    commit.set_current(commit.BLOCK_FAILED if typ is not None else commit.BLOCK_EXIT)


def _block_after(token, result, error):
    commit.context_stack().pop()
    return result


def _body_before(*args, **kwargs):
    commit.set_current(commit.BLOCK_BODY)


def _body_after(token, result, error):
    commit.set_current(commit.BLOCK_FAILED if error is not None else commit.BLOCK_EXIT)
    return result


class _StepBlock(contextlib._GeneratorContextManager):
    __enter__ = C.Trampoline(contextlib._GeneratorContextManager.__enter__, _prologue_before, _enter_after)
    __exit__ = C.Trampoline(contextlib._GeneratorContextManager.__exit__, _exit_before, _block_after)


class _Wrapped(C.Trampoline):
    """A trampoline that carries its function's name and docstring."""


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
    return functools.update_wrapper(_Wrapped(compiled, _prologue_before, _block_after), f)


# -- gradient_accumulation: a model parameter or buffer marked before it would be destroyed (the
# loop passes them through as discarded outputs), so the call is refused before anything runs.

_ga_lock = threading.Lock()
_ga_patched = None  # (module, attribute name, original function) while installed
_SHOWN = 4  # marked model tensors named in the error; the rest are counted


def _install_gradient_accumulation() -> None:
    global _ga_patched
    with _ga_lock:
        if _ga_patched is not None:
            return
        from torch_xla.experimental import gradient_accumulation as module

        # The public function forwards to this private one, looked up at call time: wrapping
        # it also covers references taken before our import.
        private = hasattr(module, "_gradient_accumulation")
        name = "_gradient_accumulation" if private else "gradient_accumulation"
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
        # A consumed tensor passed in: torch_xla (2.7) may trace the loop on placeholders and
        # hand the real tensors straight to C++, where no poison sees them: refused here.
        poison.refuse_consumed(arguments.get("iterable_tensors"), arguments.get("carried_tensors"))
        model = arguments.get("model")
        if C.marked_count() and isinstance(model, torch.nn.Module):
            _refuse_marked_model_state(model)
        result = original(*args, **kwargs)
        holders.note_graph_holds_inputs()  # the next commit's graph holds its inputs
        return result

    wrapper.__torch_xla_donate_original__ = original
    return wrapper


def _refuse_marked_model_state(model: torch.nn.Module) -> None:
    marked = [
        (kind, name, t)
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
        for name, t in named
        if C.is_marked(t)
    ]
    if not marked:
        return
    items = ", ".join(f"{kind} '{name}' {messages.shape_string(t)}" for kind, name, t in marked[:_SHOWN])
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


# -- TorchScript: the interpreter turns the poison's DonatedBufferError into a blank
# RuntimeError; a call with a consumed donated argument raises that tensor's error instead.

_ts_patched = []  # (class, its original __call__) while installed


def _translating(real, is_method):
    def __call__(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except RuntimeError as error:
            owner = getattr(self, "owner", None) if is_method else None  # a scripted module's own
            own = [list(getattr(owner, name, lambda: ())()) for name in ("parameters", "buffers")]
            t = poison.first_consumed(args, kwargs, *own)
            if t is None:
                raise
            raise poison.donated_error(t) from error

    __call__.__wrapped__ = real
    return __call__


_real_compile = None
# (name of the _XLAC function, before, after) of every trampoline; the partial syncs commit nothing.
_TRAMPOLINES = (
    ("_xla_step_marker", commit.barrier_hook, commit.barrier_after),
    ("_xla_sync_multi", commit.flush_before, commit.flush_after),
    ("_xla_sync_live_tensors", commit.flush_before, commit.flush_after),
    ("_xla_wait_device_ops", verdicts.wait_before, verdicts.wait_after),
) + dynamo.TRAMPOLINES

C.bind(tensor_type=torch.Tensor, on_refusal=marking.refused, **poison.NATIVE_HOOKS)


def installed() -> bool:
    return isinstance(xla._XLAC._xla_step_marker, C.Trampoline)


def install() -> None:
    """Routes torch_xla's executions through the plugin (idempotent)."""
    global _real_compile
    with lock:
        for name, before, after in _TRAMPOLINES:
            current = getattr(xla._XLAC, name, None)
            if current is not None and not isinstance(current, C.Trampoline):
                trampoline = _Wrapped(xla.real(name), before, after)
                trampoline.__name__ = name
                setattr(xla._XLAC, name, trampoline)
        if _real_compile is None:
            # The module torch_xla/torch_xla.py, whose step() calls its own compile (the package
            # attribute torch_xla.torch_xla is the package: it re-exports the name).
            module = sys.modules["torch_xla.torch_xla"]
            _real_compile = module.compile
            module.compile = torch_xla.compile = _compile
        dynamo.install()
        if not _ts_patched:
            for cls, is_method in ((torch._C.ScriptFunction, False), (torch._C.ScriptMethod, True)):
                _ts_patched.append((cls, cls.__call__))
                cls.__call__ = _translating(cls.__call__, is_method)
        _install_gradient_accumulation()
        config.hooks_in(True)


def uninstall() -> None:
    """Takes the hooks out and cancels every mark: without the hooks nothing would commit
    them, and nothing may be left for torch_xla to find."""
    global _real_compile
    with lock:
        for t in C.marked_tensors():
            C.unmark(t)
        _uninstall_gradient_accumulation()
        while _ts_patched:
            cls, real = _ts_patched.pop()
            cls.__call__ = real
        dynamo.uninstall()
        for name in dir(xla._XLAC):
            fn = getattr(xla._XLAC, name, None)
            if isinstance(fn, C.Trampoline):
                setattr(xla._XLAC, name, fn.real)
        if _real_compile is not None:
            sys.modules["torch_xla.torch_xla"].compile = torch_xla.compile = _real_compile
            _real_compile = None
        config.hooks_in(False)
