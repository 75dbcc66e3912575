"""Process-wide switches: strict mode and the off switch.

Both can be set by environment variable (read at import) or by
``configure``:

* ``TORCH_XLA_DONATE_STRICT=1`` / ``configure(strict=True)``: a donation that
  a step could not use raises ``UnusedDonationError`` instead of warning
  (JAX users asked for this in jax#9675).  The tensor still keeps its value.
* ``TORCH_XLA_DONATE_DISABLE=1`` / ``configure(enabled=False)``: for
  debugging, ``donate_buffer`` checks its argument and then does nothing,
  warning once.  Nothing is donated or poisoned.
* ``TORCH_XLA_DONATE_AUTO=1`` / ``configure(auto=True)``: each step barrier
  also donates the step inputs nothing else holds any more (_outcomes/auto.py).

Retired: ``configure(check_sharing=...)`` and ``TORCH_XLA_DONATE_CHECK_SHARING``
are accepted and ignored with a ``DeprecationWarning``: who else holds a
donor's buffer is always checked (_outcomes/sharing.py).

>>> import torch_xla_donate as tdx
>>> old = tdx.configure(strict=True)
>>> tdx.configure(**old)["strict"]
True
"""
import os
import threading
import warnings

__all__ = ["configure", "strict", "enabled", "auto"]

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


# Called with no argument after ``configure`` changed a switch (the step
# hook opens or closes its native fast path of marking).
changed_listeners = []


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
        holds (_outcomes/auto.py); off by default.

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
    for listener in changed_listeners:
        listener()
    return previous


def strict() -> bool:
    return _state["strict"]


def enabled() -> bool:
    return _state["enabled"]



def auto() -> bool:
    return _state["auto"]
