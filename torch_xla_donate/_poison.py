"""Poisoning one tensor (a companion, a lost buffer, an unused donation given back) and what a use of
a poisoned tensor does; a step's donors are poisoned natively (docs/design.md, "The step's life";
the dispatch key: "Reading torch_xla")."""

import torch

from . import _messages as messages
from ._native import C
from .errors import DonatedBufferError

__all__ = ["poison", "unpoison", "is_poisoned", "donation_record", "donated_error", "check_poisonable",
           "first_consumed", "refuse_consumed", "inner", "set_settler", "NATIVE_HOOKS"]  # fmt: skip

# _verdicts.settle_one(tensor, record), handed over by _verdicts (which imports this module): settles
# an in-flight tensor's verdict before a use goes on.
_settle = None


def set_settler(settle_one) -> None:
    global _settle
    _settle = settle_one


class _DonatedTensor:
    """Mixin placed in front of the tensor's own class while it is donated."""

    __slots__ = ()

    # The dispatcher is the one check path; Python-level calls reach it too.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        if not settled_consumed(self):
            return repr(self)  # unused after all: the class is restored
        record = donation_record(self)
        lost = record.verdict == C.Verdict.LOST
        fate = f"was lost when step {record.step} failed" if lost else f"was reused by step {record.step}"
        return (
            f"<donated XLA tensor {record.shape_string}: its buffer {fate} "
            f"({messages.VIA[record.via]} at {record.where}); it has no value>"
        )

    __str__ = __repr__

    def _use_count(self):
        # torch.utils.swap_tensors asks both tensors this before it swaps anything: an in-flight
        # entry's weak hold on the TensorImpl would make it refuse half-way, classes already
        # exchanged, so the verdict settles first; settled, the poison moves with the value.
        settled_consumed(self)
        return torch.Tensor._use_count(self)


def on_donated_dispatch(tensors, refill_first: bool) -> None:
    """The donated key's fallback: raises for the first consumed tensor (but the target of a refill,
    ``t.copy_(s)``, which gets its value back); an unused donation loses its poison."""
    for i, t in enumerate(tensors):
        if settled_consumed(t) and not (refill_first and i == 0):
            raise donated_error(t)
    if refill_first and is_poisoned(tensors[0]):
        unpoison(tensors[0])


_poison_classes = {}


def _poison_class_for(cls: type) -> type:
    """The donated twin of ``cls``: a subclass keeps its methods, a Parameter stays one.

    >>> twin = _poison_class_for(torch.nn.Parameter)
    >>> twin.__name__, issubclass(twin, torch.nn.Parameter)
    ('DonatedParameter', True)
    """
    poisoned = _poison_classes.get(cls)
    if poisoned is None:
        poisoned = type(f"Donated{cls.__name__}", (_DonatedTensor, cls), {"_original_class": cls})
        _poison_classes[cls] = poisoned
    return poisoned


def inner(t):
    """The tensor torch_xla computes with: the XLA tensor a functional wrapper holds, else ``t``."""
    return torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t


def poison(t: torch.Tensor, record, note: str = "") -> None:
    """Makes ``t`` refuse use, as the commit does for a step's donors; ``note`` says how ``t`` lost
    its buffer when it was not the donated tensor itself (_holders.py companions)."""
    if torch._is_functional_tensor(t) and not is_poisoned(t):
        # An alias (nn.Parameter(t), t.detach()) may hold a stale value its functional storage
        # regenerates at the next use: poison the current one.
        torch._sync(t)
    _register(type(t))
    C.poison(t, record, note)


def unpoison(t: torch.Tensor) -> None:
    """Gives ``t`` back its class and dispatch key: its donation went unused."""
    C.unpoison(t)


def check_poisonable(t) -> None:
    """TypeError unless ``t``'s class can take its donated twin (tried on ``t`` and undone): found at
    marking, the donation is refused and nothing is lost; after the step, the value would be gone."""
    cls = type(t)
    if isinstance(t, _DonatedTensor) or C.twin_of(cls) is not None:
        return
    # Past a __setattr__ the class may define: a subclass guarding its attributes must not make a
    # step fail half-way through poisoning.
    try:
        object.__setattr__(t, "__class__", _poison_class_for(cls))
    except (TypeError, AttributeError) as error:
        raise TypeError(messages.unpoisonable(cls, error)) from None
    object.__setattr__(t, "__class__", cls)
    _register(cls)


def _register(cls) -> None:
    """Lets native marking and poisoning use ``cls``'s twin."""
    if C.twin_of(cls) is None:
        C.register_twin(cls, _poison_class_for(cls))


def is_poisoned(t) -> bool:
    """The user's tensor by its class; the tensor torch_xla computes with by the donated key."""
    return isinstance(t, _DonatedTensor) or (isinstance(t, torch.Tensor) and C.has_donated_key(t))


def donation_record(t):
    """The ledger record of a poisoned tensor, or None; read from the tensor torch_xla sees, so that
    ``t.set_(s)`` and ``t.data = s`` (a new value) end the donation."""
    return C.tagged_record(inner(t)) if isinstance(t, torch.Tensor) else None


def first_consumed(*trees):
    """The first consumed tensor among ``trees``, looking into lists, tuples and dicts, or None."""
    found, stack = [], list(trees)
    while stack:
        item = stack.pop()
        if isinstance(item, _DonatedTensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return next((t for t in found if settled_consumed(t)), None)


def refuse_consumed(*trees) -> None:
    """Raises the ``DonatedBufferError`` of the first consumed tensor among ``trees``."""
    t = first_consumed(*trees)
    if t is not None:
        raise donated_error(t)


def settled_consumed(t) -> bool:
    """Settles an in-flight tensor if needed; True if its buffer is gone.

    An unused donation loses its poison here: a use through the inner tensor settles the record, and
    the wrapper the user holds follows at its next look.
    """
    record = donation_record(t)
    if record is not None and record.verdict == C.Verdict.IN_FLIGHT:
        _settle(t, record)
        record = donation_record(t)
    if record is not None and record.verdict in (C.Verdict.REUSED, C.Verdict.LOST):
        return True
    if is_poisoned(t):
        unpoison(t)
    return False


def donated_error(t) -> DonatedBufferError:
    note = C.tagged_note(inner(t))
    shape = messages.shape_string(t) if note else ""
    return DonatedBufferError(messages.donated(donation_record(t), note, shape))


# What native poisoning (csrc/poison.cpp) needs of Python: _hooks.py binds them.
NATIVE_HOOKS = dict(donated_type=_DonatedTensor, on_donated_dispatch=on_donated_dispatch)

for _cls in (torch.Tensor, torch.nn.Parameter):  # their instances swap classes freely
    _register(_cls)
