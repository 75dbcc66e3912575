"""Who else holds a marked tensor's buffer, and what that means for its
donation.

Example (the torch.func tutorial's parameters share the module's storage)::

    params = {k: v.detach() for k, v in model.named_parameters()}
    tdx.donate(params)           # judged: the module's parameters are companions
    ...; torch_xla.sync()        # model(x) now raises DonatedBufferError naming them

The problem
-----------
Donating a buffer destroys it for every tensor that holds it.  Most marked
tensors are held by nobody else, which c10's use counts say in nanoseconds
(``C.split_committed``, ``C.try_mark``).  When they say otherwise, this
module looks at who the holders are, and decides the same way at marking
and at the commit (where the holders may be new).

The holders and their fate
--------------------------
* A holder only autograd's worker thread still has.  For a few milliseconds
  after ``torch.func.grad`` returns, that thread is still releasing the
  graph's references.  ``settle_autograd`` waits for it (a backward on the
  same device queue, which the thread takes only once it is done with the
  previous one), so the outcome never depends on timing, whatever the
  caller's grad mode.
* Parameters and buffers of an ``nn.Module`` that share the tensor's storage,
  and a leaf that a finished autograd graph still accumulates into
  (``w = w.detach()`` while ``loss`` is alive): taken down with the
  donation.  They are *companions*: poisoned with it, so ``model(x)`` raises
  ``DonatedBufferError`` naming the parameter, and given back with it if
  the donation goes unused.
* Anything else alive (a view or alias the user holds, a graph that saved
  the tensor for backward, a parameter's ``.grad`` slot) keeps the donation
  from happening: ``donate_buffer`` raises a ``ValueError`` naming the
  holder and the fix; at the commit the mark is dropped with a
  ``DroppedDonationWarning`` naming it; the tensor keeps its value.

Finding holders
---------------
holders.py walks the objects Python's garbage collector tracks, only when a
use count says there is a holder, once per call (``scanning()``);
autograd_holds.py answers and waits for autograd; companions.py keeps the
companions until the verdict.

Buffers torch_xla shares between distinct tensors (copies made by
``load_state_dict``, ``copy_``, ``t.to(device, copy=True)``) are invisible to
c10's counts: a copy made since the last barrier is refused here
(``owns_its_buffer``); sharing.py looks at the others at the commit.
"""
from .._base.errors import DroppedDonationWarning
from .._base.native import C
from . import verdicts

# The rooms this module judges with; their names stay importable from here
# (the commit and sharing.py use them as ``ownership.<name>``).
from .autograd_holds import held_by_autograd, settle_autograd
from .companions import (
    companions_by_record,
    poison_companions,
    register_companions,
    settle_companions,
)
from .holders import scan, scanning, storage_of

__all__ = ["judge", "judge_at_commit", "drop",
           # from the rooms it judges with:
           "held_by_autograd", "settle_autograd", "scan", "scanning", "storage_of",
           "companions_by_record", "register_companions", "poison_companions",
           "settle_companions"]

# -- Holders ----------------------------------------------------------------------

class Judgement:
    """What the holders of one tensor mean for its donation: ``companions``
    (tensor, note) are taken down with it; ``blockers`` (descriptions) keep
    it from being donated."""

    __slots__ = ("companions", "blockers")

    def __init__(self):
        self.companions, self.blockers = [], []


def judge(t) -> Judgement:
    """Looks at who else holds ``t``'s storage or TensorImpl (see the module
    docstring).  ``settle_autograd`` should have run first."""
    result = Judgement()
    storage_uses, impl_uses = C.use_counts(t) or (1, 1)
    if storage_uses > 1:
        # Views and aliases hold their base's TensorImpl too (twice, on XLA):
        # the autograd question is asked once they are accounted for.
        _judge_aliases(t, storage_uses - 1, result)
    elif held_by_autograd(t):
        slot = scan().grad_slot_of(t)
        if slot is not None:
            result.blockers.append(
                f"it is the .grad of {slot}, which keeps holding it: take it out of the "
                "slot first (g = p.grad; p.grad = None), then donate g")
        else:
            result.blockers.append(
                "it is saved for backward by a live autograd graph (e.g. loss = "
                "(w * w).sum() saves w until loss.backward()); donated, that backward would "
                "fail on a deleted buffer. Call backward first (it frees what it saved), or "
                "drop the graph (del loss)")
    return result


def _judge_aliases(t, others, result) -> None:
    s = scan()
    address = C.storage_address(t)
    found = 0
    for alias in s.sharing(address, t):
        found += 1
        name = s.module_name(alias)
        if name is not None:
            result.companions.append((alias, f"it is {name}, which shared its storage with "
                                             "the donated tensor"))
        elif s.accumulated(alias):
            result.companions.append((alias, "it is a leaf a finished autograd graph "
                                             "accumulates gradients into, which shared its "
                                             "storage with the donated tensor"))
        else:
            blocker = (
                "it shares its buffer with a live view or alias (t[0:2], t.detach(), "
                "nn.Parameter(t), a state_dict(), ...), which donating would destroy too: "
                "delete it first, or donate a copy (t.clone(), then a step)")
            if blocker not in result.blockers:
                result.blockers.append(blocker)
    if others > found:
        result.blockers.append(
            "it shares its buffer with tensors only C++ code holds: most likely an autograd "
            "graph that saved it for backward (or a view of it); call backward first, or "
            "drop the graph")


# -- At the commit ----------------------------------------------------------------

def judge_at_commit(held, notices) -> list:
    """Decides the committed entries ``split_committed`` found held by
    another tensor or by autograd; returns those that may be donated after
    all (their companions registered), settling the others DROPPED (their
    warnings go to ``notices``, given once the commit is whole)."""
    settle_autograd(held[0][0].device)
    donors, dropped = [], {}
    with scanning():
        for entry in held:
            judgement = judge(entry[0])
            if judgement.blockers:
                dropped.setdefault("; ".join(judgement.blockers), []).append(entry)
            else:
                donors.append(entry)
                register_companions(entry[1], judgement.companions)
    for why, entries in dropped.items():
        drop(entries, why, notices)
    return donors


def drop(entries, why: str, notices) -> None:
    """Settles ``entries`` DROPPED (value kept); one warning, held in
    ``notices`` (messages.Notices) until the commit is whole."""
    verdicts.drop([record for _, record in entries])
    notices.add(
        DroppedDonationWarning,
        "Donations dropped before a step{at_step}: {items}. Since they were marked, " + why
        + ". These tensors keep their values.",
        [record for _, record in entries],
    )
