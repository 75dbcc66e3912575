"""Committing marks to an execution: one commit for the step barrier and
for a ``torch.compile``d call (dynamo.py).

Example (what a user's loop runs through; ``PJRT_DEVICE=CPU``)::

    tdx.donate_buffer(p)             # marking only records
    p = p * 0.9 + g
    torch_xla.sync()                 # barrier_before, the real barrier, barrier_after

Ours until committed
--------------------
A mark is the plugin's alone until an execution commits it: torch_xla's
buffer-donor flag is set only inside that execution, on the buffer the
marked tensor holds at that moment.  So no torch_xla path the plugin does
not see can take a marked buffer, whatever happened to the tensor in
between (``t.copy_(s)``, ``swap_tensors``, ``mark_sharding``, a flush of
pending work).

Once torch_xla has built the execution's graph its donor set is fixed
(clearing a flag then does not cancel the donation, measured on cached
graphs too), and the flag matters only on a buffer the step did not consume:
it must not fire at a later execution.  A donor its entry keeps is disarmed
at once (``finish``).  One kept by its buffer alone (released, or poisoned
and held weakly) keeps its flag: no graph can read that buffer but through
a use of its poisoned tensor, which settles the verdict first, and a verdict
that gives the value back clears the flag (``verdicts._keep``); every later
execution's commit (a barrier's, a flush's, a compiled call's extraction)
clears it too before its graph is built if the buffer still holds a value
and the user still holds its tensor (``verdicts.disarm_in_flight``).  A
consumed buffer's flag can arm nothing, and a released donor's buffer (or a
weakened one's whose tensor died) is in no graph, so the step costs no
torch_xla call to disarm, even while the step before is still running.

The stages of a commit
----------------------
Both executions that take marks run the same stages, one function each
(called with the hook lock held):

1. ``begin``: take marks into a new step: a step barrier takes those of its
   device, a compiled call those of its own arguments (the other marks wait
   for their own execution);
2. ``decide``: ``split`` the marks (a tensor updated in place since marking
   is an output, not a donor; one whose buffer another live tensor holds
   goes to ownership.py and sharing.py), then the switches: switched off
   since marking (DISABLED) or the sync of a step block that raised
   (STEP_FAILED), nothing is donated.  Every refusal is decided here, for
   both executions;
3. ``arm``: set torch_xla's donor flag on the buffer each donor holds.  A
   step barrier arms at once (``arm``): its real barrier builds the graph
   next.  A compiled call arms only while torch_xla's dynamo bridge
   extracts an executable for the call's donation pattern (dynamo.py's
   ``_arming``, between the bridge's hash and warm-up): an executable keeps
   the donor set it was built with, so a call that runs a cached one sets
   no flag;
4. the execution builds its graph (fixing its donor set) and runs;
5. ``finish``: poison the donors, clear the flags of those the entries
   keep, leave the verdicts in flight (verdicts.py); or, when the execution
   raised, ``fail``: clear the flags, note the failure and abandon the
   donations (failures.py): STEP_FAILED, values kept.  A step's ending is
   written there, and nowhere else.

One pass for the common step
----------------------------
A step barrier whose donors are all plain (materialized, not updated since
marking, no view, alias, autograd graph, copy or other holder of their
buffer) runs stages 1 to 3 as one native pass (``C.commit_fast``,
csrc/hooks/commit_fast.h): each donor's facts read once, the walk for
copies made in the step, the flags armed.  Any donor that is not plain, or
a flag torch_xla refuses, and the pass has changed nothing but begun the
step: ``decide`` and ``arm`` then run as above and give their reasons.  A
compiled call, several devices, a switch that refuses every donor, or the
walk not in use always take the stages.

Around the real barrier
-----------------------
``barrier_before`` runs begin, decide and arm for the barrier's device;
``barrier_after`` runs finish, or fail.  They are the two halves of a
native trampoline (``C.Trampoline``, see executions.py): torch_xla's own
code runs between them with no frame of ours on the stack.  The hook lock
is held from ``before`` to ``after``.

Never in the user's way
-----------------------
The user's step must run whatever the plugin's checks do.  A check that
raises drops the step's marks (``undecided``: values kept, a warning says
why); warnings are held back (messages.Notices) until the commit is whole,
so a filter that turns them into errors raises after the step, with every
donation settled.
"""
import sys

from .._base import arena, guards, reads, switches, xla
from .._base.errors import DroppedDonationWarning
from .._base.lock import lock
from .._base.messages import Notices
from .._base.native import C
from .._outcomes import auto, failures, ownership, sharing, verdicts
from .._outcomes import devices as _devices

__all__ = ["barrier_before", "barrier_after", "begin", "decide", "undecided", "split", "arm",
           "finish", "fail", "flush_before", "flush_after"]


class _Commit:
    """What ``before`` hands ``after``: the barrier's device, step, the
    donors whose flags are armed, and the warnings held back until the
    commit is whole (messages.Notices)."""

    __slots__ = ("device", "step", "donors", "wait", "notices", "auto")

    def __init__(self, device, step, donors, wait, notices):
        self.device, self.step, self.donors, self.wait = device, step, donors, wait
        self.notices = notices
        self.auto = None  # dead inputs armed with the donors (_outcomes/auto.py)


_FLUSH = object()  # a barrier that commits nothing


def barrier_before(device="", devices=(), wait=True, reset_scope=True, *, commits=True,
                   abandon=False):
    """The first half of a step barrier (``_xla_step_marker``'s arguments).

    ``commits=False``: a flush that leaves the marks as they are.
    ``abandon=True``: the sync that ends a step block whose body raised: its
    marks are committed and abandoned (STEP_FAILED).

    Never raises from the plugin's own checks: the user's step must run.  A
    check that cannot decide drops the step's marks (values kept) with a
    ``DroppedDonationWarning`` given after the barrier.
    """
    if commits:
        auto.prepare()  # once, outside the lock: the reads' self-test runs graphs
    lock.acquire()
    try:
        switches.refresh()
        here = _devices.barrier_device(device)
        verdicts.disarm_in_flight(here)  # before this execution arms anything
        if not commits:
            return _FLUSH
        if xla.local_device_count() == 1:
            # Earlier steps' donors the loop dropped since, out of the walk
            # for copies and out of torch_xla's walk of the barrier.
            verdicts.release_unheld()
        # No verdict of an earlier step before the real barrier: it may still
        # be dispatching, and a buffer reads as deleted while XLA holds it for
        # a donation it may yet give back (see verdicts.py).
        notices = Notices()
        step, tensors, records, donors = _begin_fast(here, abandon)
        if donors is None:
            try:
                donors = arm(decide(tensors, records, notices, abandon=abandon), notices)
            except Exception as error:  # the plugin's own check failed, not the step
                donors = undecided(tensors, records, error, notices)
        del tensors, records  # from here on only the entries refer to them
        token = _Commit(here, step, donors, wait, notices)
        if not abandon:
            try:
                token.auto = auto.at_commit(here)
            except Exception as error:  # never in the user's way: nothing armed
                notices.add(DroppedDonationWarning, "Automatic donation skipped a step{at_step}"
                            f"{{items}}: {type(error).__name__}: {auto.braces_safe(error)}. Please "
                            "report this.", [])
        release_unheld(donors)
        return token
    except BaseException:
        lock.release()
        raise


def _begin_fast(device, abandon):
    """``begin`` for a step barrier, with ``decide`` and ``arm`` done in the
    same native pass when every donor is plain (csrc/hooks/commit_fast.h):
    (step, tensors, records, armed donors), the donors None when the stages
    must decide.  The pass needs what ``sharing.screen`` reads natively (the
    walk in use) and one device; a switch that refuses every donor
    (DISABLED, STEP_FAILED) is the stages' to apply."""
    if abandon or not switches.on() or xla.local_device_count() != 1 or not arena.in_use():
        return (*begin(device=device), None)
    return C.commit_fast()


def begin(device=None, tensors=None):
    """Takes marks into a new step: those of ``device`` (a step barrier's),
    or those of ``tensors`` (a compiled call's arguments).  Returns (step,
    tensors, records).  Called with the lock held."""
    if tensors is None:
        return _devices.begin_step_on(device)
    return C.begin_step(tensors)


def decide(tensors, records, notices, abandon=False) -> list:
    """The donors of a step ``begin`` opened, not armed yet: ``split``, then
    the switches.  ``abandon``: the sync that ends a step block whose body
    raised.  May raise from the plugin's own checks: the caller then calls
    ``undecided``.

    The tricky case: a mark made before ``configure(enabled=False)``
    (marking itself does nothing while switched off) is refused by the
    execution that takes it, a step barrier or a compiled call alike:
    DISABLED, value kept.
    """
    if tensors:  # the guards, once (no graph of their own): one that fails switches donation off
        guards.decide(tensors[0])
        switches.refresh()
    donors = split(tensors, records, notices)
    if donors and not switches.on():
        verdicts.abandon(donors, C.Verdict.DISABLED)  # switched off after marking
        return []
    if donors and abandon:
        verdicts.abandon(donors, C.Verdict.STEP_FAILED)
        return []
    return donors


def undecided(tensors, records, error, notices) -> list:
    """A check of the commit raised: no flag stays armed, every mark of the
    step not settled yet is dropped (DROPPED, value kept), and the warning
    says why.  Returns no donor."""
    for t in tensors:
        try:
            xla.set_donor(t, False)
        except Exception:
            pass  # not an XLA tensor: nothing was armed on it
    dropped = [r for r in records if r.verdict == C.Verdict.IN_FLIGHT]
    verdicts.drop(dropped)
    if dropped:
        notices.add(
            DroppedDonationWarning,
            "Donations dropped before a step{at_step}: {items}. torch_xla_donate could not "
            f"decide whether they could be donated ({type(error).__name__}: {error}); the "
            "step ran without them and these tensors keep their values. Please report "
            "this with the message.",
            dropped,
        )
    return []


def barrier_after(token, result, error):
    """The second half of a step barrier: see the module docstring.  The
    warnings held back are given last, once the lock is released."""
    try:
        if token is _FLUSH:
            return result
        if error is not None:
            fail(token.donors, token.auto)
            return result
        _devices.dispatched(token.device, token.step if token.wait else token.step - 1)
        finish(token.device, token.donors, token.notices, certain=token.wait)
        auto.after_graph(token.auto)
        return result
    finally:
        lock.release()
        if token is not _FLUSH and token.notices:
            token.notices.deliver(quietly=sys.exc_info()[1] is not None)


def release_unheld(donors) -> None:
    """Lets go of the armed donors nothing but their entry refers to (the
    loop rebound its name), before the real execution: each entry keeps
    only its buffer, the one thing its verdict reads, and the Python
    tensor, its wrapper and its XLATensor die now, as raw donation's die
    while tracing.  So torch_xla's barrier neither walks nor keeps them
    (with them alive it costs about 1.6k instructions more per donor,
    benchmarks/bench_instructions.py).  One device only: with several,
    verdicts are split by the tensor's device.  After ``auto.at_commit``,
    whose search must see the donors as held.

    The donors of earlier steps still in flight went the same way at the
    start of the barrier (``verdicts.release_unheld``), before the walk for
    copies."""
    if donors and xla.local_device_count() == 1:
        C.release_unheld(donors)


def finish(device, donors, notices, certain: bool) -> None:
    """The end of every commit whose execution ran (a step barrier's, a
    compiled call's), once its donor set is fixed: poison the donors the
    user still holds and their companions, clear the flags of the donors
    the entries keep (see "Ours until committed"), leave the verdicts in
    flight.  ``certain``: the execution was waited for.

    A donor nothing but its entry refers to is not poisoned: no code can put
    it into another graph.  With one device (and native reads on) it is let
    go here, its entry keeping only its buffer for the verdict (the tensor
    reads None from then on), so that it dies at the commit as raw
    donation's die while tracing (csrc/hooks/commit.cpp).  A donor the user
    still holds is poisoned, and its entry keeps the buffer and only a weak
    reference to it: it dies when the loop drops it, as raw donation's do,
    and a verdict that gives its value back still finds it while it lives.
    (The entry keeps the poisoned inner tensor of a functional one until
    then, and lets go of it at the next barrier: see
    ``verdicts.release_unheld``.)
    With several devices the entry keeps it: verdicts are split by the
    tensor's device.  A donor
    that cannot be poisoned does not stop the others: a ``TypeError`` naming
    its class is held in ``notices`` and raised once the commit is whole
    (the step's results are intact; operators on the tensor still raise
    ``DonatedBufferError``, which the tensor torch_xla computes with carries).
    """
    failed = C.disarm_and_poison(donors, release=xla.local_device_count() == 1)
    if failed:
        notices.fail(_unpoisoned_error(failed))
    if ownership.companions_by_record:
        ownership.poison_companions([record.id for _, record in donors])
    verdicts.after_commit(device, donors, certain=certain)


def fail(donors, dead_inputs=None) -> None:
    """The end of every commit whose execution raised (a step barrier's, a
    compiled call's): no flag stays armed, the dead inputs armed with the
    donors (``auto.at_commit``'s token) are let go, every step so far may
    have failed (``failures.note_failure``: their open verdicts will not
    read "unused"), and the donors settle STEP_FAILED, values kept, or
    LOST if torch_xla lost the buffer (``verdicts.failed``).  Called with
    the lock held.

    The tricky case: a donor ``release_unheld`` let go before the execution.
    Its buffer is no tensor's, but the failed step's pending outputs still
    read it and the next barrier runs them again: its verdict clears its
    flag (``verdicts._keep``), on the buffer its record keeps.
    """
    auto.abandon(dead_inputs)
    C.disarm(donors)  # the donors the entries hold; released ones by their verdict
    failures.note_failure()
    verdicts.failed(donors)


def _unpoisoned_error(failed) -> TypeError:
    (t, record), message = failed[0]
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return TypeError(
        f"torch_xla_donate could not mark the donated {type(t).__qualname__} "
        f"{record.shape_string}{more} as donated after step {record.step} ({message}). The "
        f"step ran and its results are intact, and operators on the tensor still raise "
        f"DonatedBufferError, but Python code that only looks at the object will not be "
        f"told. Do not change the class of a tensor between donating it and the step."
    )


def split(tensors, records, notices) -> list:
    """Splits committed marks: returns the ``(tensor, record)`` entries that
    stay donors, settling the others (updated in place, holders alive)."""
    if not tensors:
        return []
    try:
        pending = reads.pending_flags(tensors)
    except Exception:
        # Only junk put straight into the ledger (``C.mark(obj, ...)`` with
        # something that is no XLA tensor) gets here: cancel it and go on, so
        # that the step runs and the real marks stay consistent.
        tensors, records = _cancel_junk(tensors, records)
        pending = reads.pending_flags(tensors) if tensors else []
    # Natively, per tensor: pending (updated in place after marking: an
    # output, keep it) -> UPDATED_IN_PLACE; a view, alias or autograd graph
    # holding it -> ``held``, for ownership.py; else a donor.
    donors, held = C.split_committed(tensors, records, pending)
    if held:
        donors += ownership.judge_at_commit(held, notices)
    # Buffers torch_xla shares between distinct tensors (sharing.py).
    return sharing.screen(donors, notices)


def arm(donors, notices) -> list:
    """A step barrier's arming: sets the donor flag on the buffer each donor
    holds now; returns the armed entries.  One torch_xla refuses (no plain
    device data: its value is a view or pending after all) is dropped.

    A compiled call arms its donors another way (dynamo.py's ``_arming``):
    only while the bridge extracts an executable for them, as the flags
    count only then.
    """
    if not donors:
        return donors
    armed, refused = C.arm(donors)
    if refused:
        ownership.drop(refused, "torch_xla refused them as donors: their values are not "
                                "plain device data (a view, or a copy that has not run)",
                       notices)
    return armed


def _cancel_junk(tensors, records):
    """Settles DROPPED the committed entries that are not XLA tensors;
    returns the others."""
    keep_t, keep_r = [], []
    for t, record in zip(tensors, records):
        if xla.is_xla_tensor(t):
            keep_t.append(t)
            keep_r.append(record)
        else:
            verdicts.drop([record])
    return keep_t, keep_r


# -- Executions that commit nothing ----------------------------------------
#
# ``_xla_sync_multi`` (``xm.unlazy``, ``xm.save``, ``gradient_accumulation``,
# the dynamo bridge's input sync) and ``_xla_sync_live_tensors`` run part of
# the pending work.  They honour torch_xla's donor flags, but a mark is never
# armed outside a commit, so they take nothing; they only wait for a commit
# another thread has in progress on the same device, whose flags are armed.
# (With one device per thread, ``torch_xla.launch``, they need not wait.)
# With one device they clear, as a barrier does, the flags ``finish`` left
# armed on in-flight buffers that still hold a value and whose tensor the
# user still holds (``verdicts.disarm_in_flight``).


def flush_before(*args, **kwargs):
    if xla.local_device_count() > 1:
        return C.PASS
    lock.acquire()
    try:
        verdicts.disarm_in_flight(_devices.barrier_device(""))
    except BaseException:
        lock.release()
        raise
    return _FLUSH


def flush_after(token, result, error):
    lock.release()
    return result
