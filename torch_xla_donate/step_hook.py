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

The torch_xla donor flag of every committed tensor is cleared as soon as its
step's graph is built: a flag the step did not use would otherwise stay armed
and fire at some later, unrelated step.

Several devices in one process (``torch_xla.launch`` runs one thread per
local device): a barrier syncs only its own device, so it commits only the
marks on that device and judges only that device's open verdicts; see
"Several devices" below.
"""
import sys
import threading
import warnings

import torch

from . import _C, _xla, config, poison
from .errors import DroppedDonationWarning, UnusedDonationError, UnusedDonationWarning

__all__ = ["install", "uninstall", "installed", "settle_in_flight"]

_real_step_marker = None
_lock = threading.RLock()
# (tensor, record) of committed donations whose verdict is not known yet.
_in_flight = []


def install() -> None:
    """Routes every torch_xla step barrier through the hook (idempotent)."""
    global _real_step_marker
    with _lock:
        if _real_step_marker is None:
            _real_step_marker = _xla._XLAC._xla_step_marker
            _xla._XLAC._xla_step_marker = _step_marker
            poison._settle_hook = _settle_one


def uninstall() -> None:
    global _real_step_marker
    with _lock:
        if _real_step_marker is not None:
            _xla._XLAC._xla_step_marker = _real_step_marker
            _real_step_marker = None


def installed() -> bool:
    return _real_step_marker is not None


def _step_marker(device="", devices=(), wait=True, reset_scope=True):
    global _in_flight
    with _lock:
        if _is_compile_prologue():
            return _flush_keeping_marks(device, devices, wait, reset_scope)
        here = _barrier_device(device)
        mine, others = _split_by_device(_in_flight, here)
        _in_flight = _settle(mine, certain=False) + others
        step, tensors, records = _begin_step_on(here)
        donors = _drop_unsafe(tensors, records)
        try:
            _real_step_marker(device, devices, wait=wait, reset_scope=reset_scope)
        except BaseException:
            _abandon(donors, _C.Verdict.STEP_FAILED)
            raise
        # The donor set is fixed: clear each donor's flag and poison it (see
        # the module doc).  One native call does ``_xla.set_donor(t, False)``
        # and ``poison.poison(t, record)`` per donor.
        _C.poison_donors(donors)
        # This barrier could not start before the previous step of its
        # device was dispatched, so the earlier verdicts of this device are
        # certain now; this step's are certain only if we waited for it.
        earlier, others = _split_by_device(_in_flight, here)
        _in_flight = others + donors
        _in_flight = others + _settle(earlier, certain=True) + _settle(donors, certain=wait)
        _notify_settled()


def _drop_unsafe(tensors, records):
    """Splits the committed marks: returns the (tensor, record) pairs that stay
    donors, settling the others right away."""
    updated = _xla.has_pending_ir(tensors) if tensors else []
    # Per tensor, natively: pending (updated in place after marking: an
    # output, keep it) -> UPDATED_IN_PLACE; a view or alias alive
    # (_xla.storage_use_count(t) > 1) -> flag cleared, CANCELLED, dropped;
    # else a donor.
    donors, dropped = _C.split_committed(tensors, records, updated)
    if dropped:
        _warn(
            DroppedDonationWarning,
            "Donations dropped before step {step}: {items}. A view or alias of "
            "each (t[...], t.detach(), ...) was created after donate_buffer(t) "
            "and is still alive; donating would destroy it too. These tensors "
            "keep their values; drop the views before the step to donate them.",
            dropped,
        )
    return donors


def _settle(entries, certain: bool) -> list:
    """Settles in-flight donations; returns those still unknown.

    A deleted buffer is a certain "consumed".  A live one means "unused" only
    once ``certain`` that its step was dispatched.
    """
    # Natively, per entry: skip it if a use of the tensor settled it in the
    # meantime; CONSUMED if _xla.buffer_deleted(t); else unused or unknown.
    unknown, unused = _C.settle_entries(entries, certain)
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
        if record.verdict != _C.Verdict.IN_FLIGHT:
            return
        deleted = _xla.buffer_deleted(t)
    if not deleted:
        # Never wait while holding the lock: see "Several devices".
        _xla.wait_device_ops(t.device)
    with _lock:
        if record.verdict != _C.Verdict.IN_FLIGHT:
            return  # settled by a barrier while we waited
        if _xla.buffer_deleted(t):
            _C.settle(record, _C.Verdict.CONSUMED)
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
        _xla.wait_device_ops()  # outside the lock: see "Several devices"
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


def _warn_unused(records) -> None:
    """Tells the user which donations no output could take: a warning, or
    in strict mode an error (raised after the ledger is consistent)."""
    _warn(
        UnusedDonationError if config.strict() else UnusedDonationWarning,
        "Some donated buffers were not usable at step {step}: {items}. No "
        "output of the step could take them (or they were no input of its "
        "graph); they keep their values and are no longer marked.",
        records,
    )


def _warn(category, template, records) -> None:
    items = ", ".join(f"{r.shape_string} (donated at {r.where})" for r in records)
    message = template.format(step=records[0].step, items=items)
    if issubclass(category, Exception) and not issubclass(category, Warning):
        raise category(message)
    warnings.warn(message, category, stacklevel=_user_stacklevel())


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
