"""What torch_xla knows about an XLA tensor, read natively (csrc/lazy/lazy_reads.h),
once guards.py let the reads on.

Every function answers None for a tensor the reader declines (not an
``XLATensorImpl``, a functional wrapper awaiting a sync, host data under
SPMD; every tensor while the reads are off): such a tensor is no plain
device data.
"""
from typing import NamedTuple

from .native import C

__all__ = ["LazyFacts", "Holders", "tensor_id", "is_pending", "pending_flags", "is_consumed",
           "buffer_key", "owner_ids", "holders", "excess", "facts"]

LazyFacts = NamedTuple("LazyFacts", [(name, object) for name in C.LAZY_FACT_FIELDS])
LazyFacts.__doc__ = "Every fact the native reader gives (csrc/lazy/lazy_reads.h)."


class Holders(NamedTuple):
    expected: int
    actual: int
    xla_tensor_refs: int


def tensor_id(t):
    return C.lazy_tensor_id(t)


def is_pending(t):
    return C.lazy_is_pending(t)


def pending_flags(tensors) -> list:
    """Pending computation per tensor; a tensor the reader declines counts
    as pending (it is no plain device data)."""
    return C.pending_flags(list(tensors))


def is_consumed(t):
    return C.lazy_is_consumed(t)


def buffer_key(t):
    """Equal for two tensors exactly when they share one live buffer; 0
    without one (pending, consumed, still computing)."""
    return C.lazy_buffer_key(t)


def owner_ids(tensors) -> list:
    """Per tensor, the tensor id its live buffer is filed under (-1: none,
    an upload no graph read), None without a live buffer."""
    return C.lazy_owner_ids(list(tensors))


def holders(tensors) -> list:
    """Per tensor with a handle: ``Holders(expected, actual,
    xla_tensor_refs)``; None when unknown (no handle, or functionalization
    off: torch_xla's own views then hold buffers the reader cannot see)."""
    return [None if h is None else Holders(*h) for h in C.lazy_holders(list(tensors))]


def excess(tensors):
    """``[(index, extra)]`` of the donors whose buffer has holders beyond
    those the donors sharing it account for; ``[]`` for none; None when any
    tensor's holders are unknown (see ``holders``)."""
    return C.lazy_excess(list(tensors))


def facts(t):
    f = C.lazy_facts(t)
    return None if f is None else LazyFacts(*f)
