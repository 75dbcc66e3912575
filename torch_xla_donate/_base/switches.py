"""Whether donation is on, the warning that says it is off, and the state
native marking reads (``C.set_marking_state``).

Three things turn every donation into a no-op: the plugin's own switch
(``TORCH_XLA_DONATE_DISABLE=1`` or ``configure(enabled=False)``),
torch_xla's ``XLA_ENABLE_PARAM_ALIASING=0``, and a guard that failed
(guards.py).  The warning is given once per reason and process: a loop
donates every step.

``refresh`` is the one writer of the native marking state; the config's
listeners, every barrier, the guards' decision and the first
``StaleReadWarning`` call it.  The hooks say whether they are in through
``hooks_in``, so that a ``configure()`` after ``uninstall()`` cannot let
marking on.

>>> on() in (True, False)
True
"""
import warnings

from . import config, guards, xla, xla_cpu
from .errors import DonationDisabledWarning
from .native import C
from .sites import user_stacklevel

__all__ = ["on", "warn_if_off", "refresh", "hooks_in"]

OFF = (
    "torch_xla_donate is switched off (TORCH_XLA_DONATE_DISABLE=1 or "
    "configure(enabled=False)): donate_buffer() does nothing and no "
    "tensor will be poisoned."
)
ALIASING_OFF = (
    "XLA_ENABLE_PARAM_ALIASING=0 turns off buffer donation in torch_xla: "
    "donate_buffer() does nothing and no tensor will be poisoned. Unset it "
    "to save the memory."
)
GUARD = (
    "torch_xla_donate switched donation off for this process: {why}. This torch_xla "
    "build does not match what the package reads natively; nothing is donated or "
    "poisoned, and every tensor keeps its value. Please report this message with "
    "your torch and torch_xla versions."
)

_disabled_warned = set()
_hooks_in = False


def on() -> bool:
    """Whether donation is on: no switch and no guard turns it off."""
    return config.enabled() and xla.aliasing_enabled() and guards.failure() is None


def warn_if_off() -> bool:
    """True, with the once-per-reason ``DonationDisabledWarning`` at the
    user's line, when donation is off."""
    if on():
        return False
    if guards.failure() is not None:
        message = GUARD.format(why=guards.failure())
    else:
        message = OFF if not config.enabled() else ALIASING_OFF
    if message not in _disabled_warned:
        _disabled_warned.add(message)
        warnings.warn(message, DonationDisabledWarning, stacklevel=user_stacklevel())
    return True


def hooks_in(in_: bool) -> None:
    """_hooks/install.py: the hooks are in or out; refreshes."""
    global _hooks_in
    _hooks_in = in_
    refresh()


def refresh() -> None:
    """Tells native marking whether donation is on (and the hooks in: else
    nothing would commit a mark) and whether a ``StaleReadWarning`` is owed
    first.  (torch_xla reads ``XLA_ENABLE_PARAM_ALIASING`` when it first
    compiles, so a change before the first step still counts.)"""
    C.set_marking_state(_hooks_in and on(), xla_cpu.warning_due(), guards.decided())
