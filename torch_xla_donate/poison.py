"""Poisoning: turning a donated tensor into one that refuses every use.

After a step consumed a tensor's buffer, torch_xla still lets Python touch the
tensor and fails much later with a message about async operations or deleted
buffers.  We instead swap the tensor's ``__class__`` for a subclass whose
``__torch_function__`` raises ``DonatedBufferError`` right at the line that
touched it, naming what was donated, where and at which step.

Why ``__class__`` and not ``torch.utils.swap_tensors``: swapping refuses when
a weakref or a view of the tensor is alive, and it costs ~50x more.  Changing
the class works on the very object the user holds, whoever else refers to it,
and keeps shape, dtype and device readable.

A poisoned tensor is in one of two states:

* *in flight*: the step was dispatched asynchronously and it is not yet known
  whether XLA took the buffer.  The first use settles the verdict (waiting for
  the device if need be): a tensor whose donation went unused gets its class
  back and the operation simply runs.
* *consumed*: the buffer now holds a step output; every use raises.
"""
import torch

from . import _C
from .errors import DonatedBufferError

__all__ = ["poison", "unpoison", "is_poisoned", "donation_record", "donated_error"]

# Reading these never touches the device buffer, so a donated tensor allows
# them: code that only inspects shapes keeps working.
_METADATA_READS = frozenset(
    {
        torch.Tensor.shape.__get__,
        torch.Tensor.dtype.__get__,
        torch.Tensor.device.__get__,
        torch.Tensor.ndim.__get__,
        torch.Tensor.layout.__get__,
        torch.Tensor.requires_grad.__get__,
        torch.Tensor.is_leaf.__get__,
        torch.Tensor.nbytes.__get__,
        torch.Tensor.itemsize.__get__,
        torch.Tensor.grad.__get__,
        torch.Tensor.grad.__set__,
        torch.Tensor.is_xla.__get__,
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
        # The TensorImpl's address: how _C finds a tensor's record tag.
        torch.Tensor._cdata.__get__,
    }
)

_settle_hook = None  # set by step_hook: settles an in-flight tensor's verdict


class _DonatedTensor:
    """Mixin placed in front of the tensor's own class while it is donated."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for t in _donated_in(args, kwargs):
            if is_poisoned(t) and _settled_consumed(t):
                raise donated_error(t)
        # Every donated argument turned out unused and got its class back.
        return func(*args, **kwargs)

    def __repr__(self):
        if not _settled_consumed(self):
            return repr(self)  # unused after all: the class is restored
        record = donation_record(self)
        return (
            f"<donated XLA tensor {record.shape_string}: its buffer was reused by "
            f"step {record.step} (donate_buffer at {record.where}); it has no value>"
        )

    __str__ = __repr__


_poison_classes = {}


def _poison_class_for(cls: type) -> type:
    """The donated twin of ``cls``: ``nn.Parameter`` stays a Parameter, a user
    subclass keeps its methods (only tensor ops are intercepted)."""
    poisoned = _poison_classes.get(cls)
    if poisoned is None:
        poisoned = type(f"Donated{cls.__name__}", (_DonatedTensor, cls), {"_original_class": cls})
        _poison_classes[cls] = poisoned
    return poisoned


def poison(t: torch.Tensor, record) -> None:
    """Makes ``t`` refuse use; ``record`` is its ledger entry (in flight or consumed).

    The record rides on ``t``'s TensorImpl, not in ``t.__dict__``: a dict per
    donated tensor and step would double the garbage collector's work in a
    training loop (see csrc/record_tag.h).
    """
    _C.tag_record(t, record)
    if not isinstance(t, _DonatedTensor):
        t.__class__ = _poison_class_for(type(t))


def unpoison(t: torch.Tensor) -> None:
    """Gives ``t`` back its own class: its donation went unused."""
    if isinstance(t, _DonatedTensor):
        t.__class__ = type(t)._original_class
    _C.untag_record(t)


def is_poisoned(t) -> bool:
    return isinstance(t, _DonatedTensor)


def donation_record(t):
    """The ledger record of a poisoned tensor, or None."""
    return _C.tagged_record(t) if isinstance(t, torch.Tensor) else None


def _settled_consumed(t) -> bool:
    """Settles an in-flight tensor if needed; True if its buffer is gone."""
    record = donation_record(t)
    if record is not None and record.verdict == _C.Verdict.IN_FLIGHT:
        _settle_hook(t)
    return is_poisoned(t)


def donated_error(t) -> DonatedBufferError:
    record = donation_record(t)
    return DonatedBufferError(
        f"This tensor ({record.shape_string}, {record.nbytes} bytes) was donated by "
        f"donate_buffer() at {record.where}, and step {record.step} reused its buffer "
        f"for an output, so its value is gone. Use the step's result instead, or, "
        f"if you still need this tensor, do not donate it (undonate(t) cancels a "
        f"mark before the step)."
    )


def _donated_in(args, kwargs):
    """The poisoned tensors among an op's arguments, also inside lists
    (``torch.stack([a, t])``) and dicts."""
    found = []
    stack = [args, kwargs]
    while stack:
        item = stack.pop()
        if isinstance(item, _DonatedTensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


# The step hook poisons a whole step's donors in one native call
# (``_C.poison_donors``), which does for each exactly what ``poison`` does:
# the record tag, then the class from ``_poison_class_for``.
_C.bind(donated_type=_DonatedTensor, poison_class_for=_poison_class_for)
