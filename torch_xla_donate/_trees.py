"""Donating whole pytrees (``donate``, ``undonate``) and the one walk every entry point shares
(``donate``, ``donating``, an optimizer, and each of them while dynamo traces it), so that they take
the same leaves, refuse the same objects and name a tensor by the same path.

>>> [(p, k) for p, _, k in walk("params", {"w": [torch.ones(1), 3, None]})]
[("params['w'][0]", 'tensor')]
"""

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import _config as config
from . import _holders as holders
from . import _poison as poison
from . import _verdicts as verdicts
from . import report
from ._marking import mark, refuse_unless_input
from ._messages import user_site
from ._native import C, Via, lock
from .errors import DonatedBufferError

__all__ = ["donate", "undonate", "donate_named", "tensors_in", "donate_trees_in_graph", "walk"]


def donate(tree: Any) -> int:
    """Donates every tensor leaf of ``tree`` to the outputs of the next step.

    Args:
      tree: a tensor, a pytree of tensors (lists, tuples, dicts, namedtuples, registered types), an
        ``nn.Module`` (its parameters, then its buffers) or a ``torch.optim.Optimizer`` (its state
        tensors, named as in ``state_dict()``), or any nest of these.  Non-tensor leaves are skipped,
        and so are an optimizer's 0-dim tensors on the CPU (torch.optim's ``state["step"]``):
        ``summary()`` counts them as "skipped (on CPU)".  A module buffer no output can take (a
        constant mask) comes back unused with a warning: donate ``list(model.parameters())``.

    Returns:
      The number of distinct tensors of ``tree`` now marked for the next step: 0 when donation is
      switched off (``TORCH_XLA_DONATE_DISABLE``, ``XLA_ENABLE_PARAM_ALIASING=0``) or the tree holds
      no tensor.

    Raises (marking nothing):
      TypeError: ``tree`` itself is an object pytree cannot look into, or holds an unregistered
        dataclass, so its tensors could not be donated.
      ValueError, DonatedBufferError: a tensor of the tree cannot be donated; the message names its
        path, e.g. ``tree['layer1'][0]``.
    """
    if torch.compiler.is_compiling():  # dynamo traces this: graph ops, no break
        return donate_trees_in_graph([(_root_label(tree), tree)])
    return donate_named([(_root_label(tree), tree)], user_site(), Via.DONATE)


def undonate(tree: Any) -> bool | int:
    """Cancels marks made before the step on ``tree`` (what ``donate`` takes).

    Returns: for a tensor, whether it was marked; for a tree, how many of its tensors were.

    Raises:
      DonatedBufferError: a step already consumed the buffer of a tensor passed directly: too late.
      TypeError: ``tree`` is an object pytree cannot look into.
    """
    if isinstance(tree, torch.Tensor):
        poison.refuse_consumed([tree])
        with lock:  # never in the middle of a commit
            return C.unmark(tree) is not None
    tensors = tensors_in([(_root_label(tree), tree)], call="undonate")  # refuses what donate refuses
    with lock:
        return sum(C.unmark(t) is not None for t in tensors)


def donate_named(named_trees, where, via) -> int:
    """Donates the ``(label, tree)`` pairs, all or nothing, blaming ``where`` (file, line); each label
    starts its tree's paths.  One native call marks them all, unless a tensor is refused."""
    leaves = _tensor_leaves(named_trees, paths=False)
    tensors = [t for _, t, kind in leaves if kind != HOST_COUNTER]
    refusal, count = C.try_mark_all(tensors, via, where)
    if refusal:
        return _donate_by_path(named_trees, where, via)
    _noted(named_trees, leaves)
    return count


def _donate_by_path(named_trees, where, via) -> int:
    """``donate_named`` tensor by tensor, so that an error names its path; undoes this call's marks."""
    leaves = _tensor_leaves(named_trees, paths=True)
    newly_marked = []
    try:
        with holders.scanning():  # one look at the holders for the whole tree
            for path, tensor, kind in leaves:
                if kind == HOST_COUNTER:
                    continue
                already = C.is_marked(tensor)
                try:
                    marked = mark(tensor, where, via, in_tree=True)
                except (TypeError, ValueError, DonatedBufferError) as error:
                    message = f"donate: cannot donate {path}, so no tensor of this call was marked. {error}"
                    raise type(error)(message) from None
                if marked and not already:
                    newly_marked.append(tensor)
    except BaseException:
        with lock:
            for tensor in newly_marked:
                C.unmark(tensor)
        raise
    if not config.on():
        return 0
    _noted(named_trees, leaves)
    return sum(1 for _, t, kind in leaves if kind != HOST_COUNTER and C.is_marked(t))


def _noted(named_trees, leaves) -> None:
    """Tells the reports a call's module buffers (an unused one is named by its path) and host counters."""
    if any(kind == BUFFER for _, _, kind in leaves):
        if leaves[0][0] is None:  # walked without paths: again, with them
            leaves = _tensor_leaves(named_trees, paths=True)
        verdicts.note_module_buffers([(p, t) for p, t, kind in leaves if kind == BUFFER])
    report.note_skipped_on_cpu(sum(1 for *_, kind in leaves if kind == HOST_COUNTER))


def tensors_in(named_trees, refuse=True, call="donate") -> list:
    """Every distinct tensor of the ``(label, tree)`` pairs; raises, ``refuse``, what the walk refuses."""
    return [t for _, t, _ in _tensor_leaves(named_trees, False, refuse, call)]


def _tensor_leaves(named_trees, paths, refuse=True, call="donate") -> list:
    """``walk`` over the trees, each tensor once (at its first path)."""
    seen, leaves = set(), []
    for label, tree in named_trees:
        for path, tensor, kind in walk(label, tree, paths, refuse, call):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                leaves.append((path, tensor, kind))
    return leaves


def _root_label(tree) -> str:
    if isinstance(tree, torch.nn.Module):
        return "module"
    return "optimizer" if isinstance(tree, torch.optim.Optimizer) else "tree"


def donate_trees_in_graph(named_trees) -> int:
    """``donate`` while dynamo traces: every tensor is judged as eager does, then a graph op is given
    to each but 0-dim ones (never donated); returns the ops' count (a tensor reached twice: twice)."""
    leaves = [leaf for label, tree in named_trees for leaf in walk(label, tree)]
    named = [(path, t) for path, t, kind in leaves if kind != HOST_COUNTER]
    for path, t in named:
        refuse_unless_input(t, path)
    tensors = [t for _, t in named if t.dim() > 0]
    for t in tensors:
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)
    return len(tensors)


# -- The walk, and the kinds of tensor it yields ------------------------------------
TENSOR = "tensor"  # a leaf of the tree itself
PARAMETER = "parameter"  # of a module
BUFFER = "buffer"  # of a module: a step that only reads it cannot take it
STATE = "state"  # an optimizer's state on the device
HOST_COUNTER = "host counter"  # an optimizer's 0-dim state off the device (torch.optim's step)

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def walk(label, tree, paths=True, refuse=True, call="donate") -> list:
    """``(path, tensor, kind)`` of every tensor of ``tree`` in order, never deduplicated (dynamo would
    guard on identities); ``paths=False`` builds no path (None).  With ``refuse``, a root pytree
    cannot look into and a dataclass anywhere (their tensors would go unseen) raise a TypeError."""
    out = []
    try:
        _walk(label, tree, paths, call if refuse else None, False, out, root=True)
    except _NeedsPath:  # the cheap walk met a refusal: walk again to name it
        _walk(label, tree, True, call, False, [], root=True)
        raise
    return out


class _NeedsPath(Exception):
    """The cheap walk (no paths) met a leaf to refuse."""


def _walk(label, tree, paths, refuse, in_state, out, root=False) -> None:
    """``walk``'s body, appending to ``out``; ``refuse`` is the call's name, or None."""
    if paths:
        items = [(label + pytree.keystr(k), leaf) for k, leaf in pytree.tree_flatten_with_path(tree)[0]]
    else:
        items = [(None, leaf) for leaf in pytree.tree_leaves(tree)]
    for path, leaf in items:
        if isinstance(leaf, torch.Tensor):
            if not in_state:
                out.append((path, leaf, TENSOR))
            elif leaf.dim() == 0 and leaf.device.type != "xla":
                out.append((path, leaf, HOST_COUNTER))
            else:
                out.append((path, leaf, STATE))
        elif isinstance(leaf, torch.nn.Module):
            out += [(_join(path, f".{name}"), t, PARAMETER) for name, t in leaf.named_parameters()]
            out += [(_join(path, f".{name}"), t, BUFFER) for name, t in leaf.named_buffers()]
        elif isinstance(leaf, torch.optim.Optimizer):
            params = [p for group in leaf.param_groups for p in group["params"]]
            for i, p in enumerate(params):
                if p in leaf.state:
                    _walk(_join(path, f".state[{i}]"), leaf.state[p], paths, refuse, True, out)
        elif refuse and (
            (root and leaf is tree and not isinstance(leaf, _SCALARS))  # the root is an opaque leaf
            or (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type))
        ):
            if path is None:
                raise _NeedsPath()
            raise TypeError(
                f"{refuse}: {path} is a {type(leaf).__qualname__}, which torch.utils._pytree cannot look "
                f"into, so none of its tensors would be {refuse}d. Pass its tensors in a list, tuple or "
                "dict, or register the type with torch.utils._pytree.register_pytree_node "
                "(register_dataclass for a dataclass)."
            )


def _join(path, tail):
    return None if path is None else path + tail
