"""One tensor into the ledger: the Python path of marking.

``mark`` tries the native fast path (``C.try_mark``: the checks and the
ledger entry in one call) and falls back to ``mark_checked``, which runs
every check with its own message (checks.py), honours the off switches with
one warning per reason, and then records the mark under the hook lock.

The tricky case ``mark`` exists for: helpers that mark on a user's behalf
(``donate``, ``donating``) must blame the user's line, not their own, so
the call site (``where``) is an argument; and they skip a 0-dim tensor
quietly (checks.SCALARS) where ``donate_buffer`` refuses it.

Marking only records: torch_xla's donor flag is set inside the execution
that commits the mark (_hooks/commit.py).

>>> import torch
>>> mark_version(torch.ones(1))
0
"""
from .._base import fast_path, reads, switches, xla_cpu
from .._base.dtypes import xla_dtype_name
from .._base.lock import lock
from .._base.native import C, Via
from .checks import check_donatable

__all__ = ["mark", "mark_checked", "mark_version"]


def mark(tensor, where, via=Via.DONATE_BUFFER) -> None:
    """Marks one tensor; ``where`` is the (file, line) blamed in messages and
    ``via`` the call messages name.  Raises what ``check_donatable`` raises."""
    if C.try_mark(tensor, where, via):
        return
    mark_checked(tensor, where, via)


def mark_checked(tensor, where, via=Via.DONATE_BUFFER) -> None:
    """``mark`` step by step: every check with its own message, the off
    switches, then the mark.  ``C.try_mark`` is the same path in one call
    for the common case and leaves everything else to this function."""
    check_donatable(tensor)
    if switches.warn_if_off():
        return
    if tensor.dim() == 0:
        return  # never donated, see checks.SCALARS; donate_buffer refused it already
    if xla_cpu.warn_if_unprotected():
        fast_path.refresh()  # warned once: the fast path may open
    if not reads.decided() and reads.decide_on(tensor):
        fast_path.refresh()  # decided outside any commit: the fast path may open
    # A commit in another thread must see the mark whole or not at all.
    with lock:
        if C.is_marked(tensor):
            return
        file, line = where
        C.mark(tensor, file, line, tuple(tensor.shape), xla_dtype_name(tensor.dtype),
               tensor.nbytes, via, mark_version(tensor))


def mark_version(tensor) -> int:
    """The tensor's version counter, which the commit compares to see an
    in-place update since marking (-1: an inference tensor keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1

