"""Gradient accumulation with a donated accumulator and donated weights.

    PJRT_DEVICE=CPU python examples/gradient_accumulation.py [--steps 30] [--no-donate]

A softmax-regression classifier on synthetic data.  Each training step runs
``torch_xla.experimental.gradient_accumulation`` over 4 micro-batches.  The
weight ``W`` gets its gradient in closed form, summed over the micro-batches
into a carried tensor ``acc`` (momentum: ``acc`` starts each step at
``0.9 * acc``).  A small ``nn.Module`` holding the bias is what
``gradient_accumulation`` differentiates with autograd; its gradient lands in
``bias.grad`` as usual.

Before each step ``acc`` and ``W`` are donated: the step's new ``acc`` and
new ``W`` are written into the old buffers, so the set of device buffers
holding the state stays the same step after step, and the old tensors are
poisoned.  The model's own parameters must not be donated here (the loop
passes them through unchanged): ``torch_xla_donate`` refuses that with
``ParameterDonationError``, shown at the end.
"""
import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import inspect  # noqa: E402

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from torch_xla.experimental import gradient_accumulation as _ga  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402


def gradient_accumulation(train_step, iterable_tensors, model, *carried):
    """torch_xla's ``gradient_accumulation``: it takes the carried tensors as
    varargs from torch_xla 2.8, as one tuple in 2.7."""
    params = inspect.signature(_ga.gradient_accumulation).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return _ga.gradient_accumulation(train_step, iterable_tensors, model, *carried)
    return _ga.gradient_accumulation(train_step, iterable_tensors, model, carried)

FEATURES, CLASSES = 512, 16
MICRO_BATCHES, BATCH = 4, 64
LR, MOMENTUM = 0.5, 0.9


class Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(CLASSES))


def synthetic_data(steps: int, gen: torch.Generator):
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    x = torch.randn(steps, MICRO_BATCHES, BATCH, FEATURES, generator=gen)
    return x, (x @ teacher).argmax(-1)


def pointers(*tensors) -> set:
    xm.wait_device_ops()  # on CPU only this waits for the step to run
    return {torch_xla._XLAC._unsafe_buffer_pointer(t) for t in tensors}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-donate", action="store_true", help="the same loop without donation")
    args = parser.parse_args()
    donate = not args.no_donate

    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(0)
    xs, ys = synthetic_data(args.steps, gen)
    # One device tensor per step (not slices of one big tensor, whose index
    # would make every step's graph different and compile again).
    xs, ys = [x.to(dev) for x in xs], [y.to(dev) for y in ys]
    model = Bias().to(dev)
    W = torch.zeros(FEATURES, CLASSES, device=dev)
    acc = torch.zeros(FEATURES, CLASSES, device=dev)
    torch_xla.sync()
    state_buffers = pointers(W, acc)

    def train_step(x, y, acc):
        logits = x @ W + model.b
        loss = torch.nn.functional.cross_entropy(logits, y)
        # d loss / d W, scaled like gradient_accumulation scales the loss.
        err = torch.softmax(logits, -1) - torch.nn.functional.one_hot(y, CLASSES).float()
        return loss, acc + x.T @ err / (BATCH * MICRO_BATCHES)

    same, losses = [], []
    for step in range(args.steps):
        old_W, old_acc = W, acc
        if donate:
            tdx.donate_buffer(acc)
            tdx.donate_buffer(W)
        loss, acc = gradient_accumulation(train_step, (xs[step], ys[step]), model, acc)
        with torch.no_grad():
            W = W - LR * acc
            acc = MOMENTUM * acc
            model.b -= LR * model.b.grad
        model.b.grad = None
        torch_xla.sync()
        losses.append(loss.item())
        same.append(pointers(W, acc) == state_buffers)
        if donate:
            assert tdx.is_deleted(old_W) and tdx.is_deleted(old_acc)
        del old_W, old_acc
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  state in the same buffers: {same[-1]}")

    tdx.settle()
    stats = tdx.summary().totals
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"state kept its buffers on {sum(same)} of {len(same)} steps")
    print(f"reused by donation: {stats.reused} buffers, {stats.reused_bytes / 2**20:.1f} MiB")

    try:
        tdx.donate_buffer(model.b)
        gradient_accumulation(train_step, (xs[0], ys[0]), model, acc)
    except tdx.ParameterDonationError as e:
        tdx.undonate(model.b)
        print(f"donating a model parameter: refused ({type(e).__name__}), bias intact: "
              f"{not tdx.is_deleted(model.b)}")


if __name__ == "__main__":
    main()
