"""torch.compile(backend="openxla"): a marked input of a compiled call is
donated by that call's graph, poisoned and reported; nothing unmarked is
donated; the bridge's own syncs commit nothing."""

import pytest
import torch
import torch._dynamo
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C

N = 128


def _update(p, g):
    return p * 0.9 + g


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _pair(dev):
    return materialize(torch.randn(N, N, device=dev), torch.randn(N, N, device=dev))


def _graph_breaks():
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_a_marked_input_is_donated_by_every_call_of_the_compiled_graph(dev):
    step = torch.compile(_update, backend="openxla")
    p, g = _pair(dev)
    first_ptr = buffer_ptr(p)
    expected = p.cpu()
    for call in range(6):  # the first call extracts the graph; the rest are cached
        old = p
        tdx.donate_buffer(p)
        p = step(p, g)
        expected = expected * 0.9 + g.cpu()
        torch_xla.sync()
        assert buffer_ptr(p) == first_ptr, f"call {call} did not reuse the buffer"
        assert tdx.is_deleted(old)
        with pytest.raises(tdx.DonatedBufferError, match="donate_buffer"):
            old + 1
    torch.testing.assert_close(p.cpu(), expected)
    report = tdx.last_step_report()
    assert (report.donated, report.reused, report.unused) == (1, 1, 0)


def test_a_call_without_marks_donates_nothing(dev):
    step = torch.compile(_update, backend="openxla")
    p, g = _pair(dev)
    tdx.donate_buffer(p)
    step(p, g)  # extracts a graph that donates p ...
    q = materialize(torch.randn(N, N, device=dev))
    expected = q.cpu()
    out = step(q, g)  # ... which must not donate q, which is not marked
    xm.wait_device_ops()
    assert not torch_xla._XLAC._is_placecholder(q) and torch.equal(q.cpu(), expected)
    torch.testing.assert_close(out.cpu(), expected * 0.9 + g.cpu())


def test_marks_on_other_tensors_wait_for_their_own_execution(dev):
    step = torch.compile(_update, backend="openxla")
    p, g = _pair(dev)
    other = materialize(torch.randn(N, N, device=dev))
    tdx.donate_buffer(other)
    pending = other * 2  # the bridge's sync flushes this: it must commit nothing
    out = step(p, g)
    xm.wait_device_ops()
    assert tdx.is_donated(other) and not torch_xla._XLAC._is_placecholder(other)
    ptr = buffer_ptr(other)
    new = other + 1
    torch_xla.sync()
    assert tdx.is_deleted(other) and buffer_ptr(new) == ptr


@pytest.mark.parametrize("order", ["donating(compile(f))", "compile(donating(f))"])
def test_donating_composes_with_torch_compile_without_graph_breaks(dev, order):
    if order == "donating(compile(f))":
        step = tdx.donating(torch.compile(_update, backend="openxla"), donate_argnums=0)
    else:
        step = torch.compile(tdx.donating(_update, donate_argnums=0), backend="openxla")
    p, g = _pair(dev)
    ptr = buffer_ptr(p)
    for _ in range(3):
        old = p
        p = step(p, g)
        torch_xla.sync()
        assert tdx.is_deleted(old) and buffer_ptr(p) == ptr
    assert _graph_breaks() == 0
    assert tdx.last_step_report().reused == 1


def _sgd_momentum(params, moms, grads):
    new_m = [0.9 * m + g for m, g in zip(moms, grads)]
    return [p - 0.1 * m for p, m in zip(params, new_m)], new_m


def _sgd_momentum_donating_inside(params, moms, grads):
    tdx.donate((params, moms))
    return _sgd_momentum(params, moms, grads)


_WRAPPER_ORDERS = {
    "no donation": lambda: torch.compile(_sgd_momentum, backend="openxla"),
    "donating(compile(f))": lambda: tdx.donating(
        torch.compile(_sgd_momentum, backend="openxla"), donate_argnums=(0, 1)),
    "compile(donating(f))": lambda: torch.compile(
        tdx.donating(_sgd_momentum, donate_argnums=(0, 1)), backend="openxla"),
    "donate inside compile(f)": lambda: torch.compile(_sgd_momentum_donating_inside,
                                                      backend="openxla"),
}


@pytest.mark.parametrize("order", list(_WRAPPER_ORDERS))
def test_no_wrapper_order_makes_dynamo_compile_again(dev, order):
    """20 steps with new tensors each time compile as many dynamo graphs as
    the same loop without donation (one): nothing the package runs under
    dynamo may guard on an argument's identity (``id(leaf)`` once did, and
    every step became a new graph)."""
    step = _WRAPPER_ORDERS[order]()
    params = [torch.randn(32, 32, device=dev) for _ in range(3)]
    moms = [torch.zeros(32, 32, device=dev) for _ in range(3)]
    grads = [torch.randn(32, 32, device=dev) for _ in range(3)]
    torch_xla.sync()
    reused_before = tdx.summary().totals.reused
    for _ in range(20):
        old = params + moms
        params, moms = step(params, moms, grads)
        torch_xla.sync()
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert _graph_breaks() == 0
    tdx.settle()
    donated = order != "no donation"
    assert all(tdx.is_deleted(t) for t in old) is donated
    assert tdx.summary().totals.reused - reused_before == (120 if donated else 0)


def _each(donate_one):
    def donate_each(params):
        for w in params:
            donate_one(w)
    return donate_each


# The last looks the function up on torch_xla._XLAC while dynamo traces.
@pytest.mark.parametrize("donate", [tdx.donate, _each(tdx.donate_buffer),
                                    _each(lambda w: torch_xla._XLAC.donate_buffer(w))],
                         ids=["donate", "donate_buffer", "_XLAC.donate_buffer"])
def test_donate_inside_a_compiled_function_is_a_graph_op(dev, donate):
    @torch.compile(backend="openxla", fullgraph=True)  # a graph break raises
    def step(params, g):
        donate(params)
        return [w - 0.1 * g for w in params]

    params = [materialize(torch.randn(N, N, device=dev)) for _ in range(2)]
    g = materialize(torch.randn(N, N, device=dev))
    expected = [(w - 0.1 * g).cpu() for w in params]
    ptrs = {buffer_ptr(w) for w in params}
    new = step(params, g)
    torch_xla.sync()
    assert all(tdx.is_deleted(w) for w in params) and {buffer_ptr(w) for w in new} == ptrs
    assert all(torch.equal(n.cpu(), e) for n, e in zip(new, expected))
    assert _graph_breaks() == 0
    record = _C.tagged_record(torch._from_functional_tensor(params[0]))
    assert record is not None and record.via == _C.Via.GRAPH_OP
    with pytest.raises(tdx.DonatedBufferError):
        params[0].sum()


def test_torch_xlas_graph_op_donations_are_poisoned_and_reported(dev):
    def scale(x):
        torch.ops.xla.dynamo_set_buffer_donor_(x, True)
        return x * 1.1

    step = torch.compile(scale, backend="openxla")
    x = materialize(torch.randn(N, N, device=dev))
    ptr = buffer_ptr(x)
    out = step(x)
    torch_xla.sync()
    assert tdx.is_deleted(x) and buffer_ptr(out) == ptr
    with pytest.raises(tdx.DonatedBufferError, match="dynamo_set_buffer_donor_"):
        x.sum()
    assert tdx.last_step_report().reused == 1


@pytest.mark.parametrize("cached", [False, True])
def test_a_consumed_input_raises_donated_buffer_error(dev, cached):
    step = torch.compile(lambda x, y: x * y, backend="openxla")
    p, g = _pair(dev)
    if cached:
        step(g, g)  # the graph exists before the call with the consumed input
    tdx.donate_buffer(p)
    new = p + 1
    torch_xla.sync()
    value = g.cpu()
    tdx.donate_buffer(g)
    with pytest.raises(tdx.DonatedBufferError):
        step(p, g)
    # Refused before anything ran or committed: the other mark waits, as in eager.
    assert tdx.is_donated(g) and torch.equal(g.cpu(), value)


def test_an_input_that_needs_its_gradient_is_left_for_the_step_barrier(dev):
    step = torch.compile(lambda w, x: (w * x).sum(), backend="openxla")
    w = materialize(torch.randn(N, N, device=dev)).requires_grad_()
    x = materialize(torch.randn(N, N, device=dev))
    tdx.donate_buffer(w)
    loss = step(w, x)
    loss.backward()  # the compiled forward must not have consumed w
    assert tdx.is_donated(w)
    with torch.no_grad():
        new = w - 0.1 * w.grad
    ptr = buffer_ptr(w)
    torch_xla.sync()
    assert tdx.is_deleted(w) and buffer_ptr(new) == ptr


def test_a_failing_compiled_call_keeps_its_donations(dev, monkeypatch):
    from torch_xla_donate import _dynamo as dynamo

    def failing_variant(graph, pattern, args, on, withheld=frozenset()):
        graph._static = frozenset()
        return _failing

    monkeypatch.setattr(dynamo._CompiledGraph, "_variant", failing_variant)
    step = torch.compile(_update, backend="openxla")
    p, g = _pair(dev)
    expected = p.cpu()
    tdx.donate_buffer(p)
    with pytest.raises(RuntimeError, match="simulated"):
        step(p, g)
    assert not tdx.is_deleted(p) and not tdx.is_donated(p) and torch.equal(p.cpu(), expected)
    assert tdx.last_step_report().failed == 1


def _failing(*args):
    raise RuntimeError("compiled call failed (simulated)")


def test_a_donated_input_the_compiled_function_updates_in_place_takes_the_result(dev):
    """aot_autograd writes a mutated input back (``x.copy_(new)``) after the
    graph ran: the donated buffer holds the result, and the tensor is live."""
    def scale_(x):
        x.mul_(3)

    step = torch.compile(scale_, backend="openxla")
    x = materialize(torch.arange(float(N), device=dev))
    ptr = buffer_ptr(x)
    expected = x.cpu()
    for _ in range(3):
        tdx.donate_buffer(x)
        step(x)
        expected = expected * 3
        torch_xla.sync()
        assert not tdx.is_deleted(x) and buffer_ptr(x) == ptr
        assert torch.equal(x.cpu(), expected)
    report = tdx.last_step_report()
    assert (report.donated, report.reused, report.unused) == (1, 1, 0)


def test_a_compiled_in_place_update_of_parameters_keeps_every_value(dev):
    """Parameters that require grad are never donated to a compiled graph
    (its forward may save them for backward); marked, then changed in place
    under no_grad by a compiled optimizer step (aot_autograd writes them back
    through ``p.detach().copy_``), they keep the new values, and the step
    reports the marks "updated in place": no value lost, no buffer reused."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(N, N)  # on the host: torch_xla 2.9 fails to mix the
    model = torch.nn.Linear(N, N).to(dev)  # compiled step with a lazy twin, plugin or not
    model.load_state_dict(reference.state_dict())

    def sgd(params):
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)

    step = torch.compile(sgd, backend="openxla")
    host_x = torch.randn(4, N)
    x = materialize(host_x.to(dev))
    for _ in range(3):
        for m, inp in ((model, x), (reference, host_x)):
            m.zero_grad()
            m(inp).square().sum().backward()
        torch_xla.sync()
        tdx.donate(list(model.parameters()))
        step(list(model.parameters()))
        sgd(list(reference.parameters()))
        torch_xla.sync()
        assert not any(tdx.is_deleted(p) for p in model.parameters())
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())
        report = tdx.last_step_report()
        assert (report.donated, report.updated_in_place, report.reused) == (2, 2, 0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-4)


def test_an_extraction_arms_only_once_earlier_live_flags_are_cleared(dev, monkeypatch):
    # An unused donation of a barrier keeps its flag until its verdict or
    # the next commit (commit.py, "Ours until committed"); an extraction,
    # whose executable keeps the donor set of the flags armed then, clears
    # it before arming its own.
    from torch_xla_donate import _dynamo as dynamo

    x, p, g = materialize(torch.arange(5.0, device=dev), *_pair(dev))
    tdx.donate_buffer(x)  # no output of the step can take it
    y = p * 2
    torch_xla.sync(wait=False)
    assert torch_xla._XLAC._get_buffer_donation(x), "left armed by the barrier"
    seen = []
    real = dynamo.xla.set_donor

    def spy(t, donate):
        if donate:
            seen.append(torch_xla._XLAC._get_buffer_donation(x))
        return real(t, donate)

    monkeypatch.setattr(dynamo.xla, "set_donor", spy)
    tdx.donate_buffer(p)
    with pytest.warns(tdx.UnusedDonationWarning):  # the call settles x's verdict
        torch.compile(_update, backend="openxla")(p, g)
    assert seen and not any(seen), "an extraction armed with an earlier flag still set"
    tdx.settle()
    assert torch.equal(x.cpu(), torch.arange(5.0)) and tdx.is_deleted(p)
