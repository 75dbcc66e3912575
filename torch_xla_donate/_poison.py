"""Poisoning: a donated tensor refuses every use at the line that touched it.

A step's donors are poisoned natively (``C.finish``, csrc/outcomes/poison.h);
``poison``/``unpoison`` here do the same for one tensor (companions, lost
buffers, an unused donation given back).  The tensor torch_xla computes
with (for a functional tensor, the one the wrapper holds) takes a dispatch
key of the plugin's, whose fallback hands the donated arguments of any
operator to ``on_donated_dispatch``; the tensor the user holds takes a twin
of its class (``nn.Parameter`` stays one, a subclass keeps its methods)
whose ``repr`` says it was donated.  Metadata stays readable.

A poisoned tensor is *in flight* until its verdict (the first use settles
it, waiting for the device if needed; an unused donation gives the value
back and the operator runs) or *consumed*: every use raises, but a refill
(``t.copy_(s)``: every element written, none read) makes it live again.
"""
import torch

from . import _messages as messages
from ._native import C
from .errors import DonatedBufferError

__all__ = ["poison", "unpoison", "is_poisoned", "donation_record", "donated_error",
           "check_poisonable", "consumed", "settled_consumed", "first_consumed",
           "refuse_consumed", "donated_in", "inner", "set_settler", "on_donated_dispatch"]

# Settles an in-flight tensor's verdict before a use goes on: _verdicts.py's
# settle_one, which imports this module, hands it over (set_settler).
_settle = None


def set_settler(settle_one) -> None:
    """Gives poisoning the function that settles one in-flight verdict
    (``settle_one(tensor, record)``), called before a use of such a tensor
    is let through or refused."""
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
        fate = (f"was lost when step {record.step} failed"
                if record.verdict == C.Verdict.LOST else f"was reused by step {record.step}")
        return (
            f"<donated XLA tensor {record.shape_string}: its buffer {fate} "
            f"({messages.VIA[record.via]} at {record.where}); it has no value>"
        )

    __str__ = __repr__

    def _use_count(self):
        """``torch.utils.swap_tensors`` asks both tensors this before it
        swaps anything (``nn.Module`` conversions with
        ``torch.__future__.set_swap_module_params_on_conversion(True)``
        swap too).  An in-flight verdict settles first: its entry's weak hold
        on the TensorImpl would make torch refuse the swap half-way, classes
        already exchanged.  Settled, the swap moves the poison with the
        value, as for any tensor."""
        settled_consumed(self)
        return torch.Tensor._use_count(self)


def on_donated_dispatch(tensors, refill_first: bool) -> None:
    """What an operator does with donated tensors among its arguments (the
    donated key's fallback calls it, with the tensors torch_xla computes
    with): raises
    the ``DonatedBufferError`` of the first consumed one, unless it is the
    first argument of a refill (``refill_first``: ``t.copy_(s)``, which then
    gives it its value back); one whose donation went unused loses its
    poison.  Returns: the operator goes on."""
    for i, t in enumerate(tensors):
        if settled_consumed(t) and not (refill_first and i == 0):
            raise donated_error(t)
    if refill_first and is_poisoned(tensors[0]):
        unpoison(tensors[0])


_poison_classes = {}


def _poison_class_for(cls: type) -> type:
    """The donated twin of ``cls``: ``nn.Parameter`` stays a Parameter, a user
    subclass keeps its methods (only tensor operators are refused).  Native
    poisoning gives it once it is registered (``C.register_twin``, which
    also gives it the finalizer that lets a dying instance's entry go)."""
    poisoned = _poison_classes.get(cls)
    if poisoned is None:
        poisoned = type(f"Donated{cls.__name__}", (_DonatedTensor, cls), {"_original_class": cls})
        _poison_classes[cls] = poisoned
    return poisoned


def inner(t):
    """The tensor torch_xla computes with: the XLA tensor a functional
    wrapper holds (torch_xla's default), else ``t`` itself.

    >>> inner(torch.ones(1)).shape
    torch.Size([1])
    """
    return torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t


def poison(t: torch.Tensor, record, note: str = "") -> None:
    """Makes ``t`` refuse use; ``record`` is its ledger entry (in flight or
    consumed), ``note`` says how ``t`` lost its buffer when it was not the
    donated tensor itself (_holders.py companions).  ``C.poison`` does
    it (csrc/outcomes/poison.h), as the commit does for a step's donors: the
    record and the donated key on the tensor torch_xla computes with, the
    twin class on ``t``."""
    if torch._is_functional_tensor(t) and not is_poisoned(t):
        # An alias (``nn.Parameter(t)``, ``t.detach()``) may hold a stale
        # value its functional storage regenerates at the next use: poison
        # the current one.
        torch._sync(t)
    _register(type(t))
    C.poison(t, record, note)


def unpoison(t: torch.Tensor) -> None:
    """Gives ``t`` back its class and dispatch key: its donation went unused."""
    C.unpoison(t)


def _set_class(t, cls) -> None:
    """``t.__class__ = cls``, past a ``__setattr__`` the tensor's own class
    may define (a subclass guarding its attributes must not make a step
    fail half-way through poisoning)."""
    object.__setattr__(t, "__class__", cls)


def check_poisonable(t) -> None:
    """Raises TypeError unless ``t``'s class can take its donated twin, which
    poisoning gives it after the step (tried on ``t`` and undone).

    The tricky case: a tensor subclass whose instances cannot change class
    (``__slots__`` the twin cannot share, a metaclass that forbids it).
    Found at marking, the donation is refused and nothing is lost; found
    after the step, its value would be gone with no way to say so at the
    use site.

    >>> check_poisonable(torch.ones(1))
    """
    cls = type(t)
    if isinstance(t, _DonatedTensor) or C.twin_of(cls) is not None:
        return
    twin = _poison_class_for(cls)
    try:
        _set_class(t, twin)
    except (TypeError, AttributeError) as error:
        raise TypeError(messages.unpoisonable(cls, error)) from None
    _set_class(t, cls)
    _register(cls)


def _register(cls) -> None:
    """Lets native marking and poisoning use ``cls``'s twin."""
    if C.twin_of(cls) is None:
        C.register_twin(cls, _poison_class_for(cls))


def is_poisoned(t) -> bool:
    """The user's tensor by its class; the tensor torch_xla computes with
    (an operator's argument) by the donated key, or its class."""
    return isinstance(t, _DonatedTensor) or (isinstance(t, torch.Tensor)
                                             and C.has_donated_key(t))


def donation_record(t):
    """The ledger record of a poisoned tensor, or None.

    Read from the tensor torch_xla sees: ``t.set_(s)`` and ``t.data = s``
    give a donated tensor a new value (and a new inner tensor), and with it
    the tensor is no longer donated.
    """
    if not isinstance(t, torch.Tensor):
        return None
    return C.tagged_record(inner(t))


def consumed(t) -> bool:
    """True if ``t`` is poisoned and a step consumed (or lost) its buffer;
    settles an open verdict first (it may wait for the device).

    >>> consumed(torch.ones(1))
    False
    """
    return is_poisoned(t) and settled_consumed(t)


def first_consumed(*trees):
    """The first consumed tensor among the tensors of ``trees`` (lists,
    tuples and dicts are looked into), or None."""
    for t in donated_in(trees, {}):
        if settled_consumed(t):
            return t
    return None


def refuse_consumed(*trees) -> None:
    """Raises the ``DonatedBufferError`` of the first consumed tensor among
    ``trees``: the one check every entry point that takes tensors runs
    (marking, a compiled call, ``gradient_accumulation``)."""
    t = first_consumed(*trees)
    if t is not None:
        raise donated_error(t)


def settled_consumed(t) -> bool:
    """Settles an in-flight tensor if needed; True if its buffer is gone.

    A tensor whose donation turned out unused loses its poison here, if it
    still has it: a use through the tensor torch_xla sees (the functional
    wrapper's inner tensor) settles the record, and the wrapper the user
    holds follows at its next look.
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
    record = donation_record(t)
    note = C.tagged_note(inner(t))
    shape = messages.shape_string(t) if note else ""
    return DonatedBufferError(messages.donated(record, note, shape))


def donated_in(args, kwargs):
    """The poisoned tensors among an operator's arguments, also inside lists
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


# What native poisoning (csrc/outcomes/poison.cpp) needs of Python: the
# package's install step binds them (_hooks.py).
NATIVE_HOOKS = dict(donated_type=_DonatedTensor, on_donated_dispatch=on_donated_dispatch)

for _cls in (torch.Tensor, torch.nn.Parameter):  # their instances swap classes freely
    _register(_cls)
