"""Donating whole pytrees: every tensor of a nest, a module or an optimizer.

A training step rarely updates one tensor: it replaces a dict of parameters,
a list of optimizer moments, a module's weights.  ``donate(tree)`` marks
every tensor leaf of such a nest for the next step, as ``donate_buffer``
would mark one::

    params = {"w": w, "b": b}
    momenta = [torch.zeros_like(w), torch.zeros_like(b)]
    torchxla.sync()
    ...
    tdx.donate((params, momenta))     # the old state is never read again
    params, momenta = update(params, momenta, grads)
    torchxla.sync()                  # the new state reuses the old buffers

What counts as a leaf follows ``torch.utils._pytree`` (lists, tuples,
namedtuples, dicts and any registered type), with two additions pytree does
not know about (walk.py has the rules every entry point shares):

* an ``nn.Module`` stands for its parameters and buffers.  They are donated
  *in place*: after the step the module's own tensors are poisoned, and
  calling the module raises ``DonatedBufferError``.  Donate a module only when
  its weights are being replaced by new tensors (e.g. with
  ``torch.func.functional_call`` and re-registered parameters).
* a ``torch.optim.Optimizer`` stands for the tensors of its ``state``.  They
  are named as in ``optimizer.state_dict()``: ``optimizer.state[3]['exp_avg']``
  is the state of the fourth parameter across ``param_groups``.  torch.optim
  keeps some counters (Adam's ``step``) as 0-dim tensors on the CPU by
  default (unless ``capturable=True``); those are no device buffers, so they
  are left out, and counted: ``summary()`` shows them as "skipped (on CPU)".
  The state on the device is donated.

Buffers of a module that a step only reads (a causal mask made with
``register_buffer``) cannot be taken by any output: they come back unused
with an ``UnusedDonationWarning`` naming them (``module.mask``).  Donate
``list(model.parameters())`` instead, or leave the buffers out.

Other non-tensor leaves (``None``, numbers, strings, objects) are skipped,
but a dataclass pytree cannot look into is refused: its fields would be
skipped unseen (register it with ``torch.utils._pytree.register_dataclass``).
The same tensor reached twice (tied weights, a tensor in two lists) is
donated once.

The call is all-or-nothing.  Every tensor is checked before any is marked,
and a tensor that cannot be donated (on the CPU, a view, not materialized,
already donated, ...) raises the error ``donate_buffer`` would raise, naming
the tensor's path in the tree (``params['layer1'][0]``, ``module.fc1.weight``)
and leaving every tensor of the call unmarked.

Messages about the donation (unused buffers, use after donation) point at the
line of user code that called ``donate`` (or a ``donating`` function), not at
this module.
"""
from typing import Any

import torch

from .._base import switches
from .._base.errors import DonatedBufferError
from .._base.lock import lock
from .._base.native import C, Via
from .._base.sites import user_site
from .._outcomes import ownership, poison, report, unused
from . import graph_ops
from .refusals import mark
from .walk import BUFFER, HOST_COUNTER, walk

__all__ = ["donate", "undonate", "donate_named", "tensors_in"]


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
        return graph_ops.donate_trees_in_graph([(_root_label(tree), tree)])
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
        with ownership.scanning():  # one look at the holders for the whole tree
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
    if not switches.on():
        return 0
    _noted(named_trees, leaves)
    return sum(1 for _, t, kind in leaves if kind != HOST_COUNTER and C.is_marked(t))


def _noted(named_trees, leaves) -> None:
    """What a call that marked tells the reports: its module buffers (an
    unused one is named by its path) and the host counters it left out."""
    if any(kind == BUFFER for _, _, kind in leaves):
        if leaves[0][0] is None:  # walked without paths: again, with them
            leaves = _tensor_leaves(named_trees, paths=True)
        unused.note_module_buffers([(p, t) for p, t, kind in leaves if kind == BUFFER])
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
