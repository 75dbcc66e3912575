"""What marking becomes while dynamo traces it: graph ops.

Under ``torch.compile(backend="openxla")``, ``donate_buffer``, ``donate`` and
``donating`` emit ``torch.ops.xla.dynamo_set_buffer_donor_(t, True)`` (torch_xla's
own way to donate from a compiled graph) instead of calling into the plugin,
so they cause no graph break; the compiled graph then donates those inputs
on every call, and _hooks/dynamo.py marks, poisons and reports them.

The tricky case: nothing here may look at a tensor's identity.  Dynamo
guards on what the traced code reads, and ``id(leaf)`` (a dict keyed by it,
to skip tied weights) made it guard on each argument's object id: every
call with new tensors, that is every training step, compiled a new graph.
Marking a tensor twice is harmless (the op sets a flag), so leaves are not
deduplicated.
"""
import torch
import torch.utils._pytree as pytree

__all__ = ["donate_in_graph", "donate_trees_in_graph"]


def donate_in_graph(tensors) -> None:
    """One ``dynamo_set_buffer_donor_`` node per tensor, no call into the plugin."""
    for t in tensors:
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)


def donate_trees_in_graph(trees) -> int:
    """``donate`` of ``trees`` while dynamo traces it: one graph op per tensor
    leaf (a module stands for its parameters and buffers; 0-dim leaves are
    skipped).  Returns the number of leaves (a tensor reached twice counts
    twice here)."""
    tensors = []
    for tree in trees:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.nn.Module):
                tensors += list(leaf.parameters()) + list(leaf.buffers())
            elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                tensors.append(leaf)
    donate_in_graph(tensors)
    return len(tensors)
