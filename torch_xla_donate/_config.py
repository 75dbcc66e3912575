"""``configure()`` and the environment switches: this module writes the switches,
which live natively where marking reads them (docs/design.md, "State and who owns it").

>>> old = configure(strict=True)
>>> configure(**old)["strict"], configure()["strict"]  # no argument: only reads
(True, False)
"""
import os
import warnings

from . import _messages as messages
from . import _xla as xla
from . import _xla_cpu as xla_cpu
from ._native import C
from .errors import DonationDisabledWarning

__all__ = ["configure", "strict", "auto", "on", "warn_if_off", "refresh", "hooks_in"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_RETIRED = ("{what} is retired and ignored: torch_xla_donate always checks who else holds a donated "
            "buffer (copies made in the step included) and keeps the donation when another "
            "tensor does. Remove it.")
if "TORCH_XLA_DONATE_CHECK_SHARING" in os.environ:
    warnings.warn(_RETIRED.format(what="TORCH_XLA_DONATE_CHECK_SHARING"), DeprecationWarning, stacklevel=2)
C.set_switches(strict=_env_flag("TORCH_XLA_DONATE_STRICT"),
               enabled=not _env_flag("TORCH_XLA_DONATE_DISABLE"),
               auto=_env_flag("TORCH_XLA_DONATE_AUTO"))


def configure(*, strict: bool | None = None, enabled: bool | None = None,
              check_sharing=None, auto: bool | None = None) -> dict:
    """Sets the switches given (None: left as is) and returns the previous values.

    ``strict`` (``TORCH_XLA_DONATE_STRICT=1``): unusable donations raise instead of warning;
    ``enabled=False`` (``TORCH_XLA_DONATE_DISABLE=1``): marking does nothing; ``auto``
    (``TORCH_XLA_DONATE_AUTO=1``): barriers also donate the step inputs nothing else holds."""
    if check_sharing is not None:
        warnings.warn(_RETIRED.format(what="configure(check_sharing=...)"), DeprecationWarning, stacklevel=2)
    given = {"strict": strict, "enabled": enabled, "auto": auto}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"configure({name}=...) expects True or False, got {value!r}")
    switches = C.switches()
    C.set_switches(**{name: value for name, value in given.items() if value is not None})
    refresh()
    return {name: switches[name] for name in given}


def strict() -> bool:
    return C.switches()["strict"]


def auto() -> bool:
    return C.switches()["auto"]


def on() -> bool:
    """Donation is on: switched on, aliasing on, no guard failed."""
    return C.switches()["on"]


def warn_if_off() -> bool:
    """True, with a ``DonationDisabledWarning`` at the user's line, when donation is off."""
    switches = C.switches()
    if switches["on"]:
        return False
    if switches["failure"] is not None:
        message = messages.GUARD.format(why=switches["failure"])
    else:
        message = messages.OFF if not switches["enabled"] else messages.ALIASING_OFF
    warnings.warn(message, DonationDisabledWarning, stacklevel=messages.user_stacklevel())
    return True


def hooks_in(in_: bool) -> None:
    C.set_switches(hooks_in=in_)


def refresh() -> None:
    """Reads again ``XLA_ENABLE_PARAM_ALIASING`` (torch_xla reads it at its first compile,
    so every barrier looks) and whether a ``StaleReadWarning`` is owed first."""
    C.set_switches(aliasing=xla.aliasing_enabled(), warn_first=xla_cpu.warning_due())
