"""Device buffers other tensors hold: a donation never destroys a tensor
that was not donated (docs/buffer-sharing.md has the holders and why each
is refused).

At the commit every donor's buffer is read natively: its holder count
against a clean tensor's, and the walk of torch_xla's live tensors for
copies made in the step.  A holder still there after waiting for a moment's
ones (autograd's worker thread, the previous execution) drops the donation:
value kept, a ``DroppedDonationWarning`` naming the holder.

>>> import torch_xla_donate as tdx
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     _ = tdx.configure(check_sharing=True)  # retired: ownership is always checked
>>> caught[0].category.__name__
'DeprecationWarning'
"""
import torch

from .._base import reads, xla
from .._base.dtypes import shape_string
from .._base.native import C
from . import ownership, poison

__all__ = ["drop_shared", "live_sharers", "note_graph_holds_inputs"]

_WHY = (
    "it shares its device buffer with {names}: torch_xla backs copies made by "
    "load_state_dict, copy_, t.to(device, copy=True), torch.tensor(t) or x[...] = t, and "
    "a .clone() read before its first step, with their source's buffer, and donating it "
    "would destroy that tensor too. Make such copies with .clone() and run a step "
    "(torch_xla.sync()) before reading them: the step gives a clone its own buffer"
)


_CPP_HOLDERS = (
    "its device buffer is also held where Python cannot reach it ({n} more reference(s) "
    "than its own: an autograd graph that saved a copy of it, made by t.to(device, "
    "copy=True), load_state_dict, copy_ or torch.tensor(t), or other C++ code), and "
    "donating it would destroy that copy too. Let the graph go (backward() or del loss) "
    "before the step that donates it"
)


_UNREAD = (
    "torch_xla_donate could not read its device buffer (it is no plain device data "
    "any more), so it cannot tell who else holds it"
)


_SAME_STEP = (
    "it shares its device buffer with {holder}, a copy made from it in this step "
    "(load_state_dict, copy_, t.to(device, copy=True), torch.tensor(t), x[...] = t, or a "
    ".clone() or copy.deepcopy) that the step would back with this buffer: donating it would "
    "destroy the copy. Make the copy with .clone() (copy.deepcopy for a module) and run a "
    "step (torch_xla.sync()) before the one that donates its source: the step gives a clone "
    "a buffer of its own. For load_state_dict, load a state_dict whose tensors were cloned "
    "before that step; a plain copy keeps sharing its source's buffer"
)


def drop_shared(referred, notices) -> list:
    """Drops the committed entries the commit's buffer checks referred back
    (``C.commit``/``C.screen``: ``(entry, split, detail)``), naming each
    holder Python can reach; returns those the step's own graph explains
    (see ``note_graph_holds_inputs``), which may be donated after all."""
    if not referred:
        return []
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
        facts = reads.facts(entry[0])
        functional = facts is not None and facts.is_functional
        why = _SAME_STEP.format(holder=holder) if functional else _WHY.format(names=holder)
        dropped.setdefault(why, []).append(entry)
    over = [(e, extra) for e, split, extra in referred if split == S.EXCESS]
    if over:
        tensors = [e[0] for e, _ in over]
        named = {} if xla.spmd() else _named_sharers(range(len(tensors)), tensors)
        own_graph = _graph_holds_inputs_at == C.current_step()
        for i, (entry, extra) in enumerate(over):
            names = named.get(i)
            if not names and own_graph and reads.holders([entry[0]])[0].xla_tensor_refs <= 1:
                kept.append(entry)  # the step's own graph holds it
                continue
            why = _WHY.format(names=names) if names else _CPP_HOLDERS.format(n=extra)
            dropped.setdefault(why, []).append(entry)
    unread = [e for e, split, _ in referred if split == S.UNREAD]
    if unread:
        dropped.setdefault(_UNREAD, []).extend(unread)
    for why, entries in dropped.items():
        ownership.drop(entries, why, notices)
    return kept


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
    with ownership.scanning():
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
    with ownership.scanning():
        for o in ownership.scan().tensors:
            if _is_live_xla(o):
                i = reads.tensor_id(o)
                if i in tensor_ids and i not in out:
                    out[i] = _name(o)
    return out


def live_sharers(tensors, donors) -> list:
    """For each of ``tensors``: the live tensors Python can reach that hold
    its device buffer, apart from its own views and aliases (ownership.py
    judges those) and the step's other ``donors`` (donated with it)."""
    skip = {id(t) for t in donors}
    by_key = {}
    for o in ownership.scan().tensors:
        if id(o) not in skip and _is_live_xla(o):
            key = reads.buffer_key(o)  # 0: no live buffer (pending, consumed, computing)
            if key:
                by_key.setdefault(key, []).append(o)
    out = []
    for t in tensors:
        storage = ownership.storage_of(t)
        out.append([o for o in by_key.get(reads.buffer_key(t) or -1, ())
                    if ownership.storage_of(o) != storage])
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
    name = ownership.scan().module_name(t)
    return f"the {name}" if name is not None else f"a tensor {shape_string(t)}"
