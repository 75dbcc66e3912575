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
The scan walks the objects Python's garbage collector tracks (about 50 ms in
a process with torch_xla loaded), so it runs only when a use count says
there is a holder, once per call (``scanning()`` caches it).  It leaves out
the Python objects of tensors only C++ keeps alive (csrc/outcomes/
ownership.cpp): they count as C++ holders, and kept in a list they would
outlive their TensorImpls.

Buffers torch_xla shares between distinct tensors (copies made by
``load_state_dict``, ``copy_``, ``t.to(device, copy=True)``) are invisible to
c10's counts: a copy made since the last barrier is refused here
(``owns_its_buffer``); sharing.py looks at the others at the commit.
"""
import contextlib
import threading

import torch

from .._base import reads, xla
from .._base.dtypes import shape_string
from .._base.errors import DroppedDonationWarning
from .._base.native import C
from . import devices, poison

__all__ = ["judge", "judge_at_commit", "drop", "held_by_autograd", "owns_its_buffer",
           "settle_autograd", "scan", "poison_companions", "companions_by_record",
           "storage_of"]


def held_by_autograd(t) -> bool:
    """True when C++ code besides ``t`` itself holds ``t``'s TensorImpl: an
    autograd graph that saved it for backward (``w * w`` saves ``w``), or a
    parameter's ``.grad`` slot.

    Python references do not count, and neither does the AccumulateGrad node a
    leaf that requires grad gets once a graph uses it (it never reads the
    value).  Not a tensor: False.

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
    return t._use_count() > 1 + (t.is_leaf and t.requires_grad)


def settle_autograd(device) -> None:
    """Waits until autograd's worker thread for ``device`` has released the
    graphs of the backward passes it finished.

    The thread drops its last references to a graph (and the tensors the
    graph saved) a moment after the caller of ``grad()``/``backward()`` got
    its result.  A backward on the same device is queued behind that: once
    it has run, the earlier graph is gone.  Nothing is executed on the
    device (the lazy result is dropped).

    The tricky case: the caller's grad mode.  Optimizer updates run under
    ``torch.no_grad()``, serving under ``torch.inference_mode()``, and a
    ``torch.compile`` call runs with grad off; the probe backward needs
    autograd on whatever the caller's mode is, so it switches it on for
    itself only.

    >>> import torch_xla
    >>> with torch.inference_mode():
    ...     settle_autograd(torch_xla.device())
    >>> torch.is_grad_enabled()
    True

    (On an XLA device: autograd sizes its device queues at its first
    backward, and a first backward on the CPU before torch_xla's runtime is
    up would leave XLA's out.)
    """
    with torch.inference_mode(False), torch.enable_grad():
        # Shape (1,): a 0-dim tensor moved to the device becomes a constant
        # in torch_xla's IR (pending), not device data.
        x = torch.zeros(1).to(device).requires_grad_()
        one = torch.ones(1).to(device)
        torch.autograd.grad(_Probe.apply(x), x, grad_outputs=one)


class _Probe(torch.autograd.Function):
    """The probe backward of ``settle_autograd``, which computes nothing.

    The tricky case: autograd's worker thread holds the probe's own graph a
    moment after ``grad()`` returns too.  A probe computing ``x * 1.0``
    left a lazy tensor (the gradient it captured) alive in that thread, and
    one still alive at the step barrier that follows became an extra output
    of the user's graph: a new graph and a compile, now and then, under
    load.  Here every tensor is device data uploaded from the host and the
    backward hands its gradient through: nothing pending, nothing to sync.
    """

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


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




class _Scan:
    """One walk over the objects the garbage collector tracks: live tensors,
    the modules holding them, and the leaves autograd graphs accumulate into."""

    def __init__(self):
        # Not the Python objects of tensors only C++ keeps alive (see
        # live_objects in csrc/module.cpp): no Python code holds those, and
        # ours must not outlive their TensorImpls.
        self.tensors, modules = C.live_objects((torch.Tensor, torch.nn.Module))
        self._names = {}
        for m in modules:
            for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
                for name, p in named:
                    label = f"{kind} '{name}' of {type(m).__name__}"
                    # The root-most module gives the longest, most telling name.
                    if len(label) > len(self._names.get(id(p), "")):
                        self._names[id(p)] = label
        self._leaves = None

    def sharing(self, address, t):
        seen = {id(t)}
        for o in self.tensors + self._accumulated_leaves():
            if id(o) not in seen and storage_of(o) == address:
                seen.add(id(o))
                yield o

    def module_name(self, t):
        return self._names.get(id(t))

    def accumulated(self, t) -> bool:
        return any(t is leaf for leaf in self._accumulated_leaves())

    def _accumulated_leaves(self) -> list:
        """The variables of the AccumulateGrad nodes of every graph a live
        tensor roots."""
        if self._leaves is None:
            leaves, seen = [], set()
            todo = [f for f in (_attribute(t, "grad_fn") for t in self.tensors) if f is not None]
            kept = []  # node wrappers are made on access: keep them, or ids repeat
            while todo:
                node = todo.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                kept.append(node)
                variable = getattr(node, "variable", None)
                if isinstance(variable, torch.Tensor):
                    leaves.append(variable)
                todo.extend(n for n, _ in node.next_functions)
            self._leaves = leaves
        return self._leaves

    def grad_slot_of(self, t):
        for o in self.tensors:
            if o is not t and _attribute(o, "is_leaf") and _attribute(o, "grad") is t:
                name = self._names.get(id(o))
                return f"the {name}" if name else f"a tensor {shape_string(o)}"
        return None


def _attribute(t, name):
    """``t.<name>``, or None where torch refuses (an undefined tensor)."""
    try:
        return getattr(t, name)
    except RuntimeError:
        return None


def storage_of(t) -> int:
    """The address of ``t``'s StorageImpl; 0 for none (or a tensor torch
    cannot describe, as found among the garbage collector's objects)."""
    try:
        return C.storage_address(t)
    except (RuntimeError, TypeError):
        return 0


_local = threading.local()


@contextlib.contextmanager
def scanning():
    """Within it, ``scan()`` walks the objects once and reuses the result."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _local.scan = None


def scan() -> _Scan:
    cached = getattr(_local, "scan", None)
    if cached is None:
        cached = _Scan()
        if getattr(_local, "depth", 0):
            _local.scan = cached
    return cached


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
    for _, record in entries:
        C.settle(record, C.Verdict.DROPPED)
    notices.add(
        DroppedDonationWarning,
        "Donations dropped before a step{at_step}: {items}. Since they were marked, " + why
        + ". These tensors keep their values.",
        [record for _, record in entries],
    )


# -- Companions: taken down with a donation ---------------------------------------

companions_by_record = {}  # record id -> (record, [(tensor, note)]) while its verdict is open


def register_companions(record, companions) -> None:
    if companions:
        companions_by_record[record.id] = (record, list(companions))


def poison_companions(records_ids) -> None:
    """After the execution: the companions of these donations share their
    fate (provisionally, as the donors do, until the verdict)."""
    for rid in records_ids:
        entry = companions_by_record.get(rid)
        if entry is not None:
            record, companions = entry
            for t, note in companions:
                poison.poison(t, record, note)


def settle_companions() -> None:
    """Companions of donations judged since: given back with an unused or
    failed donation, kept poisoned with a consumed one, forgotten."""
    if not companions_by_record:
        return
    for rid, (record, companions) in list(companions_by_record.items()):
        if record.verdict in (C.Verdict.MARKED, C.Verdict.IN_FLIGHT):
            continue
        del companions_by_record[rid]
        if record.verdict != C.Verdict.REUSED:
            for t, _ in companions:
                if poison.is_poisoned(t):
                    poison.unpoison(t)


# -- Copies sharing their source's buffer -----------------------------------------

def owns_its_buffer(t) -> bool:
    """False for a copy that has no buffer of its own yet.

    torch_xla backs a copy or clone made since the last barrier (``s.clone()``,
    ``t.copy_(s)``, ``s.to(device, copy=True)``, ``torch.tensor(s)``) with the
    source's buffer, filed under the source's (older) tensor id: donating the
    copy would destroy the source, and marking refuses it.

    The tricky case is the other direction.  Some copies keep that buffer
    after the barrier, and torch_xla then files it under the copy, a *newer*
    tensor id: the source is not refused here, because whether the copy is
    still alive can only be told by looking at the live tensors, which the
    commit does for every donor alike (sharing.py).  A buffer filed under
    nobody belongs to its one tensor.
    """
    me = reads.tensor_id(t)
    if me <= devices.settled_id():
        # Older than the last barrier, which gave every copy then alive a
        # buffer (or the buffer it shares, sharing.py's business).  Not asked:
        # such a tensor may be an output still being computed, and torch_xla
        # crashes asking about one that is sharded.
        return True
    # Both reads twins give None without a live buffer (the callers refused
    # pending and consumed tensors: an output still being computed), which
    # is nobody else's buffer.  The native twin asks without the owner
    # query's side effects (_base/reads.py owner_ids).
    owner = reads.owner_ids([t])[0]
    return owner is None or owner in (me, xla.NO_OWNER) or owner > me
