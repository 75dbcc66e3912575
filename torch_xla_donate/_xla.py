"""The one place that talks to torch_xla's private ``_XLAC`` functions.

Every question the plugin asks the lazy-tensor executor goes through here, so
a torch_xla upgrade that renames or changes one of them breaks one module.
"""
import os

import torch
import torch_xla

_XLAC = torch_xla._XLAC


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def has_pending_ir(tensors) -> list:
    """For each tensor: does it still hold unexecuted computation?

    True both for a freshly computed tensor and for a materialized one that
    was updated in place since the last step.  One call for the whole list.
    """
    return _XLAC._check_tensor_need_materialization(list(tensors))


def set_donor(t: torch.Tensor, donate: bool) -> bool:
    """Sets torch_xla's buffer-donor flag on the device data behind ``t``.

    Returns False, changing nothing, when ``t`` is not plain device data: it
    has pending IR, or it is a view (its IR is still an ``aten::view``).
    """
    return _XLAC._set_buffer_donation(t, donate)


def buffer_deleted(t: torch.Tensor) -> bool:
    """True once the buffer behind ``t`` was consumed by a donation.

    Only meaningful for a tensor without pending IR: an in-flight output is a
    placeholder too.
    """
    return _XLAC._is_placecholder(t)


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage: 1 unless views or aliases
    (``t[0:2]``, ``t.detach()``, ``nn.Parameter(t)``) are alive."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def wait_device_ops() -> None:
    """Blocks until every dispatched computation has run; only after this is
    a donated input's deletion certain to be visible."""
    _XLAC._xla_wait_device_ops([])


def aliasing_enabled() -> bool:
    """False when ``XLA_ENABLE_PARAM_ALIASING=0`` turned off all donation."""
    value = os.environ.get("XLA_ENABLE_PARAM_ALIASING")
    if value is None:
        return True
    try:
        return bool(int(value))
    except ValueError:
        return value.strip().lower() not in ("false", "off", "no")
