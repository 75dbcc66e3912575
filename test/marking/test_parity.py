"""What a JAX user expects of donation: forwarded arguments stay usable,
argnums work without a signature, the wrapper says what it resolved, and the
messages count and name things precisely."""
import pytest
import torch
import torch_xla
from helpers import buffer_ptr, materialize
from torch_xla.experimental.gradient_accumulation import gradient_accumulation

import torch_xla_donate as tdx

N = 64


def _pair(dev):
    return materialize(torch.randn(N, N, device=dev), torch.randn(N, N, device=dev))


@pytest.mark.parametrize("shape", ["identity", "tuple", "nested"])
def test_a_donated_argument_handed_back_stays_usable_without_a_warning(dev, shape, recwarn):
    if shape == "identity":
        fn = tdx.donating(lambda x: x, donate_argnums=0)
        x, _ = _pair(dev)
        out = fn(x)
        kept = out
    elif shape == "tuple":
        fn = tdx.donating(lambda x: (x, x * 2), donate_argnums=0)
        x, _ = _pair(dev)
        out = fn(x)
        kept = out[0]
    else:
        # Frozen parameters passed through a donated tree, the everyday case.
        fn = tdx.donating(lambda p, g: {"frozen": p["frozen"], "w": p["w"] - g},
                          donate_argnums=0)
        x, g = _pair(dev)
        w = materialize(torch.randn(N, N, device=dev))
        w_ptr = buffer_ptr(w)
        out = fn({"frozen": x, "w": w}, g)
        kept = out["frozen"]
    expected = x.cpu()
    torch_xla.sync()
    tdx.settle()
    assert kept is x and not tdx.is_deleted(x) and torch.equal(x.cpu(), expected)
    assert not [w for w in recwarn if issubclass(w.category, tdx.UnusedDonationWarning)]
    if shape == "nested":
        assert tdx.is_deleted(w) and buffer_ptr(out["w"]) == w_ptr  # the rest is donated


def test_argnums_work_for_a_callable_without_a_signature(dev):
    add = tdx.donating(torch.add, donate_argnums=0)  # a builtin: no inspectable signature
    x, y = _pair(dev)
    ptr, expected = buffer_ptr(x), x.cpu() + y.cpu()
    out = add(x, y)
    torch_xla.sync()
    assert tdx.is_deleted(x) and buffer_ptr(out) == ptr
    torch.testing.assert_close(out.cpu(), expected)
    assert add.donate_argnums == (0,) and add.donate_argnames == ()
    with pytest.raises(TypeError, match="donate_argnames needs the function's signature"):
        tdx.donating(torch.add, donate_argnames="input")
    with pytest.raises(ValueError, match="negative"):
        tdx.donating(torch.add, donate_argnums=-1)


def test_the_wrapper_says_what_it_resolved():
    def step(params, opt_state, batch, *, lr=0.1):
        return params

    by_name = tdx.donating(step, donate_argnames=("opt_state", "params"))
    assert by_name.donate_argnums == (0, 1) and by_name.donate_argnames == ("params", "opt_state")
    by_number = tdx.donating(step, donate_argnums=(-3, 1))
    assert by_number.donate_argnums == (0, 1) and by_number.donate_argnames == ("params", "opt_state")
    keyword_only = tdx.donating(step, donate_argnames="lr")
    assert keyword_only.donate_argnums == () and keyword_only.donate_argnames == ("lr",)


def test_argnums_into_varargs_are_resolved_as_in_jax(dev):
    """Positions past the named parameters select elements of ``*args``: the
    wrapper reports them (JAX: ``jit(f, donate_argnums=(0,)).donate_argnums``
    of ``def f(*args)`` is ``(0,)``) and donates exactly those."""
    def update(*states):
        return [s * 0.5 for s in states]

    def step(scale, *states):
        return [s * scale for s in states]

    assert tdx.donating(update, donate_argnums=(0, 2)).donate_argnums == (0, 2)
    assert tdx.donating(step, donate_argnums=(0, 3)).donate_argnums == (0, 3)
    assert tdx.donating(step, donate_argnames="states").donate_argnums == ()
    a, b = _pair(dev)
    c = (a * 3).clone()
    torch_xla.sync()
    out = tdx.donating(update, donate_argnums=(0, 2))(a, b, c)
    torch_xla.sync()
    tdx.settle()
    assert [tdx.is_deleted(t) for t in (a, b, c)] == [True, False, True]
    assert torch.equal(b.cpu(), out[1].cpu() * 2)


def test_a_positional_only_parameter_cannot_be_named():
    def step(params, /, batch):
        return params

    with pytest.raises(ValueError, match=r"positional-only.*donate_argnums=0"):
        tdx.donating(step, donate_argnames="params")
    assert tdx.donating(step, donate_argnums=0).donate_argnames == ("params",)


def test_undonate_takes_trees_as_donate_does(dev):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(dev)
    materialize(model[0].weight)
    assert tdx.donate(model) == 4
    assert tdx.undonate(model) == 4
    assert not any(tdx.is_donated(p) for p in model.parameters())
    x, y = _pair(dev)
    tdx.donate({"x": x, "y": [y]})
    assert tdx.undonate({"x": x, "y": [y, 3]}) == 2 and tdx.undonate(x) is False


def test_unused_donations_are_counted_per_shape(dev):
    xs = [materialize(torch.randn(32, 32, device=dev)) for _ in range(16)]
    other = materialize(torch.ones(3, device=dev))
    tdx.donate(xs + [other])
    z = other.sum()  # none of them can take an output: all unused
    with pytest.warns(tdx.UnusedDonationWarning) as caught:
        torch_xla.sync(wait=True)
    message = str(caught[0].message)
    assert "16 x f32[32,32]" in message and "f32[3]" in message
    assert message.count("f32[32,32]") == 1


def test_the_use_after_donation_message_names_the_call_that_marked(dev):
    cases = {
        "donate_buffer()": lambda t: tdx.donate_buffer(t),
        "donate()": lambda t: tdx.donate([t]),
        "donating()": lambda t: tdx.donating(lambda a: None, donate_argnums=0)(t),
    }
    for via, mark in cases.items():
        t = materialize(torch.randn(N, device=dev))
        mark(t)
        new = t + 1
        torch_xla.sync()
        with pytest.raises(tdx.DonatedBufferError, match=rf"donated by (a )?{via.split('(')[0]}"):
            t.sum()
        assert "donated" in repr(t) and via.split("(")[0] in repr(t)


def test_parameter_donation_error_names_a_few_and_counts_the_rest(dev):
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)]).to(dev)
    x = materialize(torch.ones(1, 2, 4, device=dev))
    tdx.donate(model)
    with pytest.raises(tdx.ParameterDonationError) as info:
        gradient_accumulation(lambda a: model(a).sum(), (x,), model)
    message = str(info.value)
    assert "and 6 more" in message and message.count("parameter '") == 4
    assert "undonate(model)" in message
    assert tdx.undonate(model) == 10
