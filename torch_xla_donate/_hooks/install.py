"""Installing the hooks into torch_xla, and taking them out.

``install`` runs when ``torch_xla_donate`` is imported: the native
trampolines in place of torch_xla's step barrier and syncs
(executions.py), the dynamo bridge's graph extraction (dynamo.py),
TorchScript's call translation (torchscript.py) and the guard of
``gradient_accumulation`` (gradient_accumulation.py).  ``uninstall`` takes
them out and cancels every mark: without the hooks nothing would commit
them, and nothing may be left for torch_xla to find.

Importing this module hands the native library, in one ``C.bind`` call,
what it needs of Python (``bind_native``): this is the one writer of those
bindings, as it may import every layer.  torch_xla's and torch's functions
come from ``_base/xla``, the poison's class and its dispatch callback from
``_outcomes/poison``; each module says what it hands over in its
``NATIVE_HOOKS``.  Until then the native calls that need them raise
(``hooks are not bound``); nothing calls them while the package imports.

>>> import torch_xla_donate
>>> installed()
True
"""
from .._base import config, switches, xla
from .._base.lock import lock
from .._base.native import C
from .._outcomes import poison
from . import dynamo, executions, gradient_accumulation, torchscript

__all__ = ["install", "uninstall", "installed", "bind_native"]


def bind_native() -> None:
    """Hands the native library every callable it calls back, in one call
    (once, at import; binding again replaces them)."""
    C.bind(**xla.NATIVE_HOOKS, **poison.NATIVE_HOOKS)


bind_native()


def install() -> None:
    """Routes torch_xla's executions through the plugin (idempotent)."""
    with lock:
        executions.install(extra=dynamo.TRAMPOLINES)
        dynamo.install()
        torchscript.install()
        gradient_accumulation.install()
        if switches.refresh not in config.changed_listeners:
            config.changed_listeners.append(switches.refresh)
        switches.hooks_in(True)


def uninstall() -> None:
    """Takes the hooks out and cancels every mark: without the hooks nothing
    would commit them, and nothing may be left for torch_xla to find."""
    with lock:
        for t in C.marked_tensors():
            C.unmark(t)
        gradient_accumulation.uninstall()
        torchscript.uninstall()
        dynamo.uninstall()
        executions.uninstall()
        switches.hooks_in(False)


def installed() -> bool:
    """True while the hooks are in place."""
    return executions.installed()
