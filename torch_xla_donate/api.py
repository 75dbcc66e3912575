"""The public API: mark a tensor's buffer for donation at the next step.

Example (``PJRT_DEVICE=CPU python this_file.py``)::

    import torch, torch_xla, torch_xla.core.xla_model as xm
    import torch_xla_donate as tdx

    params = torch.randn(1024, 1024, device=torch_xla.device())
    grads = torch.randn(1024, 1024, device=torch_xla.device())
    xm.mark_step()                       # materialize: only device data donates

    old = params
    tdx.donate_buffer(params)            # the old params are never read again
    params = params - 0.1 * grads        # functional update
    xm.mark_step()                       # new params live in the old buffer
    tdx.is_deleted(old)                  # True; old.sum() raises DonatedBufferError
"""
import sys
import warnings

import torch

from . import _C, _xla, commit, config, dynamo, ownership, poison, xla_cpu
from .hook_lock import lock
from .dtypes import shape_string, xla_dtype_name
from .errors import DonatedBufferError, DonationDisabledWarning

__all__ = ["donate_buffer", "undonate", "is_donated", "is_deleted"]

# Which call marked a tensor (the ledger's Via, csrc/ledger.h): messages name it.
VIA_DONATE_BUFFER, VIA_DONATE, VIA_DONATING, VIA_GRAPH_OP = range(4)


def donate_buffer(tensor: torch.Tensor) -> None:
    """Donates ``tensor``'s device buffer to the outputs of the next step.

    At the next step barrier the buffer may hold one of the step's outputs;
    ``tensor`` is then poisoned and any use raises ``DonatedBufferError``.
    If no output can take the buffer, the tensor keeps its value and an
    ``UnusedDonationWarning`` says so.  Marking twice before a step counts once.

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
      ValueError: it is not on an XLA device, has pending computation (call
        ``xm.mark_step()`` first), is a view or has live views/aliases, is
        saved for backward by a live autograd graph, or is a 0-dim scalar.
      DonatedBufferError: it was donated already.
    """
    if torch.compiler.is_compiling():  # dynamo traces this: a graph op, no break
        return dynamo.donate_in_graph([tensor])
    # The common case is one native call (checks and ledger entry; the "1"
    # blames our caller's line): a plain tensor or parameter passing every
    # check of ``_check_donatable``, 0-dim and autograd ones included, while
    # donation is on and no commit is running (see hook_lock.py).  Anything
    # unusual goes through ``_mark_checked``, which raises or warns precisely.
    # Marking only records: torch_xla's donor flag is set inside the
    # execution that commits the mark (commit.py).
    if _C.try_mark(tensor, 1):
        return
    _check_tensor("donate_buffer", tensor)
    torch._check_value(
        tensor.dim() > 0 or not _xla.is_xla(tensor) or poison.is_poisoned(tensor),
        lambda: f"donate_buffer: {_describe(tensor)} is 0-dimensional. {_SCALARS}",
    )
    _mark_checked(tensor, _caller(1))


# Why scalars are never donated.  Helpers that donate whole trees for the
# user (``donate``, ``donating``) skip them quietly, as they skip numbers.
_SCALARS = (
    "torch_xla keeps one device buffer per scalar value moved to the device "
    "(torch.tensor(2.5, device=...), torch.full((), ...), t.to(device)) and hands "
    "it to every such tensor and constant: donating it would delete that value "
    "for all of them. A scalar saves no memory; do not donate it."
)


def _mark(tensor, where, via=VIA_DONATE_BUFFER) -> None:
    """Marks one tensor; ``where`` is the (file, line) blamed in messages and
    ``via`` the call messages name (``VIA_*``).

    Split from ``donate_buffer`` so helpers that donate on a user's behalf
    (pytrees, ``donating``) blame the user's line, not their own.  Unlike
    ``donate_buffer`` it skips a 0-dim tensor quietly (see ``_SCALARS``).
    """
    if _C.try_mark(tensor, where, via):  # see donate_buffer
        return
    _mark_checked(tensor, where, via)


def _mark_checked(tensor, where, via=VIA_DONATE_BUFFER) -> None:
    """``_mark`` step by step: every check with its own message, the off
    switches, then the mark.  ``_C.try_mark`` is the same path in one call
    for the common case and leaves everything else to this function."""
    _check_donatable(tensor)
    if not config.enabled():
        _warn_disabled_once(
            "torch_xla_donate is switched off (TORCH_XLA_DONATE_DISABLE=1 or "
            "configure(enabled=False)): donate_buffer() does nothing and no "
            "tensor will be poisoned."
        )
        return
    if not _xla.aliasing_enabled():
        _warn_disabled_once(
            "XLA_ENABLE_PARAM_ALIASING=0 turns off buffer donation in torch_xla: "
            "donate_buffer() does nothing and no tensor will be poisoned. Unset it "
            "to save the memory."
        )
        return
    if tensor.dim() == 0:
        return  # never donated, see _SCALARS; donate_buffer refused it already
    if xla_cpu.warn_if_unprotected():
        commit.refresh_fast_path()  # warned once: the fast path may open
    # A commit in another thread must see the mark whole or not at all.
    with lock:
        if _C.is_marked(tensor):
            return
        file, line = where
        _C.mark(tensor, file, line, tuple(tensor.shape), xla_dtype_name(tensor.dtype),
                tensor.nbytes, via, _version(tensor))


def _version(tensor) -> int:
    """The tensor's version counter (-1: an inference tensor keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _check_donatable(tensor) -> None:
    """Raises the error ``donate_buffer`` would raise for ``tensor``, if any."""
    # Every check below passes: one native call, and the ones it lacks.
    if _C.is_donatable(tensor):
        return
    _check_tensor("donate_buffer", tensor)
    if poison.is_poisoned(tensor) and poison._settled_consumed(tensor):
        raise poison.donated_error(tensor)
    torch._check_type(
        not _wraps_others(tensor),
        lambda: f"donate_buffer: {type(tensor).__name__} is a tensor subclass with its "
        "own __torch_dispatch__ (a wrapper made with _make_wrapper_subclass): it has "
        "no XLA buffer of its own to donate. Donate the XLA tensors it wraps instead.",
    )
    poison.check_poisonable(tensor)  # a subclass that cannot take its twin class
    torch._check_value(
        _xla.is_xla(tensor),
        lambda: f"donate_buffer expects a tensor on an XLA device, got one on "
        f"'{tensor.device}'. Move it first: t = t.to(torch_xla.device()).",
    )
    torch._check_value(
        not tensor._is_view(),
        lambda: f"donate_buffer: {_describe(tensor)} is a view (t[...], reshape, "
        "transpose, t.as_subclass(...), ...) of another tensor's buffer; only plain "
        "device data can be donated. Donate its base tensor, or materialize a copy "
        "first: t = t.clone(); xm.mark_step().",
    )
    torch._check_value(
        not _xla.has_pending_ir([tensor])[0],
        lambda: f"donate_buffer: {_describe(tensor)} has pending computation, so it "
        "has no buffer yet. Call xm.mark_step() (or torch_xla.sync()) first to "
        "materialize it, then donate it.",
    )
    torch._check_value(
        ownership.owns_its_buffer(tensor),
        lambda: f"donate_buffer: {_describe(tensor)} has no buffer of its own yet: it is "
        "a copy or clone made since the last step (s.clone(), t.copy_(s), "
        "s.to(device, copy=True), torch.tensor(s), ...), and torch_xla backs it with "
        "its source's buffer until the next step, so donating it would destroy the "
        "source. Call torch_xla.sync() first, then donate it.",
    )
    if _xla.storage_use_count(tensor) > 1 or ownership.held_by_autograd(tensor):
        # Someone else holds its storage or TensorImpl: who, and may the
        # donation take them down with it?  (The same judgement the commit
        # makes, ownership.py; a thread still releasing a finished backward
        # is waited for first, so this never depends on timing.)
        ownership.settle_autograd(tensor.device)
        with ownership.scanning():
            blockers = ownership.judge(tensor).blockers
        torch._check_value(
            not blockers,
            lambda: f"donate_buffer: cannot donate {_describe(tensor)}: " + "; ".join(blockers) + ".",
        )


def _wraps_others(t) -> bool:
    """True for a tensor subclass with its own ``__torch_dispatch__`` (made
    with ``_make_wrapper_subclass``): its data lives in the tensors it wraps."""
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)




def _check_tensor(name, tensor, tree_form="donate(tree)") -> None:
    """TypeError unless ``tensor`` is a tensor, pointing containers at the
    call that takes trees."""
    if isinstance(tensor, torch.Tensor):
        return
    hint = ""
    items = tensor.values() if isinstance(tensor, dict) else tensor
    if tree_form is None:
        pass  # a question about one tensor
    elif isinstance(tensor, (torch.nn.Module, torch.optim.Optimizer)) or (
        isinstance(tensor, (list, tuple, dict))
        and any(isinstance(x, (torch.Tensor, list, tuple, dict)) for x in items)
    ):
        hint = (" For the tensors of a list, dict, module, optimizer or any pytree, "
                f"use torch_xla_donate.{tree_form}.")
    raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}.{hint}")


def undonate(tree):
    """Cancels marks made before the step.

    ``tree`` is what ``donate`` takes: a tensor (returning whether it was
    marked), or a pytree, ``nn.Module`` or optimizer (returning how many of
    its tensors were).  Raises ``DonatedBufferError`` if a step already
    consumed the buffer of a tensor passed directly: too late to cancel.
    """
    if isinstance(tree, torch.Tensor):
        if poison.is_poisoned(tree) and poison._settled_consumed(tree):
            raise poison.donated_error(tree)
        with lock:  # never in the middle of a commit
            return _C.unmark(tree) is not None
    from . import pytree

    pytree._check_root("tree", tree, "undonate")  # what donate refuses, undonate does too
    tensors = pytree.tensors_in([("tree", tree)])
    with lock:
        return sum(_C.unmark(t) is not None for t in tensors)


def is_donated(tensor: torch.Tensor) -> bool:
    """True while ``tensor`` is marked and waiting for the next step."""
    _check_tensor("is_donated", tensor, None)
    return _C.is_marked(tensor)


def is_deleted(tensor: torch.Tensor) -> bool:
    """True if a step consumed ``tensor``'s buffer through donation.

    May wait for the device: right after ``sync(wait=False)`` whether XLA
    took the buffer is not known until the step has been dispatched.
    """
    _check_tensor("is_deleted", tensor, None)
    return poison.is_poisoned(tensor) and poison._settled_consumed(tensor)


def _describe(tensor) -> str:
    return f"the tensor {shape_string(tensor)}"


def _caller(depth: int):
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno


_disabled_warned = set()


def _warn_disabled_once(message: str) -> None:
    """Warns once per reason: a loop that donates every step should not
    print the same line every step."""
    if message not in _disabled_warned:
        _disabled_warned.add(message)
        warnings.warn(message, DonationDisabledWarning, stacklevel=4)
