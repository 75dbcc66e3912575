"""Tensors of every kind handed to donate_buffer: autograd's (saved for
backward, leaves, .grad), dtypes and sizes (zero-size, scalars), tensors just
moved to the device, and subclasses.  Each is either donated like a plain
tensor or refused with a typed error that says what to do, and the refused
tensor is untouched (test_bad_input.py's rule).
"""
import pytest
import torch
import torch_xla
from helpers import Guarded, Pinned, Tagged, Wrapper, buffer_ptr, materialize
from helpers import assert_untouched as _untouched

import torch_xla_donate as tdx
from torch_xla_donate import _C

# -- autograd ------------------------------------------------------------------


def test_parameter_saved_for_backward_is_refused_until_backward_ran(dev):
    w = torch.nn.Parameter(materialize(torch.full((4,), 3.0, device=dev)))
    loss = (w * w).sum()  # saves w for backward
    with pytest.raises(ValueError, match=r"saved for backward by a live autograd graph.*backward first"):
        tdx.donate_buffer(w)
    _untouched(w, torch.full((4,), 3.0))
    loss.backward()  # frees what it saved: now donating is safe
    grad = w.grad
    torch_xla.sync()
    assert grad.cpu().tolist() == [6.0] * 4
    tdx.donate_buffer(w)
    with torch.no_grad():
        new_w = w - 0.5 * grad
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and new_w.cpu().tolist() == [0.0] * 4


def test_graph_saving_a_marked_parameter_drops_the_mark_at_the_step(dev):
    """Marked first, saved for backward after: the barrier drops the mark
    (a warning), so the backward that follows still finds its input."""
    w = torch.nn.Parameter(materialize(torch.full((4,), 3.0, device=dev)))
    tdx.donate_buffer(w)
    loss = (w * w).sum()
    with pytest.warns(tdx.DroppedDonationWarning,
                      match=r"f32\[4\].*saved for backward by a live autograd graph"):
        torch_xla.sync(wait=True)
    _untouched(w, torch.full((4,), 3.0))
    loss.backward()
    torch_xla.sync(wait=True)
    assert w.grad.cpu().tolist() == [6.0] * 4
    assert _C.step_stats()["dropped"] == 1  # the newest step that donated


def test_non_leaf_saved_for_backward_is_refused(dev):
    x = torch.nn.Parameter(materialize(torch.zeros(3, device=dev)))
    e = x.exp()  # exp saves its own result: an alias of e's buffer
    h = x * 2 + 1
    torch_xla.sync()
    with pytest.raises(ValueError, match="an autograd graph that saved it for backward"):
        tdx.donate_buffer(e)
    y = (h * h).sum() + e.sum()  # mul saves h itself
    with pytest.raises(ValueError, match="is saved for backward by a live autograd graph"):
        tdx.donate_buffer(h)
    y.backward()
    torch_xla.sync()
    assert x.grad.cpu().tolist() == pytest.approx([5.0] * 3)  # 2 * 2 * h + exp(0)


def test_leaf_requiring_grad_with_no_graph_can_be_donated(dev):
    w = torch.nn.Parameter(materialize(torch.ones(4, device=dev)))
    out = (w * 2).sum()  # a graph that saves only the constant
    tdx.donate_buffer(w)
    with torch.no_grad():
        new_w = w + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and isinstance(w, torch.nn.Parameter)
    assert new_w.cpu().tolist() == [2.0] * 4


# -- dtypes and shapes: documented correct behaviour -------------------------


@pytest.mark.parametrize("dtype,fill,update", [
    (torch.int32, 7, lambda t: t + 1),
    (torch.int64, -3, lambda t: t * 2),
    (torch.bool, True, lambda t: ~t),
    (torch.uint8, 200, lambda t: t // 2),
    (torch.complex64, 1 + 2j, lambda t: t * 1j),
    (torch.bfloat16, 1.5, lambda t: t * 2),
], ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else "")
def test_any_dtype_is_donated_like_float(dev, dtype, fill, update):
    t = materialize(torch.full((8,), fill, dtype=dtype, device=dev))
    expected = update(torch.full((8,), fill, dtype=dtype))
    tdx.donate_buffer(t)
    new = update(t)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t)
    with pytest.raises(tdx.DonatedBufferError):
        t.cpu()
    assert torch.equal(new.cpu(), expected)


def test_output_of_another_dtype_of_the_same_size_can_take_the_buffer(dev):
    """XLA pairs donated buffers with outputs by byte size: f32[4] can hold s32[4]."""
    t = materialize(torch.arange(4.0, device=dev))
    tdx.donate_buffer(t)
    as_int = (t * 2).to(torch.int32)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and as_int.cpu().tolist() == [0, 2, 4, 6]


def test_zero_size_tensor(dev):
    """Zero bytes: taken by a zero-byte output if there is one (and then
    poisoned like any donation), else an unused donation."""
    z = materialize(torch.empty(0, device=dev))
    tdx.donate_buffer(z)
    out = z + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(z) and out.shape == (0,)
    lonely = materialize(torch.empty(0, 3, device=dev))
    tdx.donate_buffer(lonely)
    other = torch.ones(2, device=dev) * 2
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[0,3\]"):
        torch_xla.sync(wait=True)
    _untouched(lonely)
    assert lonely.shape == (0, 3)


def test_scalars_are_refused_because_torch_xla_shares_their_buffers(dev):
    """torch_xla hands one cached device buffer to every 0-dim tensor of the
    same value moved to the device; donating one used to delete the value
    for all of them, and for the constant in ``t * 2.5`` too."""
    a = torch.tensor(2.5, device=dev)
    b = torch.tensor(2.5).to(dev)
    c = torch.full((), 2.5, device=dev)
    materialize(a, b, c)
    assert buffer_ptr(a) == buffer_ptr(b) == buffer_ptr(c)  # one buffer, three tensors
    computed = materialize(torch.ones(4, device=dev).sum())
    for s in (a, b, c, computed):
        with pytest.raises(ValueError, match=r"f32\[\] is 0-dimensional.*do not donate it"):
            tdx.donate_buffer(s)
    scaled = torch.ones(2, device=dev) * 2.5
    torch_xla.sync(wait=True)
    assert scaled.cpu().tolist() == [2.5, 2.5]
    for s in (a, b, c):
        _untouched(s, torch.tensor(2.5))


def test_donating_a_tree_skips_its_scalars(dev):
    """A functional optimizer's state holds a step counter: ``donate(tree)``
    marks the real buffers and leaves 0-dim tensors alone, as it does numbers."""
    w = materialize(torch.ones(4, device=dev))
    step = torch.tensor(7.0).to(dev)  # the cached buffer of 7.0
    materialize(step)
    assert tdx.donate({"w": w, "step": step, "lr": 0.1}) == 1
    assert tdx.is_donated(w) and not tdx.is_donated(step)
    new_w, new_step = w * 2, step + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and new_w.cpu().tolist() == [2.0] * 4
    assert step.item() == 7.0 and new_step.item() == 8.0
    assert torch.tensor(7.0).to(dev).item() == 7.0  # the cache is intact


def test_tensor_moved_to_the_device_needs_no_step(dev):
    """``cpu_tensor.to(device)`` is device data at once: it can be donated
    before any step."""
    t = torch.arange(3.0).to(dev)
    tdx.donate_buffer(t)
    assert tdx.is_donated(t)
    new = t + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and new.cpu().tolist() == [1.0, 2.0, 3.0]


# -- tensor subclasses ---------------------------------------------------------


def test_as_subclass_is_a_view_and_says_so(dev):
    t = torch.ones(4, device=dev).as_subclass(Tagged)
    torch_xla.sync()
    with pytest.raises(ValueError, match=r"is a view \(.*as_subclass"):
        tdx.donate_buffer(t)
    _untouched(t, torch.ones(4))


def test_subclass_sharing_the_tensor_can_be_donated_and_keeps_its_methods(dev):
    plain = materialize(torch.ones(4, device=dev))
    t = torch.Tensor._make_subclass(Tagged, plain)
    del plain
    tdx.donate_buffer(t)
    new = torch.Tensor.add(t, 1)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and isinstance(t, Tagged) and t.tag() == "tagged"
    with pytest.raises(tdx.DonatedBufferError):
        t + 1
    assert new.cpu().tolist() == [2.0] * 4


def test_wrapper_subclass_has_no_buffer_of_its_own(dev):
    inner = materialize(torch.ones(4, device=dev))
    w = Wrapper(inner)
    with pytest.raises(TypeError, match="Wrapper is a tensor subclass with its own __torch_dispatch__.*"
                                        "Donate the XLA tensors it wraps"):
        tdx.donate_buffer(w)
    assert _C.marked_count() == 0
    _untouched(inner, torch.ones(4))
    tdx.donate_buffer(w.inner)  # the advice works
    assert tdx.is_donated(inner)
    tdx.undonate(inner)


def test_subclass_guarding_its_class_is_poisoned_all_the_same(dev):
    """Poisoning goes past the subclass's ``__setattr__``: the step does not
    raise half-way and the consumed tensor refuses use at the use site."""
    t = torch.Tensor._make_subclass(Guarded, materialize(torch.ones(4, device=dev)))
    tdx.donate_buffer(t)
    new = torch.Tensor.add(t, 1)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and isinstance(t, Guarded)
    with pytest.raises(tdx.DonatedBufferError):
        t + 1
    assert new.cpu().tolist() == [2.0] * 4


def test_subclass_that_cannot_change_class_is_refused_at_marking(dev):
    t = torch.Tensor._make_subclass(Pinned, materialize(torch.ones(4, device=dev)))
    with pytest.raises(TypeError, match=r"cannot donate a .*Pinned.*refuses that.*Donate a plain"):
        tdx.donate_buffer(t)
    assert type(t) is Pinned and _C.marked_count() == 0
    with pytest.raises(TypeError, match=r"cannot donate tree\[0\].*Pinned"):
        tdx.donate([t])
    assert _C.marked_count() == 0


def test_class_changed_after_marking_fails_the_sync_after_the_step_ran(dev):
    """The step's results are intact, the other donors are poisoned, the
    tensor torch_xla computes with refuses operators, and the error names
    the class."""
    plain = materialize(torch.ones(4, device=dev))
    t = torch.Tensor._make_subclass(Tagged, plain)
    other = materialize(torch.full((4,), 2.0, device=dev))
    del plain
    tdx.donate_buffer(t)
    tdx.donate_buffer(other)
    object.__setattr__(t, "__class__", Pinned)  # now it cannot take a twin class
    new = torch.Tensor.add(t, 1)
    new_other = other * 3
    with pytest.raises(TypeError, match=r"could not mark the donated Pinned f32\[4\].*results are intact"):
        torch_xla.sync(wait=True)
    assert new.cpu().tolist() == [2.0] * 4 and new_other.cpu().tolist() == [6.0] * 4
    tdx.settle()
    assert tdx.is_deleted(other)
    with pytest.raises(tdx.DonatedBufferError):
        torch.Tensor.add(t, 1)
