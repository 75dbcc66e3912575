"""What can be donated, and the error that says why not.

``check_donatable`` is the Python twin of the native fast path's checks
(csrc/marking/marking.cpp): the fast path answers the common case in one
call and says "no" to anything unusual; this module then finds what is
unusual and raises the error that names it and says what to do.
test/marking/test_marking_twins.py runs every tensor kind through both.

The tricky cases each check exists for:

* a consumed tensor: ``DonatedBufferError`` (it has nothing left to give);
* a wrapper subclass (``_make_wrapper_subclass``): no buffer of its own;
* a subclass that cannot take its poisoned twin class (poison.py);
* a view (``t[0:2]``, ``reshape``, ``as_subclass``): torch_xla refuses it
  as a donor; its base is what holds the buffer;
* pending computation (also after ``xm.optimization_barrier_``, which
  changes neither the tensor's id nor its version): no buffer yet;
* a copy made since the last step: it holds its source's buffer;
* other holders (views, module parameters, autograd): ownership.py judges.

>>> import torch
>>> check_tensor("donate_buffer", [torch.ones(1)])
Traceback (most recent call last):
TypeError: donate_buffer expects a torch.Tensor, got list. For the tensors of a list, ...
"""
import torch

from .._base import reads, xla
from .._base.dtypes import shape_string
from .._base.native import C
from .._outcomes import ownership, poison

__all__ = ["check_donatable", "check_tensor", "describe", "wraps_others", "SCALARS",
           "not_on_xla", "a_view", "pending", "zero_dim"]

# Why scalars are never donated.  Helpers that donate whole trees for the
# user (``donate``, ``donating``) skip them quietly, as they skip numbers.
SCALARS = (
    "torch_xla keeps one device buffer per scalar value moved to the device "
    "(torch.tensor(2.5, device=...), torch.full((), ...), t.to(device)) and hands "
    "it to every such tensor and constant: donating it would delete that value "
    "for all of them. A scalar saves no memory; do not donate it."
)


def check_donatable(tensor) -> None:
    """Raises the error ``donate_buffer`` would raise for ``tensor``, if any.

    Raises:
      TypeError: not a tensor, a wrapper subclass, or a class that cannot be
        poisoned.
      DonatedBufferError: a step consumed it already.
      ValueError: not on an XLA device, a view, pending computation, a copy
        without a buffer of its own, or another holder that blocks it.
    """
    # Every check below passes: one native call, and the ones it lacks.
    if C.is_donatable(tensor):
        return
    check_tensor("donate_buffer", tensor)
    poison.refuse_consumed([tensor])
    torch._check_type(
        not wraps_others(tensor),
        lambda: f"donate_buffer: {type(tensor).__name__} is a tensor subclass with its "
        "own __torch_dispatch__ (a wrapper made with _make_wrapper_subclass): it has "
        "no XLA buffer of its own to donate. Donate the XLA tensors it wraps instead.",
    )
    poison.check_poisonable(tensor)  # a subclass that cannot take its twin class
    torch._check_value(xla.is_xla(tensor), lambda: not_on_xla(tensor))
    torch._check_value(not tensor._is_view(), lambda: a_view(tensor))
    torch._check_value(not reads.is_pending(tensor), lambda: pending(tensor))
    torch._check_value(
        ownership.owns_its_buffer(tensor),
        lambda: f"donate_buffer: {describe(tensor)} has no buffer of its own yet: it is "
        "a copy or clone made since the last step (s.clone(), t.copy_(s), "
        "s.to(device, copy=True), torch.tensor(s), ...), and torch_xla backs it with "
        "its source's buffer until the next step, so donating it would destroy the "
        "source. Call torch_xla.sync() first, then donate it.",
    )
    if xla.storage_use_count(tensor) > 1 or ownership.held_by_autograd(tensor):
        # Someone else holds its storage or TensorImpl: who, and may the
        # donation take them down with it?  (The same judgement the commit
        # makes, ownership.py; a thread still releasing a finished backward
        # is waited for first, so this never depends on timing.)
        ownership.settle_autograd(tensor.device)
        with ownership.scanning():
            blockers = ownership.judge(tensor).blockers
        torch._check_value(
            not blockers,
            lambda: f"donate_buffer: cannot donate {describe(tensor)}: " + "; ".join(blockers) + ".",
        )


# The refusals the compiled path can also make while dynamo traces
# (graph_ops.py): there ``tensor`` is the FakeTensor dynamo computes with.

def not_on_xla(tensor) -> str:
    return (f"donate_buffer expects a tensor on an XLA device, got one on "
            f"'{tensor.device}'. Move it first: t = t.to(torch_xla.device()).")


def a_view(tensor) -> str:
    return (f"donate_buffer: {describe(tensor)} is a view (t[...], reshape, "
            "transpose, t.as_subclass(...), ...) of another tensor's buffer; only plain "
            "device data can be donated. Donate its base tensor, or materialize a copy "
            "first: t = t.clone(); xm.mark_step().")


def pending(tensor) -> str:
    return (f"donate_buffer: {describe(tensor)} has pending computation, so it "
            "has no buffer yet. Call xm.mark_step() (or torch_xla.sync()) first to "
            "materialize it, then donate it.")


def zero_dim(tensor) -> str:
    return f"donate_buffer: {describe(tensor)} is 0-dimensional. {SCALARS}"


def wraps_others(t) -> bool:
    """True for a tensor subclass with its own ``__torch_dispatch__`` (made
    with ``_make_wrapper_subclass``): its data lives in the tensors it wraps.

    >>> wraps_others(torch.ones(1))
    False
    """
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


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
