"""gradient_accumulation: donated carried tensors reuse their buffers; donated
model parameters are refused before anything runs."""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from helpers import buffer_ptr, materialize, settled_sync
from torch_xla.experimental import gradient_accumulation as _ga

import torch_xla_donate as tdx
from torch_xla_donate import _hooks as integrations
from torch_xla_donate import _native as _compat
from torch_xla_donate._native import call_gradient_accumulation


def gradient_accumulation(train_step, iterable_tensors, model, *carried):
    """torch_xla's, with the carried tensors in the form this release takes."""
    return call_gradient_accumulation(_ga.gradient_accumulation, train_step, iterable_tensors,
                                      model, *carried)

# After torch_xla 2.7's gradient_accumulation, XLA no longer takes the
# parameters' buffers as donors (torch_xla's own flag is ignored too, plugin
# or not): such a donation is honestly unused there, its value kept.
KEEPS_PARAMETER_BUFFERS = _compat.release(torch_xla.__version__) < (2, 8)

MICRO_BATCHES = 4
ACC_SHAPE = (96, 96)  # no other output of the step has this byte size


def _setup(dev, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 4).to(dev)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(MICRO_BATCHES, 8, 32, generator=gen).to(dev)
    target = torch.randn(MICRO_BATCHES, 8, 4, generator=gen).to(dev)
    acc = torch.zeros(ACC_SHAPE).to(dev)
    materialize(data, target, acc)
    return model, data, target, acc


def _train_step(model):
    def step(x, y, acc):
        out = model(x)
        loss = ((out - y) ** 2).mean()
        # The carried accumulator: a running sum of the outputs' squares.
        return loss, acc + (out**2).sum()

    return step


def _run(dev, donate: bool, calls=3):
    model, data, target, acc = _setup(dev)
    first_ptr = buffer_ptr(acc)
    same_ptr, deleted, losses = [], [], []
    for _ in range(calls):
        old = acc
        if donate:
            tdx.donate_buffer(acc)
        loss, acc = gradient_accumulation(_train_step(model), (data, target), model, acc)
        settled_sync()  # bit-repeatable, with or without donation
        same_ptr.append(buffer_ptr(acc) == first_ptr)
        deleted.append(tdx.is_deleted(old))
        losses.append(loss.item())
        del old
    grads = [p.grad.cpu() for p in model.parameters()]
    return same_ptr, deleted, losses, acc.cpu(), grads, model


def test_donated_carried_tensor_reuses_its_buffer_call_after_call(dev):
    same_ptr, deleted, losses, acc, grads, _ = _run(dev, donate=True)
    assert same_ptr == [True] * 3
    assert deleted == [True] * 3
    # Same numbers as without donation.
    ref_same_ptr, ref_deleted, ref_losses, ref_acc, ref_grads, _ = _run(dev, donate=False)
    assert ref_same_ptr == [False] * 3 and ref_deleted == [False] * 3
    assert losses == ref_losses
    assert torch.equal(acc, ref_acc) and acc.abs().sum() > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_the_old_carried_tensor_is_poisoned(dev):
    model, data, target, acc = _setup(dev)
    old = acc
    tdx.donate_buffer(acc)
    _, acc = gradient_accumulation(_train_step(model), (data, target), model, acc)
    torch_xla.sync()
    with pytest.raises(tdx.DonatedBufferError, match=r"f32\[96,96\]"):
        old.sum()
    # Feeding the dead tensor back in is caught at the user's train_step.
    with pytest.raises(tdx.DonatedBufferError):
        gradient_accumulation(_train_step(model), (data, target), model, old)


def _executions() -> int:
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_donated_parameter_is_refused_before_anything_runs(dev, which):
    model, data, target, acc = _setup(dev)
    param = getattr(model, which)
    before = param.detach().cpu()
    tdx.donate_buffer(param)
    runs = _executions()
    with pytest.raises(tdx.ParameterDonationError, match=rf"parameter '{which}'.*undonate"):
        gradient_accumulation(_train_step(model), (data, target), model, acc)
    assert _executions() == runs  # nothing ran
    assert tdx.is_donated(param)  # the mark is left as it was
    assert param.grad is None
    assert tdx.undonate(param)
    loss, acc = gradient_accumulation(_train_step(model), (data, target), model, acc)
    torch_xla.sync()
    assert not tdx.is_deleted(param) and torch.equal(param.detach().cpu(), before)
    assert param.grad is not None and loss.item() > 0


def test_donated_model_buffer_is_refused(dev):
    model, data, target, acc = _setup(dev)
    model.register_buffer("scale", torch.full((4,), 2.0, device=dev))
    materialize(model.scale)
    tdx.donate_buffer(model.scale)

    def step(x, y, acc):
        loss = ((model(x) * model.scale - y) ** 2).mean()
        return loss, acc + loss

    with pytest.raises(tdx.ParameterDonationError, match="buffer 'scale' f32\\[4\\]"):
        gradient_accumulation(step, (data, target), model, acc)
    assert tdx.undonate(model.scale)


def test_parameter_donated_after_the_call_may_be_replaced(dev):
    """The way out the error names: mark the old parameter once
    gradient_accumulation has returned, and build its replacement."""
    model, data, target, acc = _setup(dev)
    old = model.weight
    ptr = buffer_ptr(old)
    gradient_accumulation(_train_step(model), (data, target), model, acc)
    # Read before the update is traced: a read of the gradient may run what
    # is pending with it (torch_xla 2.7 does), new weight included.
    expected = (old.detach().cpu() - 0.1 * old.grad.cpu())
    with torch.no_grad():
        tdx.donate_buffer(old)
        new = old - 0.1 * old.grad
    if KEEPS_PARAMETER_BUFFERS:
        before = old.detach().cpu()
        with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[4,32\]"):
            torch_xla.sync()
            tdx.settle()
        assert not tdx.is_deleted(old) and torch.equal(old.detach().cpu(), before)
        assert torch.allclose(new.cpu(), expected)
        return
    torch_xla.sync()
    model.weight = torch.nn.Parameter(new)
    assert tdx.is_deleted(old)
    # Two outputs have the weight's size (its gradient and the new weight):
    # XLA gives the buffer to one of them.
    assert ptr in (buffer_ptr(model.weight), buffer_ptr(old.grad))
    assert torch.allclose(model.weight.detach().cpu(), expected)


def test_without_the_guard_a_donated_parameter_is_destroyed(dev):
    """Why the guard exists: torch_xla alone lets the loop consume it."""
    model, data, target, acc = _setup(dev)
    integrations._uninstall_gradient_accumulation()
    try:
        tdx.donate_buffer(model.weight)
        gradient_accumulation(_train_step(model), (data, target), model, acc)
        torch_xla.sync()
    finally:
        integrations._install_gradient_accumulation()
    if _compat.release(torch_xla.__version__) >= (2, 8):
        assert tdx.is_deleted(model.weight)
        with pytest.raises(tdx.DonatedBufferError):
            model(data[0])
    else:  # torch_xla 2.7 traces the loop apart and happens to keep it
        assert not tdx.is_deleted(model.weight)


def test_donated_iterable_tensor_is_not_consumed_by_the_inner_sync(dev):
    """gradient_accumulation materializes its input slices with
    _xla_sync_multi, which is no barrier: the mark must survive it and be
    judged by the real step (no output has the data's size: unused)."""
    model, data, target, acc = _setup(dev)
    before = data.cpu()
    tdx.donate_buffer(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, acc = gradient_accumulation(_train_step(model), (data, target), model, acc)
        assert tdx.is_donated(data)  # still waiting for the barrier
        torch_xla.sync()
        tdx.is_deleted(data)  # settles the verdict
    unused = [w for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    assert len(unused) == 1 and "f32[4,8,32]" in str(unused[0].message)
    assert not tdx.is_deleted(data) and torch.equal(data.cpu(), before)
    assert loss.item() > 0


def test_guard_is_installed_on_import_and_idempotent():
    from torch_xla.experimental import gradient_accumulation as module

    assert hasattr(module._gradient_accumulation, "__torch_xla_donate_original__")
    wrapped = module._gradient_accumulation
    integrations._install_gradient_accumulation()
    assert module._gradient_accumulation is wrapped
    integrations._uninstall_gradient_accumulation()
    try:
        assert not hasattr(module._gradient_accumulation, "__torch_xla_donate_original__")
    finally:
        integrations._install_gradient_accumulation()
    assert module._gradient_accumulation.__torch_xla_donate_original__ is not None


def test_only_the_step_it_builds_skips_unreachable_holders(dev):
    """gradient_accumulation's graph holds its inputs' buffers, so the step
    it builds does not count holders Python cannot reach; the steps after it
    do: a copy only an autograd graph holds is seen again."""
    model, data, target, acc = _setup(dev)
    gradient_accumulation(_train_step(model), (data, target), model, acc)
    torch_xla.sync()
    p = materialize(torch.randn(16, 16, device=dev))
    u = p.to(dev, copy=True)  # shares p's buffer after the step
    torch_xla.sync()
    w = torch.ones(16, 16, device=dev, requires_grad=True)
    loss = (u @ w).sum()
    del u  # only the autograd graph holds the copy now
    value = p.cpu()
    with pytest.warns(tdx.DroppedDonationWarning, match="also held where Python cannot reach"):
        tdx.donate_buffer(p)
        new = p * 2
        torch_xla.sync()
        tdx.settle()
    assert not tdx.is_deleted(p) and torch.equal(p.cpu(), value)
    loss.backward()  # the copy's buffer is intact
    assert torch.equal(new.cpu(), value * 2) and w.grad is not None


def test_a_captured_tensor_donated_in_the_step_it_builds_is_reused(dev):
    """The other half: the step gradient_accumulation builds holds the
    buffer of a tensor its loop only captures (a weight read by the
    closure), one reference no tensor owns; donated there, that tensor is
    still reused, not dropped as held elsewhere (the example's pattern)."""
    model, data, target, acc = _setup(dev)
    w = materialize(torch.randn(32, 32, device=dev))
    value = w.cpu()

    def step(x, y, acc):
        out = model(x @ w)
        return ((out - y) ** 2).mean(), acc + (out**2).sum()

    old_w = w
    tdx.donate_buffer(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdx.DroppedDonationWarning)
        loss, acc = gradient_accumulation(step, (data, target), model, acc)
        w = w * 0.5  # an output of w's size takes its buffer
        torch_xla.sync()
        tdx.settle()
    assert tdx.is_deleted(old_w)
    assert torch.equal(w.cpu(), value * 0.5) and loss.item() > 0
