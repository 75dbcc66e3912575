"""Verdicts of committed donations (docs/design.md, "The step's life"): this
module owns the in-flight entries, settled at the device's next barrier, a
use of the tensor (``settle_one``), ``is_deleted`` or ``settle()``.
"""
import threading
import weakref

import torch

from . import _auto as auto
from . import _holders as holders
from . import _messages as messages
from . import _poison as poison
from . import _xla as xla
from ._config import strict
from ._native import C, lock
from .errors import DroppedDonationWarning, UnusedDonationError, UnusedDonationWarning

__all__ = ["after_commit", "settle", "settle_one", "abandon", "failed", "drop", "drop_entries",
           "disarm_in_flight", "release_unheld", "settled_listeners", "notify_settled",
           "barrier_device", "marks_on", "dispatched", "wait_before", "wait_after",
           "note_failure", "note_module_buffers"]

# The C.Entry of every committed donation whose verdict is open.
_in_flight = []

# Called whenever verdicts may have settled (report.py); cheap, never raising.
settled_listeners = []


def notify_settled() -> None:
    holders.settle_companions()
    for listener in settled_listeners:
        listener()


def after_commit(device, donors, certain: bool) -> None:
    """The device's earlier verdicts are certain now (this execution started
    after the previous one was dispatched); its own if ``certain``."""
    global _in_flight
    earlier, others = _split_by_device(_in_flight, device)
    try:
        earlier = _settle(earlier, certain=True)
        donors = _settle(donors, certain=certain)
    finally:  # also when strict mode raises: what is unsettled stays in flight
        _in_flight = _joined(others, earlier, donors)
    notify_settled()


def _joined(*lists) -> list:
    """The lists' entries in one list, the one non-empty list itself when
    there is only one (no new block of hundreds of entries per step).

    >>> a = [1]
    >>> _joined([], a, []) is a, _joined([1], [2])
    (True, [1, 2])
    """
    full = [entries for entries in lists if entries]
    return full[0] if len(full) == 1 else [e for entries in full for e in entries]


def abandon(entries, verdict) -> None:
    """Committed entries that will not be donated: values kept, quietly."""
    for t, record in entries:
        _keep(t, record, verdict)


def failed(entries) -> None:
    """A failed execution's donations: STEP_FAILED, or LOST if torch_xla lost
    the buffer (2.7, a compile error)."""
    for entry in entries:
        t, record = entry
        if record.verdict == C.Verdict.IN_FLIGHT:
            if _consumed(entry):
                _lose(t, record)
            else:
                _keep(t, record, C.Verdict.STEP_FAILED)


def _consumed(entry) -> bool:
    consumed = C.entry_consumed(entry)  # None: the entry holds its tensor, ask it
    return C.lazy_is_consumed(entry[0]) if consumed is None else consumed


def _settle(entries, certain: bool) -> list:
    """Settles entries once ``certain`` their step was dispatched (before, a
    buffer XLA holds for a donation reads as deleted); returns those open."""
    if not certain:
        return entries
    if _failed_through > 0:
        failed([e for e in entries if _in_failed_step(e[1])])
    unknown, unusable = C.settle_entries(entries, certain)
    for t, record in unusable:
        _keep(t, record, C.Verdict.UNUSED)
    if unusable:
        _warn_unused(unusable)
    return unknown


def settle_one(t, record) -> None:
    """Settles ``record`` now: ``t`` is about to be used.  Never waits holding
    the lock (another device's step may wait in a collective for this thread)."""
    with lock:
        if record.verdict != C.Verdict.IN_FLIGHT:
            return
    if record.step > dispatched_through(t.device):
        xla.wait_device_ops(t.device)
    with lock:
        if record.verdict != C.Verdict.IN_FLIGHT:
            return  # a barrier settled it meanwhile
        at = next((i for i, e in enumerate(_in_flight) if e[1].id == record.id), None)
        entry = _in_flight.pop(at) if at is not None else None
        held = t if entry is None or entry[0] is None else entry[0]  # the user's tensor
        if _in_failed_step(record):
            failed([(held, record)])
        else:
            _, unusable = C.settle_entries([(t, record)], True)
            if unusable:
                _keep(held, record, C.Verdict.UNUSED)
                notify_settled()
                _warn_unused([(held, record)])
                return
        notify_settled()


def settle() -> None:
    """Settles every open verdict, waiting for the device if needed
    (``torch_xla_donate.settle()``): reports and counts taken after it are
    final.  It first waits for autograd's worker thread to let go of finished
    backward passes, so a loop calling it before each barrier is
    bit-repeatable even without donations (a run to compare a donating one with).

    Raises:
      UnusedDonationError: in strict mode, for donations no output could take.
      The error of a failed asynchronous step, if it surfaces while waiting
      (its donations keep their values and stay open).
    """
    global _in_flight
    if xla.runtime_started():
        holders.settle_autograd(barrier_device(""))
    auto.settle()
    with lock:
        entries, _in_flight = _in_flight, []
    if not entries:
        return
    try:
        xla.wait_device_ops()
    except BaseException:
        with lock:
            _in_flight = entries + _in_flight
        raise
    with lock:
        try:
            _settle(entries, certain=True)
        finally:
            notify_settled()


def release_unheld() -> None:
    """Entries whose tensor the loop dropped since keep only their buffer."""
    if _in_flight:
        C.release_unheld(_in_flight)


def disarm_in_flight(device) -> None:
    """Before an execution builds its graph: clears the flag ``finish`` left
    armed on a held donor whose buffer still has a value (its step running)."""
    if _in_flight:
        for entry in C.live_held(_in_flight, True):
            xla.set_donor(entry[0], False)


def in_flight_count() -> int:
    return len(_in_flight)


def _keep(t, record, verdict) -> None:
    """A verdict that leaves ``t`` (None: nobody holds it) its value."""
    if t is not None and C.live_held([record]):
        xla.set_donor(t, False)
    C.settle(record, verdict)
    if t is not None and poison.is_poisoned(t):
        poison.unpoison(t)


def _lose(t, record) -> None:
    C.settle(record, C.Verdict.LOST)
    if t is not None and not poison.is_poisoned(t):
        poison.poison(t, record)


def drop(records) -> None:
    """DROPPED: marks a commit decided against, never armed: values kept."""
    for record in records:
        C.settle(record, C.Verdict.DROPPED)


def drop_entries(dropped, notices) -> None:
    """Drops ``{why: entries}``: one ``DroppedDonationWarning`` per why."""
    for why, entries in dropped.items():
        records = [record for _, record in entries]
        drop(records)
        notices.add(DroppedDonationWarning,
                    messages.DROPPED.replace("{why}", messages.escape(why)), records)


# -- Devices and steps: with several devices a barrier is certain only about
# its own device's verdicts.

def barrier_device(device: str):
    """The device a barrier called with ``device`` ("" : the thread's) syncs."""
    return torch.device(device) if device else xla.default_device()


def _split_by_device(entries, device):
    if xla.local_device_count() == 1:
        return entries, []
    mine = [e for e in entries if e[0].device == device]
    return mine, [e for e in entries if e[0].device != device]


def marks_on(device):
    """The tensors whose marks a barrier of ``device`` takes (None: all)."""
    if xla.local_device_count() == 1:
        return None
    return [t for t in C.marked_tensors() if t.device == device]


_dispatched_steps = {}  # device (None: all) -> newest step known dispatched


def dispatched(device, step) -> None:
    if step > _dispatched_steps.get(device, 0):
        _dispatched_steps[device] = step


def dispatched_through(device) -> int:
    return max(_dispatched_steps.get(device, 0), _dispatched_steps.get(None, 0))


_failed_through = 0  # a failure surfaced: every step up to this one may have failed


def note_failure() -> None:
    global _failed_through
    _failed_through = max(_failed_through, C.current_step())


def _in_failed_step(record) -> bool:
    return record.step <= _failed_through


def wait_before(*args, **kwargs):
    """torch_xla's ``_xla_wait_device_ops``, listened to (a Trampoline)."""
    devices_ = kwargs.get("devices", args[0] if args else None)
    return (C.current_step(), not devices_)


def wait_after(token, result, error):
    step, every_device = token
    if error is not None:
        note_failure()
    elif every_device:
        dispatched(None, step)
    return result


# -- Unused donations: one warning per marking line, the same text each step,
# so Python's filters decide how often it shows; strict mode raises each time.

_lock = threading.RLock()  # weakref callbacks may run while it is held
_buffers = {}  # id(tensor) -> (weakref, path): module buffers given to donate()


def _warn_unused(entries) -> None:
    by_line = {}
    for entry in entries:
        by_line.setdefault(entry[1].where, []).append(entry)
    category = UnusedDonationError if strict() else UnusedDonationWarning
    for group in by_line.values():
        with _lock:
            paths = [p for p in (_buffer_path(t) for t, _ in group) if p is not None]
        template = messages.UNUSED + messages.escape(messages.unused_fix(paths, len(group)))
        messages.warn_records(category, template, [record for _, record in group])


def note_module_buffers(named) -> None:
    """(path, tensor) pairs of module buffers given to ``donate``: an unused
    warning names them while they live."""
    with _lock:
        for path, tensor in named:
            known = _buffers.get(id(tensor))
            if known is None or known[0]() is not tensor:
                _buffers[id(tensor)] = (weakref.ref(tensor, _dropper(id(tensor))), path)


def _dropper(key):
    def drop_buffer(ref):
        with _lock:
            if _buffers.get(key, (None,))[0] is ref:
                del _buffers[key]
    return drop_buffer


def _buffer_path(tensor):
    known = _buffers.get(id(tensor))
    return known[1] if known is not None and known[0]() is tensor else None


poison.set_settler(settle_one)
