"""Train a small MLP on scikit-learn's digits with explicit buffer donation.

    PJRT_DEVICE=CPU python examples/train_digits.py [--epochs N] [--no-donate]

The parameters and the Adam state are plain tensors, replaced by new tensors
every step (a functional optimizer, as in JAX).  Without donation each step
allocates a second copy of that state for its outputs while the old copy is
still alive.  Here ``tdx.donate((params, opt_state))`` hands the old buffers
to the step: the new state is written into them and the old tensors are
poisoned (using one raises ``DonatedBufferError``).

The data set ships with scikit-learn (1797 8x8 images, no download).  At the
end the script prints the test accuracy and what donation saved, from the
plugin's report (``torch_xla_donate.summary()``).
"""
import argparse
import math
import os
import sys
import time

import numpy as np

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="train without donation, to compare")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1:
        parser.error("--epochs, --batch-size and --hidden must be positive")
    return args


# -- data ----------------------------------------------------------------------


def load_data(seed):
    """80/20 split of the digits, pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def batches(x, y, batch_size, rng):
    """Shuffled full batches: a constant batch shape keeps one compiled graph."""
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


# -- model and a functional Adam ---------------------------------------------------


def init_params(sizes, seed, device):
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1 / math.sqrt(fan_in)
        params[f"w{i}"] = (torch.rand(fan_in, fan_out, generator=gen) * 2 - 1) * bound
        params[f"b{i}"] = torch.zeros(fan_out)
    return {k: v.to(device).requires_grad_() for k, v in params.items()}


def forward(params, x):
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = torch.relu(x)
    return x


def adam_init(params):
    return {
        "step": torch.zeros((), device=next(iter(params.values())).device),
        "m": {k: torch.zeros_like(p, requires_grad=False) for k, p in params.items()},
        "v": {k: torch.zeros_like(p, requires_grad=False) for k, p in params.items()},
    }


@torch.no_grad()
def adam_update(params, grads, state, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """One Adam step that returns new tensors and never writes the old ones."""
    step = state["step"] + 1
    m = {k: beta1 * state["m"][k] + (1 - beta1) * grads[k] for k in params}
    v = {k: beta2 * state["v"][k] + (1 - beta2) * grads[k] ** 2 for k in params}
    scale = lr * torch.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    new_params = {
        k: (params[k] - scale * m[k] / (v[k].sqrt() + eps)).requires_grad_()
        for k in params
    }
    return new_params, {"step": step, "m": m, "v": v}


def train_step(params, opt_state, x, y, lr, donate):
    loss = torch.nn.functional.cross_entropy(forward(params, x), y)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    if donate:
        # The old parameters and Adam state are never read after this step:
        # give their buffers to the new ones.
        tdx.donate((params, opt_state))
    params, opt_state = adam_update(params, grads, opt_state, lr)
    return params, opt_state, loss.detach()


@torch.no_grad()
def accuracy(params, x, y, device):
    logits = forward(params, torch.from_numpy(x).to(device))
    hits = (logits.argmax(dim=1) == torch.from_numpy(y).to(device)).sum()
    return hits.item() / len(y)


# -- progress bar ---------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar on stderr; one line per epoch when stderr is
    not a terminal (logs, CI), so the output stays readable there too."""

    def __init__(self, epochs, steps_per_epoch, stream=sys.stderr, width=30):
        self.epochs, self.steps = epochs, steps_per_epoch
        self.stream, self.width = stream, width
        self.live = stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._loss = None  # the last epoch's mean loss, shown until the next one
        self._drawn = 0  # length of the line on screen, to blank leftovers

    def update(self, epoch, step, loss=None, force=False):
        now = time.perf_counter()
        if not (force or (self.live and now - self._last_draw > 0.1)):
            return
        self._last_draw = now
        done = (epoch * self.steps + step) / (self.epochs * self.steps)
        filled = int(round(done * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        if loss is not None:
            self._loss = loss
        loss_text = f" loss {self._loss:.4f}" if self._loss is not None else ""
        line = (f"epoch {epoch + 1:>3}/{self.epochs} [{bar}] {100 * done:5.1f}%"
                f"{loss_text} {now - self.start:6.1f}s")
        if self.live:
            self.stream.write("\r" + line.ljust(self._drawn))
            self._drawn = len(line)
        elif force:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


# -- main ----------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    device = torch_xla.device()
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    params = init_params([x_train.shape[1], args.hidden, 10], args.seed, device)
    opt_state = adam_init(params)
    torch_xla.sync()  # materialize: only device data can be donated

    rng = np.random.default_rng(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size
    bar = ProgressBar(args.epochs, steps_per_epoch)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        for i, (xb, yb) in enumerate(batches(x_train, y_train, args.batch_size, rng)):
            params, opt_state, loss = train_step(
                params, opt_state, xb.to(device), yb.to(device), args.lr, args.donate)
            torch_xla.sync()  # the step barrier: new state lands in the old buffers
            losses.append(loss)
            bar.update(epoch, i + 1)
        bar.update(epoch, steps_per_epoch, torch.stack(losses).mean().item(), force=True)
    bar.close()
    train_seconds = time.perf_counter() - start

    test_acc = accuracy(params, x_test, y_test, device)
    tdx.settle()  # the last step's verdicts
    report(args, test_acc, train_seconds, args.epochs * steps_per_epoch, params, opt_state)


def report(args, test_acc, seconds, steps, params, opt_state):
    totals = tdx.summary().totals
    # The Adam step counter is a 0-dim scalar: donate() skips scalars (they
    # save nothing and torch_xla may share their device buffer).
    state_tensors = list(params.values())
    state_tensors += list(opt_state["m"].values()) + list(opt_state["v"].values())
    state_bytes = sum(t.nbytes for t in state_tensors)
    print(f"test accuracy: {test_acc:.4f} ({args.epochs} epochs, {steps} steps, "
          f"{seconds:.1f}s)")
    print(f"training state (params + Adam moments): {len(state_tensors)} tensors, "
          f"{state_bytes} bytes (plus the scalar step counter, never donated)")
    if not args.donate:
        print("donation: off (--no-donate); every step allocated a new copy of the state")
        return
    per_step = totals.reused_bytes / steps
    reused = 100 * totals.reused_bytes / max(totals.donated_bytes, 1)
    print(f"donation: {totals.donated} buffers donated, {totals.reused} reused "
          f"by step outputs, {totals.unused} unused")
    print(f"reused bytes: {totals.reused_bytes} in total, {per_step:.0f} per step "
          f"({reused:.1f}% of the donated bytes): the steps wrote the new state into "
          f"the old buffers instead of allocating {per_step / 1024:.1f} KiB each")


if __name__ == "__main__":
    main()
