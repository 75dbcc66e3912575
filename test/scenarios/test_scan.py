"""torch_xla.experimental.scan: the donated carry's buffer holds the final
carry, step after step; donating xs is reported unused and loses nothing."""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from helpers import buffer_ptr, materialize, settled_sync
from torch_xla.experimental.scan import scan

import torch_xla_donate as tdx

STEPS = 4


def _decay(carry, x):
    new = carry * 0.5 + x
    return new, new.sum()  # ys are scalars: no output has xs' size


def _inputs(dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    carry = torch.randn(128, 64, generator=gen).to(dev)
    xs = torch.randn(3, 128, 64, generator=gen).to(dev)
    return materialize(carry, xs)


def _executions() -> int:
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


def _loop(dev, donate: bool):
    carry, xs = _inputs(dev)
    first = buffer_ptr(carry)
    ptrs, old_carries = [], []
    for _ in range(STEPS):
        if donate:
            tdx.donate_buffer(carry)
        old_carries.append(carry)
        carry, ys = scan(_decay, carry, xs)
        torch_xla.sync()
        ptrs.append(buffer_ptr(carry))
    return first, ptrs, old_carries, carry.cpu(), ys.cpu()


def test_fed_back_carry_keeps_its_buffer_step_after_step(dev):
    first, ptrs, olds, carry, ys = _loop(dev, donate=True)
    assert ptrs == [first] * STEPS
    for old in olds:
        assert tdx.is_deleted(old)
        with pytest.raises(tdx.DonatedBufferError, match=r"f32\[128,64\]"):
            old + 1
    ref_first, ref_ptrs, ref_olds, ref_carry, ref_ys = _loop(dev, donate=False)
    assert ref_first not in ref_ptrs[1:]  # without donation: fresh buffers
    assert not any(tdx.is_deleted(t) for t in ref_olds)
    assert torch.equal(carry, ref_carry) and torch.equal(ys, ref_ys)


def test_scan_is_staged_and_committed_by_the_next_barrier(dev):
    """scan only builds a lazy xla::scan node: no computation runs when it
    returns, the mark waits, and the barrier that runs the loop commits it."""
    carry, xs = _inputs(dev)
    tdx.donate_buffer(carry)
    runs = _executions()
    new, _ = scan(_decay, carry, xs)
    assert _executions() == runs
    assert tdx.is_donated(carry) and not tdx.is_deleted(carry)
    torch_xla.sync()
    assert not tdx.is_donated(carry) and tdx.is_deleted(carry)


def test_donated_xs_is_unused_and_keeps_its_value(dev):
    carry, xs = _inputs(dev)
    before = xs.cpu()
    tdx.donate_buffer(xs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        carry, ys = scan(_decay, carry, xs)
        torch_xla.sync()
        deleted = tdx.is_deleted(xs)
    unused = [w for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    assert len(unused) == 1 and "f32[3,128,64]" in str(unused[0].message)
    assert not deleted and not tdx.is_donated(xs)
    assert torch.equal(xs.cpu(), before)
    # The same scan again: the old mark did not stay armed.
    again, _ = scan(_decay, carry, xs)
    torch_xla.sync()
    assert torch.equal(xs.cpu(), before) and not tdx.is_deleted(carry)


def test_donated_xs_in_strict_mode_raises_and_keeps_its_value(dev):
    carry, xs = _inputs(dev)
    before = xs.cpu()
    previous = tdx.configure(strict=True)
    try:
        tdx.donate_buffer(xs)
        carry, _ = scan(_decay, carry, xs)
        with pytest.raises(tdx.UnusedDonationError, match=r"f32\[3,128,64\]"):
            torch_xla.sync(wait=True)
            tdx.is_deleted(xs)
    finally:
        tdx.configure(**previous)
    assert torch.equal(xs.cpu(), before)
    assert carry.abs().sum().item() > 0


def test_pytree_carry_every_leaf_reuses_its_buffer(dev):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(32, 16, generator=gen).to(dev)
    count = torch.zeros(7).to(dev)  # scan's tracing needs float leaves
    xs = torch.randn(5, 32, 16, generator=gen).to(dev)
    materialize(h, count, xs)
    ptrs = (buffer_ptr(h), buffer_ptr(count))
    expected_h = h.cpu()
    for x in xs.cpu():
        expected_h = torch.tanh(expected_h + x)

    def fn(carry, x):
        h, count = carry
        return (torch.tanh(h + x), count + 1), h.mean()

    olds = (h, count)
    tdx.donate_buffer(h)
    tdx.donate_buffer(count)
    (h, count), _ = scan(fn, (h, count), xs)
    torch_xla.sync()
    assert (buffer_ptr(h), buffer_ptr(count)) == ptrs
    assert all(tdx.is_deleted(t) for t in olds)
    assert torch.allclose(h.cpu(), expected_h, atol=1e-5)
    assert count.cpu().tolist() == [5.0] * 7


def _layers(dev, donate: bool):
    """scan over stacked layer weights with autograd: the donated input
    activation is the carry, the weights are xs."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(4, 64, 64, generator=gen) * 0.1).to(dev).requires_grad_()
    h = torch.randn(16, 64, generator=gen).to(dev)
    materialize(w, h)
    ptr, old = buffer_ptr(h), h
    if donate:
        tdx.donate_buffer(h)
    h, ys = scan(lambda c, x: (torch.tanh(c @ x), c.sum()), h, w)
    (h.sum() + ys.sum()).backward()
    settled_sync()  # bit-repeatable, with or without donation
    return buffer_ptr(h) == ptr, tdx.is_deleted(old), h.cpu(), w.grad.cpu()


def test_carry_donated_in_a_scan_with_backward(dev):
    reused, deleted, h, grad = _layers(dev, donate=True)
    ref_reused, ref_deleted, ref_h, ref_grad = _layers(dev, donate=False)
    assert (reused, deleted) == (True, True)
    assert (ref_reused, ref_deleted) == (False, False)
    assert torch.equal(h, ref_h) and torch.equal(grad, ref_grad)
    assert grad.abs().sum() > 0
