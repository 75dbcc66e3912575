"""The switches (``configure`` and the environment), whether donation is on,
and the state native marking reads.

* ``TORCH_XLA_DONATE_STRICT=1`` / ``configure(strict=True)``: an unusable
  donation raises ``UnusedDonationError`` instead of warning (JAX users
  asked for this in jax#9675); the tensor keeps its value;
* ``TORCH_XLA_DONATE_DISABLE=1`` / ``configure(enabled=False)``: marking
  checks its argument and does nothing, warning once;
* ``TORCH_XLA_DONATE_AUTO=1`` / ``configure(auto=True)``: each step barrier
  also donates the step inputs nothing else holds (_auto.py).

Donation is also off under torch_xla's ``XLA_ENABLE_PARAM_ALIASING=0`` and
once a guard failed (_guards.py).  ``refresh`` is the one writer of the
native marking state (``C.set_marking_state``).

>>> import torch_xla_donate as tdx
>>> old = tdx.configure(strict=True)
>>> tdx.configure(**old)["strict"]
True
"""
import os
import threading
import warnings

from . import _guards as guards
from . import _messages as messages
from . import _xla as xla
from . import _xla_cpu as xla_cpu
from ._native import C
from .errors import DonationDisabledWarning

__all__ = ["configure", "strict", "enabled", "auto", "on", "warn_if_off", "refresh", "hooks_in"]

_lock = threading.Lock()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_state = {
    "strict": _env_flag("TORCH_XLA_DONATE_STRICT"),
    "enabled": not _env_flag("TORCH_XLA_DONATE_DISABLE"),
    "auto": _env_flag("TORCH_XLA_DONATE_AUTO"),
}

_CHECK_SHARING_RETIRED = (
    "{what} is retired and ignored: torch_xla_donate always checks who else holds a "
    "donated buffer (copies made in the step included) and keeps the donation when another "
    "tensor does. Remove it."
)
if "TORCH_XLA_DONATE_CHECK_SHARING" in os.environ:
    warnings.warn(_CHECK_SHARING_RETIRED.format(what="TORCH_XLA_DONATE_CHECK_SHARING"),
                  DeprecationWarning, stacklevel=2)


def configure(*, strict: bool | None = None, enabled: bool | None = None,
              check_sharing=None, auto: bool | None = None) -> dict:
    """Sets the switches given; None leaves one as it is.

    Args:
      strict: unusable donations raise ``UnusedDonationError`` instead of
        warning.
      enabled: False switches donation off (marking checks and does nothing).
      check_sharing: retired: accepted and ignored with a
        ``DeprecationWarning`` (ownership is always checked).
      auto: at each step barrier also donate the step inputs nothing else
        holds; off by default.

    Returns:
      The previous values, so ``configure(**previous)`` restores them.

    Raises:
      TypeError: a value is not True, False or None.
    """
    if check_sharing is not None:
        warnings.warn(_CHECK_SHARING_RETIRED.format(what="configure(check_sharing=...)"),
                      DeprecationWarning, stacklevel=2)
    given = {"strict": strict, "enabled": enabled, "auto": auto}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"configure({name}=...) expects True or False, got {value!r}")
    with _lock:
        previous = dict(_state)
        for name, value in given.items():
            if value is not None:
                _state[name] = value
    refresh()
    return previous


def strict() -> bool:
    return _state["strict"]


def enabled() -> bool:
    return _state["enabled"]


def auto() -> bool:
    return _state["auto"]


def on() -> bool:
    """Whether donation is on: no switch and no guard turns it off."""
    return _state["enabled"] and xla.aliasing_enabled() and guards.failure() is None


_disabled_warned = set()


def warn_if_off() -> bool:
    """True, with the once-per-reason ``DonationDisabledWarning`` at the
    user's line, when donation is off (a loop donates every step)."""
    if on():
        return False
    if guards.failure() is not None:
        message = messages.GUARD.format(why=guards.failure())
    else:
        message = messages.OFF if not _state["enabled"] else messages.ALIASING_OFF
    if message not in _disabled_warned:
        _disabled_warned.add(message)
        warnings.warn(message, DonationDisabledWarning, stacklevel=messages.user_stacklevel())
    return True


_hooks_in = False


def hooks_in(in_: bool) -> None:
    """_hooks.py: the hooks are in or out (without them nothing would
    commit a mark, so marking is off)."""
    global _hooks_in
    _hooks_in = in_
    refresh()


def refresh() -> None:
    """Tells native marking whether donation is on, whether a
    ``StaleReadWarning`` is owed first, and whether the guards ran.
    (torch_xla reads ``XLA_ENABLE_PARAM_ALIASING`` when it first compiles,
    so a change before the first step still counts: every barrier calls
    this.)"""
    C.set_marking_state(_hooks_in and on(), xla_cpu.warning_due(), guards.decided())
