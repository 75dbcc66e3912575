"""Marking one tensor: ``donate_buffer`` (one native call when it marks), the refusals only Python can
word or resolve, ``is_donated``, ``is_deleted``, and the graph op marking becomes while dynamo traces
it (docs/design.md, "The step's life" and "Where each rule lives")."""

import torch
from torch._dynamo.comptime import comptime
from torch._dynamo.exc import TorchRuntimeError

from . import _config as config
from . import _guards as guards
from . import _holders as holders
from . import _messages as messages
from . import _poison as poison
from . import _xla_cpu as xla_cpu
from ._native import C, Via, lock

__all__ = ["donate_buffer", "is_donated", "is_deleted", "refused", "mark", "refuse_unless_input",
           "is_donor_op"]  # fmt: skip

R = C.Refusal

donate_buffer = C.donate_buffer  # one native call when it marks


def refused(tensor, refusal, file, line) -> None:
    """``C.donate_buffer``'s refusal (its one way into Python): worded, or resolved and marked."""
    check_tensor("donate_buffer", tensor)
    mark(tensor, (file, line))


# What dynamo traces for donate_buffer and its mark: a graph op, no graph break.
@torch.compiler.substitute_in_graph(C.donate_buffer, skip_signature_check=True)
def _donate_buffer_in_graph(tensor) -> None:
    donate_in_graph([tensor])


@torch.compiler.substitute_in_graph(C.try_mark, skip_signature_check=True)
def _try_mark_in_graph(tensor, via=Via.DONATE_BUFFER, where=1, held_ok=False, locked=False) -> int:
    donate_in_graph([tensor])
    return 0


def is_donated(tensor: torch.Tensor) -> bool:
    """True while ``tensor`` is marked and waiting for the next execution that commits marks.

    The tricky case: a mark is the plugin's until an execution commits it, so torch_xla's own donor
    flag (``_get_buffer_donation``) stays False while this says True.

    >>> import torch, torch_xla, torch_xla_donate
    >>> t = torch.ones(4, device=torch_xla.device()) * 2
    >>> torch_xla.sync(); donate_buffer(t); is_donated(t), torch_xla._XLAC._get_buffer_donation(t)
    (True, False)
    >>> torch_xla_donate.undonate(t), is_donated(t)
    (True, False)

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
    """
    check_tensor("is_donated", tensor, None)
    return C.is_marked(tensor)


def is_deleted(tensor: torch.Tensor) -> bool:
    """True if a step's output took ``tensor``'s buffer through donation (then any use of ``tensor``
    raises ``DonatedBufferError``).

    May wait for the device: right after ``sync(wait=False)`` whether XLA took the buffer is not known
    until the step has been dispatched.  A donation no output could take leaves the tensor as it was
    (``b``):

    >>> import torch, torch_xla, torch_xla_donate, warnings
    >>> a, b = torch.ones(4, device=torch_xla.device()) * 2, torch.ones(3, device=torch_xla.device()) * 2
    >>> torch_xla.sync(); donate_buffer(a); donate_buffer(b)
    >>> new_a, new_b = a + 1, b.sum().reshape(1)  # no output of b's 12 bytes
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # b's UnusedDonationWarning
    ...     torch_xla.sync(); torch_xla_donate.settle()
    >>> is_deleted(a), is_deleted(b), b.cpu().tolist()
    (True, False, [2.0, 2.0, 2.0])

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
    """
    check_tensor("is_deleted", tensor, None)
    return poison.is_poisoned(tensor) and poison.settled_consumed(tensor)


def mark(tensor, where, via=Via.DONATE_BUFFER, in_tree=False) -> bool:
    """Marks ``tensor`` blaming ``where`` (file, line), or raises its refusal's error.  False, nothing
    marked, when donation is off (warned once) or, ``in_tree``, for a scalar."""
    marked = _mark(tensor, where, via, in_tree, locked=False)
    if marked is None:  # a commit on another thread must see the mark whole or not at all
        with lock:
            marked = _mark(tensor, where, via, in_tree, locked=True)
    return marked


def _mark(tensor, where, via, in_tree, locked) -> bool | None:
    """``mark``'s loop; None when another thread is inside a commit."""
    held_ok, settled, synced, done = False, False, False, set()
    while True:
        refusal = R(C.try_mark(tensor, via, where, held_ok, locked))
        if refusal == R.NONE:
            return True
        if refusal == R.OFF:
            config.warn_if_off()
            return False
        if refusal == R.ZERO_DIM and in_tree:
            return False
        if refusal == R.COMMITTING:
            return None
        if refusal in (R.UNDECIDED, R.PENDING) and not synced and torch._is_functional_tensor(tensor):
            # A functional wrapper with view updates not applied yet (also one _make_subclass made)
            # reads as no plain device data: applied, as any torch_xla call on it would.
            torch._sync(tensor)
            synced = True
            continue
        if refusal == R.HELD and not settled:
            # A holder may be autograd's worker thread still releasing a finished backward: waited
            # for first, so that the outcome never depends on timing.
            holders.settle_autograd(tensor.device)
            settled = True
            continue
        if refusal in done:  # Python did its part and the rule still refuses
            raise RuntimeError(
                f"torch_xla_donate: marking refused {messages.describe(tensor)} twice ({refusal.name}). "
                "Please report this."
            )
        done.add(refusal)
        held_ok = _resolve(tensor, refusal) or held_ok


def _resolve(tensor, refusal) -> bool:
    """Does Python's part for ``refusal`` or raises its error; True when the aliases may go with it."""
    if refusal == R.POISONED:
        poison.refuse_consumed([tensor])  # settles it: consumed raises, unused lifts the poison
    elif refusal == R.NEW_CLASS:
        poison.check_poisonable(tensor)  # makes and registers the twin, or raises
    elif refusal == R.UNDECIDED and guards.decide(tensor):
        config.refresh()
    elif refusal == R.WARN_FIRST:
        xla_cpu.warn_if_unprotected()
        config.refresh()
    elif refusal == R.HELD:
        # Who holds its storage or TensorImpl, and may the donation take them down with it (the
        # commit's judgement, _holders.py)?
        with holders.scanning():
            blockers = holders.judge(tensor).blockers
        if blockers:
            why = "; ".join(blockers)
            raise ValueError(messages.HELD.format(tensor=messages.describe(tensor), why=why))
        return True
    else:  # and UNDECIDED when the guards failed
        if refusal == R.UNDECIDED and guards.holds_no_device_data(tensor):
            refusal = R.PENDING  # an upload under SPMD, not synced yet: "sync first"
        error = TypeError if refusal in (R.NOT_TENSOR, R.WRAPPER) else ValueError
        raise error(messages.refusal(tensor, refusal))
    return False


def check_tensor(name, tensor, tree_form="donate(tree)") -> None:
    """TypeError unless ``tensor`` is a tensor; a container is pointed at ``tree_form`` (None: no hint)."""
    if isinstance(tensor, torch.Tensor):
        return
    hint = ""
    items = tensor.values() if isinstance(tensor, dict) else tensor
    if tree_form is not None and (
        isinstance(tensor, (torch.nn.Module, torch.optim.Optimizer))
        or isinstance(tensor, (list, tuple, dict))
        and any(isinstance(x, (torch.Tensor, list, tuple, dict)) for x in items)
    ):
        hint = (
            " For the tensors of a list, dict, module, optimizer or any pytree, use "
            f"torch_xla_donate.{tree_form}."
        )
    raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}.{hint}")


# -- While dynamo traces ----------------------------------------------------------------
_DONOR_OP = torch.ops.xla.dynamo_set_buffer_donor_
# Kept by dead-code elimination (dynamo's, AOT autograd's) although its
# result may go unread: the donation is its effect.
torch.fx.node.has_side_effect(_DONOR_OP)
torch.fx.node.has_side_effect(_DONOR_OP.default)


def is_donor_op(node) -> bool:
    return node.op == "call_function" and node.target in (_DONOR_OP, _DONOR_OP.default)


class RefusedWhileTracing(TorchRuntimeError, ValueError):
    """Eager's ``ValueError``, raised while dynamo traces (a ``TorchRuntimeError``: passed on unchanged)."""


def donate_in_graph(tensors) -> None:
    """``donate_buffer`` while dynamo traces: one graph op per tensor, each an input of the graph."""
    for t in tensors:
        refuse_unless_input(t, None)
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)


def refuse_unless_input(t, path) -> None:
    """Eager's error for ``t`` (``path``: its name in a tree) unless it is an input of the graph."""
    comptime(_judge)  # runs while dynamo traces; nothing at run time


def _judge(ctx) -> None:
    """At trace time: judges the locals ``t`` and ``path`` of ``refuse_unless_input``."""
    var = ctx.get_local("t")
    if not var.is_proxy():
        return  # not a tensor: the graph op itself says so
    fake = var.as_fake()
    if not isinstance(fake, torch.Tensor):
        return
    path = ctx.get_local("path").as_python_constant()
    # The rules of metadata (csrc/marking.cpp ClassifyMeta) on the fake tensor; a tree skips scalars.
    refusal = R(C.classify_meta(fake))
    if refusal == R.ZERO_DIM and path is not None:
        refusal = R.NONE
    if refusal == R.NONE and var.as_proxy().node.op not in ("placeholder", "get_attr"):
        refusal = R.PENDING  # eager calls an intermediate pending; here it has no buffer either
    if refusal == R.NONE:
        return
    message = messages.refusal(fake, refusal)
    if path is not None:  # as _trees.py says it
        message = f"donate: cannot donate {path}, so no tensor of this call was marked. {message}"
    raise RefusedWhileTracing(message)
