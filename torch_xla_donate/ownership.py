"""Who else holds a marked tensor's buffer, and what that means for its
donation.

Donating a buffer destroys it for every tensor that holds it.  At the commit
(where the holders may be new since marking), a marked tensor whose storage
another live tensor shares (a view, ``t.detach()``, ``nn.Parameter(t)``), or
whose TensorImpl a live autograd graph saved for backward, is not donated:
its mark is dropped with a ``DroppedDonationWarning`` naming the holder, and
it keeps its value.
"""
import torch

from . import _C, _xla
from .errors import DroppedDonationWarning
from .verdicts import warn_records

__all__ = ["judge_at_commit", "drop", "held_by_autograd", "owns_its_buffer", "note_barrier"]


def owns_its_buffer(t) -> bool:
    """False for a tensor whose value is still another tensor's device buffer.

    torch_xla backs a copy or clone made since the last barrier (``s.clone()``,
    ``t.copy_(s)``, ``s.to(device, copy=True)``, ``torch.tensor(s)``) with the
    source's buffer until a barrier gives it its own: donating the copy then
    would destroy the source.  torch_xla files a buffer under the tensor that
    last took it as its own; a buffer uploaded from the host and never read
    by a graph is filed under nobody and belongs to its one tensor.
    """
    owners = _xla.buffer_owner_ids([t])
    return owners[0] in (_xla.tensor_id(t), _xla.NO_OWNER)


# The newest tensor id known to have its own buffer, per device: a barrier
# gives every live tensor of its device a buffer of its own (copies still
# sharing their source's take theirs then).  The native fast path marks only
# tensors at most that old, and sends newer ones here (owns_its_buffer).
_settled_ids = {}


def note_barrier(device) -> None:
    """After a barrier of ``device``: every tensor older than now has its own
    buffer there."""
    probe = torch.empty(0, device=device)
    _settled_ids[device] = _xla.tensor_id(probe)
    _C.set_settled_ids(min(_settled_ids.values()) if _xla.local_device_count() == len(
        _settled_ids) or _xla.local_device_count() == 1 else -1)


def held_by_autograd(t) -> bool:
    """True when C++ code besides ``t`` itself holds ``t``'s TensorImpl: an
    autograd graph that saved it for backward (``w * w`` saves ``w``).

    Python references do not count, and neither does the AccumulateGrad node a
    leaf that requires grad gets once a graph uses it (it never reads the
    value).  Decided only while no view or alias shares ``t``'s storage: views
    hold their base too (twice, on XLA), and a shared storage is judged
    apart.  Not a tensor: False.

    >>> w = torch.ones(2, requires_grad=True)
    >>> held_by_autograd(w)
    False
    >>> loss = (w * w).sum()
    >>> held_by_autograd(w)
    True
    >>> loss.backward()
    >>> held_by_autograd(w)
    False
    """
    if not isinstance(t, torch.Tensor):
        return False
    if t._use_count() <= 1 + (t.is_leaf and t.requires_grad):
        return False  # the common case, cheaply
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 1
    except RuntimeError:  # no storage (a wrapper subclass): other checks say why
        return False


def judge_at_commit(held) -> list:
    """Decides the committed entries ``split_committed`` found held by
    another tensor or by autograd; returns those that may be donated after
    all, settling the others CANCELLED."""
    drop(held, "a view or alias of it was created after it was marked (t[...], "
               "t.detach(), ...) or an autograd graph saved it for backward, and is "
               "still alive; donating would destroy it too")
    return []


def drop(entries, why: str) -> None:
    """Settles ``entries`` CANCELLED (value kept) with one warning."""
    for _, record in entries:
        _C.settle(record, _C.Verdict.CANCELLED)
    warn_records(
        DroppedDonationWarning,
        "Donations dropped before a step{at_step}: {items}. " + why + ". These "
        "tensors keep their values.",
        [record for _, record in entries],
    )
