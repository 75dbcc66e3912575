"""Donating whole pytrees: ``donate(tree)``, ``undonate(tree)``, and the one
walk every entry point shares (``donate``, ``donating``, an optimizer, and
all of them while dynamo traces them), so they accept the same leaves and
name them the same way:

* a tensor is a leaf; lists, tuples, namedtuples, dicts, ``None`` and any
  type registered with ``torch.utils._pytree`` are looked into;
* an ``nn.Module`` stands for its parameters, then its buffers
  (``module.fc1.weight``);
* a ``torch.optim.Optimizer`` stands for its ``state`` tensors, named as in
  ``state_dict()`` (``optimizer.state[3]['exp_avg']``); its 0-dim tensors
  off the device (torch.optim's ``step`` counters) are host counters, left
  out and counted;
* numbers, strings and other objects inside a tree are skipped; a root
  pytree cannot look into, and a dataclass anywhere, are refused (their
  tensors would be skipped unseen).

A call is all or nothing: every tensor is checked before any is marked,
and a refusal names the tensor's path.  The walk never looks at a tensor's
identity (dynamo would guard on it); callers that want each tensor once
deduplicate themselves, outside a trace.

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

__all__ = ["donate", "undonate", "donate_named", "tensors_in", "donate_trees_in_graph", "walk",
           "check_root", "TENSOR", "PARAMETER", "BUFFER", "STATE", "HOST_COUNTER"]

def donate(tree: Any) -> int:
    """Donates every tensor leaf of ``tree`` to the outputs of the next step.

    Args:
      tree: a tensor, a pytree of tensors (lists, tuples, dicts, namedtuples,
        registered types), an ``nn.Module`` (its parameters and buffers) or a
        ``torch.optim.Optimizer`` (its state tensors), or any nest of these.
        Non-tensor leaves are skipped.  So are an optimizer's 0-dim tensors
        on the CPU (torch.optim keeps ``state["step"]`` there by default):
        the state on the device is donated, and ``summary()`` counts the
        counters left out as "skipped (on CPU)".  A module's buffers are
        donated with its parameters; one no output can take (a constant
        mask) comes back unused with a warning: donate
        ``list(model.parameters())`` to leave them out.

    Returns:
      The number of distinct tensors of ``tree`` now marked for the next step:
      0 when donation is switched off (``TORCH_XLA_DONATE_DISABLE``,
      ``XLA_ENABLE_PARAM_ALIASING=0``) or the tree holds no tensor.

    Raises (marking nothing):
      TypeError: ``tree`` itself is an object pytree cannot look into, or
        holds an unregistered dataclass, so its tensors could not be donated.
      ValueError, DonatedBufferError: a tensor of the tree cannot be donated;
        the message names its path, e.g. ``tree['layer1'][0]``.
    """
    if torch.compiler.is_compiling():  # dynamo traces this: graph ops, no break
        return donate_trees_in_graph([(_root_label(tree), tree)])
    return donate_named([(_root_label(tree), tree)], user_site(), Via.DONATE)


def undonate(tree: Any) -> bool | int:
    """Cancels marks made before the step.

    Args:
      tree: what ``donate`` takes: a tensor, or a pytree, ``nn.Module`` or
        optimizer.

    Returns:
      For a tensor, whether it was marked; for a tree, how many of its
      tensors were.

    Raises:
      DonatedBufferError: a step already consumed the buffer of a tensor
        passed directly: too late to cancel.
      TypeError: ``tree`` is an object pytree cannot look into.
    """
    if isinstance(tree, torch.Tensor):
        poison.refuse_consumed([tree])
        with lock:  # never in the middle of a commit
            return C.unmark(tree) is not None
    # What donate refuses, undonate does too.
    tensors = tensors_in([(_root_label(tree), tree)], call="undonate")
    with lock:
        return sum(C.unmark(t) is not None for t in tensors)


def donate_named(named_trees, where, via) -> int:
    """Donates several trees at once, all or nothing.

    ``named_trees`` is a list of ``(label, tree)``; ``label`` starts every path
    in messages (``donating`` passes argument names, so an error reads
    ``params['w']``).  ``where`` is the (file, line) blamed for the marks,
    ``via`` the call messages name (``Via``).

    The common case is one native call for every tensor
    (``C.try_mark_all``); a refusal is found again path by path, so that
    its error names the leaf.
    """
    leaves = _tensor_leaves(named_trees, paths=False)
    tensors = [t for _, t, kind in leaves if kind != HOST_COUNTER]
    refusal, count = C.try_mark_all(tensors, via, where)
    if refusal:
        return _donate_by_path(named_trees, where, via)
    _noted(named_trees, leaves)
    return count


def _donate_by_path(named_trees, where, via) -> int:
    """``donate_named`` path by path: every error names its leaf, and undoes
    this call's marks."""
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
                    raise type(error)(f"donate: cannot donate {path}, so no tensor of this "
                                      f"call was marked. {error}") from None
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
    """What a call that marked tells the reports: its module buffers (an
    unused one is named by its path) and the host counters it left out."""
    if any(kind == BUFFER for _, _, kind in leaves):
        if leaves[0][0] is None:  # walked without paths: again, with them
            leaves = _tensor_leaves(named_trees, paths=True)
        verdicts.note_module_buffers([(p, t) for p, t, kind in leaves if kind == BUFFER])
    report.note_skipped_on_cpu(sum(1 for *_, kind in leaves if kind == HOST_COUNTER))


def tensors_in(named_trees, refuse=True, call="donate") -> list:
    """Every distinct tensor of the ``(label, tree)`` pairs, as ``donate``
    would see them (module parameters and buffers, optimizer state), without
    building paths; ``refuse``: raise what the walk refuses (walk.py), worded
    for ``call``.

    >>> t = torch.ones(1)
    >>> tensors_in([("a", [t, t, 3])]) == [t]
    True
    """
    seen, out = set(), []
    for label, tree in named_trees:
        for _, t, _ in walk(label, tree, paths=False, refuse=refuse, call=call):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _tensor_leaves(named_trees, paths):
    """Every distinct tensor of the trees as ``(path, tensor, kind)``, the
    first path winning (None without ``paths``)."""
    seen, leaves = set(), []
    for label, tree in named_trees:
        for path, tensor, kind in walk(label, tree, paths=paths):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                leaves.append((path, tensor, kind))
    return leaves


def _root_label(tree) -> str:
    if isinstance(tree, torch.nn.Module):
        return "module"
    if isinstance(tree, torch.optim.Optimizer):
        return "optimizer"
    return "tree"


def donate_trees_in_graph(named_trees) -> int:
    """``donate`` of the ``(label, tree)`` pairs while dynamo traces it: one
    graph op per tensor the walk yields (walk.py: the same leaves, paths and
    refusals as eager), but for 0-dim tensors, never donated (messages.SCALARS;
    an optimizer's host counters are not even judged).  All or nothing:
    every tensor is judged before any op is emitted, and a refusal names
    the tensor's path as eager does.  Returns the number of tensors given an
    op (a tensor reached twice counts twice here)."""
    named = [(path, t) for label, tree in named_trees
             for path, t, kind in walk(label, tree) if kind != HOST_COUNTER]
    for path, t in named:
        refuse_unless_input(t, path)
    tensors = [t for _, t in named if t.dim() > 0]
    for t in tensors:
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)
    return len(tensors)


# -- The walk ------------------------------------------------------------------------

# The kinds of tensor ``walk`` yields.
TENSOR = "tensor"  # a leaf of the tree itself
PARAMETER = "parameter"  # of a module
BUFFER = "buffer"  # of a module: a step that only reads it cannot take it
STATE = "state"  # an optimizer's state on the device
HOST_COUNTER = "host counter"  # an optimizer's 0-dim state off the device

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def walk(label, tree, paths=True, refuse=True, call="donate") -> list:
    """``(path, tensor, kind)`` for every tensor of ``tree``, in order, a
    tensor reached twice listed twice.  ``label`` starts each path;
    ``paths=False`` gives None for paths (cheaper: no key paths built).
    With ``refuse``, raises the TypeError of the rules above, worded for
    ``call``."""
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
    """``walk``'s body, appending to ``out``; ``refuse`` is the call's name,
    or None."""
    if paths:
        items = [(label + pytree.keystr(k), leaf)
                 for k, leaf in pytree.tree_flatten_with_path(tree)[0]]
    else:
        items = [(None, leaf) for leaf in pytree.tree_leaves(tree)]
    if root and refuse and len(items) == 1 and items[0][1] is tree:
        check_root(label, tree, refuse)  # a leaf itself: one pytree can look into?
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
        elif refuse and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            if path is None:
                raise _NeedsPath()
            raise _opaque(path, leaf, refuse)


def _join(path, tail):
    return None if path is None else path + tail


def check_root(label, tree, call="donate") -> None:
    """Refuses a root that pytree sees as an opaque leaf.

    Nested opaque objects are skipped like numbers (dataclasses excepted, see
    the module docstring), but a root the caller explicitly asked to donate
    (a custom state object) that pytree cannot look into would silently
    donate nothing.
    """
    if isinstance(tree, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer) + _SCALARS):
        return
    if pytree.tree_structure(tree).is_leaf():
        raise _opaque(label, tree, call)


def _opaque(path, obj, call) -> TypeError:
    return TypeError(
        f"{call}: {path} is a {type(obj).__qualname__}, which torch.utils._pytree "
        f"cannot look into, so none of its tensors would be {call}d. Pass its "
        "tensors in a list, tuple or dict, or register the type with "
        "torch.utils._pytree.register_pytree_node (register_dataclass for a "
        "dataclass)."
    )
