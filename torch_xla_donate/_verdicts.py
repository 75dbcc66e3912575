"""Verdicts: what became of each committed donation, and when it is known.

Whether XLA took a buffer is visible only once the execution has been
dispatched (the input's buffer is then deleted); with ``sync(wait=False)``
that may be a moment later, and before that a buffer XLA holds for a
donation reads as deleted even if a failing step gives it back.  So each
donation waits *in flight*, poisoned, until the next barrier of its device
(which cannot start before this step was dispatched), the first use of the
tensor (``settle_one``), ``is_deleted`` or ``settle()``: nothing blocks the
training loop.  The verdicts:

* REUSED: the buffer is gone; the tensor stays poisoned (native:
  ``C.settle_entries``);
* UNUSED: no output could take it: value given back, poison lifted, and an
  ``UnusedDonationWarning`` (``UnusedDonationError`` in strict mode);
* STEP_FAILED, DISABLED: value kept, quietly (``_keep``);
* LOST: the step failed and torch_xla lost the buffer (2.7, a compile
  error): the tensor refuses use (``_lose``);
* DROPPED: decided against at the commit, value kept (``drop``).

A failed step (a compile error, an out-of-memory surfacing at the next
barrier or wait) is one of every step so far: their open verdicts whose
buffer survived settle STEP_FAILED, never "unused".  With several devices
(``torch_xla.launch``: one thread each) a barrier is certain only about
its own device's verdicts, and nothing here waits for a device while
holding the lock (another device's step may sit in a collective until its
thread passes its own barrier).
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

__all__ = ["after_commit", "settle", "settle_one", "abandon", "failed", "drop",
           "disarm_in_flight", "release_unheld", "settled_listeners", "notify_settled",
           "barrier_device", "marks_on", "dispatched", "wait_before", "wait_after",
           "note_failure", "note_module_buffers"]

# (tensor, record) C.Entry of committed donations whose verdict is not known
# yet; the tensor is None once the commit released it (commit.finish): the
# entry then keeps only its buffer, which is all a verdict reads.
_in_flight = []

# Called with no argument whenever verdicts may have been settled, so that a
# step's report can be given once it is complete (report.py's per-step log).
# Listeners must be cheap and must not raise.
settled_listeners = []


def notify_settled() -> None:
    holders.settle_companions()
    for listener in settled_listeners:
        listener()


def after_commit(device, donors, certain: bool) -> None:
    """After an execution on ``device`` committed ``donors`` (entries): its
    earlier verdicts of that device are certain now (it could not start
    before the previous one was dispatched); this one's are if ``certain``
    (the execution was waited for).  Called with the lock held."""
    global _in_flight
    earlier, others = _split_by_device(_in_flight, device)
    try:
        earlier = _settle(earlier, certain=True)
        donors = _settle(donors, certain=certain)
    finally:
        # Also if settling raises (strict mode's UnusedDonationError): what
        # it did not settle stays in flight (settled entries are skipped).
        _in_flight = _joined(others, earlier, donors)
    notify_settled()


def _joined(*lists) -> list:
    """The entries of ``lists`` in one list: the one non-empty list itself
    when there is only one, as in a loop whose step before has settled.

    The tricky case: a list of hundreds of entries is a block malloc gives
    only after merging the small blocks freed since, which torch then takes
    again more slowly (csrc/base/scratch.h); one per step showed in the
    async loop's count.

    >>> a = [1]
    >>> _joined([], a, []) is a
    True
    """
    full = [entries for entries in lists if entries]
    if len(full) == 1:
        return full[0]
    return [e for entries in full for e in entries]


def abandon(entries, verdict) -> None:
    """Settles committed entries that will not be donated (switched off,
    a step block that raised before its sync): values kept, poison lifted,
    no warning."""
    for t, record in entries:
        _keep(t, record, verdict)


def failed(entries) -> None:
    """Settles the donations of an execution that failed: STEP_FAILED, value
    kept, quietly (the failure is the user's news) -- unless torch_xla lost
    the buffer with the failed step (torch_xla 2.7 does when a step fails to
    compile): then LOST, and the tensor refuses use like a consumed one."""
    for entry in entries:
        t, record = entry
        if record.verdict != C.Verdict.IN_FLIGHT:
            continue
        if _consumed(entry):
            _lose(t, record)
        else:
            _keep(t, record, C.Verdict.STEP_FAILED)


def _consumed(entry) -> bool:
    """Whether the buffer of ``entry`` is gone: read from the buffer a
    released entry keeps (its tensor is None: the commit let it go), else
    from its tensor."""
    consumed = C.entry_consumed(entry)
    return C.lazy_is_consumed(entry[0]) if consumed is None else consumed


def _settle(entries, certain: bool) -> list:
    """Settles in-flight donations; returns those still unknown.

    Only once ``certain`` that their step was dispatched: then a deleted
    buffer is "consumed" and a live one "unused".  Before that a buffer may
    read as deleted while XLA holds it for a donation it gives back if the
    step fails, so nothing is concluded.
    """
    if not certain:
        return entries
    if _failed_through > 0:  # see failures.py: kept, or lost with the step
        failed([e for e in entries if _in_failed_step(e[1])])
    # Natively, per entry: skip it if a use of the tensor settled it in the
    # meantime; REUSED if its buffer is deleted; else unused or unknown.
    unknown, unusable = C.settle_entries(entries, certain)
    for t, record in unusable:
        _keep(t, record, C.Verdict.UNUSED)
    if unusable:
        _warn_unused(unusable)
    return unknown


def settle_one(t, record) -> None:
    """Settles the in-flight donation ``record`` of ``t`` now, waiting for the
    device if needed: ``t`` (or the tensor torch_xla sees behind it) is about
    to be used."""
    with lock:
        if record.verdict != C.Verdict.IN_FLIGHT:
            return
    # Unless its step is known to be dispatched, wait, even when the buffer
    # reads as deleted already: that may be XLA holding it for a donation
    # that a failing step gives back.  Never wait while holding the lock (see
    # the module docstring).  A failure of the step surfaces here: the
    # verdict stays open and the error goes to the user's line.
    if record.step > dispatched_through(t.device):
        xla.wait_device_ops(t.device)
    with lock:
        if record.verdict != C.Verdict.IN_FLIGHT:
            return  # settled by a barrier while we waited
        # The entry holds the tensor the user has: ``t`` may be the tensor
        # torch_xla sees behind it, which an operator's dispatch hands us.
        # (A released entry's tensor is None: nobody held it, so ``t`` is a
        # companion, ownership.py.)
        # Settled here, the entry leaves the in-flight list, and once this
        # returns (the verdict in: its death lets go of what the verdict
        # reads) its weak hold on the tensor goes with it
        # (torch.utils.swap_tensors refuses a TensorImpl anything else
        # holds, even weakly).
        at = next((i for i, e in enumerate(_in_flight) if e[1].id == record.id), None)
        entry = _in_flight.pop(at) if at is not None else None
        held = t if entry is None or entry[0] is None else entry[0]
        if _in_failed_step(record):
            failed([(held, record)])
        else:
            # The barrier's native settle, for this one entry: REUSED if the
            # buffer of ``t`` (the tensor being used) is deleted.
            _, unusable = C.settle_entries([(t, record)], True)
            if unusable:
                _keep(held, record, C.Verdict.UNUSED)
                notify_settled()
                _warn_unused([(held, record)])
                return
        notify_settled()


def settle() -> None:
    """Settles every open verdict, waiting for the device if needed
    (``torch_xla_donate.settle()``).

    After ``torch_xla.sync(wait=False)`` a step's verdicts are known only
    once it has been dispatched; reports and counts taken after this are
    final.

    It first waits for autograd's worker thread of the calling thread's
    device to release the backward passes it finished, as a donation does.
    The tricky case: a loop that donates nothing.  A moment after
    ``torch.func.grad`` returns, that thread may still hold lazy tensors of
    the backward, and the next barrier makes them extra outputs of the
    step's graph: another graph, which may round differently, so a plain
    loop is not bit-repeatable from run to run.  Called before each
    barrier, ``settle()`` makes it so (a run to compare a donating one with).

    Raises:
      UnusedDonationError: in strict mode, for donations no output could
        take (they keep their values; other modes warn).
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
        xla.wait_device_ops()  # outside the lock: see the module docstring
    except BaseException:
        with lock:  # a failed step surfaced: keep the verdicts open
            _in_flight = entries + _in_flight
        raise
    with lock:
        try:
            _settle(entries, certain=True)
        finally:
            notify_settled()


def release_unheld() -> None:
    """Lets go of the in-flight donors nothing but their entry refers to
    any more (the loop dropped a poisoned tensor after its step; entries
    the commit weakened hold none): each entry
    keeps only its buffer, which is all its verdict reads, and nobody is
    left to lift the poison from.  The poisoned inner tensor a weakened
    entry keeps (so that it dies with the GIL held, csrc/base/py_types.h
    ``EntryKeepInner``) goes too once the loop dropped its wrapper.  A
    barrier calls it first, so that neither the walk for copies
    (arena.py) nor torch_xla's walk of the live tensors meets them again.
    The caller (commit.barrier_before) makes sure there is one device:
    with several, verdicts are split by the tensor's device.  Called with
    the lock held."""
    if _in_flight:
        C.release_unheld(_in_flight)


def disarm_in_flight(device) -> None:
    """Before an execution on ``device`` builds its graph: clears the donor
    flag that ``commit.finish`` left armed on the buffer of an in-flight
    donation kept weakly, if that buffer still holds a value (not consumed,
    or not yet) and the user still holds its tensor.  Called with the lock
    held, before any flag of the execution is armed.

    The tricky case: a step still running (``sync(wait=False)``), whose
    donors' buffers hold their values until it consumes them.  A donor the
    commit released, or a weakened one whose tensor died since, leads no
    graph to its buffer: it is left alone, and a loop that rebinds its
    names, or drops the old tensors, pays no torch_xla call here.  A
    weakened tensor the user still holds is cleared: ``_XLAC`` calls that
    take it straight to torch_xla (``_replace_xla_tensor``) do not meet its
    poison."""
    if _in_flight:
        for entry in C.live_held(_in_flight, True):
            xla.set_donor(entry[0], False)


def in_flight_count() -> int:
    return len(_in_flight)


def _keep(t, record, verdict) -> None:
    """Settles ``record`` with a verdict that leaves ``t`` its value
    (UNUSED, STEP_FAILED, DISABLED) and lifts its poison.  ``t`` is None for
    an entry the commit released (nobody held it, nothing was poisoned), or
    weakened whose tensor died since (nobody is left to give it back to).

    An unused donation's caller warns (unused.py); a failed step's and a
    switched-off one's stay quiet (the failure, the switch are the news).
    """
    # A weakened donor's buffer may still have the flag the commit left
    # armed: cleared before anyone can read the value.  (A released one's
    # buffer leads no graph to it: its tensor died with its last holder.)
    if t is not None and C.live_held([record]):
        xla.set_donor(t, False)
    C.settle(record, verdict)
    if t is not None and poison.is_poisoned(t):
        poison.unpoison(t)


def _lose(t, record) -> None:
    """LOST: the step failed and took the buffer with it; ``t`` refuses use
    as a consumed tensor does."""
    C.settle(record, C.Verdict.LOST)
    if t is not None and not poison.is_poisoned(t):
        poison.poison(t, record)


def drop(records) -> None:
    """DROPPED: marks a commit decided not to donate (another holder shares
    the buffer, torch_xla refused the flag, a check raised).  Never armed nor
    poisoned, so the values stay as they are; the caller says why."""
    for record in records:
        C.settle(record, C.Verdict.DROPPED)


def drop_entries(dropped, notices) -> None:
    """Drops the committed entries of ``dropped`` ({why: entries}), one
    ``DroppedDonationWarning`` each, held in ``notices`` until the commit is
    whole."""
    for why, entries in dropped.items():
        records = [record for _, record in entries]
        drop(records)
        notices.add(DroppedDonationWarning,
                    messages.DROPPED.replace("{why}", messages.escape(why)), records)


# -- Devices -------------------------------------------------------------------------

def barrier_device(device: str):
    """The device a barrier called with ``device`` ("" : the thread's) syncs."""
    return torch.device(device) if device else xla.default_device()


def _split_by_device(entries, device):
    """(entries whose tensor is on ``device``, the others)."""
    if xla.local_device_count() == 1:
        return entries, []
    mine = [e for e in entries if e[0].device == device]
    return mine, [e for e in entries if e[0].device != device]


def marks_on(device):
    """The tensors whose marks a barrier of ``device`` takes: None for all
    (one device), else those on ``device``."""
    if xla.local_device_count() == 1:
        return None
    return [t for t in C.marked_tensors() if t.device == device]


# The newest step known to be dispatched, per device (None: every device).
# A verdict of such a step is certain without waiting: its buffers no longer
# change between "held for a donation" and "deleted".
_dispatched_steps = {}


def dispatched(device, step) -> None:
    """Every step of ``device`` (None: of every device) up to ``step`` has
    been dispatched."""
    if step > _dispatched_steps.get(device, 0):
        _dispatched_steps[device] = step


def dispatched_through(device) -> int:
    return max(_dispatched_steps.get(device, 0), _dispatched_steps.get(None, 0))


# -- Failed steps --------------------------------------------------------------------

_failed_through = 0  # every step up to this one may have failed


def note_failure() -> None:
    global _failed_through
    _failed_through = max(_failed_through, C.current_step())


def _in_failed_step(record) -> bool:
    return record.step <= _failed_through


# torch_xla's ``_xla_wait_device_ops``, listening (a Trampoline's before and
# after, _hooks.py): for failed steps, and for steps known to be dispatched
# (every step so far, once a wait for every device returns).

def wait_before(*args, **kwargs):
    devices_ = kwargs.get("devices", args[0] if args else None)
    return (C.current_step(), not devices_)


def wait_after(token, result, error):
    step, every_device = token
    if error is not None:
        note_failure()
    elif every_device:
        dispatched(None, step)
    return result


# -- Unused donations ----------------------------------------------------------------
#
# A donation no output can take at one step cannot at the next either: a loop
# repeats it.  Its warning's text names only the line that marked it and the
# shape, so Python's filters decide: once per place by default, every time
# under "always", an error under "error".  Strict mode raises every time.
# A module buffer passed to donate() is named by its path (module.mask).

_lock = threading.RLock()  # weakref callbacks may run while it is held
# id(tensor) -> (weak reference to it, its path, e.g. "module.mask"): the
# buffers of modules given to donate() that are still alive.
_buffers = {}


def _warn_unused(entries) -> None:
    """Tells the user about the unused ``entries`` ((tensor, record) pairs):
    one ``UnusedDonationWarning`` per line that marked them, naming its
    shapes and what to do (``UnusedDonationError`` in strict mode)."""
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
    """Remembers that the tensors of ``named`` ((path, tensor) pairs) are
    buffers of a module given to ``donate``, for as long as they live."""
    with _lock:
        for path, tensor in named:
            key = id(tensor)
            known = _buffers.get(key)
            if known is not None and known[0]() is tensor:
                continue
            _buffers[key] = (weakref.ref(tensor, _dropper(key)), path)


def _dropper(key):
    def drop_buffer(ref):
        with _lock:
            known = _buffers.get(key)
            if known is not None and known[0] is ref:
                del _buffers[key]
    return drop_buffer


def _buffer_path(tensor):
    known = _buffers.get(id(tensor))
    return known[1] if known is not None and known[0]() is tensor else None


poison.set_settler(settle_one)
