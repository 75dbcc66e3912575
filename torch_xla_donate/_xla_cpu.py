"""Right values on torch_xla's CPU backend: XLA:CPU's XNNPACK switched off before the
runtime starts, or one ``StaleReadWarning`` at the first donation where it cannot be.
Why, when the flag is added, and the states reported: docs/xnnpack.md.  With auto on from the
import, also XLA:CPU's fusion emitters, whose parallel compile corrupts the heap when a compile
with donated inputs fails (docs/lifecycle.md, "Failing steps")."""
import functools
import logging
import mmap
import os
import warnings

import torch_xla

from . import _xla as xla
from ._messages import user_stacklevel
from ._native import release
from .errors import StaleReadWarning

__all__ = ["FLAG", "COMPILE_FLAG", "protect_at_import", "protect_compile_failures", "decide",
           "chosen_value", "flag_supported", "on_by_default", "recheck", "watch_runtime_start",
           "warn_if_unprotected", "warning_due", "state", "describe"]

FLAG = "--xla_cpu_use_xnnpack"
COMPILE_FLAG = "--xla_cpu_use_fusion_emitters"
KEEP_ENV = "TORCH_XLA_DONATE_CPU_XNNPACK"
_log = logging.getLogger("torch_xla_donate")

# The import's decision, then recheck's (_MEANING); final once the runtime has started.
_state = "none"
_warned = False
_final = False
_compile_guard = False  # True once the import added COMPILE_FLAG=false
_RELIES_ON_FLAGS = ("added", "re-added", "chosen")  # need XLA_FLAGS to say off at the start
_MEANING = {
    "added": "XNNPACK off: the package added {flag}=false to XLA_FLAGS",
    "re-added": "XNNPACK off: XLA_FLAGS was replaced after the import; the package added {flag}=false "
                "again before the runtime started",
    "chosen": "XNNPACK off: XLA_FLAGS switches it off",
    "off by default": "XNNPACK off: this torch_xla's XLA has it off by default",
    "lost": "XNNPACK ON: XLA_FLAGS was replaced after the import without {flag}=false "
            "and the runtime started with it; values of reused buffers can be stale",
    "warn": "XNNPACK ON: values of reused buffers can be stale (see StaleReadWarning)",
    "none": "not XLA:CPU, or no XNNPACK switch in this XLA: nothing to guard",
}


def chosen_value(xla_flags: str, flag: str = FLAG):
    """What ``XLA_FLAGS`` sets ``flag`` to (None: not mentioned); the last mention wins, as in XLA.

    >>> chosen_value("--xla_cpu_use_xnnpack=false --xla_dump_to=/tmp/d --xla_cpu_use_xnnpack")
    True
    >>> chosen_value("--xla_cpu_use_xnnpack=0"), chosen_value("--xla_cpu_use_xnnpack_other=1")
    (False, None)
    """
    value = None
    for token in xla_flags.split():
        name, _, text = token.partition("=")
        if name == flag:
            value = text.strip().lower() not in ("false", "0", "no", "off") if text else True
    return value


def on_by_default(torch_xla_version: str) -> bool:
    return (release(torch_xla_version) or (0, 0)) >= (2, 9)


def decide(device: str, xla_flags: str, *, runtime_started: bool, supported: bool,
           keep: bool, default_on: bool = True) -> str:
    """What to do at import: ``"add"`` the flag, or the state to keep (_MEANING)."""
    if device.upper() != "CPU":
        return "none"
    value = chosen_value(xla_flags)
    if value is False:
        return "chosen"
    if not supported:
        return "none"
    if value is True:
        return "warn"
    if not default_on:
        return "off by default"
    return "warn" if runtime_started or keep else "add"


def flag_supported(xlac_path: str, flag: str = FLAG) -> bool:
    """Whether the XLA in ``xlac_path`` knows ``flag`` (an unknown one aborts XLA)."""
    try:
        with open(xlac_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(flag[2:].encode() + b"\x00") >= 0
    except (OSError, ValueError):
        return False


def protect_at_import() -> str:
    """Adds the flag to ``XLA_FLAGS`` if needed and still in time; returns the state."""
    global _state
    device = os.environ.get("PJRT_DEVICE", "")
    xla_flags = os.environ.get("XLA_FLAGS", "")
    # Only a CPU process that has not switched XNNPACK off pays for the search.
    undecided = device.upper() == "CPU" and chosen_value(xla_flags) is not False
    decision = decide(device, xla_flags, runtime_started=xla.runtime_started(),
                      supported=undecided and flag_supported(xla._XLAC.__file__),
                      keep=os.environ.get(KEEP_ENV, "").strip().lower() == "keep",
                      default_on=on_by_default(getattr(torch_xla, "__version__", "")))
    if decision == "add":
        os.environ["XLA_FLAGS"] = f"{xla_flags} {FLAG}=false".strip()
        _log.info("added %s=false to XLA_FLAGS: XLA:CPU's XNNPACK can compute with a "
                  "reused buffer's old contents (docs/xnnpack.md; %s=keep "
                  "leaves XLA_FLAGS alone).", FLAG, KEEP_ENV)
        decision = "added"
    _state = decision
    return decision


def protect_compile_failures() -> None:
    """With auto on from the import: adds ``COMPILE_FLAG=false`` on XLA:CPU unless the user
    chose it, kept XLA_FLAGS, the runtime started or this XLA lacks the flag (torch_xla 2.7).
    Not for explicit donation alone: the emitters' absence changes a donated step's rounding."""
    global _compile_guard
    device = os.environ.get("PJRT_DEVICE", "")
    keep = os.environ.get(KEEP_ENV, "").strip().lower() == "keep"
    flags = os.environ.get("XLA_FLAGS", "")
    if (device.upper() != "CPU" or keep or chosen_value(flags, COMPILE_FLAG) is not None
            or xla.runtime_started() or not flag_supported(xla._XLAC.__file__, COMPILE_FLAG)):
        return
    os.environ["XLA_FLAGS"] = f"{flags} {COMPILE_FLAG}=false".strip()
    _compile_guard = True


def recheck() -> str:
    """Looks at ``XLA_FLAGS`` again until the runtime has started: a flag gone is re-added, or lost."""
    global _state, _final
    if _final:
        return _state
    started = xla.runtime_started()
    flags = os.environ.get("XLA_FLAGS", "")
    value = chosen_value(flags)
    if value is True and _state in _RELIES_ON_FLAGS + ("off by default",):
        _state = "warn"  # the user's own, explicit choice: warn, never override
    elif value is None and _state in _RELIES_ON_FLAGS:
        if started:
            _state = "lost"
        else:
            lost = _compile_guard and chosen_value(flags, COMPILE_FLAG) is None
            added = f"{FLAG}=false" + (f" {COMPILE_FLAG}=false" if lost else "")
            os.environ["XLA_FLAGS"] = f"{flags} {added}".strip()
            _log.info("XLA_FLAGS was replaced after torch_xla_donate was imported: added "
                      "%s=false again before torch_xla's runtime starts (put it in your "
                      "assignment to say so yourself).", FLAG)
            _state = "re-added"
    _final = started
    return _state


def watch_runtime_start() -> None:
    """Makes ``torch_xla.device(s)`` (``xm.xla_device`` too) ``recheck`` around starting the runtime."""
    for name in ("device", "devices"):
        original = getattr(torch_xla, name, None)
        if original is None or getattr(original, "_tdx_original", None) is not None:
            continue

        @functools.wraps(original)
        def watched(*args, _original=original, **kwargs):
            recheck()  # returns at once when final
            try:
                return _original(*args, **kwargs)
            finally:
                recheck()

        watched._tdx_original = original
        setattr(torch_xla, name, watched)


state = recheck  # the reports' name for it


def describe() -> str:
    """The state in words, for ``summary()`` and ``metrics_report()``."""
    text = _MEANING[state()].format(flag=FLAG)
    if _compile_guard:
        text += f"; fusion emitters off ({COMPILE_FLAG}=false): a failed compile cannot corrupt the heap"
    return text


def warn_if_unprotected() -> bool:
    """One ``StaleReadWarning`` at the first donation of an unprotected process; True if it warned."""
    global _warned
    if not warning_due():
        return False
    _warned = True
    if _state == "lost":
        why = (f"XLA_FLAGS was assigned after torch_xla_donate was imported, without {FLAG}=false, "
               "and torch_xla's runtime started with it (the package could not add the flag "
               "again: the runtime started from C++, not through torch_xla.device()). Add it to "
               f"your assignment, e.g. os.environ['XLA_FLAGS'] = '... {FLAG}=false', or assign "
               "XLA_FLAGS before importing torch_xla_donate, to get values you can trust.")
    else:
        why = ("This process runs with XLA:CPU's XNNPACK on (XLA_FLAGS turns it on, torch_xla's "
               "runtime had started before torch_xla_donate was imported, or "
               f"{KEEP_ENV}=keep). Set XLA_FLAGS='{FLAG}=false' before torch_xla starts (or "
               "import torch_xla_donate first) to get values you can trust.")
    warnings.warn("torch_xla's CPU backend can compute a matmul with a buffer's old contents "
                  "after the buffer was reused in place (a donation, or torch_xla's own aliasing "
                  "of in-place updates), so a donating loop may drift from the same loop without "
                  "donation. " + why, StaleReadWarning, stacklevel=user_stacklevel())
    return True


def warning_due() -> bool:
    """True until an unprotected process's first donation warned (marking's fast path waits)."""
    return recheck() in ("warn", "lost") and not _warned
