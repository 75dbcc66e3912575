"""torch.compile(backend="openxla") keeps eager's promises: what eager
refuses (a view, an intermediate, a 0-dim tensor) is refused while dynamo
traces, with eager's ``ValueError``; an optimizer's state is donated as in
eager, also by ``tdx.donate(opt); opt.step()`` in one compiled function;
switched off, a compiled graph donates nothing and warns."""

import os
import warnings

import pytest
import torch
import torch._dynamo
import torch_xla
from helpers import buffer_ptr, materialize, run_python

import torch_xla_donate as tdx
import torch_xla_donate._config
from torch_xla_donate import _C

N = 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


FULLGRAPH = pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])


# -- refusals: eager's error, raised while dynamo traces ----------------------

_PICK = {
    "view": lambda x: x[0],
    "intermediate": lambda x: x + 1,
    "0-dim": lambda x: x.sum(),
}
_CALLS = {
    "donate_buffer": tdx.donate_buffer,
    "donate": lambda t: tdx.donate({"w": [t]}),
}


def _eager_error(call, pick, x):
    with pytest.raises(ValueError) as caught:
        call(pick(x))
    return str(caught.value)


# donate() skips a 0-dim tensor quietly, eager and compiled: not a refusal.
_REFUSED = [(kind, call) for kind in _PICK for call in _CALLS
            if (kind, call) != ("0-dim", "donate")]


@FULLGRAPH
@pytest.mark.parametrize("kind, call", _REFUSED)
def test_what_eager_refuses_is_refused_with_eagers_error(dev, kind, call, fullgraph):
    pick, donate = _PICK[kind], _CALLS[call]
    x = materialize(torch.randn(N, N, device=dev))
    expected = x.cpu()
    eager = _eager_error(donate, pick, x)

    def step(x):
        donate(pick(x))
        return x * 2

    compiled = torch.compile(step, backend="openxla", fullgraph=fullgraph)
    with pytest.raises(ValueError) as caught:
        compiled(x)
    assert str(caught.value).startswith(eager), (str(caught.value), eager)
    torch_xla.sync()  # nothing marked, nothing consumed
    assert _C.marked_count() == 0 and not tdx.is_deleted(x)
    assert torch.equal(x.cpu(), expected)


def _update(params, g):
    return [w - g for w in params]


@FULLGRAPH
def test_donating_names_the_argument_it_refuses(dev, fullgraph):
    def outer(y, x):
        return tdx.donating(_update, donate_argnums=0)([y, x[1]], x)

    y, x = materialize(torch.randn(N, device=dev), torch.randn(N, N, device=dev))
    with pytest.raises(ValueError) as caught:
        outer(y, x)
    eager = str(caught.value)
    assert eager.startswith("donate: cannot donate params[1]")
    with pytest.raises(ValueError) as caught:
        torch.compile(outer, backend="openxla", fullgraph=fullgraph)(y, x)
    assert str(caught.value).startswith(eager), (str(caught.value), eager)
    torch_xla.sync()
    assert _C.marked_count() == 0 and not tdx.is_deleted(y)


# -- an optimizer's state -------------------------------------------------------

def _model_and_optimizer(dev, kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(N, N).to(dev)
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, N, device=dev)).sum().backward()
    opt.step()
    materialize(model.weight)
    return model, opt


_MOMENT = {"sgd": "momentum_buffer", "adam": "exp_avg"}


@FULLGRAPH
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.filterwarnings("ignore::torch_xla_donate.UnusedDonationWarning")
def test_an_optimizers_state_is_donated_inside_a_compiled_function(dev, kind, fullgraph):
    """``donate(optimizer)`` in a compiled function donates the state on the
    device, as in eager: the old moments are consumed, the new ones hold the
    values of the same update without donation; Adam's second moments, which
    the step does not replace, come back unused with their values (the
    graph never reads them: their marks wait for the barrier, as eager's)."""
    model, opt = _model_and_optimizer(dev, kind)
    key = _MOMENT[kind]

    def decay():
        tdx.donate(opt)
        for state in opt.state.values():
            state[key] = state[key] * 0.5

    compiled = torch.compile(decay, backend="openxla", fullgraph=fullgraph)
    torch._dynamo.utils.counters.clear()
    unused = 0
    for _ in range(3):  # new state tensors each step: no recompile
        old = [s[key] for s in opt.state.values()]
        untouched = [s["exp_avg_sq"] for s in opt.state.values()] if kind == "adam" else []
        expected = [(t * 0.5).cpu() for t in old]
        kept = [t.cpu() for t in untouched]
        compiled()
        torch_xla.sync()
        tdx.settle()
        unused += _C.step_stats()["unused"]
        assert all(tdx.is_deleted(t) for t in old)
        for state, e in zip(opt.state.values(), expected):
            assert torch.equal(state[key].cpu(), e)
        # Donated too, but no output replaces them: unused, values kept.
        assert not any(tdx.is_deleted(t) for t in untouched)
        assert all(torch.equal(t.cpu(), k) for t, k in zip(untouched, kept))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert unused == 3 * len(untouched)
    if kind == "adam":  # the CPU step counters are left alone
        assert all(s["step"].item() == 1 for s in opt.state.values())


def _adam_run(dev, donate, compiled=True):
    """Three Adam steps (compiled, or eager); ``donate``: None, "before" the
    call, "inside" the called function or "both".  The state's buffers kept by each
    step and the final values."""
    model, opt = _model_and_optimizer(dev, "adam")

    def step():
        if donate in ("inside", "both"):
            tdx.donate(opt)
        opt.step()

    step = torch.compile(step, backend="openxla") if compiled else step
    kept = []
    for _ in range(3):
        before = [buffer_ptr(s["exp_avg"]) for s in opt.state.values()]
        if donate in ("before", "both"):
            tdx.donate(opt)
        step()
        torch_xla.sync()
        kept.append(before == [buffer_ptr(s["exp_avg"]) for s in opt.state.values()])
    assert _C.marked_count() == 0
    values = [t.detach().cpu() for t in model.parameters()] + [
        s[k].cpu() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return kept, values


@pytest.mark.parametrize("donate", ["before", "inside", "both"])
def test_an_optimizers_state_donated_for_its_compiled_step_is_reused(dev, donate):
    """``tdx.donate(opt)`` before the compiled call, or inside it next to
    ``opt.step()``, or both: torch.optim breaks the graph before ``step()``,
    so the marks made inside wait for the step's graph as eager marks do,
    and the graph that only marks commits none (dynamo.py,
    _take_marks_only).  Every way the step's graph updates the state in its
    own buffers, with the values of the same steps without donation (which
    allocate new ones)."""
    kept_plain, plain = _adam_run(dev, None)
    torch._dynamo.reset()
    kept, donated = _adam_run(dev, donate)
    assert kept == [True] * 3 and kept_plain == [False] * 3
    for a, b in zip(plain, donated):
        torch.testing.assert_close(a, b)


def test_an_optimizers_state_donated_for_its_eager_step_keeps_its_values(dev):
    """The same in eager: torch.optim updates in place, which torch_xla
    aliases at the barrier with or without donation; the marks end
    "updated in place", nothing is poisoned, the values are those of the
    steps without donation."""
    kept_plain, plain = _adam_run(dev, None, compiled=False)
    kept, donated = _adam_run(dev, "inside", compiled=False)
    assert kept == kept_plain == [True] * 3
    assert _C.step_stats()["updated_in_place"] == 4
    for a, b in zip(plain, donated):
        assert torch.equal(a, b)


# -- switched off -----------------------------------------------------------------

def _donate_buffer_inside(x):
    tdx.donate_buffer(x)
    return x * 2


def _donate_inside(x):
    tdx.donate([x])
    return x * 2


_SWITCHED_OFF = {
    "donate_buffer inside": lambda: _donate_buffer_inside,
    "donate inside": lambda: _donate_inside,
    "compile(donating(f))": lambda: tdx.donating(lambda x: x * 2, donate_argnums=0),
}


@FULLGRAPH
@pytest.mark.parametrize("compiled_before", [False, True], ids=["compiled off", "compiled on"])
@pytest.mark.parametrize("how", list(_SWITCHED_OFF))
def test_switched_off_a_compiled_function_donates_nothing(dev, monkeypatch, how, compiled_before,
                                                          fullgraph):
    step = torch.compile(_SWITCHED_OFF[how](), backend="openxla", fullgraph=fullgraph)
    if compiled_before:  # the graph and its donating executable exist already
        warm = materialize(torch.randn(N, N, device=dev))
        step(warm)
        torch_xla.sync()
        assert tdx.is_deleted(warm)
    x = materialize(torch.randn(N, N, device=dev))
    expected = x.cpu()
    previous = tdx.configure(enabled=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(x)
            torch_xla.sync()
            tdx.settle()
    finally:
        tdx.configure(**previous)
    assert not tdx.is_deleted(x) and torch.equal(x.cpu(), expected)
    assert torch.equal(out.cpu(), expected * 2)
    assert [w.category for w in caught] == [tdx.DonationDisabledWarning]
    # Switched on again, the same compiled function donates again.
    y = materialize(torch.randn(N, N, device=dev))
    step(y)
    torch_xla.sync()
    assert tdx.is_deleted(y)


def test_param_aliasing_off_a_compiled_function_donates_nothing():
    """torch_xla's own switch, in a fresh interpreter (it is read from the
    environment): as ``enabled=False``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = run_python(
        """
        import warnings
        import torch, torch_xla
        import torch_xla_donate as tdx
        print("from", tdx.__file__)
        dev = torch_xla.device()

        @torch.compile(backend="openxla", fullgraph=True)
        def step(x):
            tdx.donate(x)
            return x * 2

        x = torch.ones(64, device=dev)
        torch_xla.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(x)
            torch_xla.sync()
            tdx.settle()
        kinds = [type(w.message).__name__ for w in caught]
        print("warnings", kinds.count("DonationDisabledWarning"), len(kinds))
        print("values", x.sum().item(), out.sum().item(), "deleted", tdx.is_deleted(x))
        """,
        env={"XLA_ENABLE_PARAM_ALIASING": "0", "PYTHONPATH": root},  # this checkout's package
    )
    assert f"from {root}" in proc.stdout
    assert "warnings 1 1" in proc.stdout, proc.stdout
    assert "values 64.0 128.0 deleted False" in proc.stdout, proc.stdout
