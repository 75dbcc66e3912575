"""The commit's stages, run by a step barrier (``barrier_before`` and
``barrier_after``, the halves of its trampoline) and by a compiled call
(_dynamo.py): begin and decide, arm, then finish or fail (docs/design.md,
"The step's life").  A check of the plugin that raises never stops the
user's step: the marks are dropped, values kept (``undecided``).
"""
import sys
import threading
from itertools import repeat
from operator import itemgetter

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
_tensor_of = itemgetter(0)


# What the calling thread is inside of, innermost last (_hooks.py keeps it):
# a step block's first flush commits nothing, its closing sync commits the
# marks (abandoned if its body raised); syncs in a compiled call commit nothing.
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
    """What ``before`` hands ``after``; warnings wait until the commit is whole."""

    __slots__ = ("device", "step", "donors", "wait", "notices", "auto")

    def __init__(self, device, step, donors, wait, notices):
        self.device, self.step, self.donors, self.wait = device, step, donors, wait
        self.notices = notices
        self.auto = None  # dead inputs armed with the donors (_auto.py)


_FLUSH = object()  # a barrier that commits nothing


def barrier_before(device="", devices=(), wait=True, reset_scope=True, *, commits=True,
                   abandon=False):
    """The first half of a step barrier (``_xla_step_marker``'s arguments);
    ``commits=False``: a flush; ``abandon``: marks settle STEP_FAILED."""
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
            verdicts.release_unheld()  # earlier donors dropped since: out of the walks
        # No verdict of an earlier step before the real barrier: a buffer XLA
        # holds for a donation it may yet give back reads as deleted.
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
            # Donors only their entry refers to go now, the entry keeping the
            # buffer: torch_xla's barrier neither walks nor keeps them.  After
            # auto.at_commit, whose search must see them held.
            C.release_unheld(donors)
        return token
    except BaseException:
        lock.release()
        raise


def begin_and_decide(only, notices, abandon=False):
    """Takes the marks (all, or those of the tensors ``only``) into a new
    step and decides them: (step, donors not armed yet).  A mark made before
    ``configure(enabled=False)`` settles DISABLED, value kept."""
    if not guards.decided():
        # The guards, once, on a marked tensor (no graph of their own); one
        # that fails switches donation off and the marks settle DISABLED.
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
    """The entries ``C.commit`` referred back: those donated after all; the
    others are dropped (value kept, a warning)."""
    donors = []
    held = [e for e, split, _ in referred if split == S.HELD]
    if held:
        # Aliases: a module's parameter goes with the donation, a name the
        # user holds blocks it; those let through get the buffer checks.
        allowed, dropped = holders.judge_held(held)
        verdicts.drop_entries(dropped, notices)
        more, referred_again = C.screen(allowed)
        donors += more
        referred = [r for r in referred if r[1] != S.HELD] + referred_again
    excess = [e for e, split, _ in referred if split == S.EXCESS]
    if excess:
        # A moment's holders (autograd's worker, the previous execution
        # dispatching): asked again once both are done, never timing-dependent.
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
    """A check of the commit raised: the step's open marks are DROPPED
    (values kept) and the warning says why.  Returns no donor."""
    dropped = [r for _, r in entries if r.verdict == C.Verdict.IN_FLIGHT]
    verdicts.drop(dropped)
    if dropped:
        error = messages.escape(f"{type(error).__name__}: {error}")
        notices.add(DroppedDonationWarning, messages.UNDECIDED.format(error=error), dropped)
    return []


def arm(donors, notices) -> list:
    """Sets the donor flag on the buffer each donor holds now; returns the
    armed entries (one torch_xla refuses is dropped)."""
    if not donors:
        return donors
    set_donor = xla.real("_set_buffer_donation")
    # map, not a loop: no bytecode per donor.  Arming is idempotent, so after
    # a refusal each donor is asked again to find the refused ones.
    if all(map(set_donor, map(_tensor_of, donors), repeat(True))):
        return donors
    refused = [e for e in donors if not set_donor(e[0], True)]
    verdicts.drop_entries({messages.REFUSED_FLAG: refused}, notices)
    gone = {id(e) for e in refused}
    return [e for e in donors if id(e) not in gone]


def disarm(tensors) -> None:
    """Clears torch_xla's donor flag on the buffer each tensor holds."""
    set_donor = xla.real("_set_buffer_donation")
    for t in tensors:
        if t is not None:
            set_donor(t, False)


def barrier_after(token, result, error):
    """The second half of a step barrier; held-back warnings go last."""
    try:
        if token is _FLUSH:
            return result
        if error is not None:
            fail(token.donors, token.auto)
            return result
        verdicts.dispatched(token.device, token.step if token.wait else token.step - 1)
        finish(token.device, token.donors, token.notices, certain=token.wait)
        auto.after_graph(token.auto, token.step)
        return result
    finally:
        lock.release()
        if token is not _FLUSH and token.notices:
            token.notices.deliver(quietly=sys.exc_info()[1] is not None)


def finish(device, donors, notices, certain: bool) -> None:
    """A commit whose execution ran: poisons the donors the user still holds
    (``C.finish``) and their companions, disarms what the entries keep, and
    leaves the verdicts in flight (``certain``: the execution was waited
    for).  A donor that cannot be poisoned raises TypeError after the commit.
    """
    to_disarm, failed = C.finish(donors, release=xla.local_device_count() == 1)
    disarm(to_disarm)
    if failed:
        notices.fail(_unpoisoned_error(failed))
    if holders.companions_by_record:
        holders.poison_companions([record.id for _, record in donors])
    verdicts.after_commit(device, donors, certain=certain)


def fail(donors, dead_inputs=None) -> None:
    """A commit whose execution raised: no flag stays armed and the donors
    settle STEP_FAILED (values kept) or LOST.  A donor released before the
    execution has no tensor, yet the failed step's outputs still read its
    buffer: its flag is cleared through a carrier (``xla.set_unheld_flags``)."""
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


# Partial syncs (``_xla_sync_multi``: ``xm.unlazy``, ``xm.save``; and
# ``_xla_sync_live_tensors``) commit nothing: they wait for another thread's
# commit on the device (its flags are armed) and clear the flags ``finish``
# left armed on in-flight buffers the user still holds.


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
