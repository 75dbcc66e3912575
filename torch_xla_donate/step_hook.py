"""The step hook: commits donation marks at every step barrier.

Every barrier of PyTorch/XLA (``xm.mark_step``, ``torch_xla.sync``,
``torch_xla.step()``/``compile``, ``MpDeviceLoader``) ends in
``torch_xla._XLAC._xla_step_marker``.  We wrap that one function.

Around the real barrier:

1. *Before*: commit the ledger's marks to a new step.  A marked tensor that
   was updated in place since (``t.add_(1)``) is an output of the step now,
   not a donor: it keeps its new value.  A marked tensor that gained a view or
   alias since marking would take that view down with it: its mark is
   dropped.  The rest stay torch_xla buffer donors.
2. The real barrier builds the graph (fixing its donor set) and dispatches it.
3. *After*: the donations are poisoned.  Whether XLA really took a buffer is
   visible only once the step has been dispatched (the input's buffer is then
   deleted), and with ``sync(wait=False)`` that may be a moment later.  So
   each donation waits *in flight*: it is settled by the next barrier (which
   cannot start before this step was dispatched), by the first use of the
   tensor, or by ``is_deleted``.  Nothing blocks the training loop.

A donor's torch_xla flag is cleared when its verdict says the step did not
take the buffer (unused, failed step): a flag left armed would fire at some
later, unrelated step.  Until that verdict the tensor is poisoned, so no later
graph can take it as an input without a use that settles it first; a
consumed buffer is gone, and its flag with it.  (Clearing every donor's flag
right after the barrier, as we first did, costs a torch_xla call per tensor.)

Several devices in one process (``torch_xla.launch`` runs one thread per
local device): a barrier syncs only its own device, so it commits only the
marks on that device and judges only that device's open verdicts; see
"Several devices" below.

A step that fails (compile error, out of memory, an exception in the body of
``with torch_xla.step():``) consumes nothing: its donations are settled
STEP_FAILED and keep their values, also when the failure of an asynchronous
step surfaces only later; see "Failed steps" below.
"""
import sys
import threading
import warnings

import torch

from . import _C, _xla, config, poison
from .errors import DroppedDonationWarning, UnusedDonationError, UnusedDonationWarning

__all__ = ["install", "uninstall", "installed", "settle_in_flight"]

_real_step_marker = None


class _HookLock:
    """A re-entrant lock that tells the native fast path of marking when it
    is held.

    ``_C.try_mark`` marks without taking this lock (it cannot be interrupted
    by another Python thread), but must not mark while another thread is
    inside a barrier or any other critical section here: it declines while
    the lock has holders, and ``donate_buffer`` then takes the lock.
    """

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        _C.note_lock(True)
        return self

    def __exit__(self, *exc_info):
        _C.note_lock(False)
        self._lock.release()


_lock = _HookLock()
# (tensor, record) of committed donations whose verdict is not known yet.
_in_flight = []


def install() -> None:
    """Routes every torch_xla step barrier through the hook (idempotent)."""
    global _real_step_marker, _real_wait_device_ops
    with _lock:
        if _real_step_marker is None:
            _real_step_marker = _xla._XLAC._xla_step_marker
            _xla._XLAC._xla_step_marker = _step_marker
            _real_wait_device_ops = _xla._XLAC._xla_wait_device_ops
            _xla._XLAC._xla_wait_device_ops = _wait_device_ops
            poison._settle_hook = _settle_one
            if refresh_fast_path not in config.changed_listeners:
                config.changed_listeners.append(refresh_fast_path)
        refresh_fast_path()


def uninstall() -> None:
    global _real_step_marker, _real_wait_device_ops
    with _lock:
        if _real_step_marker is not None:
            _xla._XLAC._xla_step_marker = _real_step_marker
            _real_step_marker = None
            _xla._XLAC._xla_wait_device_ops = _real_wait_device_ops
            _real_wait_device_ops = None


def installed() -> bool:
    return _real_step_marker is not None


def refresh_fast_path() -> None:
    """Opens ``_C.try_mark``'s fast path only while donation is on: off, the
    Python path gives its warning.  Called when ``configure`` changes, and at
    every barrier (torch_xla reads ``XLA_ENABLE_PARAM_ALIASING`` when it
    first compiles, so a change before the first step still counts)."""
    _C.set_fast_path_enabled(config.enabled() and _xla.aliasing_enabled())


def _step_marker(device="", devices=(), wait=True, reset_scope=True):
    global _in_flight
    with _lock:
        refresh_fast_path()
        if _is_compile_prologue():
            return _flush_keeping_marks(device, devices, wait, reset_scope)
        here = _barrier_device(device)
        # No verdict of an earlier step before the real barrier: it may still
        # be dispatching, and a buffer reads as deleted while XLA holds it for
        # a donation it may yet give back (see _settle_one).
        step, tensors, records = _begin_step_on(here)
        try:
            donors = _drop_unsafe(tensors, records)
        except Exception:
            # Only junk put straight into the ledger (``_C.mark(obj, ...)``
            # with something that is no XLA tensor) gets here: cancel it and
            # go on, so that the step runs and the real marks stay consistent.
            tensors, records = _cancel_junk(tensors, records)
            donors = _drop_unsafe(tensors, records)
        # From here on only the donors' entries refer to them (besides the
        # user): poison_donors leaves alone those the user no longer holds.
        del tensors, records
        if donors and not config.enabled():
            _abandon(donors, _C.Verdict.DISABLED)  # switched off after marking
            donors = []
        elif donors and _step_block_failed():
            _abandon(donors, _C.Verdict.STEP_FAILED)  # see "Failed steps"
            donors = []
        try:
            _real_step_marker(device, devices, wait=wait, reset_scope=reset_scope)
        except BaseException:
            _note_failure()
            _abandon(donors, _C.Verdict.STEP_FAILED)
            raise
        # The donor set is fixed: poison the donors.  One native call does
        # ``poison.poison(t, record)`` per donor that the user still holds
        # (one only its entry refers to cannot be used again); their flags
        # stay until their verdicts (see the module doc).
        _C.poison_donors(donors)
        _dispatched(here, step if wait else step - 1)
        # This barrier could not start before the previous step of its
        # device was dispatched, so the earlier verdicts of this device are
        # certain now; this step's are certain only if we waited for it.
        earlier, others = _split_by_device(_in_flight, here)
        # Already the state to keep if settling raises (strict mode's
        # UnusedDonationError): this step's donors stay in flight.
        _in_flight = others + donors
        _in_flight = others + _settle(earlier, certain=True) + _settle(donors, certain=wait)
        _notify_settled()


def _drop_unsafe(tensors, records):
    """Splits the committed marks: returns the (tensor, record) pairs that stay
    donors, settling the others right away."""
    updated = _xla.has_pending_ir(tensors) if tensors else []
    # Per tensor, natively: pending (updated in place after marking: an
    # output, keep it) -> UPDATED_IN_PLACE; a view or alias alive
    # (_xla.storage_use_count(t) > 1) or saved for backward since marking
    # (held_by_autograd(t)) -> flag cleared, CANCELLED, dropped; else a
    # donor, as a (tensor, record) _C.Entry.
    donors, dropped = _C.split_committed(tensors, records, updated)
    if dropped:
        _warn(
            DroppedDonationWarning,
            "Donations dropped before a step{at_step}: {items}. After "
            "donate_buffer(t), a view or alias of each was created (t[...], "
            "t.detach(), ...) or an autograd graph saved it for backward, and "
            "is still alive; donating would destroy it too. These tensors keep "
            "their values; drop the views (or run backward) before the step to "
            "donate them.",
            dropped,
        )
    return donors


def held_by_autograd(t) -> bool:
    """True when C++ code besides ``t`` itself holds ``t``'s TensorImpl: an
    autograd graph that saved it for backward (``w * w`` saves ``w``).

    Python references do not count, and neither does the AccumulateGrad node a
    leaf that requires grad gets once a graph uses it (it never reads the
    value).  Decided only while no view or alias shares ``t``'s storage: views
    hold their base too (twice, on XLA), and a shared storage is refused
    anyway.  Not a tensor: False.

    >>> w = torch.ones(2, requires_grad=True)
    >>> held_by_autograd(w)
    False
    >>> loss = (w * w).sum()
    >>> held_by_autograd(w)
    True
    >>> loss.backward()
    >>> held_by_autograd(w)
    False
    """
    if not isinstance(t, torch.Tensor):
        return False
    if t._use_count() <= 1 + (t.is_leaf and t.requires_grad):
        return False  # the common case, cheaply
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 1
    except RuntimeError:  # no storage (a wrapper subclass): other checks say why
        return False


def _cancel_junk(tensors, records):
    """Settles CANCELLED the committed entries that are not XLA tensors;
    returns the others."""
    keep_t, keep_r = [], []
    for t, record in zip(tensors, records):
        if isinstance(t, torch.Tensor) and t.device.type == "xla":
            keep_t.append(t)
            keep_r.append(record)
        else:
            _C.settle(record, _C.Verdict.CANCELLED)
    return keep_t, keep_r


def _settle(entries, certain: bool) -> list:
    """Settles in-flight donations; returns those still unknown.

    Only once ``certain`` that their step was dispatched: then a deleted
    buffer is "consumed" and a live one "unused".  Before that a buffer may
    read as deleted while XLA holds it for a donation it gives back if the
    step fails, so nothing is concluded.
    """
    if not certain:
        return entries
    # Natively, per entry: skip it if a use of the tensor settled it in the
    # meantime; CONSUMED if _xla.buffer_deleted(t); else unused or unknown.
    unknown, unused = _C.settle_entries(entries, certain)
    if unused and _failed_through:
        failed = [e for e in unused if _in_failed_step(e[1])]
        unused = [e for e in unused if not _in_failed_step(e[1])]
        for t, record in failed:
            _fail(t, record)
    for t, record in unused:
        _unuse(t, record)
    if unused:
        _warn_unused([record for _, record in unused])
    return unknown


def _settle_one(t) -> None:
    """Settles one in-flight tensor now, waiting for the device if needed.
    Called on the first use of a tensor whose verdict is still open."""
    with _lock:
        record = poison.donation_record(t)
        # None: another thread's barrier found it unused and unpoisoned it
        # between the caller's look at it and here.
        if record is None or record.verdict != _C.Verdict.IN_FLIGHT:
            return
    # Unless its step is known to be dispatched, wait, even when the buffer
    # reads as deleted already: that may be XLA holding it for a donation
    # that a failing step gives back.  Never wait while holding the lock: see
    # "Several devices".  A failure of the step surfaces here (see "Failed
    # steps"): the verdict stays open and the error goes to the user's line.
    if record.step > _dispatched_through(t.device):
        _xla.wait_device_ops(t.device)
    with _lock:
        if record.verdict != _C.Verdict.IN_FLIGHT:
            return  # settled by a barrier while we waited
        if _xla.buffer_deleted(t):
            _C.settle(record, _C.Verdict.CONSUMED)
            _notify_settled()
        elif _in_failed_step(record):
            _fail(t, record)
            _notify_settled()
        else:
            _unuse(t, record)
            _notify_settled()
            _warn_unused([record])


def settle_in_flight() -> None:
    """Settles every open verdict, waiting for the device if needed."""
    global _in_flight
    with _lock:
        entries, _in_flight = _in_flight, []
    if entries:
        try:
            _xla.wait_device_ops()  # outside the lock: see "Several devices"
        except BaseException:
            with _lock:  # a failed step surfaced: keep the verdicts open
                _in_flight = entries + _in_flight
            raise
        with _lock:
            try:
                _settle(entries, certain=True)
            finally:
                _notify_settled()


# Called with no argument whenever verdicts may have been settled, so that
# a step's report can be given once it is complete (report.py's per-step log
# and torch_xla counters).  Listeners must be cheap and must not raise.
settled_listeners = []


def _notify_settled() -> None:
    for listener in settled_listeners:
        listener()


def _unuse(t, record) -> None:
    _xla.set_donor(t, False)
    _C.settle(record, _C.Verdict.UNUSED)
    poison.unpoison(t)


def _abandon(donors, verdict) -> None:
    for t, record in donors:
        _xla.set_donor(t, False)
        _C.settle(record, verdict)


def _fail(t, record) -> None:
    """An in-flight donation whose step failed: it keeps its value, quietly
    (the step's error is the user's news, not an unused donation)."""
    _xla.set_donor(t, False)
    _C.settle(record, _C.Verdict.STEP_FAILED)
    poison.unpoison(t)


def _warn_unused(records) -> None:
    """Tells the user which donations no output could take: a warning, or
    in strict mode an error (raised after the ledger is consistent)."""
    _warn(
        UnusedDonationError if config.strict() else UnusedDonationWarning,
        "Some donated buffers were not usable{at_step}: {items}. No "
        "output of the step could take them (or they were no input of its "
        "graph); they keep their values and are no longer marked.",
        records,
    )


def _warn(category, template, records) -> None:
    items = ", ".join(f"{r.shape_string} (donated at {r.where})" for r in records)
    if issubclass(category, Exception) and not issubclass(category, Warning):
        raise category(template.format(at_step=f" at step {records[0].step}", items=items))
    # No step number in a warning: a loop that repeats the same unusable
    # donation must repeat the same text, which Python's default filter then
    # shows once.  A text per step would be shown, and remembered in the
    # caller's __warningregistry__, at every step, without bound.
    warnings.warn(template.format(at_step="", items=items), category, stacklevel=_user_stacklevel())


# -- torch_xla.compile / torch_xla.step() ------------------------------------
#
# ``with torch_xla.step():`` first flushes pending work with a barrier of its
# own, then runs the body, then syncs.  A user who marks a tensor right before
# the block means the block's graph, so the flush must neither commit the
# marks nor let torch_xla donate those buffers to the flush's graph.


def _is_compile_prologue() -> bool:
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == "_clear_pending_ops_before_compile":
            return True
        frame = frame.f_back
    return False


def _flush_keeping_marks(device, devices, wait, reset_scope):
    marked = _C.marked_tensors()
    for t in marked:
        _xla.set_donor(t, False)
    try:
        _real_step_marker(device, devices, wait=wait, reset_scope=reset_scope)
    finally:
        for t in marked:
            _xla.set_donor(t, True)


# -- Failed steps -------------------------------------------------------------
#
# A step that raises at its barrier (compile error, or the out-of-memory of an
# earlier asynchronous step that torch_xla reports at the next barrier)
# abandons its own donations: STEP_FAILED, flag cleared, value kept.
#
# A step dispatched with ``sync(wait=False)`` can fail later, while running.
# torch_xla then reports the error once, at the next barrier or wait for the
# device, whoever comes first: our barrier, our own wait when a verdict is
# settled (a use of the tensor, ``is_deleted``, ``settle_in_flight``), or the
# user's ``xm.wait_device_ops()``, which we wrap to listen.  A donated input
# of a failed step is not deleted, which alone would read "unused"; so every
# failure seen marks the steps committed so far as failed, and their open
# verdicts whose buffer survived settle STEP_FAILED, without an unused
# warning (or UnusedDonationError in strict mode).  An unused donation of an
# earlier step still open at that moment is reported as failed too: a failure
# cannot be attributed to one step, and saying nothing is the safe error.
# A failure that surfaces elsewhere (``loss.item()`` on an output of the
# failed step) is invisible to us: those donations read "unused".
#
# ``with torch_xla.step():`` (and ``torch_xla.compile``) syncs on the way out
# even when its body raised, running whatever part of the step was traced.
# The donations are abandoned there: the outputs that would take the buffers
# are lost with the exception, and the old values must not be lost with them.

_real_wait_device_ops = None
_failed_through = 0  # every step up to this one may have failed


def _note_failure() -> None:
    global _failed_through
    _failed_through = max(_failed_through, _C.current_step())


def _in_failed_step(record) -> bool:
    return record.step <= _failed_through


def _wait_device_ops(*args, **kwargs):
    """torch_xla's ``_xla_wait_device_ops``, listening: for failed steps, and
    for steps known to be dispatched (every step so far, once it returns)."""
    step = _C.current_step()
    try:
        result = _real_wait_device_ops(*args, **kwargs)
    except BaseException:
        _note_failure()
        raise
    devices = kwargs.get("devices", args[0] if args else None)
    if not devices:  # waited for every device
        _dispatched(None, step)
    return result


# The newest step known to be dispatched, per device (None: every device).
# A verdict of such a step is certain without waiting: its buffers no longer
# change between "held for a donation" and "deleted".
_dispatched_steps = {}


def _dispatched(device, step) -> None:
    if step > _dispatched_steps.get(device, 0):
        _dispatched_steps[device] = step


def _dispatched_through(device) -> int:
    return max(_dispatched_steps.get(device, 0), _dispatched_steps.get(None, 0))


def _step_block_failed() -> bool:
    """True when this barrier is the sync that ``torch_xla.compile`` /
    ``torch_xla.step()`` runs on the way out of a body that raised.

    Its context manager's ``__exit__`` got the exception (``typ``); the
    thread's current exception would also be set for a clean block run
    inside some ``except`` clause, so it cannot tell.
    """
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == "_compile" and frame.f_back is not None:
            exit_frame = frame.f_back
            return exit_frame.f_code.co_name == "__exit__" and exit_frame.f_locals.get("typ") is not None
        frame = frame.f_back
    return False


# -- Several devices ----------------------------------------------------------
#
# ``torch_xla.launch`` (``xmp.spawn``) on CPU or GPU runs one thread per local
# device in one process, and each thread's barrier syncs only the tensors of
# its own device.  So a barrier commits only the marks on its device (the
# others wait for their own thread's barrier), and is certain only about the
# open verdicts of its device.  No code here waits for a device while holding
# ``_lock``: the step of another device may sit in a collective (all_reduce)
# until that device's thread has passed its own barrier, which takes the lock.


def _barrier_device(device: str):
    return torch.device(device) if device else _xla.default_device()


def _split_by_device(entries, device):
    """(in-flight entries on ``device``, the others)."""
    if _xla.local_device_count() == 1:
        return entries, []
    mine = [e for e in entries if e[0].device == device]
    return mine, [e for e in entries if e[0].device != device]


def _begin_step_on(device):
    """``_C.begin_step()`` for the marks on ``device`` only.

    The ledger commits every mark, so the marks of other devices are taken
    out around the commit and put back with their original file:line.
    """
    held = []
    if _xla.local_device_count() > 1:
        for t in _C.marked_tensors():
            if t.device != device:
                record = _C.unmark(t)
                if record is not None:
                    held.append((t, record))
    try:
        committed = _C.begin_step()
    finally:
        for t, r in held:
            _C.mark(t, r.file, r.line, r.shape, r.dtype, r.nbytes)
    if _xla.spmd():
        # ``xs.mark_sharding(t, ...)`` after ``donate_buffer(t)`` moves t's
        # value into new sharded device data, which lacks the donor flag the
        # old data had: set it again, so the mark means t's current buffer.
        for t in committed[1]:
            _xla.set_donor(t, True)
    return committed


def _user_stacklevel() -> int:
    """The stacklevel that points a warning at the user's line, past the
    frames of torch_xla and of this package."""
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch_xla.") or name == "torch_xla" or name.startswith("torch_xla_donate")):
            return level
        frame = frame.f_back
        level += 1
    return 1
