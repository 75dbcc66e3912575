"""Process-wide switches: strict mode and the off switch.

Both can be set by environment variable (read at import) or by
``configure``:

* ``TORCH_XLA_DONATE_STRICT=1`` / ``configure(strict=True)``: a donation that
  a step could not use raises ``UnusedDonationError`` instead of warning
  (JAX users asked for this in jax#9675).  The tensor still keeps its value.
* ``TORCH_XLA_DONATE_DISABLE=1`` / ``configure(enabled=False)``: for
  debugging, ``donate_buffer`` checks its argument and then does nothing,
  warning once.  Nothing is donated or poisoned.

>>> import torch_xla_donate as tdx
>>> old = tdx.configure(strict=True)
>>> tdx.configure(**old)["strict"]
True
"""
import os
import threading

__all__ = ["configure", "strict", "enabled"]

_lock = threading.Lock()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_state = {
    "strict": _env_flag("TORCH_XLA_DONATE_STRICT"),
    "enabled": not _env_flag("TORCH_XLA_DONATE_DISABLE"),
}


# Called with no argument after ``configure`` changed a switch (the step
# hook opens or closes its native fast path of marking).
changed_listeners = []


def configure(*, strict=None, enabled=None) -> dict:
    """Sets the switches given (None leaves one as it is); returns the
    previous values, so ``configure(**previous)`` restores them."""
    for name, value in (("strict", strict), ("enabled", enabled)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"configure({name}=...) expects True or False, got {value!r}")
    with _lock:
        previous = dict(_state)
        if strict is not None:
            _state["strict"] = strict
        if enabled is not None:
            _state["enabled"] = enabled
    for listener in changed_listeners:
        listener()
    return previous


def strict() -> bool:
    return _state["strict"]


def enabled() -> bool:
    return _state["enabled"]
