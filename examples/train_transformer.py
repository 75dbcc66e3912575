"""Train a small decoder-only transformer with torch.func and donation.

    PJRT_DEVICE=CPU python examples/train_transformer.py [--steps N] [--no-donate]

The model is built from ``torch.nn`` (embeddings, ``nn.TransformerEncoderLayer``
blocks under a causal mask, a language-model head) and trained the torch.func
way: its parameters are plain tensors taken from the module
(``{k: v.detach() for k, v in model.named_parameters()}``), the loss runs the
module with ``torch.func.functional_call``, ``grad_and_value`` gives the
gradients, and a functional AdamW returns new parameters and new moments.
``@tdx.donating(donate_argnums=(0, 1))`` donates the old parameters and
optimizer state at every step, so the new ones are written into their
buffers.  (The first step also takes down the module's own parameters,
which share their storage with the detached ones: using ``model`` directly
afterwards raises ``DonatedBufferError``.)

The data needs no download: sequences of a short random phrase repeated, so
predicting a token means finding the phrase earlier in the context.  The
script prints the loss, how much the peak memory grew over the training
loop (run with ``--no-donate`` to compare), and the plugin's report.
"""
import argparse
import math
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
from torch.func import functional_call, grad_and_value  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256, help="d_model")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="train without donation, to compare")
    args = parser.parse_args(argv)
    if min(args.steps, args.layers, args.width, args.heads, args.vocab, args.context,
           args.batch_size) < 1 or args.width % args.heads:
        parser.error("sizes must be positive and --width a multiple of --heads")
    return args


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, pre-norm transformer blocks with a
    causal mask, a final norm and a language-model head."""

    def __init__(self, vocab, context, width, heads, layers):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                             batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batch(gen, args):
    """Each row repeats a random phrase of 4-8 tokens: inputs and targets."""
    rows = []
    for _ in range(args.batch_size):
        length = int(torch.randint(4, 9, (), generator=gen))
        phrase = torch.randint(0, args.vocab, (length,), generator=gen)
        rows.append(phrase.repeat(args.context // length + 2)[: args.context + 1])
    data = torch.stack(rows)
    return data[:, :-1], data[:, 1:]


def adamw_init(params):
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    return {"step": torch.zeros((), device=next(iter(params.values())).device),
            "m": zeros, "v": {k: torch.zeros_like(p) for k, p in params.items()}}


def adamw(params, grads, state, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """One AdamW step as a function: new parameters and moments, old ones untouched."""
    b1, b2 = betas
    step = state["step"] + 1
    m = {k: b1 * state["m"][k] + (1 - b1) * grads[k] for k in params}
    v = {k: b2 * state["v"][k] + (1 - b2) * grads[k] ** 2 for k in params}
    scale = lr * torch.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    new = {k: params[k] * (1 - lr * weight_decay) - scale * m[k] / (v[k].sqrt() + eps)
           for k in params}
    return new, {"step": step, "m": m, "v": v}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def start_peak_memory() -> float:
    """Makes the peak resident size follow the live device buffers (XLA:CPU
    keeps them in host memory) and restarts it from now; returns the
    resident size it starts from.  Linux only."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: big buffers return to the system when freed
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status_mib("VmRSS:")


def peak_rss_mib() -> float:
    return _status_mib("VmHWM:")


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch_xla.device()
    model = TinyGPT(args.vocab, args.context, args.width, args.heads, args.layers).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt_state = adamw_init(params)
    torch_xla.sync()

    def loss_fn(params, x, y):
        logits = functional_call(model, params, (x,))
        return F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))

    def train_step(params, opt_state, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        params, opt_state = adamw(params, grads, opt_state, args.lr)
        return params, opt_state, loss

    if args.donate:
        # The old parameters and AdamW state are never read after a step.
        train_step = tdx.donating(train_step, donate_argnums=(0, 1))

    gen = torch.Generator().manual_seed(args.seed)
    state_bytes = sum(t.nbytes for t in list(params.values())
                      + list(opt_state["m"].values()) + list(opt_state["v"].values()))
    print(f"TinyGPT: {sum(p.numel() for p in params.values()):,} parameters, "
          f"training state {state_bytes / 2**20:.1f} MiB; donation "
          f"{'on' if args.donate else 'off (--no-donate)'}")
    base, start, first_loss = None, time.perf_counter(), None
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(gen, args))
        params, opt_state, loss = train_step(params, opt_state, x, y)
        torch_xla.sync()  # the step barrier: the new state lands in the old buffers
        if step == 0:
            first_loss = loss.item()
        if step == min(2, args.steps - 1):  # every graph compiled: measure from here
            base = start_peak_memory()
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    tdx.settle()
    growth = peak_rss_mib() - base
    print(f"loss {first_loss:.3f} -> {loss.item():.3f} ({args.steps} steps, "
          f"{time.perf_counter() - start:.1f}s); ln(vocab) = {math.log(args.vocab):.3f}")
    print(f"peak memory growth over the loop (after step 2): {growth:.1f} MiB "
          f"({'donated' if args.donate else 'not donated'}; the state is "
          f"{state_bytes / 2**20:.1f} MiB)")
    print(tdx.summary())
    if args.donate:
        try:
            model(x)
        except tdx.DonatedBufferError as error:
            print(f"the module's own parameters went with the first donation: "
                  f"{str(error).split(':')[0]}")


if __name__ == "__main__":
    main()
