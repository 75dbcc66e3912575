"""``donate(model)`` with a constant module buffer, and ``donate(optimizer)``,
in torch.optim loops.

* A model whose bool mask is a ``register_buffer``: no output can take it,
  so its donation goes unused; the warning says so once per line and shape
  (barrier, ``sync(wait=False)`` and step-block loops alike) and names the
  fix, while every counter counts each step.
* ``donate(optimizer)`` leaves torch.optim's CPU ``step`` counters out
  (counted as skipped) and donates the device moments: consumed by a
  functional update, updated in place by ``opt.step()``; values equal those
  of the loop without donation.
"""
import warnings

import pytest
import torch
import torch_xla
from helpers import materialize, settle_autograd, settled_sync

import torch_xla_donate as tdx
from torch_xla_donate import _native

# torch_xla 2.8.1's XLA rounds the aliased functional Adam update differently
# (weight and moments, a few ulps): its own _set_buffer_donation, with no
# plugin, gives the same difference (docs/testing.md, "Each release").
_LAST_BIT = _native.release(torch_xla.__version__)[:2] == (2, 8)


def _assert_same(a, b, what=""):
    if _LAST_BIT:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(a, b), what


class _Masked(torch.nn.Module):
    """A linear layer behind a causal mask kept with ``register_buffer``: a
    step reads the mask, and no output (all f32) can take a bool buffer."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8, dtype=torch.bool)))

    def forward(self, x):
        return self.fc(x).masked_fill(~self.mask, 0.0)


def _barrier(body):
    body()
    torch_xla.sync()


def _not_waited(body):
    body()
    torch_xla.sync(wait=False)


def _step_block(body):
    with torch_xla.step():
        body()


LOOPS = {"barrier": _barrier, "wait_false": _not_waited, "step_block": _step_block}


def _masked_loop(dev, run, donate, steps=6):
    torch.manual_seed(0)
    model = _Masked().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 8).to(dev)
    materialize(model.fc.weight)

    def body():
        if donate:
            tdx.donate(model)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        settle_autograd()  # before the barrier: bit-repeatable runs

    for _ in range(steps):
        LOOPS[run](body)
    tdx.settle()
    return model


@pytest.mark.parametrize("action, warned", [("default", 1), ("always", 6)])
@pytest.mark.parametrize("run", LOOPS)
def test_a_constant_module_buffer_warns_once_in_a_torch_optim_loop(dev, run, action, warned):
    """The warning's text is the same each step (the line and shapes), so
    Python's filters decide: once under the default filter, each of the 6
    steps under "always"; the ledger, the summary and torch_xla's counters
    count every step either way."""
    counter = "DonatedBuffersUnused"
    before = tdx.summary().totals.unused
    counter_before = torch_xla.debug.metrics.counter_value(counter) or 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        model = _masked_loop(dev, run, donate=True)
    said = [str(w.message) for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    assert len(said) == warned and len(set(said)) == 1, said
    # It names the buffer and the fix.
    assert "pred[8,8]" in said[0] and "module.mask is a buffer of a module" in said[0]
    assert "tdx.donate(list(model.parameters()))" in said[0]
    assert tdx.summary().totals.unused - before == 6
    assert tdx.last_step_report().unused == 1
    assert (torch_xla.debug.metrics.counter_value(counter) or 0) - counter_before == 6
    assert f"Counter: {counter}\n  Value: {tdx.summary().totals.unused}" in tdx.metrics_report()
    # The mask kept its value and the training is that of the plain loop.
    assert torch.equal(model.mask.cpu(), torch.tril(torch.ones(8, 8, dtype=torch.bool)))
    plain = _masked_loop(dev, run, donate=False)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.cpu(), b.cpu())


def test_donating_only_the_parameters_leaves_the_buffer_out(dev):
    """What the warning advises: the parameters are donated, the mask is not,
    and nothing comes back unused."""
    torch.manual_seed(0)
    model = _Masked().to(dev)
    materialize(model.fc.weight)
    params = list(model.parameters())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", tdx.UnusedDonationWarning)
        assert tdx.donate(list(model.parameters())) == 2
        out = model(torch.ones(8, 8, device=dev))
        new = [p * 0.5 for p in params]
        materialize(out, *new)
    assert all(tdx.is_deleted(p) for p in params)
    assert tdx.last_step_report().unused == 0 and not tdx.is_donated(model.mask)
    assert bool(model.mask[7, 0]) and out.shape == new[0].shape == (8, 8)


def _adam_loop(dev, update, donate, steps=4):
    """Adam's state made by a first ``opt.step()`` (its ``step`` counters on
    the CPU, torch.optim's default), then updated by ``opt.step()`` (in place)
    or functionally (new moments written into ``opt.state``), with
    ``donate(opt)`` before each update.  Returns the model, the optimizer and
    how many old moments each step consumed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(5, 6).to(dev)
    materialize(model.weight)
    consumed = []
    for n in range(steps):
        opt.zero_grad()
        model(x).square().sum().backward()
        if n == 0:
            opt.step()
            settled_sync()  # bit-repeatable, with or without donation
            continue
        old = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        if donate:
            assert tdx.donate(opt) == 4  # the moments; the CPU counters are left out
        if update == "torch.optim":
            opt.step()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    s = opt.state[p]
                    s["step"] += 1
                    s["exp_avg"] = 0.9 * s["exp_avg"] + 0.1 * p.grad
                    s["exp_avg_sq"] = 0.999 * s["exp_avg_sq"] + 0.001 * p.grad * p.grad
                    p.sub_(0.01 * s["exp_avg"] / (s["exp_avg_sq"].sqrt() + 1e-8))
        settled_sync()
        tdx.settle()
        consumed.append(sum(tdx.is_deleted(t) for t in old))
    return model, opt, consumed


@pytest.mark.parametrize("update", ["torch.optim", "functional"])
def test_donating_an_optimizer_skips_its_cpu_counters_and_donates_the_rest(dev, update):
    skipped = tdx.summary().skipped_on_cpu
    with warnings.catch_warnings():
        for w in (tdx.UnusedDonationWarning, tdx.DroppedDonationWarning):
            warnings.simplefilter("error", w)
        model, opt, consumed = _adam_loop(dev, update, donate=True)
    # Three donate(opt) calls, two CPU counters each: counted as skipped.
    assert tdx.summary().skipped_on_cpu - skipped == 3 * 2
    assert "skipped (on CPU)" in str(tdx.summary())
    # The device state was donated: a functional update consumed every old
    # moment; torch.optim's in-place update kept them (updated in place).
    assert consumed == ([4, 4, 4] if update == "functional" else [0, 0, 0])
    # Values equal those of the loop without donation; counters untouched.
    plain_model, plain_opt, plain_consumed = _adam_loop(dev, update, donate=False)
    assert plain_consumed == [0, 0, 0]
    for p, q in zip(model.parameters(), plain_model.parameters()):
        _assert_same(p.cpu(), q.cpu())
        s, t = opt.state[p], plain_opt.state[q]
        assert s["step"].device.type == "cpu" and s["step"].item() == t["step"].item() == 4
        for k in ("exp_avg", "exp_avg_sq"):
            _assert_same(s[k].cpu(), t[k].cpu(), k)
