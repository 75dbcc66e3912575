"""TorchScript: a donated tensor used by a scripted or traced function raises
``DonatedBufferError``, not a blank ``RuntimeError``.

Poisoning works in c10's dispatcher (poison.py), so the TorchScript
interpreter does reach the poison.  But it turns any error raised by an
operator into a ``RuntimeError`` of its own, and loses a Python error's
message on the way ("RuntimeError: " and nothing else).  This module puts
the error back where the user can read it: when a call of a
``torch.jit.ScriptFunction`` or ``ScriptMethod`` raises, and one of its
arguments (or a parameter or buffer of the scripted module) is a consumed
donated tensor, the call raises that tensor's ``DonatedBufferError``
instead, chained to the interpreter's error.  A call that succeeds pays
nothing.

``install()`` runs when ``torch_xla_donate`` is imported.

>>> installed()
True
"""
import torch

from .._outcomes import poison

__all__ = ["install", "uninstall", "installed"]

# (class, its original __call__) while installed.
_patched = []


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


def install() -> None:
    if _patched:
        return
    for cls, is_method in ((torch._C.ScriptFunction, False), (torch._C.ScriptMethod, True)):
        real = cls.__call__
        cls.__call__ = _translating(real, is_method)
        _patched.append((cls, real))


def uninstall() -> None:
    while _patched:
        cls, real = _patched.pop()
        cls.__call__ = real


def installed() -> bool:
    return bool(_patched)
