"""The one owner of the native library ``torch_xla_donate._C``, the releases
it runs on, and the commit lock.

Supported: torch_xla 2.7, 2.8 and 2.9, each with the torch release of the
same number (torch_xla's wheels do not declare it, so a mismatch installs
silently).  torch_xla 2.6 and older ignore explicit donor flags at the step
barrier (honoured from 2.7, pytorch/xla#8982): importing says so.

>>> check_versions("2.9.0+cu128", "2.9.0")
>>> check_versions("2.6.0", "2.6.0")
Traceback (most recent call last):
ImportError: torch_xla_donate needs torch_xla 2.7, 2.8 or 2.9; this is torch_xla 2.6.0, ...
>>> Verdict.REUSED.name, Via.DONATE_BUFFER.value
('REUSED', 0)
"""
import atexit
import inspect
import re
import threading

import torch
import torch_xla

from . import _C as C

__all__ = ["C", "Verdict", "Via", "lock", "SUPPORTED", "release", "check_versions",
           "check_build", "carried_as_varargs", "call_gradient_accumulation"]

SUPPORTED = ((2, 7), (2, 8), (2, 9))


def release(version: str):
    """(major, minor) of a version string.

    >>> release("2.9.0+cu128"), release("2.7.0rc1"), release("nightly")
    ((2, 9), (2, 7), None)
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_versions(torch_version: str, torch_xla_version: str) -> None:
    """Raises ImportError, saying what to install, unless this torch_xla is
    supported and torch is its matching release."""
    xla, torch_release = release(torch_xla_version), release(torch_version)
    names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED[:-1]) + f" or {'.'.join(map(str, SUPPORTED[-1]))}"
    if xla not in SUPPORTED:
        older = xla is not None and xla < SUPPORTED[0]
        why = (" torch_xla 2.6 and older ignore explicit donor flags at the step barrier "
               "(honoured from 2.7, pytorch/xla#8982)." if older else "")
        raise ImportError(
            f"torch_xla_donate needs torch_xla {names}; this is torch_xla "
            f"{torch_xla_version}, with torch {torch_version}.{why} Install a supported "
            f"release with its own torch: pip install 'torch==2.9.0' 'torch_xla==2.9.0'.")
    if torch_release != xla:
        raise ImportError(
            f"torch_xla {torch_xla_version} is built for torch {xla[0]}.{xla[1]}, but torch "
            f"{torch_version} is installed (torch_xla's wheels do not pin it, so pip "
            f"allows the mismatch). Install the matching torch: "
            f"pip install 'torch=={xla[0]}.{xla[1]}.*'.")


def check_build(built_for, torch_version: str) -> None:
    """Raises ImportError unless the native extension was built against this
    torch (a checkout switched between releases keeps the last build).

    >>> check_build("2.9.0+cu128", "2.9.0+cu128"); check_build(None, "2.8.0")
    >>> check_build("2.7.0", "2.9.0")
    Traceback (most recent call last):
    ImportError: torch_xla_donate's extension was built against torch 2.7.0, ...
    """
    if built_for is not None and built_for != torch_version:
        raise ImportError(
            f"torch_xla_donate's extension was built against torch {built_for}, but torch "
            f"{torch_version} is installed. Rebuild it in this environment: "
            f"pip install --no-build-isolation -e . (or TDX_TORCH_XLA=<release> bash "
            f"tools/dev.sh test, which does).")


def carried_as_varargs(gradient_accumulation) -> bool:
    """True when ``gradient_accumulation`` takes carried tensors as
    ``*carried_tensors`` (torch_xla 2.8 and later), False for one tuple."""
    params = inspect.signature(gradient_accumulation).parameters.values()
    return any(p.kind == p.VAR_POSITIONAL for p in params)


def call_gradient_accumulation(gradient_accumulation, train_step, iterable_tensors, model,
                               *carried):
    """``gradient_accumulation`` with the carried tensors as this torch_xla
    takes them."""
    if carried_as_varargs(gradient_accumulation):
        return gradient_accumulation(train_step, iterable_tensors, model, *carried)
    return gradient_accumulation(train_step, iterable_tensors, model, tuple(carried))


check_versions(torch.__version__, torch_xla.__version__)
check_build(C.BUILT_FOR_TORCH, torch.__version__)

Verdict = C.Verdict
Via = C.Via


class _CommitLock:
    """The re-entrant lock of a commit, which native marking sees: it counts
    its holders in ``_C``, and a mark made while another thread holds it
    waits for it (Refusal.COMMITTING).

    >>> with lock:
    ...     C.lock_holders() > 0
    True
    """

    def __init__(self):
        self._lock = threading.RLock()

    def acquire(self):
        self._lock.acquire()
        C.note_lock(True)

    def release(self):
        C.note_lock(False)
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info):
        self.release()


lock = _CommitLock()

# The consumed buffers the native reaper frees off the loop's thread: all
# freed before the interpreter and torch_xla's runtime go.  Registered after
# torch_xla's own exit handler (``_prepare_to_exit``, at its import), so run
# before it.
atexit.register(C.reaper_drain, True)
