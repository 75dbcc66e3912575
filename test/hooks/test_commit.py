"""Committing marks at a barrier: every barrier commits the marks, XLA
reuses the buffers, donated tensors are poisoned, unused marks do not
linger, holders that appeared after marking drop the mark, and a barrier
never raises from the plugin's own checks."""
import inspect
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
import torch_xla_donate._verdicts
from torch_xla_donate import _C


def _functional_update(dev, n=256):
    """A materialized state and gradient, marked: returns (state, grad, ptr)."""
    p, g = materialize(torch.randn(n, n, device=dev), torch.randn(n, n, device=dev))
    ptr = buffer_ptr(p)
    tdx.donate_buffer(p)
    return p, g, ptr


def _barrier_mark_step():
    xm.mark_step()


def _barrier_sync():
    torch_xla.sync()


def _barrier_sync_wait():
    torch_xla.sync(wait=True)


BARRIERS = {"xm.mark_step": _barrier_mark_step, "torch_xla.sync": _barrier_sync,
            "sync(wait=True)": _barrier_sync_wait}


@pytest.mark.parametrize("barrier", BARRIERS.values(), ids=BARRIERS.keys())
def test_barrier_commits_the_donation_and_reuses_the_buffer(dev, barrier):
    p, g, ptr = _functional_update(dev)
    expected = (p * 0.9 + g).cpu()
    new = p * 0.9 + g
    barrier()
    assert buffer_ptr(new) == ptr
    assert torch.equal(new.cpu(), expected)
    assert tdx.is_deleted(p)


def test_torch_xla_step_context_applies_marks_made_before_it(dev):
    p, g, ptr = _functional_update(dev)
    unrelated = torch.ones(256, 256, device=dev) * 3  # pending: flushed on entry
    with torch_xla.step():
        new = p - 0.5 * g
    assert buffer_ptr(new) == ptr
    assert tdx.is_deleted(p)
    assert unrelated.sum().item() == 3 * 256 * 256


def test_torch_xla_compile_commits_marks_made_inside(dev):
    p, g = materialize(torch.randn(64, 64, device=dev), torch.randn(64, 64, device=dev))
    ptr = buffer_ptr(p)
    expected = (p + g).cpu()

    @torch_xla.compile
    def update(p, g):
        tdx.donate_buffer(p)
        return p + g

    new = update(p, g)
    assert buffer_ptr(new) == ptr and torch.equal(new.cpu(), expected)
    assert tdx.is_deleted(p)


def test_mp_device_loader_iteration_is_a_barrier(dev):
    batches = [torch.full((64,), float(i)) for i in range(3)]
    loader = pl.MpDeviceLoader(batches, dev)
    acc = materialize(torch.zeros(64, device=dev))
    seen = []
    for batch in loader:
        old, ptr = acc, buffer_ptr(acc)
        tdx.donate_buffer(acc)
        acc = acc + batch
        seen.append((old, ptr))
    torch_xla.sync()
    for old, _ in seen:
        assert tdx.is_deleted(old)
    # Each step's sum landed in the previous accumulator's buffer.
    assert buffer_ptr(acc) == seen[-1][1]
    assert acc.cpu().tolist() == [3.0] * 64


def test_use_raises_at_the_line_that_touched_it(dev):
    p, g, _ = _functional_update(dev, n=8)
    new = p + g
    torch_xla.sync()
    with pytest.raises(tdx.DonatedBufferError) as info:
        line = inspect.currentframe().f_lineno + 1
        p.mul(2)
    assert any(entry.lineno + 1 == line and entry.path.name == "test_commit.py"
               for entry in info.traceback)


USES = {
    "arithmetic": lambda t: t * 2,
    "indexing": lambda t: t[0],
    "in-place": lambda t: t.add_(1),
    "cpu": lambda t: t.cpu(),
    "item": lambda t: t[0, 0].item(),
    "other op": lambda t: torch.matmul(torch.ones(8, 8, device=t.device), t),
    "print": lambda t: print(t.tolist()),
}


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_every_use_raises_before_any_sync(dev, use):
    p, g, _ = _functional_update(dev, n=8)
    new = p + g
    torch_xla.sync()
    with pytest.raises(tdx.DonatedBufferError, match=r"f32\[8,8\].*test_commit\.py:\d+"):
        use(p)
    # Nothing of the failed use reached the graph: the next step is clean.
    torch_xla.sync(wait=True)
    assert new.shape == (8, 8) and torch.isfinite(new.cpu()).all()


def test_message_has_step_and_the_donate_call_site(dev):
    p, g = materialize(torch.ones(4, 2, device=dev), torch.ones(4, 2, device=dev))
    line = inspect.currentframe().f_lineno + 1
    tdx.donate_buffer(p)
    new = p + g
    torch_xla.sync()
    step = _C.current_step()
    with pytest.raises(tdx.DonatedBufferError) as info:
        p.sum()
    msg = str(info.value)
    assert f"test_commit.py:{line}" in msg and f"step {step}" in msg
    assert "f32[4,2]" in msg and "32 bytes" in msg
    assert p.shape == (4, 2) and p.dtype == torch.float32 and p.device == dev
    assert "donated" in repr(p)


def test_unused_mark_warns_keeps_value_and_does_not_linger(dev):
    lonely, other = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(lonely)
    out = other * 2  # `lonely` is no input of this step
    with pytest.warns(tdx.UnusedDonationWarning, match=r"not usable.*f32\[3\]"):
        torch_xla.sync(wait=True)
    assert not tdx.is_donated(lonely) and not tdx.is_deleted(lonely)
    assert lonely.cpu().tolist() == [0.0, 1.0, 2.0]
    # The old mark must not fire in a later step that could use the buffer.
    ptr = buffer_ptr(lonely)
    later = lonely + 1
    torch_xla.sync(wait=True)
    assert buffer_ptr(later) != ptr
    assert lonely.cpu().tolist() == [0.0, 1.0, 2.0]


def test_no_output_of_the_same_size_means_unused(dev):
    x = materialize(torch.arange(5.0, device=dev))
    tdx.donate_buffer(x)
    total = x.sum()  # f32[] cannot live in an f32[5] buffer
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[5\]"):
        torch_xla.sync(wait=True)
    assert total.item() == 10.0 and x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def _inference_update(dev):
    """A tensor without a version counter: only its pending value tells."""
    with torch.inference_mode():
        t = materialize(torch.ones(16, device=dev))
    tdx.donate_buffer(t)
    with torch.inference_mode():
        t.mul_(5)
    return t, 5.0


def _barrier_update(dev):
    """torch_xla's in-place function: pending, with the same id and version."""
    t = materialize(torch.ones(16, device=dev))
    tdx.donate_buffer(t)
    xm.optimization_barrier_([t])
    return t, 1.0


def _mul_update(dev):
    t = materialize(torch.ones(16, device=dev))
    tdx.donate_buffer(t)
    t.mul_(5)
    return t, 5.0


@pytest.mark.parametrize("update", [_mul_update, _barrier_update, _inference_update],
                         ids=["mul_", "optimization_barrier_", "inference tensor"])
def test_in_place_update_after_marking_keeps_the_new_value(dev, update):
    t, value = update(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an output, not a dropped donation
        torch_xla.sync(wait=True)
    assert not tdx.is_deleted(t)
    assert t.cpu().tolist() == [value] * 16
    assert _C.step_stats()["updated_in_place"] == 1


def test_view_taken_after_marking_drops_the_donation(dev):
    t = materialize(torch.arange(4.0, device=dev))
    tdx.donate_buffer(t)
    head = t[0:2]
    doubled = t * 2
    with pytest.warns(tdx.DroppedDonationWarning, match=r"f32\[4\]"):
        torch_xla.sync(wait=True)
    assert head.cpu().tolist() == [0.0, 1.0]
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert doubled.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_weakref_to_a_donated_tensor_sees_the_poison(dev):
    import weakref
    p, g, ptr = _functional_update(dev, n=8)
    ref = weakref.ref(p)
    new = p + g
    torch_xla.sync()
    assert buffer_ptr(new) == ptr
    with pytest.raises(tdx.DonatedBufferError):
        ref().sum()


def test_a_donor_only_a_weakref_reaches_is_never_usable(dev):
    # The commit lets such a donor go (test/outcomes/test_release.py): the
    # weak reference is dead right after the barrier.  Were it kept alive
    # (several devices, native reads off), it would be poisoned.
    import weakref
    p, g, ptr = _functional_update(dev, n=8)
    ref = weakref.ref(p)
    new = p + g
    del p  # only the weakref (and the plugin) can reach it now
    torch_xla.sync()
    assert buffer_ptr(new) == ptr
    left = ref()
    if left is not None:
        with pytest.raises(tdx.DonatedBufferError):
            left.sum()


def test_a_donor_an_autograd_node_holds_is_still_poisoned(dev):
    # The AccumulateGrad node of a leaf keeps its TensorImpl, and hands the
    # tensor back to Python (``.variable``) after the user dropped it.
    w = materialize(torch.randn(8, device=dev).requires_grad_())
    y = w * 2
    tdx.donate_buffer(w)
    with torch.no_grad():
        new = w * 0.5
    del w
    torch_xla.sync()
    again = y.grad_fn.next_functions[0][0].variable
    with pytest.raises(tdx.DonatedBufferError):
        again.sum()


def test_donors_the_user_dropped_are_judged_but_not_poisoned(dev):
    # ``params = [p * 2 for p in params]`` drops the old tensors: nobody can
    # use them again, so the barrier leaves them as they are (poisoning
    # would only make freeing them dearer).  Their verdicts still count.
    kept, dropped = materialize(torch.ones(4, device=dev), torch.ones(4, device=dev))
    tdx.donate_buffer(kept)
    tdx.donate_buffer(dropped)
    new_kept, new_dropped = kept * 2, dropped * 3
    del dropped
    torch_xla.sync(wait=False)
    step = _C.current_step()
    in_flight = [t for t, _ in torch_xla_donate._verdicts._in_flight]
    assert len(in_flight) == 2 and torch_xla_donate._poison.is_poisoned(kept)
    assert [torch_xla_donate._poison.is_poisoned(t) for t in in_flight if t is not kept] == [False]
    del in_flight
    tdx.settle()
    r = tdx.last_step_report(step)
    assert (r.donated, r.reused, r.unused) == (2, 2, 0)
    with pytest.raises(tdx.DonatedBufferError):
        kept.sum()
    assert new_dropped.cpu().tolist() == [3.0] * 4 and new_kept.cpu().tolist() == [2.0] * 4


def test_nn_parameter_is_poisoned_in_place(dev):
    lin = torch.nn.Linear(8, 8).to(dev)
    materialize(lin.weight)
    w = lin.weight
    tdx.donate_buffer(w)
    new_w = w * 0.5
    torch_xla.sync()
    assert isinstance(lin.weight, torch.nn.Parameter) and tdx.is_deleted(lin.weight)
    with pytest.raises(tdx.DonatedBufferError):
        lin(torch.ones(2, 8, device=dev))


# -- A barrier never raises from the plugin's own checks ----------------------


@pytest.fixture
def broken_judgement(monkeypatch):
    """The holders' judgement raises, as an unforeseen tensor might make it."""
    from torch_xla_donate import _holders as ownership

    def judge(t):
        raise RuntimeError("an unforeseen tensor")

    monkeypatch.setattr(ownership, "judge", judge)


def test_a_check_that_cannot_decide_drops_the_mark_and_the_step_runs(dev, broken_judgement):
    p = materialize(torch.full((4,), 3.0, device=dev))
    tdx.donate_buffer(p)
    view = p[0:2]  # a holder: the judgement runs at the barrier, and raises
    new = p * 2
    with pytest.warns(tdx.DroppedDonationWarning,
                      match=r"could not decide .*RuntimeError: an unforeseen tensor"):
        torch_xla.sync()
    assert new.cpu().tolist() == [6.0] * 4  # the step ran
    assert p.cpu().tolist() == [3.0] * 4 and view.cpu().tolist() == [3.0] * 2
    assert not tdx.is_donated(p) and not torch_xla._XLAC._get_buffer_donation(p)
    report = tdx.last_step_report()
    assert report.dropped == 1 and report.in_flight == 0


def test_warnings_made_errors_by_a_filter_come_after_the_step(dev):
    """``-W error``: the warning a barrier gives raises, but only once the
    step ran and every donation has its verdict."""
    p = materialize(torch.full((4,), 3.0, device=dev))
    q = materialize(torch.full((4,), 5.0, device=dev))
    tdx.donate_buffer(p)
    tdx.donate_buffer(q)
    view = p[0:2]  # p's mark is dropped at the barrier, with a warning
    new_p, new_q = p * 2, q * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdx.DroppedDonationWarning)
        with pytest.raises(tdx.DroppedDonationWarning, match="live view or alias"):
            torch_xla.sync()
    assert new_p.cpu().tolist() == [6.0] * 4 and new_q.cpu().tolist() == [10.0] * 4
    tdx.settle()
    assert tdx.is_deleted(q) and not tdx.is_deleted(p)
    assert view.cpu().tolist() == [3.0] * 2
    assert tdx.last_step_report().in_flight == 0


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_torch_func_pattern_donates_under_any_grad_mode(dev, mode):
    """``params = {k: v.detach() ...}`` shares storage with the module: the
    ownership check waits for autograd's worker thread, which must work
    whatever the caller's grad mode (an optimizer update runs under
    ``no_grad``)."""
    model = torch.nn.Linear(8, 8).to(dev)
    torch_xla.sync()
    params = {k: v.detach() for k, v in model.named_parameters()}
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        assert tdx.donate(params) == 2
        new = {k: v * 0.5 for k, v in params.items()}
        torch_xla.sync()
    tdx.settle()
    assert all(tdx.is_deleted(v) for v in params.values())
    with pytest.raises(tdx.DonatedBufferError, match="parameter 'weight' of Linear"):
        model(torch.ones(1, 8, device=dev))
    assert new["weight"].shape == (8, 8)


def test_a_compiled_call_with_a_viewed_marked_argument_drops_it(dev):
    step = torch.compile(lambda p, g: p * 0.5 + g, backend="openxla")
    p = materialize(torch.full((4,), 2.0, device=dev))
    g = materialize(torch.ones(4, device=dev))
    tdx.donate_buffer(p)
    view = p[0:2]
    with pytest.warns(tdx.DroppedDonationWarning, match="live view or alias"):
        with torch.no_grad():
            new = step(p, g)
        torch_xla.sync()
    assert new.cpu().tolist() == [2.0] * 4 and p.cpu().tolist() == [2.0] * 4
    assert view.cpu().tolist() == [2.0] * 2 and not tdx.is_deleted(p)
