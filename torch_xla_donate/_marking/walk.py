"""The one walk over what the donating calls take.

``donate(tree)``, ``undonate(tree)``, ``donating`` (each selected argument,
named by selection.py), ``donate(optimizer)`` and all of them while dynamo
traces them (graph_ops.py) see a tree through ``walk``, so they accept the
same leaves and name them the same way:

* a tensor is a leaf; lists, tuples, namedtuples, dicts, ``None`` and any
  type registered with ``torch.utils._pytree`` are looked into;
* an ``nn.Module`` stands for its parameters, then its buffers
  (``module.fc1.weight``);
* a ``torch.optim.Optimizer`` stands for the tensors of its ``state``, named
  by the parameter's index across ``param_groups`` as in
  ``state_dict()`` (``optimizer.state[3]['exp_avg']``); its 0-dim tensors
  off the device (torch.optim's ``step`` counters) are host counters, never
  donated;
* numbers, strings, ``None`` and other objects inside a tree are skipped;
* refused with a ``TypeError`` naming the path and the fix: a root that
  pytree cannot look into (``donate(my_state_object)`` would donate
  nothing), and a dataclass anywhere (it has fields, likely tensors, that
  pytree does not see unless the type is registered).

What is done with a tensor (refused on the CPU, as a view, ...) is the
caller's business: checks.py in eager, graph_ops.py while dynamo traces.

The tricky case: the walk never looks at a tensor's identity (no ``id``,
no dict keyed by tensors it builds), because dynamo guards on what the
traced code reads and would compile a new graph for every new tensor.
Callers that want each tensor once deduplicate themselves, outside a trace.

>>> [(p, k) for p, _, k in walk("params", {"w": [torch.ones(1), 3, None]})]
[("params['w'][0]", 'tensor')]
"""
import dataclasses

import torch
import torch.utils._pytree as pytree

__all__ = ["walk", "check_root", "TENSOR", "PARAMETER", "BUFFER", "STATE", "HOST_COUNTER"]

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
