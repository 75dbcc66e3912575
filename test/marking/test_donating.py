"""donating(fn, donate_argnums=..., donate_argnames=...): donation per call."""
import sys

import pytest
import torch
import torch_xla
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
import torch_xla_donate._config


def _pair(dev, n=64):
    x = torch.randn(n, n, device=dev)
    y = torch.randn(n, n, device=dev)
    materialize(x)
    return x, y


def _axpy(x, y):
    return x * 2 + y


def _assert_reused(out, x, x_ptr, expected):
    """``out`` is the only output of x's size, so only it can take x's buffer:
    equal pointers prove the reuse, and x must refuse any use."""
    assert buffer_ptr(out) == x_ptr
    assert tdx.is_deleted(x)
    with pytest.raises(tdx.DonatedBufferError):
        x + 1
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("call", ["positional", "keyword", "reversed keywords"])
def test_argument_is_donated_however_it_is_passed(dev, call):
    step = tdx.donating(_axpy, donate_argnums=0)
    x, y = _pair(dev)
    x_ptr, expected = buffer_ptr(x), x.cpu() * 2 + y.cpu()
    if call == "positional":
        out = step(x, y)
    elif call == "keyword":
        out = step(x=x, y=y)
    else:
        out = step(y=y, x=x)
    assert tdx.is_donated(x) and not tdx.is_donated(y)
    materialize(out)
    _assert_reused(out, x, x_ptr, expected)
    assert not tdx.is_deleted(y)


def test_decorator_by_name_donates_on_every_call(dev):
    @tdx.donating(donate_argnames="x")
    def step(x, y):
        return x * 2 + y

    assert step.__name__ == "step"
    x, y = _pair(dev)
    for _ in range(3):
        x_ptr, expected = buffer_ptr(x), x.cpu() * 2 + y.cpu()
        old, x = x, step(x, y)
        materialize(x)
        _assert_reused(x, old, x_ptr, expected)


def test_without_donating_the_buffer_is_not_reused(dev):
    """The control for the pointer evidence above."""
    x, y = _pair(dev)
    x_ptr = buffer_ptr(x)
    out = _axpy(x, y)
    materialize(out)
    assert buffer_ptr(out) != x_ptr and not tdx.is_deleted(x)


@pytest.mark.parametrize("order", ["compile(donating(f))", "donating(compile(f))"])
def test_composes_with_torch_xla_compile(dev, order):
    if order == "compile(donating(f))":
        step = torch_xla.compile(tdx.donating(_axpy, donate_argnums=0))
    else:
        step = tdx.donating(torch_xla.compile(_axpy), donate_argnums=0)
    for _ in range(2):  # the second call runs the cached graph
        x, y = _pair(dev)
        x_ptr, expected = buffer_ptr(x), x.cpu() * 2 + y.cpu()
        out = step(x, y=y)
        _assert_reused(out, x, x_ptr, expected)


def test_inside_compile_pending_arguments_are_materialized_first(dev):
    """compile flushes pending work before the body, so a freshly computed
    argument can be donated inside it."""
    step = torch_xla.compile(tdx.donating(_axpy, donate_argnums=0))
    x, y = _pair(dev)
    expected = (x.cpu() + 1) * 2 + y.cpu()
    x = x + 1  # pending: donate_buffer(x) would refuse it here
    out = step(x, y)
    assert tdx.is_deleted(x)
    torch.testing.assert_close(out.cpu(), expected)


def test_pytree_arguments_and_path_in_errors(dev):
    @tdx.donating(donate_argnums=0)
    def update(params, grads, lr=0.5):
        return {k: p - lr * grads[k] for k, p in params.items()}

    w, b = torch.ones(4, 4, device=dev), torch.ones(4, device=dev)
    gw, gb = torch.ones(4, 4, device=dev), torch.ones(4, device=dev)
    materialize(w)
    new = update({"w": w, "b": b}, {"w": gw, "b": gb})
    materialize(*new.values())
    assert tdx.is_deleted(w) and tdx.is_deleted(b)
    assert not tdx.is_deleted(gw)
    torch.testing.assert_close(new["w"].cpu(), torch.full((4, 4), 0.5))

    good = torch.ones(4, 4, device=dev)
    materialize(good)
    with pytest.raises(ValueError, match=r"params\['b'\].*XLA device"):
        update(params={"w": good, "b": torch.ones(4)}, grads={"w": gw, "b": gb})
    assert not tdx.is_donated(good)


def test_messages_blame_the_call_site(dev):
    step = tdx.donating(_axpy, donate_argnums=0)
    x, y = _pair(dev)
    line = sys._getframe().f_lineno + 1
    out = step(x, y)
    materialize(out)
    with pytest.raises(tdx.DonatedBufferError, match=rf"{__file__}:{line}\b"):
        x.sum()


def test_switched_off_warning_points_at_the_call(dev, monkeypatch):
    step = torch_xla.compile(tdx.donating(_axpy, donate_argnums=0))
    x, y = _pair(dev)
    previous = tdx.configure(enabled=False)
    try:
        with pytest.warns(tdx.DonationDisabledWarning) as caught:
            out = step(x, y)
    finally:
        tdx.configure(**previous)
    assert [w.filename for w in caught] == [__file__]
    assert not tdx.is_deleted(x)
    torch.testing.assert_close(out.cpu(), x.cpu() * 2 + y.cpu())


def test_defaults_are_never_donated(dev):
    default = torch.ones(8, device=dev)
    materialize(default)

    @tdx.donating(donate_argnames=("x", "bias"))
    def f(x, bias=default):
        return x + bias

    x = torch.ones(8, device=dev)
    materialize(x)
    out = f(x)
    materialize(out)
    assert tdx.is_deleted(x) and not tdx.is_deleted(default)
    assert f(out).sum().item() == 24  # the default still works


def test_a_wrong_call_raises_the_functions_error_and_donates_nothing(dev):
    step = tdx.donating(_axpy, donate_argnums=0)
    x, _ = _pair(dev)
    with pytest.raises(TypeError, match="unexpected keyword"):
        step(x, z=1)
    assert not tdx.is_donated(x)


def test_method_counts_self(dev):
    class Trainer:
        @tdx.donating(donate_argnums=1)
        def step(self, state, delta):
            return state + delta

    state, delta = _pair(dev)
    new = Trainer().step(state, delta)
    materialize(new)
    assert tdx.is_deleted(state) and not tdx.is_deleted(delta)


def test_module_is_matched_against_forward(dev):
    class Scale(torch.nn.Module):
        def forward(self, x, factor):
            return x * factor

    step = tdx.donating(Scale(), donate_argnames="x")
    for call in ("positional", "keyword"):
        x, _ = _pair(dev)
        x_ptr, expected = buffer_ptr(x), x.cpu() * 3
        out = step(x, 3) if call == "positional" else step(factor=3, x=x)
        materialize(out)
        _assert_reused(out, x, x_ptr, expected)


# -- *args and **kwargs ------------------------------------------------------------


def test_index_past_named_parameters_picks_from_varargs(dev):
    @tdx.donating(donate_argnums=(0, 2))
    def double(first, *rest):  # one output per input: each can take a buffer
        return [t * 2 for t in (first, *rest)]

    a, b = _pair(dev, 8)
    c = torch.ones(8, 8, device=dev)
    materialize(c)
    out = double(a, b, c)  # index 2 is rest[1] = c
    materialize(*out)
    assert tdx.is_deleted(a) and tdx.is_deleted(c) and not tdx.is_deleted(b)
    d, e = _pair(dev, 8)
    out2 = double(d, e)  # no index 2 in this call: only d is donated
    materialize(*out2)
    assert tdx.is_deleted(d) and not tdx.is_deleted(e)


def test_names_select_kwargs_entries_or_all_varargs(dev):
    @tdx.donating(donate_argnames=("rest", "state"))
    def f(*rest, **options):
        return [t + 1 for t in rest] + [options["state"] * 2]

    a, b = _pair(dev, 8)
    s = torch.ones(8, 8, device=dev)
    materialize(s)
    out = f(a, b, state=s)
    materialize(*out)
    assert all(tdx.is_deleted(t) for t in (a, b, s))


def test_error_paths_name_varargs_elements(dev):
    @tdx.donating(donate_argnums=1)
    def f(*xs):
        return xs

    a = torch.ones(2, device=dev)
    materialize(a)
    with pytest.raises(ValueError, match=r"xs\[1\]"):
        f(a, torch.ones(2))


# -- mistakes caught at wrap time ------------------------------------------------


def test_out_of_range_index_names_function_parameters_and_fix():
    def step(params, batch, *, lr):
        return params

    with pytest.raises(ValueError) as info:
        tdx.donating(step, donate_argnums=2)
    message = str(info.value)
    for part in ("step", "donate_argnums=2", "'params', 'batch'", "0..1, or -2..-1",
                 "donate_argnames=('lr',)"):
        assert part in message, (part, message)


def test_unknown_name_suggests_the_close_one():
    def step(params, batch):
        return params

    with pytest.raises(ValueError, match=r"'param'.*\('params', 'batch'\).*Did you mean 'params'"):
        tdx.donating(step, donate_argnames="param")


def test_negative_indices():
    def step(params, batch):
        return params

    assert tdx.donating(step, donate_argnums=-2).donate_argnums == (0,)  # resolved
    with pytest.raises(ValueError, match="out of range"):
        tdx.donating(step, donate_argnums=-3)

    def variadic(*xs):
        return xs

    with pytest.raises(ValueError, match=r"ambiguous.*\*xs"):
        tdx.donating(variadic, donate_argnums=-1)


def test_negative_index_donates_the_last_parameter(dev):
    step = tdx.donating(_axpy, donate_argnums=-1)
    x, y = _pair(dev)
    materialize(step(x, y))
    assert tdx.is_deleted(y) and not tdx.is_deleted(x)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({}, ValueError, r"selects no argument.*donate_argnums=0"),
        ({"donate_argnums": "0"}, TypeError, "must be ints"),
        ({"donate_argnums": True}, TypeError, "must be ints"),
        ({"donate_argnames": 0}, TypeError, "must be strs"),
    ],
)
def test_bad_selection(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        tdx.donating(_axpy, **kwargs)


def test_not_callable():
    with pytest.raises(TypeError, match=r"donating\(fn, donate_argnums=0\)"):
        tdx.donating(0)
