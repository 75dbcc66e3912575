"""A plain torch.func loop is bit-repeatable only when each barrier waits for
autograd's worker thread (``tdx.settle()``, helpers.settle_autograd); a
donating loop waits for it by itself, and equals the settled plain loop bit
for bit.

The tricky case: on an XLA device the backward of ``grad_and_value`` runs on
autograd's worker thread, which drops the graph's lazy tensors a moment
after the caller got its gradients.  Still alive at the barrier, they become
extra outputs of the step's graph: another graph (another compile), whose
fusions may round differently.  Measured 2026-11-26 on the 2-CPU VM (load
average about 7), this loop in fresh processes: without the wait 13 of 16
runs ended with other bits than the settled run (12 distinct results), and
each of those compiled a second graph; with ``tdx.settle()`` before each
barrier 9 of 9 agreed, with one graph.  Here, in the test's process, about
one unsettled run in four differs.

Without the wait the outcome is timing: the test runs the unsettled loop
too and prints how often it differed, asserting nothing about it.
"""
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met
from helpers import settle_autograd
from torch.func import functional_call, grad_and_value

import torch_xla_donate as tdx

STEPS, WIDTH, UNSETTLED_RUNS = 10, 256, 4


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _loop(dev, how):
    """The torch.func tutorial's loop on a small MLP with a LayerNorm; ``how``:
    "unsettled" (a plain loop as users write it), "settled" (settle before
    each barrier) or "donated" (``tdx.donate`` the parameters, no settle)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.GELU(), torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 10)).to(dev)
    params = {k: v.detach() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, WIDTH, generator=gen) for _ in range(STEPS)]
    ys = [torch.randint(0, 10, (64,), generator=gen) for _ in range(STEPS)]

    def loss_fn(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    torch_xla.sync()
    losses = []
    for x, y in zip(xs, ys):
        grads, loss = grad_and_value(loss_fn)(params, x.to(dev), y.to(dev))
        if how == "settled":
            settle_autograd()
        elif how == "donated":
            tdx.donate(params)
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        torch_xla.sync()
        losses.append(loss)
    return [t.cpu() for t in losses + list(params.values())]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_settled_and_donated_torch_func_loops_repeat_bit_for_bit(dev):
    first = _loop(dev, "settled")
    compiles = _compiles()
    second = _loop(dev, "settled")
    # The same graphs at every step: all cached, and the same bits.
    assert _compiles() == compiles, "a settled run built a graph the first did not"
    assert _same(first, second), "two settled plain runs differ"
    before = tdx.summary().totals
    donated = _loop(dev, "donated")
    tdx.settle()
    after = tdx.summary().totals
    assert after.reused - before.reused == STEPS * len(first[STEPS:])  # it donated
    assert _same(donated, first), "the donated run differs from the settled plain run"
    differing = sum(not _same(_loop(dev, "unsettled"), first) for _ in range(UNSETTLED_RUNS))
    print(f"unsettled plain runs differing from the settled one: {differing} of {UNSETTLED_RUNS}")
