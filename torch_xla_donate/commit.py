"""Committing marks to an execution: the heart of the step barrier.

A mark is the plugin's alone until an execution commits it: torch_xla's
buffer-donor flag is set only inside that execution, on the buffer the
marked tensor holds at that moment, and cleared as soon as torch_xla has
built the execution's graph (its donor set is fixed then; clearing the flag
does not cancel the donation, measured on cached graphs too).  So no
torch_xla path the plugin does not see can take a marked buffer, whatever
happened to the tensor in between (``t.copy_(s)``, ``swap_tensors``,
``mark_sharding``, a flush of pending work).

Around the real barrier (see executions.py for which barriers commit):

1. *before*: take the marks of the barrier's device to a new step; split
   them (a tensor updated in place since marking is an output, not a donor;
   one whose buffer another live tensor holds goes to ownership.py); arm the
   donors' flags;
2. the real barrier builds the graph (fixing its donor set) and dispatches it;
3. *after*: clear the flags, poison the donors, and leave their verdicts in
   flight (verdicts.py).  A donor nothing but the plugin refers to any more
   (the loop rebound its name) can be put into no other graph: it is left
   as it is, flag and all, and freed with its entry.  A failed execution abandons its donations
   (failures.py): STEP_FAILED, values kept.

``before`` and ``after`` run as the two halves of a native trampoline
(``_C.Trampoline``, see executions.py): torch_xla's own code runs between
them with no frame of ours on the stack.  The hook lock is held from
``before`` to ``after``.
"""
from . import _C, _xla, config, failures, ownership, verdicts, xla_cpu
from . import devices as _devices
from .hook_lock import lock

__all__ = ["barrier_before", "barrier_after", "flush_before", "flush_after", "refresh_fast_path"]


def refresh_fast_path() -> None:
    """Opens ``_C.try_mark``'s fast path only while donation is on: off, the
    Python path gives its warning.  Called when ``configure`` changes, and at
    every barrier (torch_xla reads ``XLA_ENABLE_PARAM_ALIASING`` when it
    first compiles, so a change before the first step still counts).  It
    also stays closed until an unprotected CPU process has had its
    ``StaleReadWarning`` (xla_cpu.py), which the Python path gives."""
    _C.set_fast_path_enabled(config.enabled() and _xla.aliasing_enabled()
                             and not xla_cpu.warning_due())


class _Commit:
    """What ``before`` hands ``after``: the barrier's device, step, and the
    donors whose flags are armed."""

    __slots__ = ("device", "step", "donors", "wait")

    def __init__(self, device, step, donors, wait):
        self.device, self.step, self.donors, self.wait = device, step, donors, wait


_FLUSH = object()  # a barrier that commits nothing


def barrier_before(device="", devices=(), wait=True, reset_scope=True, *, commits=True,
                   abandon=False):
    """The first half of a step barrier (``_xla_step_marker``'s arguments).

    ``commits=False``: a flush that leaves the marks as they are.
    ``abandon=True``: the sync that ends a step block whose body raised: its
    marks are committed and abandoned (STEP_FAILED).
    """
    lock.acquire()
    try:
        refresh_fast_path()
        if not commits:
            return _FLUSH
        here = _devices.barrier_device(device)
        # No verdict of an earlier step before the real barrier: it may still
        # be dispatching, and a buffer reads as deleted while XLA holds it for
        # a donation it may yet give back (see verdicts.py).
        step, tensors, records = _devices.begin_step_on(here)
        donors = split(tensors, records)
        del tensors, records  # from here on only the entries refer to them
        if donors and not config.enabled():
            verdicts.abandon(donors, _C.Verdict.DISABLED)  # switched off after marking
            donors = []
        elif donors and abandon:
            verdicts.abandon(donors, _C.Verdict.STEP_FAILED)
            donors = []
        return _Commit(here, step, arm(donors), wait)
    except BaseException:
        lock.release()
        raise


def barrier_after(token, result, error):
    """The second half of a step barrier: see the module docstring."""
    try:
        if token is _FLUSH:
            return result
        if error is not None:
            _C.disarm(token.donors)
            failures.note_failure()
            verdicts.failed(token.donors)
            return result
        # The donor set is fixed: clear the flags and poison the donors the
        # user still holds (one only its entry refers to cannot be put into
        # another graph, and its buffer goes with it: see hot_path.cpp).
        _C.disarm_and_poison(token.donors)
        if ownership._companions:
            ownership.poison_companions([record.id for _, record in token.donors])
        ownership.note_barrier(token.device)
        _devices.dispatched(token.device, token.step if token.wait else token.step - 1)
        verdicts.after_commit(token.device, token.donors, certain=token.wait)
        return result
    finally:
        lock.release()


def split(tensors, records) -> list:
    """Splits committed marks: returns the ``(tensor, record)`` entries that
    stay donors, settling the others (updated in place, holders alive)."""
    if not tensors:
        return []
    try:
        pending = _xla.has_pending_ir(tensors)
    except Exception:
        # Only junk put straight into the ledger (``_C.mark(obj, ...)`` with
        # something that is no XLA tensor) gets here: cancel it and go on, so
        # that the step runs and the real marks stay consistent.
        tensors, records = _cancel_junk(tensors, records)
        pending = _xla.has_pending_ir(tensors) if tensors else []
    # Natively, per tensor: pending (updated in place after marking: an
    # output, keep it) -> UPDATED_IN_PLACE; a view, alias or autograd graph
    # holding it -> ``held``, for ownership.py; else a donor.
    donors, held = _C.split_committed(tensors, records, pending)
    if held:
        donors += ownership.judge_at_commit(held)
    return donors


def arm(donors) -> list:
    """Sets the donor flag on the buffer each donor holds now; returns the
    armed entries.  One torch_xla refuses (no plain device data: its value
    is a view or pending after all) is dropped."""
    if not donors:
        return donors
    armed, refused = _C.arm(donors)
    if refused:
        ownership.drop(refused, "torch_xla refused them as donors: their values are not "
                                "plain device data (a view, or a copy that has not run)")
    return armed


def _cancel_junk(tensors, records):
    """Settles CANCELLED the committed entries that are not XLA tensors;
    returns the others."""
    keep_t, keep_r = [], []
    for t, record in zip(tensors, records):
        if _xla.is_xla_tensor(t):
            keep_t.append(t)
            keep_r.append(record)
        else:
            _C.settle(record, _C.Verdict.CANCELLED)
    return keep_t, keep_r


# -- Executions that commit nothing ----------------------------------------
#
# ``_xla_sync_multi`` (``xm.unlazy``, ``xm.save``, ``gradient_accumulation``,
# the dynamo bridge's input sync) and ``_xla_sync_live_tensors`` run part of
# the pending work.  They honour torch_xla's donor flags, but a mark is never
# armed outside a commit, so they take nothing; they only wait for a commit
# another thread has in progress on the same device, whose flags are armed.
# (With one device per thread, ``torch_xla.launch``, they need not wait.)


def flush_before(*args, **kwargs):
    if _xla.local_device_count() > 1:
        return _C.PASS
    lock.acquire()
    return _FLUSH


def flush_after(token, result, error):
    lock.release()
    return result
