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
import warnings
from typing import Any

import torch

from .._base import config, xla
from .._base.errors import DonatedBufferError
from .._base.lock import lock
from .._base.native import C, Via
from .._base.sites import user_site, user_stacklevel
from .._outcomes import ownership, poison, report, unused
from . import graph_ops
from .checks import check_donatable
from .marks import mark
from .walk import BUFFER, HOST_COUNTER, TENSOR, walk

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
    """
    marked = _donate_plain(named_trees, where, via)
    if marked >= 0:
        return marked
    with ownership.scanning():  # one look at the holders for the whole tree
        return _donate_checked(named_trees, where, via)


def _donate_checked(named_trees, where, via) -> int:
    """``donate_named`` path by path: every error names its leaf."""
    leaves, buffers, host_counters = _tensor_leaves(named_trees)
    for path, tensor in leaves:
        _checked(path, check_donatable, tensor)
    if leaves and not (config.enabled() and xla.aliasing_enabled()):
        _mark_while_switched_off(leaves, where, via)
        return 0
    # Checked: now mark.  A failure here is unexpected (torch_xla refusing a
    # tensor that passed every check); undo this call's marks so that the
    # promise "nothing marked" holds anyway.
    newly_marked = []
    try:
        for path, tensor in leaves:
            already = C.is_marked(tensor)
            _checked(path, mark, tensor, where, via)
            if not already and C.is_marked(tensor):
                newly_marked.append(tensor)
    except BaseException:
        for tensor in newly_marked:
            undonate(tensor)
        raise
    # Only now that the call marked: a refused call leaves nothing behind.
    unused.note_module_buffers(buffers)
    report.note_skipped_on_cpu(host_counters)
    return sum(1 for _, tensor in leaves if C.is_marked(tensor))


def _donate_plain(named_trees, where, via) -> int:
    """The common case of ``donate_named`` in one native call; -1 if unusual.

    Why: with thousands of tensors per step, building a path string and
    running the checks one Python call at a time per leaf cost more than the
    donation.  When every leaf is a plain tensor that can be donated (or is
    marked already, or is a scalar, skipped as ever), ``C.try_mark_all``
    marks them all at once.  Anything else (a module, an optimizer, a tensor
    that must be refused, the switches off) returns -1 having marked nothing,
    and the path-by-path route gives the precise, path-named error.
    """
    if not (config.enabled() and xla.aliasing_enabled()):
        return -1
    tensors = {}
    for label, tree in named_trees:
        for _, leaf, kind in walk(label, tree, paths=False):
            if kind != TENSOR:
                return -1
            tensors[id(leaf)] = leaf
    with lock:  # never in the middle of a commit; see marks.mark_checked
        return C.try_mark_all(list(tensors.values()), where, via)


def _mark_while_switched_off(leaves, where, via) -> None:
    """Lets ``mark`` give its once-per-reason ``DonationDisabledWarning``, and
    re-issues it at the user's line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path, tensor in leaves:
            _checked(path, mark, tensor, where, via)
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=user_stacklevel())


def _checked(path, check, *args):
    """Runs ``check``; re-raises its error with the tensor's path in front."""
    try:
        check(*args)
    except (TypeError, ValueError, DonatedBufferError) as error:
        raise type(error)(
            f"donate: cannot donate {path}, so no tensor of this call was marked. "
            f"{error}"
        ) from None


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


def _tensor_leaves(named_trees):
    """Every distinct tensor of the trees as ``(path, tensor)``, first path
    wins; with the ``(path, tensor)`` of those that are module buffers, and
    how many host-side optimizer counters were left out."""
    seen, leaves, buffers, host_counters = set(), [], [], 0
    for label, tree in named_trees:
        for path, tensor, kind in walk(label, tree):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if kind == HOST_COUNTER:
                host_counters += 1
                continue
            leaves.append((path, tensor))
            if kind == BUFFER:
                buffers.append((path, tensor))
    return leaves, buffers, host_counters


def _root_label(tree) -> str:
    if isinstance(tree, torch.nn.Module):
        return "module"
    if isinstance(tree, torch.optim.Optimizer):
        return "optimizer"
    return "tree"
