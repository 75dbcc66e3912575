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

from . import _C, _xla, config, poison
from .dtypes import xla_dtype_name
from .errors import DonatedBufferError, DonationDisabledWarning

__all__ = ["donate_buffer", "undonate", "is_donated", "is_deleted"]


def donate_buffer(tensor: torch.Tensor) -> None:
    """Donates ``tensor``'s device buffer to the outputs of the next step.

    At the next step barrier the buffer may hold one of the step's outputs;
    ``tensor`` is then poisoned and any use raises ``DonatedBufferError``.
    If no output can take the buffer, the tensor keeps its value and an
    ``UnusedDonationWarning`` says so.  Marking twice before a step counts once.

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
      ValueError: it is not on an XLA device, has pending computation (call
        ``xm.mark_step()`` first), or is a view or has live views/aliases.
      DonatedBufferError: it was donated already.
    """
    # The common case is one native call (checks, donor flag, ledger entry;
    # the "1" blames our caller's line).  Anything unusual goes through
    # ``_mark_checked``, which raises or warns precisely.
    if not (config.enabled() and _C.try_mark(tensor, 1)):
        _mark_checked(tensor, _caller(1))


def _mark(tensor, where) -> None:
    """Marks one tensor; ``where`` is the (file, line) blamed in messages.

    Split from ``donate_buffer`` so helpers that donate on a user's behalf
    (pytrees, ``donating``) blame the user's line, not their own.
    """
    if not (config.enabled() and _C.try_mark(tensor, where)):
        _mark_checked(tensor, where)


def _mark_checked(tensor, where) -> None:
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
    if _C.is_marked(tensor):
        return
    torch._check_value(
        _xla.set_donor(tensor, True),
        lambda: f"donate_buffer: torch_xla refused to donate {_describe(tensor)}: "
        "it is not plain device data. Materialize a copy first: "
        "t = t.clone(); xm.mark_step().",
    )
    file, line = where
    _C.mark(
        tensor,
        file,
        line,
        tuple(tensor.shape),
        xla_dtype_name(tensor.dtype),
        tensor.nbytes,
    )


def _check_donatable(tensor) -> None:
    """Raises the error ``donate_buffer`` would raise for ``tensor``, if any."""
    if _C.is_donatable(tensor):  # every check below passes: one native call
        return
    torch._check_type(
        isinstance(tensor, torch.Tensor),
        lambda: f"donate_buffer expects a torch.Tensor, got {type(tensor).__name__}.",
    )
    if poison.is_poisoned(tensor) and poison._settled_consumed(tensor):
        raise poison.donated_error(tensor)
    torch._check_value(
        _xla.is_xla(tensor),
        lambda: f"donate_buffer expects a tensor on an XLA device, got one on "
        f"'{tensor.device}'. Move it first: t = t.to(torch_xla.device()).",
    )
    torch._check_value(
        not tensor._is_view(),
        lambda: f"donate_buffer: {_describe(tensor)} is a view (t[...], reshape, "
        "transpose, ...) of another tensor's buffer; only plain device data can be "
        "donated. Donate its base tensor, or materialize a copy first: "
        "t = t.clone(); xm.mark_step().",
    )
    torch._check_value(
        not _xla.has_pending_ir([tensor])[0],
        lambda: f"donate_buffer: {_describe(tensor)} has pending computation, so it "
        "has no buffer yet. Call xm.mark_step() (or torch_xla.sync()) first to "
        "materialize it, then donate it.",
    )
    uses = _xla.storage_use_count(tensor)
    torch._check_value(
        uses == 1,
        lambda: f"donate_buffer: {_describe(tensor)} shares its buffer with "
        f"{uses - 1} other live tensor(s) (views such as t[0:2], aliases such as "
        "t.detach() or nn.Parameter(t)). Donating would destroy them too. Delete "
        "them first, or donate a copy made with t.clone() and xm.mark_step().",
    )


def undonate(tensor: torch.Tensor) -> bool:
    """Cancels ``donate_buffer(tensor)`` before the step; returns whether a
    mark was cancelled.

    Raises ``DonatedBufferError`` if the step already consumed the buffer:
    too late to cancel.
    """
    if poison.is_poisoned(tensor) and poison._settled_consumed(tensor):
        raise poison.donated_error(tensor)
    if _C.unmark(tensor) is None:
        return False
    _xla.set_donor(tensor, False)
    return True


def is_donated(tensor: torch.Tensor) -> bool:
    """True while ``tensor`` is marked and waiting for the next step."""
    return _C.is_marked(tensor)


def is_deleted(tensor: torch.Tensor) -> bool:
    """True if a step consumed ``tensor``'s buffer through donation.

    May wait for the device: right after ``sync(wait=False)`` whether XLA
    took the buffer is not known until the step has been dispatched.
    """
    return poison.is_poisoned(tensor) and poison._settled_consumed(tensor)


def _describe(tensor) -> str:
    shape = ",".join(str(d) for d in tensor.shape)
    return f"the tensor {xla_dtype_name(tensor.dtype)}[{shape}]"


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
