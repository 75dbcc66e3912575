"""Who else holds a donor's buffer, judged the same way at marking and at
the commit (docs/buffer-sharing.md): a module's parameter or a leaf only an
autograd graph holds goes with the donation (a *companion*, poisoned with
it); any other holder blocks it, and the message names it.
"""
import contextlib
import threading

import torch

from . import _messages as messages
from . import _poison as poison
from . import _xla as xla
from ._native import C

__all__ = ["held_by_autograd", "settle_autograd", "scan", "scanning", "storage_of", "judge",
           "judge_held", "resolve_copies", "judge_shared", "note_graph_holds_inputs",
           "live_sharers", "companions_by_record", "register_companions", "poison_companions",
           "settle_companions"]


def held_by_autograd(t) -> bool:
    """C++ code besides ``t`` holds its TensorImpl: a graph that saved it, a
    ``.grad`` slot (not the AccumulateGrad node of a leaf, which never reads
    the value).

    >>> w = torch.ones(2, requires_grad=True)
    >>> loss = (w * w).sum()
    >>> held_by_autograd(w), loss.backward(), held_by_autograd(w)
    (True, None, False)
    """
    if not isinstance(t, torch.Tensor):
        return False
    return t._use_count() > 1 + (t.is_leaf and t.requires_grad)


def settle_autograd(device) -> None:
    """Waits until autograd's worker thread for ``device`` has let go of the
    graphs of the backward passes it finished (a moment after ``backward()``
    returned): a probe backward queued behind them, computing nothing, in
    whatever grad mode the caller is.

    >>> import torch_xla
    >>> with torch.inference_mode():
    ...     settle_autograd(torch_xla.device())
    >>> torch.is_grad_enabled()
    True
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1).to(device).requires_grad_()  # (1,): device data, not a constant
        torch.autograd.grad(_Probe.apply(x), x, grad_outputs=torch.ones(1).to(device))


class _Probe(torch.autograd.Function):
    """Hands its gradient through: nothing pending is left in the worker
    thread (a lazy ``x * 1.0`` there became an extra output of the next step)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


# -- The objects Python can reach --------------------------------------------

class _Scan:
    """One walk of the objects the garbage collector tracks: the tensors
    Python code holds (not those only C++ keeps, ``C.live_objects``), the
    modules holding them, and the leaves autograd graphs accumulate into."""

    def __init__(self):
        self.tensors, modules = C.live_objects((torch.Tensor, torch.nn.Module))
        self._names = {}
        for m in modules:
            for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
                for name, p in named:
                    label = f"{kind} '{name}' of {type(m).__name__}"
                    if len(label) > len(self._names.get(id(p), "")):  # the root-most module's
                        self._names[id(p)] = label
        self._leaves = None

    def sharing(self, address, t):
        """(tensor, held by Python code) for each other tensor of ``t``'s storage."""
        seen = {id(t)}
        for held, tensors in ((True, self.tensors), (False, self._accumulated_leaves())):
            for o in tensors:
                if id(o) not in seen and storage_of(o) == address:
                    seen.add(id(o))
                    yield o, held

    def module_name(self, t):
        return self._names.get(id(t))

    def _accumulated_leaves(self) -> list:
        if self._leaves is None:
            leaves, seen, kept = [], set(), []  # kept: node wrappers, or ids repeat
            todo = [f for f in (_attribute(t, "grad_fn") for t in self.tensors) if f is not None]
            while todo:
                node = todo.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                kept.append(node)
                if isinstance(getattr(node, "variable", None), torch.Tensor):
                    leaves.append(node.variable)
                todo.extend(n for n, _ in node.next_functions)
            self._leaves = leaves
        return self._leaves

    def grad_slot_of(self, t):
        for o in self.tensors:
            if o is not t and _attribute(o, "is_leaf") and _attribute(o, "grad") is t:
                return _name(o)
        return None

    def with_ids(self, ids) -> dict:
        """torch_xla id -> a live XLA tensor Python holds with that id."""
        out = {}
        for o in self.tensors:
            if _is_live_xla(o):
                i = C.lazy_tensor_id(o)
                if i in ids:
                    out.setdefault(i, o)
        return out


def _attribute(t, name):
    try:
        return getattr(t, name)
    except RuntimeError:  # an undefined tensor
        return None


def storage_of(t) -> int:
    """The address of ``t``'s StorageImpl (0: none, or no tensor torch can read)."""
    try:
        return C.storage_address(t)
    except (RuntimeError, TypeError):
        return 0


_local = threading.local()


@contextlib.contextmanager
def scanning():
    """Within it, ``scan()`` walks the objects once."""
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


# -- Judging the holders -----------------------------------------------------

class Judgement:
    """``companions`` ((tensor, note)) go with the donation; ``blockers``
    (descriptions) keep it from being donated."""

    __slots__ = ("companions", "blockers")

    def __init__(self):
        self.companions, self.blockers = [], []


def judge(t) -> Judgement:
    """Who else holds ``t``'s storage or TensorImpl, judged.  The one rule for
    an alias: a module's parameter or buffer is a companion, and so is a leaf
    only a finished autograd graph holds; an alias Python code holds by a
    name (``p = nn.Parameter(t)``), graph or not, blocks the donation."""
    result = Judgement()
    storage_uses, _ = C.use_counts(t) or (1, 1)
    if storage_uses > 1:
        s, found = scan(), 0
        for alias, held in s.sharing(C.storage_address(t), t):
            found += 1
            name = s.module_name(alias)
            if name is not None:
                result.companions.append(
                    (alias, f"it is {name}, which shared its storage with the donated tensor"))
            elif not held:
                result.companions.append(
                    (alias, "it is a leaf a finished autograd graph accumulates gradients "
                            "into, which shared its storage with the donated tensor"))
            elif messages.ALIAS not in result.blockers:
                result.blockers.append(messages.ALIAS)
        if storage_uses - 1 > found:
            result.blockers.append(messages.CPP_ALIAS)
    elif held_by_autograd(t):
        slot = scan().grad_slot_of(t)
        result.blockers.append(messages.GRAD_SLOT.format(slot=slot) if slot
                               else messages.SAVED_FOR_BACKWARD)
    return result


def judge_held(held):
    """The entries the commit referred back as held, judged: (those that may
    be donated, their companions registered; {why: entries} to drop)."""
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


def resolve_copies(copies):
    """The entries with copies made in the step (``(entry, ids)``): torch_xla
    gives a clone a buffer of its own at the barrier and backs any other copy
    with its source's (docs/design.md, "Clones among those copies").  Its own
    collection of a sync, asked of the copies Python holds, attaches the
    others to the buffer and leaves the clones pending; the entries are
    screened again past their clones: ``C.screen``'s (donors, referred)."""
    with scanning():
        held = scan().with_ids(set().union(*(ids for _, ids in copies)))
    if held:
        xla.attach_copies(list(held.values()))
    facts = {i: xla.read_facts(t) for i, t in held.items()}
    clones = [i for i, f in facts.items() if f and f.ir_is_device_data and not f.has_handle]
    return C.screen([e for e, _ in copies], clones)


# -- Companions: poisoned with a donation, given back with it if it goes unused --

companions_by_record = {}  # record id -> (record, [(tensor, note)]) while its verdict is open


def register_companions(record, companions) -> None:
    if companions:
        companions_by_record[record.id] = (record, list(companions))


def poison_companions(record_ids) -> None:
    for rid in record_ids:
        if rid in companions_by_record:
            record, companions = companions_by_record[rid]
            for t, note in companions:
                poison.poison(t, record, note)


def settle_companions() -> None:
    for rid, (record, companions) in list(companions_by_record.items()):
        if record.verdict in (C.Verdict.MARKED, C.Verdict.IN_FLIGHT):
            continue
        del companions_by_record[rid]
        if record.verdict != C.Verdict.REUSED:
            for t, _ in companions:
                if poison.is_poisoned(t):
                    poison.unpoison(t)


# -- Buffers other tensors share ---------------------------------------------

def judge_shared(referred):
    """The entries the buffer checks referred back (``(entry, split,
    detail)``), judged: (those the step's own graph explains; {why: entries}
    to drop, naming each holder Python can reach)."""
    S, dropped, kept = C.Split, {}, []
    copies = [(e, ids) for e, split, ids in referred if split == S.COPY]
    if copies:
        with scanning():
            named = {i: _name(t) for i, t in
                     scan().with_ids(set().union(*(ids for _, ids in copies))).items()}
        for entry, ids in copies:
            holders = [named[h] for h in ids if h in named]
            holders = holders[:3] + ([f"{len(holders) - 3} more"] if len(holders) > 3 else [])
            holder = (", ".join(holders) if holders else
                      f"a tensor Python cannot reach (torch_xla tensor {ids[0]}: an autograd "
                      f"graph or C++ code holds it)")
            facts = xla.read_facts(entry[0])
            why = (messages.SAME_STEP.format(holder=holder) if facts and facts.is_functional
                   else messages.SHARES.format(names=holder))
            dropped.setdefault(why, []).append(entry)
    over = [(e, extra) for e, split, extra in referred if split == S.EXCESS]
    if over:
        tensors = [e[0] for e, _ in over]
        named = {} if xla.spmd() else _named_sharers(tensors)
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


_graph_holds_inputs_at = -1  # the step torch_xla's gradient_accumulation built


def note_graph_holds_inputs() -> None:
    """torch_xla's ``gradient_accumulation`` built the pending step: its while
    loop holds the buffers it reads, one reference each no tensor owns, so
    the next commit does not count holders Python cannot reach."""
    global _graph_holds_inputs_at
    _graph_holds_inputs_at = C.current_step() + 1


def _named_sharers(tensors) -> dict:
    """index -> names of the live tensors Python holds that share its buffer."""
    out = {}
    with scanning():
        for i, sharers in enumerate(live_sharers(tensors, tensors)):
            if sharers:
                more = f" and {len(sharers) - 3} more" if len(sharers) > 3 else ""
                out[i] = ", ".join(_name(o) for o in sharers[:3]) + more
    return out


def live_sharers(tensors, donors) -> list:
    """For each of ``tensors``, the live tensors Python holds with its device
    buffer, but its own views and aliases and the step's other ``donors``."""
    skip, by_key = {id(t) for t in donors}, {}
    for o in scan().tensors:
        if id(o) not in skip and _is_live_xla(o):
            key = xla.read_buffer_key(o)
            if key:
                by_key.setdefault(key, []).append(o)
    return [[o for o in by_key.get(xla.read_buffer_key(t) or -1, ())
             if storage_of(o) != storage_of(t)] for t in tensors]


def _is_live_xla(o) -> bool:
    """An XLA tensor with a value of its own (not donated, not a wrapper)."""
    try:
        return (o.device.type == "xla" and not poison.is_poisoned(o)
                and not torch._C._dispatch_keys(o).has(torch._C.DispatchKey.Python))
    except RuntimeError:
        return False


def _name(t) -> str:
    name = scan().module_name(t)
    return f"the {name}" if name is not None else f"a tensor {messages.shape_string(t)}"
