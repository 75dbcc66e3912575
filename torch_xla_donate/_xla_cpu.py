"""Right values on torch_xla's CPU backend: XLA:CPU's XNNPACK switched off.

torch_xla 2.9's XLA:CPU can compute a matmul with a buffer's old contents
after the buffer was reused in place (a donation, or torch_xla's own
aliasing of in-place updates) on some x86 CPUs; ``--xla_cpu_use_xnnpack=false``
makes such loops right (docs/xnnpack.md).  At import, on the CPU backend,
before torch_xla's runtime starts (XLA reads ``XLA_FLAGS`` once, then), and
when ``XLA_FLAGS`` does not decide it, the flag is added and logged once.
``XLA_FLAGS`` replaced after the import is looked at again until the runtime
starts (``recheck``: at ``torch_xla.device()``, every barrier and marking).
When the process cannot be protected, the first donation gives a
``StaleReadWarning`` naming the flag; nothing changes silently.
``TORCH_XLA_DONATE_CPU_XNNPACK=keep`` leaves ``XLA_FLAGS`` alone.  torch_xla
2.7 and 2.8 have XNNPACK off by default: nothing is added there.

>>> decide("CPU", "", runtime_started=False, supported=True, keep=False)
'add'
>>> decide("CPU", "--xla_cpu_use_xnnpack=true", runtime_started=False, supported=True, keep=False)
'warn'
>>> decide("CUDA", "", runtime_started=False, supported=True, keep=False)
'none'
>>> decide("CPU", "", runtime_started=True, supported=True, keep=False, default_on=False)
'off by default'
"""
import functools
import logging
import mmap
import os
import warnings

import torch_xla

from ._messages import user_stacklevel
from ._native import release
from .errors import StaleReadWarning

__all__ = ["FLAG", "protect_at_import", "decide", "chosen_value", "flag_supported",
           "on_by_default", "recheck", "watch_runtime_start", "warn_if_unprotected",
           "warning_due", "state", "describe"]

FLAG = "--xla_cpu_use_xnnpack"
KEEP_ENV = "TORCH_XLA_DONATE_CPU_XNNPACK"

_log = logging.getLogger("torch_xla_donate")

# The first torch_xla release whose XLA:CPU has XNNPACK on by default.
FIRST_RELEASE_ON_BY_DEFAULT = (2, 9)

# What the import decided: "added", "chosen" (XLA_FLAGS decides it, off),
# "warn" (unprotected: warn at the first donation), "off by default" (this
# release's XLA has it off), "none" (not the CPU backend, or this XLA has no
# XNNPACK switch); and what recheck found later: "re-added", "lost".
_state = "none"
_warned = False
# True once torch_xla's runtime has started (XLA has read XLA_FLAGS): the
# state cannot change any more.
_final = False
# States that rely on XLA_FLAGS still switching XNNPACK off at the start.
_RELIES_ON_FLAGS = ("added", "re-added", "chosen")
# What each state means, for the reports.
_MEANING = {
    "added": "XNNPACK off: the package added {flag}=false to XLA_FLAGS",
    "re-added": "XNNPACK off: XLA_FLAGS was replaced after the import; the package added "
                "{flag}=false again before the runtime started",
    "chosen": "XNNPACK off: XLA_FLAGS switches it off",
    "off by default": "XNNPACK off: this torch_xla's XLA has it off by default",
    "lost": "XNNPACK ON: XLA_FLAGS was replaced after the import without {flag}=false "
            "and the runtime started with it; values of reused buffers can be stale",
    "warn": "XNNPACK ON: values of reused buffers can be stale (see StaleReadWarning)",
    "none": "not XLA:CPU, or no XNNPACK switch in this XLA: nothing to guard",
}


def chosen_value(xla_flags: str):
    """The value ``XLA_FLAGS`` gives the XNNPACK switch: True, False, or None
    when it does not mention it (the last mention wins, as in XLA).

    >>> chosen_value("--xla_cpu_use_xnnpack=false --xla_dump_to=/tmp/d")
    False
    >>> chosen_value("--xla_cpu_use_xnnpack"), chosen_value("--xla_cpu_use_xnnpack=0")
    (True, False)
    >>> chosen_value("--xla_cpu_use_xnnpack_other=1") is None
    True
    """
    value = None
    for token in xla_flags.split():
        name, _, text = token.partition("=")
        if name != FLAG:
            continue
        value = text.strip().lower() not in ("false", "0", "no", "off") if text else True
    return value


def on_by_default(torch_xla_version: str) -> bool:
    """Whether this torch_xla release's XLA:CPU has XNNPACK on by default.

    >>> on_by_default("2.9.0"), on_by_default("2.8.1+neuron"), on_by_default("2.10.0")
    (True, False, True)
    """
    return (release(torch_xla_version) or (0, 0)) >= FIRST_RELEASE_ON_BY_DEFAULT


def decide(device: str, xla_flags: str, *, runtime_started: bool, supported: bool,
           keep: bool, default_on: bool = True) -> str:
    """What to do at import: ``"add"`` the flag, ``"warn"`` at the first
    donation, ``"chosen"`` (the user switched XNNPACK off already), ``"off
    by default"`` (this release's XLA has it off and ``XLA_FLAGS`` does not
    turn it on) or ``"none"`` (not XLA:CPU, or no such switch in this XLA)."""
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
    if runtime_started or keep:
        return "warn"
    return "add"


def flag_supported(xlac_path: str) -> bool:
    """True when the XLA inside ``_XLAC`` (at ``xlac_path``) knows the flag:
    its name is among the flag names compiled into the library.  The
    library is mapped by the import already, so the search reads memory
    (tens of ms, once, on the CPU backend only)."""
    try:
        with open(xlac_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(FLAG[2:].encode() + b"\x00") >= 0
    except (OSError, ValueError):
        return False


def _runtime_started(xlac) -> bool:
    started = getattr(xlac, "_xla_runtime_is_initialized", None)
    # Without the query (no supported release lacks it) assume the worst.
    return True if started is None else bool(started())


def protect_at_import(xlac) -> str:
    """Adds the flag to ``XLA_FLAGS`` if it is needed and can still count;
    returns what was decided: ``"added"``, or ``decide``'s answer."""
    global _state
    device = os.environ.get("PJRT_DEVICE", "")
    xla_flags = os.environ.get("XLA_FLAGS", "")
    # Only a CPU process that has not switched XNNPACK off pays for the search.
    undecided = device.upper() == "CPU" and chosen_value(xla_flags) is not False
    decision = decide(device, xla_flags, runtime_started=_runtime_started(xlac),
                      supported=undecided and flag_supported(xlac.__file__),
                      keep=os.environ.get(KEEP_ENV, "").strip().lower() == "keep",
                      default_on=on_by_default(getattr(torch_xla, "__version__", "")))
    if decision == "add":
        os.environ["XLA_FLAGS"] = f"{xla_flags} {FLAG}=false".strip()
        _log.info("added %s=false to XLA_FLAGS: XLA:CPU's XNNPACK can compute with a "
                  "reused buffer's old contents (see torch_xla_donate.xla_cpu; %s=keep "
                  "leaves XLA_FLAGS alone).", FLAG, KEEP_ENV)
        decision = "added"
    _state = decision
    return decision


def recheck(xlac=None) -> str:
    """Looks at ``XLA_FLAGS`` again until torch_xla's runtime has started
    (see "The tricky case" above) and returns the state.

    Before the start, a flag the import relied on and that is gone now is
    added again; at or after it the state is final: ``"lost"`` if it was
    gone, ``"warn"`` if ``XLA_FLAGS`` now turns XNNPACK on explicitly.
    """
    global _state, _final
    if _final:
        return _state
    started = _runtime_started(xlac or torch_xla._XLAC)
    flags = os.environ.get("XLA_FLAGS", "")
    value = chosen_value(flags)
    if value is True and _state in _RELIES_ON_FLAGS + ("off by default",):
        _state = "warn"  # the user's own, explicit choice: warn, never override
    elif value is None and _state in _RELIES_ON_FLAGS:
        if started:
            _state = "lost"
        else:
            os.environ["XLA_FLAGS"] = f"{flags} {FLAG}=false".strip()
            _log.info("XLA_FLAGS was replaced after torch_xla_donate was imported: added "
                      "%s=false again before torch_xla's runtime starts (put it in your "
                      "assignment to say so yourself).", FLAG)
            _state = "re-added"
    _final = started
    return _state


def watch_runtime_start(module=None) -> None:
    """Wraps ``torch_xla.device`` and ``torch_xla.devices`` (``xm.xla_device``
    calls the former) so that ``recheck`` runs just before they can start
    the runtime, and once after.  Idempotent."""
    module = module or torch_xla
    for name in ("device", "devices"):
        original = getattr(module, name, None)
        if original is None or getattr(original, "_tdx_original", None) is not None:
            continue

        @functools.wraps(original)
        def watched(*args, _original=original, **kwargs):
            if _final:
                return _original(*args, **kwargs)
            recheck()
            try:
                return _original(*args, **kwargs)
            finally:
                recheck()

        watched._tdx_original = original
        setattr(module, name, watched)


def state() -> str:
    """The guard's state: added, re-added, chosen, off by default, warn,
    lost or none (``recheck``'s answer)."""
    return recheck()


def describe() -> str:
    """The guard's state in words, for ``summary()`` and ``metrics_report()``.

    >>> describe().split(":")[0] in ("XNNPACK off", "XNNPACK ON", "not XLA")
    True
    """
    return _MEANING[state()].format(flag=FLAG)


def warn_if_unprotected() -> bool:
    """At the first donation in an unprotected CPU process: one
    ``StaleReadWarning`` naming the flag.  True while a warning is still
    due (the fast path of marking stays closed until it was given)."""
    global _warned
    if recheck() not in ("warn", "lost") or _warned:
        return False
    _warned = True
    if _state == "lost":
        why = ("XLA_FLAGS was assigned after torch_xla_donate was imported, without "
               f"{FLAG}=false, and torch_xla's runtime started with it (the package could "
               "not add the flag again: the runtime started from C++, not through "
               "torch_xla.device()). Add it to your assignment, e.g. "
               f"os.environ['XLA_FLAGS'] = '... {FLAG}=false', or assign XLA_FLAGS before "
               "importing torch_xla_donate, to get values you can trust.")
    else:
        why = ("This process runs with XLA:CPU's XNNPACK on (XLA_FLAGS turns it on, "
               "torch_xla's runtime had started before torch_xla_donate was imported, or "
               f"{KEEP_ENV}=keep). Set XLA_FLAGS='{FLAG}=false' before torch_xla starts (or "
               "import torch_xla_donate first) to get values you can trust.")
    warnings.warn(
        "torch_xla's CPU backend can compute a matmul with a buffer's old contents after "
        "the buffer was reused in place (a donation, or torch_xla's own aliasing of "
        "in-place updates), so a donating loop may drift from the same loop without "
        "donation. " + why,
        StaleReadWarning,
        stacklevel=user_stacklevel(),
    )
    return True


def warning_due() -> bool:
    """True until the first donation of an unprotected process has warned
    (also when the guard was lost after the import: ``recheck``)."""
    return recheck() in ("warn", "lost") and not _warned
