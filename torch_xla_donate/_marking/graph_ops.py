"""What marking becomes while dynamo traces it: graph ops.

Under ``torch.compile(backend="openxla")``, ``donate_buffer``, ``donate`` and
``donating`` emit ``torch.ops.xla.dynamo_set_buffer_donor_(t, True)`` (torch_xla's
own way to donate from a compiled graph) instead of calling into the plugin,
so they cause no graph break; the compiled graph then donates those inputs
on every call, and _hooks/dynamo.py marks, poisons and reports them.

What eager refuses is refused here too, while dynamo traces, with eager's
message: a view (``x[0]``), an intermediate (``x + 1``: eager calls it
pending computation; in a graph it has no buffer before the call either) and,
for ``donate_buffer``, a 0-dim tensor.  torch_xla's graph op would take such
a tensor and donate nothing.  Only the graph's inputs can be donated.  The
error is a ``ValueError`` that dynamo lets through (it is also dynamo's
``TorchRuntimeError``, what an op failing on fake tensors raises), with or
without ``fullgraph``; nothing is compiled and nothing is marked.

The tricky case: nothing here may look at a tensor's identity.  Dynamo
guards on what the traced code reads, and ``id(leaf)`` (a dict keyed by it,
to skip tied weights) made it guard on each argument's object id: every
call with new tensors, that is every training step, compiled a new graph.
Marking a tensor twice is harmless (the op sets a flag), so leaves are not
deduplicated.  The refusals are judged by ``comptime`` on what dynamo knows
of the tensor (its FX node, its fake value), which adds no guard.

The other tricky case: a donor op whose result nothing reads (``donate(x)``
of an ``x`` the graph does not use, ``donate(opt)`` before torch.optim's
graph break) was dead code to the compiler, removed with its donation, so
nothing was donated and nothing said.  The op is registered here as a side
effect, so every graph keeps it; _hooks/dynamo.py then leaves such a mark
for the next execution that takes the tensor, as eager ``donate`` does.
"""
import torch
from torch._dynamo.comptime import comptime
from torch._dynamo.exc import TorchRuntimeError

from .._base.native import C
from . import refusals
from .walk import HOST_COUNTER, walk

R = C.Refusal

__all__ = ["donate_in_graph", "donate_trees_in_graph", "RefusedWhileTracing", "is_donor_op"]

_DONOR_OP = torch.ops.xla.dynamo_set_buffer_donor_
# Kept by dead-code elimination (dynamo's, AOT autograd's) although its
# result may go unread: the donation is its effect.
torch.fx.node.has_side_effect(_DONOR_OP)
torch.fx.node.has_side_effect(_DONOR_OP.default)


def is_donor_op(node) -> bool:
    """Whether the FX ``node`` calls ``dynamo_set_buffer_donor_``."""
    return node.op == "call_function" and node.target in (_DONOR_OP, _DONOR_OP.default)


class RefusedWhileTracing(TorchRuntimeError, ValueError):
    """A tensor a compiled function donates cannot be donated: eager's
    ``ValueError``, raised while dynamo traces (a ``TorchRuntimeError`` so
    that dynamo passes it on unchanged)."""


def donate_in_graph(tensors) -> None:
    """``donate_buffer`` of each of ``tensors`` while dynamo traces it: one
    ``dynamo_set_buffer_donor_`` node per tensor, no call into the plugin; a
    tensor that is no input of the graph is refused first."""
    for t in tensors:
        _refuse_unless_input(t, None)
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)


def donate_trees_in_graph(named_trees) -> int:
    """``donate`` of the ``(label, tree)`` pairs while dynamo traces it: one
    graph op per tensor the walk yields (walk.py: the same leaves, paths and
    refusals as eager), but for 0-dim tensors, never donated (refusals.SCALARS;
    an optimizer's host counters are not even judged).  All or nothing:
    every tensor is judged before any op is emitted, and a refusal names
    the tensor's path as eager does.  Returns the number of tensors given an
    op (a tensor reached twice counts twice here)."""
    named = [(path, t) for label, tree in named_trees
             for path, t, kind in walk(label, tree) if kind != HOST_COUNTER]
    for path, t in named:
        _refuse_unless_input(t, path)
    tensors = [t for _, t in named if t.dim() > 0]
    for t in tensors:
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)
    return len(tensors)


def _refuse_unless_input(t, path) -> None:
    """Eager's error for ``t`` (``path``: its name in a tree, None for
    ``donate_buffer``) unless it is an input of the graph and no view."""
    comptime(_judge)  # runs while dynamo traces; nothing at run time


def _judge(ctx) -> None:
    """At trace time: judges the locals ``t`` and ``path`` of
    ``_refuse_unless_input``."""
    var = ctx.get_local("t")
    if not var.is_proxy():
        return  # not a tensor: the graph op itself says so
    fake = var.as_fake()
    if not isinstance(fake, torch.Tensor):
        return
    path = ctx.get_local("path").as_python_constant()
    # The rules of metadata, native (csrc/marking/marking.cpp ClassifyMeta),
    # on the fake tensor; a tree skips scalars.
    refusal = R(C.classify_meta(fake))
    if refusal == R.ZERO_DIM and path is not None:
        refusal = R.NONE
    if refusal == R.NONE and var.as_proxy().node.op not in ("placeholder", "get_attr"):
        refusal = R.PENDING  # eager calls an intermediate pending; here it has no buffer either
    if refusal == R.NONE:
        return
    message = refusals.message(fake, refusal)
    if path is not None:  # as trees.py says it
        message = f"donate: cannot donate {path}, so no tensor of this call was marked. {message}"
    raise RefusedWhileTracing(message)
