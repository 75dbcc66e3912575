"""Who else holds a donor's buffer, and what that means for its donation
(docs/buffer-sharing.md has every kind of holder and why each is refused).

Most donors are held by nobody else, which the native reads say in a few
instructions.  When they say otherwise, this module finds the holders
Python can reach (one walk of the garbage collector's objects per call)
and judges them, the same way at marking and at the commit:

* a module's parameter or buffer, or a leaf a finished autograd graph
  accumulates into, sharing the donor's storage: a *companion*, poisoned
  with the donation and given back with it if it goes unused;
* anything else (a view or alias the user holds, a graph that saved the
  tensor, a ``.grad`` slot, a copy sharing its buffer): it blocks the
  donation, and the message names it.

A moment's holder (autograd's worker thread releasing a finished backward)
is waited for first (``settle_autograd``), so the outcome never depends on
timing.
"""
import contextlib
import threading

import torch

from . import _messages as messages
from . import _poison as poison
from . import _xla as xla
from ._native import C

__all__ = ["held_by_autograd", "settle_autograd", "scan", "scanning", "storage_of", "judge",
           "judge_held", "judge_shared", "note_graph_holds_inputs", "live_sharers",
           "companions_by_record", "register_companions", "poison_companions",
           "settle_companions"]


# -- Autograd -------------------------------------------------------------------------

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


# -- The objects Python can reach ------------------------------------------------

class _Scan:
    """One walk over the objects the garbage collector tracks: live tensors,
    the modules holding them, and the leaves autograd graphs accumulate into."""

    def __init__(self):
        # Not the Python objects of tensors only C++ keeps alive
        # (csrc/outcomes/ownership.cpp live_objects): no Python code holds
        # those, and ours must not outlive their TensorImpls.
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
                return f"the {name}" if name else f"a tensor {messages.shape_string(o)}"
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


# -- Judging the holders ----------------------------------------------------------

class Judgement:
    """What the holders of one tensor mean for its donation: ``companions``
    (tensor, note) are taken down with it; ``blockers`` (descriptions) keep
    it from being donated."""

    __slots__ = ("companions", "blockers")

    def __init__(self):
        self.companions, self.blockers = [], []


def judge(t) -> Judgement:
    """Who else holds ``t``'s storage or TensorImpl, judged (see the
    module docstring).  ``settle_autograd`` should have run first."""
    result = Judgement()
    storage_uses, impl_uses = C.use_counts(t) or (1, 1)
    if storage_uses > 1:
        # Views and aliases hold their base's TensorImpl too (twice, on XLA):
        # the autograd question is asked once they are accounted for.
        _judge_aliases(t, storage_uses - 1, result)
    elif held_by_autograd(t):
        slot = scan().grad_slot_of(t)
        if slot is not None:
            result.blockers.append(messages.GRAD_SLOT.format(slot=slot))
        else:
            result.blockers.append(messages.SAVED_FOR_BACKWARD)
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
            if messages.ALIAS not in result.blockers:
                result.blockers.append(messages.ALIAS)
    if others > found:
        result.blockers.append(messages.CPP_ALIAS)


def judge_held(held):
    """The committed entries the commit referred back as held (aliases,
    autograd), judged: (those that may be donated after all, their
    companions registered; {why: entries} to drop)."""
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
    return donors, dropped


# -- Companions ----------------------------------------------------------------------
#
# Taken down with a donation: poisoned with the donor after the execution,
# given back with it if the donation goes unused or fails, kept poisoned if
# it was consumed.

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


# -- Buffers other tensors share ---------------------------------------------------

def judge_shared(referred):
    """The committed entries the commit's buffer checks referred back
    (``C.commit``/``C.screen``: ``(entry, split, detail)``), judged: (those
    the step's own graph explains, which may be donated after all; {why:
    entries} to drop, naming each holder Python can reach)."""
    if not referred:
        return [], {}
    S = C.Split
    dropped, kept = {}, []
    copies = [(e, ids) for e, split, ids in referred if split == S.COPY]
    named = _names_of(set().union(*(ids for _, ids in copies))) if copies else {}
    for entry, ids in copies:
        holders = [named[h] for h in ids if h in named]
        if len(holders) > 3:
            holders = holders[:3] + [f"{len(holders) - 3} more"]
        holder = (", ".join(holders) if holders else
                  f"a tensor Python cannot reach (torch_xla tensor {ids[0]}: an autograd graph "
                  f"or C++ code holds it)")
        facts = xla.read_facts(entry[0])
        functional = facts is not None and facts.is_functional
        why = (messages.SAME_STEP.format(holder=holder) if functional
               else messages.SHARES.format(names=holder))
        dropped.setdefault(why, []).append(entry)
    over = [(e, extra) for e, split, extra in referred if split == S.EXCESS]
    if over:
        tensors = [e[0] for e, _ in over]
        named = {} if xla.spmd() else _named_sharers(range(len(tensors)), tensors)
        own_graph = _graph_holds_inputs_at == C.current_step()
        for i, (entry, extra) in enumerate(over):
            names = named.get(i)
            if not names and own_graph and xla.read_holders([entry[0]])[0].xla_tensor_refs <= 1:
                kept.append(entry)  # the step's own graph holds it
                continue
            why = (messages.SHARES.format(names=names) if names
                   else messages.CPP_HOLDERS.format(n=extra))
            dropped.setdefault(why, []).append(entry)
    unread = [e for e, split, _ in referred if split == S.UNREAD]
    if unread:
        dropped.setdefault(messages.UNREAD, []).extend(unread)
    return kept, dropped


# The step whose graph torch_xla's gradient_accumulation built (-1: none).
_graph_holds_inputs_at = -1


def note_graph_holds_inputs() -> None:
    """torch_xla's ``gradient_accumulation`` built the pending step: its
    while loop holds the buffers of the tensors it reads (captured ones
    too) in the graph itself, one reference each that no tensor owns.  The
    next commit does not count holders Python cannot reach against its
    donors (a copy only an autograd graph holds is not seen in that step).
    Every barrier begins a step, so a later step is never exempted."""
    global _graph_holds_inputs_at
    _graph_holds_inputs_at = C.current_step() + 1


def _named_sharers(indices, tensors) -> dict:
    """Names of the live tensors Python can reach that hold the buffer of
    each donor at ``indices`` (index -> names; absent: none found)."""
    out = {}
    with scanning():
        shared = live_sharers([tensors[i] for i in indices], tensors)
        for i, sharers in zip(indices, shared):
            if sharers:
                names = ", ".join(_name(o) for o in sharers[:3])
                if len(sharers) > 3:
                    names += f" and {len(sharers) - 3} more"
                out[i] = names
    return out


def _names_of(tensor_ids) -> dict:
    """torch_xla tensor id -> the name of a live tensor Python can reach
    with that id (absent: none found)."""
    out = {}
    with scanning():
        for o in scan().tensors:
            if _is_live_xla(o):
                i = C.lazy_tensor_id(o)
                if i in tensor_ids and i not in out:
                    out[i] = _name(o)
    return out


def live_sharers(tensors, donors) -> list:
    """For each of ``tensors``: the live tensors Python can reach that hold
    its device buffer, apart from its own views and aliases (``judge``
    judges those) and the step's other ``donors`` (donated with it)."""
    skip = {id(t) for t in donors}
    by_key = {}
    for o in scan().tensors:
        if id(o) not in skip and _is_live_xla(o):
            key = xla.read_buffer_key(o)  # 0: no live buffer (pending, consumed, computing)
            if key:
                by_key.setdefault(key, []).append(o)
    out = []
    for t in tensors:
        storage = storage_of(t)
        out.append([o for o in by_key.get(xla.read_buffer_key(t) or -1, ())
                    if storage_of(o) != storage])
    return out


def _is_live_xla(o) -> bool:
    """An XLA tensor with a value: not consumed by a donation (its handle
    means nothing now), not a wrapper subclass (no buffer of its own)."""
    try:
        return (o.device.type == "xla" and not poison.is_poisoned(o)
                and not torch._C._dispatch_keys(o).has(torch._C.DispatchKey.Python))
    except RuntimeError:
        return False


def _name(t) -> str:
    name = scan().module_name(t)
    return f"the {name}" if name is not None else f"a tensor {messages.shape_string(t)}"
