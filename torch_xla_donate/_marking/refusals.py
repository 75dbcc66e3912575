"""Marking one tensor when ``C.try_mark`` refuses it: each refusal worded,
and what only Python can do before asking again (warn once, settle a
donated tensor's verdict, make a poisoned twin class, judge who holds an
alias).  The rules themselves are native, in one function
(csrc/marking/marking.cpp ``Classify``).

>>> check_tensor("donate_buffer", [torch.ones(1)])
Traceback (most recent call last):
TypeError: donate_buffer expects a torch.Tensor, got list. For the tensors of a list, ...
"""
import torch

from .._base import guards, switches, xla_cpu
from .._base.dtypes import shape_string
from .._base.lock import lock
from .._base.native import C, Via
from .._outcomes import ownership, poison

__all__ = ["mark", "check_tensor", "describe", "message", "SCALARS"]

R = C.Refusal

# Why scalars are never donated.  Helpers that donate whole trees for the
# user (``donate``, ``donating``) skip them quietly, as they skip numbers.
SCALARS = (
    "torch_xla keeps one device buffer per scalar value moved to the device "
    "(torch.tensor(2.5, device=...), torch.full((), ...), t.to(device)) and hands "
    "it to every such tensor and constant: donating it would delete that value "
    "for all of them. A scalar saves no memory; do not donate it."
)


def mark(tensor, where, via=Via.DONATE_BUFFER, in_tree=False) -> bool:
    """Marks ``tensor`` blaming ``where`` (file, line), or raises the error
    of its refusal.  False, nothing marked, when donation is switched off
    (warned once) or, ``in_tree``, for a scalar (skipped quietly)."""
    try:
        return _mark(tensor, where, via, in_tree, locked=False)
    except _Committing:
        with lock:  # a commit on another thread must see the mark whole or not at all
            return _mark(tensor, where, via, in_tree, locked=True)


class _Committing(Exception):
    """Another thread is inside a commit: mark with the lock held."""


def _mark(tensor, where, via, in_tree, locked) -> bool:
    held_ok, settled, synced, done = False, False, False, set()
    while True:
        refusal = R(C.try_mark(tensor, via, where, held_ok, locked))
        if refusal == R.NONE:
            return True
        if refusal == R.OFF:
            switches.warn_if_off()
            return False
        if refusal == R.ZERO_DIM and in_tree:
            return False
        if refusal == R.COMMITTING:
            raise _Committing()
        if refusal in (R.UNDECIDED, R.PENDING) and not synced and torch._is_functional_tensor(tensor):
            # A functional wrapper with view updates not applied yet (also
            # one ``_make_subclass`` made) reads as no plain device data:
            # applied, as any torch_xla call on it would.
            torch._sync(tensor)
            synced = True
            continue
        if refusal == R.HELD and not settled:
            # A holder may be autograd's worker thread still releasing a
            # finished backward: waited for first, so that the outcome
            # never depends on timing.
            ownership.settle_autograd(tensor.device)
            settled = True
            continue
        if refusal in done:  # Python did its part and the rule still refuses
            raise RuntimeError(f"torch_xla_donate: marking refused {describe(tensor)} twice "
                               f"({refusal.name}). Please report this.")
        done.add(refusal)
        held_ok = _resolve(tensor, refusal) or held_ok


def _resolve(tensor, refusal) -> bool:
    """Does Python's part for ``refusal`` before marking asks again, or
    raises its error.  True when the tensor's aliases may go with it."""
    if refusal == R.POISONED:
        poison.refuse_consumed([tensor])  # settles it: consumed raises, unused lifts the poison
    elif refusal == R.NEW_CLASS:
        poison.check_poisonable(tensor)  # makes and registers the twin, or raises
    elif refusal == R.UNDECIDED:
        if not guards.decide(tensor):
            raise ValueError(message(tensor, refusal))
        switches.refresh()
    elif refusal == R.WARN_FIRST:
        xla_cpu.warn_if_unprotected()
        switches.refresh()
    elif refusal == R.HELD:
        # Someone else holds its storage or TensorImpl: who, and may the
        # donation take them down with it?  (The judgement the commit makes,
        # ownership.py.)
        with ownership.scanning():
            blockers = ownership.judge(tensor).blockers
        if blockers:
            raise ValueError(f"donate_buffer: cannot donate {describe(tensor)}: "
                             + "; ".join(blockers) + ".")
        return True
    else:
        raise _error(tensor, refusal)
    return False


def _error(tensor, refusal) -> Exception:
    if refusal in (R.NOT_TENSOR, R.WRAPPER):
        return TypeError(message(tensor, refusal))
    return ValueError(message(tensor, refusal))


def message(tensor, refusal) -> str:
    """Why ``tensor`` cannot be donated, and what to do (also the compiled
    path's words, graph_ops.py, where ``tensor`` is a FakeTensor)."""
    if refusal == R.NOT_TENSOR:
        return f"donate_buffer expects a torch.Tensor, got {type(tensor).__name__}."
    if refusal == R.WRAPPER:
        return (f"donate_buffer: {type(tensor).__name__} is a tensor subclass with its own "
                "__torch_dispatch__ (a wrapper made with _make_wrapper_subclass): it has no XLA "
                "buffer of its own to donate. Donate the XLA tensors it wraps instead.")
    if refusal == R.NOT_XLA:
        return (f"donate_buffer expects a tensor on an XLA device, got one on "
                f"'{tensor.device}'. Move it first: t = t.to(torch_xla.device()).")
    if refusal == R.VIEW:
        return (f"donate_buffer: {describe(tensor)} is a view (t[...], reshape, transpose, "
                "t.as_subclass(...), ...) of another tensor's buffer; only plain device data "
                "can be donated. Donate its base tensor, or materialize a copy first: "
                "t = t.clone(); xm.mark_step().")
    if refusal == R.ZERO_DIM:
        return f"donate_buffer: {describe(tensor)} is 0-dimensional. {SCALARS}"
    if refusal == R.COPY:
        return (f"donate_buffer: {describe(tensor)} has no buffer of its own yet: it is a copy "
                "or clone made since the last step (s.clone(), t.copy_(s), s.to(device, "
                "copy=True), torch.tensor(s), ...), and torch_xla backs it with its source's "
                "buffer until the next step, so donating it would destroy the source. Call "
                "torch_xla.sync() first, then donate it.")
    if refusal == R.UNDECIDED:
        return (f"donate_buffer: torch_xla_donate cannot check {describe(tensor)} here (inside "
                "a dispatch mode, before any plain XLA tensor was donated). Donate it outside.")
    return (f"donate_buffer: {describe(tensor)} has pending computation, so it has no buffer "
            "yet. Call xm.mark_step() (or torch_xla.sync()) first to materialize it, then "
            "donate it.")


def check_tensor(name, tensor, tree_form="donate(tree)") -> None:
    """TypeError unless ``tensor`` is a tensor, pointing containers at the
    call that takes trees (``tree_form=None``: a question about one tensor,
    no hint)."""
    if isinstance(tensor, torch.Tensor):
        return
    hint = ""
    items = tensor.values() if isinstance(tensor, dict) else tensor
    if tree_form is None:
        pass
    elif isinstance(tensor, (torch.nn.Module, torch.optim.Optimizer)) or (
        isinstance(tensor, (list, tuple, dict))
        and any(isinstance(x, (torch.Tensor, list, tuple, dict)) for x in items)
    ):
        hint = (" For the tensors of a list, dict, module, optimizer or any pytree, "
                f"use torch_xla_donate.{tree_form}.")
    raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}.{hint}")


def describe(tensor) -> str:
    """How messages name a tensor.

    >>> describe(torch.zeros(2, 3))
    'the tensor f32[2,3]'
    """
    return f"the tensor {shape_string(tensor)}"
