"""Committing marks to an execution: a step barrier (``barrier_before`` and
``barrier_after``, the two halves of its trampoline) and a compiled call
(_dynamo.py) run the same stages (docs/design.md, "The step's life"):

1. ``begin_and_decide``: ``C.commit`` takes the marks into a new step and
   judges each (csrc/hooks/commit.h, the rules in one function); Python
   judges what it referred back (aliases, a moment's holders, copies) and
   applies the switches;
2. ``arm``: torch_xla's donor flag on each donor's buffer (a compiled call
   arms its own way, _dynamo.py);
3. torch_xla builds its graph and runs it;
4. ``finish`` (poison, verdicts in flight) or ``fail`` (values kept).

The user's step must run whatever the plugin's checks do: a check that
raises drops the step's marks (``undecided``: values kept, a warning says
why), and warnings are held back (messages.Notices) until the commit is
whole, so a filter that turns them into errors raises after the step.
"""
import sys
import threading

from . import _auto as auto
from . import _config as config
from . import _guards as guards
from . import _holders as holders
from . import _messages as messages
from . import _verdicts as verdicts
from . import _xla as xla
from ._messages import Notices
from ._native import C, lock
from .errors import DroppedDonationWarning

__all__ = ["barrier_hook", "barrier_before", "barrier_after", "begin_and_decide", "arm", "disarm",
           "finish", "fail", "flush_before", "flush_after", "context", "current", "set_current",
           "BLOCK_PROLOGUE", "BLOCK_BODY", "BLOCK_EXIT", "BLOCK_FAILED", "COMPILED_CALL"]

S = C.Split


# -- What a barrier commits ----------------------------------------------------------
#
# A step block (``torch_xla.compile``/``step()``) starts with a flush that
# commits nothing (the marks made before it are meant for its graph) and
# ends with the sync that commits them (abandoned if its body raised); the
# syncs inside a compiled call commit nothing (_dynamo.py).  _hooks.py keeps
# this thread-local stack.

# What the calling thread is inside of, innermost last: decides what its
# barriers commit.
BLOCK_PROLOGUE = "block prologue"  # the flush a step block starts with
BLOCK_BODY = "block body"
BLOCK_EXIT = "block exit"          # the sync that ends a step block
BLOCK_FAILED = "block failed"      # ... whose body raised
COMPILED_CALL = "compiled call"    # a torch.compile'd graph call (_dynamo.py)

_local = threading.local()


def context_stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current():
    stack = context_stack()
    return stack[-1] if stack else None


class context:
    """``with context(kind):`` the calling thread is inside ``kind``."""

    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        context_stack().append(self.kind)
        return self

    def __exit__(self, *exc_info):
        context_stack().pop()


def set_current(kind) -> None:
    stack = context_stack()
    if stack:
        stack[-1] = kind



def barrier_hook(*args, **kwargs):
    """The first half of the step barrier's trampoline: what this thread's
    barrier commits, by what it is inside of."""
    kind = current()
    if kind in (BLOCK_PROLOGUE, COMPILED_CALL):
        return barrier_before(*args, commits=False, **kwargs)
    return barrier_before(*args, abandon=kind == BLOCK_FAILED, **kwargs)


class _Commit:
    """What ``before`` hands ``after``: the barrier's device, step, the
    armed donors, and the warnings held back until the commit is whole."""

    __slots__ = ("device", "step", "donors", "wait", "notices", "auto")

    def __init__(self, device, step, donors, wait, notices):
        self.device, self.step, self.donors, self.wait = device, step, donors, wait
        self.notices = notices
        self.auto = None  # dead inputs armed with the donors (_auto.py)


_FLUSH = object()  # a barrier that commits nothing


def barrier_before(device="", devices=(), wait=True, reset_scope=True, *, commits=True,
                   abandon=False):
    """The first half of a step barrier (``_xla_step_marker``'s arguments).

    ``commits=False``: a flush that leaves the marks as they are.
    ``abandon=True``: the sync that ends a step block whose body raised: its
    marks are committed and abandoned (STEP_FAILED).
    """
    if commits:
        auto.prepare()  # once, outside the lock
    lock.acquire()
    try:
        config.refresh()
        here = verdicts.barrier_device(device)
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
        step, donors = begin_and_decide(verdicts.marks_on(here), notices, abandon=abandon)
        donors = arm(donors, notices)
        token = _Commit(here, step, donors, wait, notices)
        if not abandon:
            try:
                token.auto = auto.at_commit(here)
            except Exception as error:  # never in the user's way: nothing armed
                notices.add(DroppedDonationWarning, messages.AUTO_SKIPPED.format(
                    error=f"{type(error).__name__}: {auto.braces_safe(error)}"), [])
        if donors and xla.local_device_count() == 1:
            # The donors nothing but their entry refers to (the loop rebound
            # its names) go now, each entry keeping only its buffer: so
            # torch_xla's barrier neither walks nor keeps them, as raw
            # donation's die while tracing.  After auto.at_commit, whose
            # search must see them held.
            C.release_unheld(donors)
        return token
    except BaseException:
        lock.release()
        raise


def begin_and_decide(only, notices, abandon=False):
    """Takes the marks (all, or those of the tensors ``only``) into a new
    step and decides them; returns (step, donors), the donors not armed.
    Never raises from the plugin's own checks (see ``undecided``).

    The tricky case: a mark made before ``configure(enabled=False)``
    (marking itself does nothing while switched off) is refused by the
    execution that takes it, a step barrier or a compiled call alike:
    DISABLED, value kept.
    """
    if not guards.decided():
        # The guards, once, on a marked tensor (no graph of their own; a
        # compiled function's own donations decide them here): one that
        # fails switches donation off, and the marks are DISABLED below.
        marked = C.marked_tensors() if only is None else only
        if marked:
            guards.decide(marked[0])
            config.refresh()
    step, donors, referred = C.commit(only)
    try:
        donors += _judged(referred, notices)
    except Exception as error:  # the plugin's own check failed, not the step
        return step, undecided(donors + [e for e, _, _ in referred], error, notices)
    if donors and not config.on():
        verdicts.abandon(donors, C.Verdict.DISABLED)  # switched off after marking
        return step, []
    if donors and abandon:
        verdicts.abandon(donors, C.Verdict.STEP_FAILED)
        return step, []
    return step, donors


def _judged(referred, notices) -> list:
    """The entries ``C.commit`` referred back, judged: those that may be
    donated after all, the others dropped (value kept, a warning)."""
    donors = []
    held = [e for e, split, _ in referred if split == S.HELD]
    if held:
        # Aliases and autograd graphs: a module's parameters sharing the
        # storage go with the donation, a name the user holds blocks it
        # (_holders.py); those let through get the buffer checks.
        allowed, dropped = holders.judge_held(held)
        verdicts.drop_entries(dropped, notices)
        more, referred_again = C.screen(allowed)
        donors += more
        referred = [r for r in referred if r[1] != S.HELD] + referred_again
    excess = [e for e, split, _ in referred if split == S.EXCESS]
    if excess:
        # A moment's holders: autograd's worker thread, or the previous
        # execution still dispatching with the buffer as its input.  Asked
        # again once both are done, so the outcome never depends on timing.
        holders.settle_autograd(excess[0][0].device)
        xla.wait_device_ops()
        more, referred_again = C.screen(excess)
        donors += more
        referred = [r for r in referred if r[1] != S.EXCESS] + referred_again
    copies = [(e, ids) for e, split, ids in referred if split == S.COPY]
    if copies:
        # Copies made in this step: a clone gets a buffer of its own at the
        # barrier, any other copy is backed with the donor's (_holders.py).
        more, referred_again = holders.resolve_copies(copies)
        donors += more
        referred = [r for r in referred if r[1] != S.COPY] + referred_again
    kept, dropped = holders.judge_shared(referred)
    verdicts.drop_entries(dropped, notices)
    return donors + kept


def undecided(entries, error, notices) -> list:
    """A check of the commit raised: every mark of the step not settled yet
    is dropped (DROPPED, value kept), and the warning says why.  Returns no
    donor."""
    dropped = [r for _, r in entries if r.verdict == C.Verdict.IN_FLIGHT]
    verdicts.drop(dropped)
    if dropped:
        error = messages.escape(f"{type(error).__name__}: {error}")
        notices.add(DroppedDonationWarning, messages.UNDECIDED.format(error=error), dropped)
    return []


def arm(donors, notices) -> list:
    """A step barrier's arming: sets the donor flag on the buffer each donor
    holds now; returns the armed entries.  One torch_xla refuses (no plain
    device data after all) is dropped.  A compiled call arms its donors
    only while the bridge extracts an executable for them (_dynamo.py)."""
    if not donors:
        return donors
    set_donor = xla.real("_set_buffer_donation")
    refused = [e for e in donors if not set_donor(e[0], True)]
    if not refused:
        return donors
    verdicts.drop_entries({messages.REFUSED_FLAG: refused}, notices)
    gone = {id(e) for e in refused}
    return [e for e in donors if id(e) not in gone]


def disarm(tensors) -> None:
    """Clears torch_xla's donor flag on the buffer each tensor holds (a
    consumed buffer keeps one nothing can read any more)."""
    set_donor = xla.real("_set_buffer_donation")
    for t in tensors:
        if t is not None:
            set_donor(t, False)


def barrier_after(token, result, error):
    """The second half of a step barrier.  The warnings held back are given
    last, once the lock is released."""
    try:
        if token is _FLUSH:
            return result
        if error is not None:
            fail(token.donors, token.auto)
            return result
        verdicts.dispatched(token.device, token.step if token.wait else token.step - 1)
        finish(token.device, token.donors, token.notices, certain=token.wait)
        auto.after_graph(token.auto)
        return result
    finally:
        lock.release()
        if token is not _FLUSH and token.notices:
            token.notices.deliver(quietly=sys.exc_info()[1] is not None)


def finish(device, donors, notices, certain: bool) -> None:
    """The end of every commit whose execution ran, once its donor set is
    fixed: poison the donors the user still holds and their companions,
    disarm the flags of the donors the entries keep, leave the verdicts in
    flight (``certain``: the execution was waited for).

    With one device a donor nothing but its entry refers to is let go (its
    entry keeps only its buffer), and one the user still holds is poisoned
    and kept weakly, its flag left armed until its verdict: it dies when
    the loop drops it, as raw donation's do (csrc/hooks/commit.cpp Finish).
    A donor that cannot be poisoned does not stop the others: a
    ``TypeError`` naming its class is raised once the commit is whole.
    """
    to_disarm, failed = C.finish(donors, release=xla.local_device_count() == 1)
    disarm(to_disarm)
    if failed:
        notices.fail(_unpoisoned_error(failed))
    if holders.companions_by_record:
        holders.poison_companions([record.id for _, record in donors])
    verdicts.after_commit(device, donors, certain=certain)


def fail(donors, dead_inputs=None) -> None:
    """The end of every commit whose execution raised: no flag stays armed,
    the dead inputs armed with the donors are let go, every step so far may
    have failed (``verdicts.note_failure``: their open verdicts will not
    read "unused"), and the donors settle STEP_FAILED, values kept, or LOST
    if torch_xla lost the buffer.

    The tricky case: a donor ``release_unheld`` let go before the
    execution.  Its buffer is no tensor's, but the failed step's pending
    outputs still read it, and a partial sync of some of them
    (``xm.unlazy``) would consume it under the others: its flag is cleared
    through a carrier (``xla.set_unheld_flags``)."""
    auto.abandon(dead_inputs)
    disarm(e[0] for e in donors)
    released = [e for e in donors if e[0] is None]
    if released:
        # Released with one device only: the thread's.
        xla.set_unheld_flags(verdicts.barrier_device(""),
                             lambda carrier, i: C.point_carrier(carrier, released[i]),
                             len(released), False)
    verdicts.note_failure()
    verdicts.failed(donors)


def _unpoisoned_error(failed) -> TypeError:
    (t, record), message = failed[0]
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return TypeError(messages.unpoisoned(t, record, message, more))


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
        verdicts.disarm_in_flight(verdicts.barrier_device(""))
    except BaseException:
        lock.release()
        raise
    return _FLUSH


def flush_after(token, result, error):
    lock.release()
    return result
