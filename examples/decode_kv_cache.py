"""Greedy decoding with a static KV cache that is donated at every step.

    PJRT_DEVICE=CPU python examples/decode_kv_cache.py [--compile] [--no-donate]

A small decoder-only model built from ``torch.nn`` (random weights, no
download) serves a few requests one after the other.  Its keys and values
live in a cache allocated once, ``--positions`` long: per layer a ``(k, v)``
pair of ``f32[batch * heads, positions, head_dim]``.  Each decode step writes
the new token's keys and values functionally::

    k_cache = k_cache.index_copy(1, pos, k)

and returns the new cache.  Without donation the old and the new cache are
both alive while a step runs: every step needs a second cache.  The steps
are wrapped in ``tdx.donating(..., donate_argnums=(2,))``, so the old cache
is donated and the new one is written into its buffers.  ``--compile`` runs
the prefill and decode steps through ``torch.compile(backend="openxla")``,
where the outputs get fresh buffers too unless the inputs are donated.

Shapes stay static, so each graph is compiled once: the position is a device
tensor (a mask hides the cache beyond it), and a prompt is padded to a
multiple of ``--bucket`` tokens (one prefill graph per bucket; the padding's
cache entries are masked out, then overwritten by the generated tokens).
Before serving, a warm-up compiles every graph, as a server would.

The script prints each request's tokens, the compile counts (after the
warm-up: none), tokens per second, the peak memory growth while serving and
the plugin's report.  Run it once more with ``--no-donate`` to compare (peak
memory only grows, so each mode needs its own process): with the default
128 MiB cache the peak grew by about 20 MiB with donation and by 330-340 MiB
without it, lazy or compiled (2026-11-24, 2 CPUs; the tokens are the same).

How the cache is written matters as much as donating it: XLA:CPU must be
able to update it in place, or the step copies it anyway (see ``write``,
``Block`` and tools/repros/kv_cache_update_copies.py).
"""
import argparse
import hashlib
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402

MIB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--positions", type=int, default=2048, help="cache length")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=40, help="decode steps per request")
    parser.add_argument("--prompt-min", type=int, default=5)
    parser.add_argument("--prompt-max", type=int, default=40)
    parser.add_argument("--bucket", type=int, default=16, help="prompts are padded to a multiple")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help='run the steps through torch.compile(backend="openxla")')
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="decode without donation, to compare")
    args = parser.parse_args(argv)
    sizes = (args.layers, args.batch_size, args.heads, args.head_dim, args.positions,
             args.vocab, args.requests, args.new_tokens, args.prompt_min, args.bucket)
    if min(sizes) < 1 or args.prompt_max < args.prompt_min:
        parser.error("sizes must be positive and --prompt-max at least --prompt-min")
    if bucket_of(args.prompt_max, args.bucket) + args.new_tokens > args.positions:
        parser.error("--positions too small for the longest padded prompt plus --new-tokens")
    return args


def bucket_of(length: int, bucket: int) -> int:
    return -(-length // bucket) * bucket


def write(cache, new, pos):
    """The cache with ``new`` [N, T, head_dim] written along its positions:
    a prompt at 0..T-1 when ``pos`` is None, else one token at ``pos`` (a
    device tensor [1]).  Functional: the old cache is left as it was.

    Both forms let XLA:CPU write the new cache over the old one, so that
    with donation a step holds one cache.  ``index_copy`` with T > 1
    positions would not: XLA runs that scatter on a transposed copy of the
    cache.  A prompt's positions are static, so it is written with
    ``slice_scatter``; one token's position is known on the device only, and
    ``index_copy`` at one position becomes an in-place dynamic-update-slice."""
    if pos is None:
        return cache.slice_scatter(new, 1, 0, new.shape[1])
    return cache.index_copy(1, pos, new)


class Block(torch.nn.Module):
    """Pre-norm attention over the KV cache, then an MLP.

    The cache of a layer is two 3-D tensors [batch * heads, positions,
    head_dim].  With 4-D [batch, heads, positions, head_dim] tensors the
    batched matmul reshapes the updated cache, and XLA:CPU then computes the
    update once per reader, each on a copy of the cache: a temporary the
    size of the cache at every step, whatever donation saves.  The scores
    scale the queries, not the keys, for the same reason
    (``F.scaled_dot_product_attention`` scales both: a scaled copy of the
    keys)."""

    def __init__(self, heads, head_dim):
        super().__init__()
        width = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, h, positions, pos, k_cache, v_cache):
        """h: [B, T, width] at ``positions`` [T] (a device tensor); ``pos``:
        see ``write``.  Returns the new h, k_cache and v_cache."""
        b, t, width = h.shape
        qkv = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).reshape(3, b * self.heads, t, self.head_dim)
        k_cache, v_cache = write(k_cache, k, pos), write(v_cache, v, pos)
        # A query at position p sees the cache up to p: what lies beyond
        # (padding, an earlier request's entries) is masked out.
        seen = torch.arange(k_cache.shape[1], device=h.device)[None, :] <= positions[:, None]
        scores = (q * self.head_dim ** -0.5) @ k_cache.transpose(1, 2)  # [B * heads, T, P]
        a = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v_cache
        a = a.view(b, self.heads, t, self.head_dim).transpose(1, 2).reshape(b, t, width)
        h = h + self.proj(a)
        return h + self.mlp(self.norm2(h)), k_cache, v_cache


class TinyDecoder(torch.nn.Module):
    def __init__(self, vocab, positions, heads, head_dim, layers):
        super().__init__()
        width = heads * head_dim
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.ModuleList(Block(heads, head_dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids, pos, cache):
        """ids [B, T]: a prompt (``pos`` None) or one token at ``pos`` [1];
        cache: one (k, v) per layer.  Returns the logits and the new cache."""
        positions = torch.arange(ids.shape[1], device=ids.device) if pos is None else pos
        h = self.tokens(ids) + self.positions(positions)
        new_cache = []
        for block, (k_cache, v_cache) in zip(self.blocks, cache):
            h, k_cache, v_cache = block(h, positions, pos, k_cache, v_cache)
            new_cache.append((k_cache, v_cache))
        return self.head(self.norm(h)), new_cache


def make_steps(model, args):
    """The prefill and decode steps, each donating the cache (argument 2)."""

    def prefill(ids, length, cache):
        """ids: [B, bucket] padded prompts, length: [1] their true length.
        Returns the first generated token, its position and the new cache."""
        logits, cache = model(ids, None, cache)
        last = logits.index_select(1, length - 1)  # the last true prompt token
        return last.argmax(-1), length, cache

    def decode(ids, pos, cache):
        """ids: [B, 1] the previous token at position pos [1]."""
        logits, cache = model(ids, pos, cache)
        return logits.argmax(-1), pos + 1, cache

    if args.compile:
        prefill = torch.compile(prefill, backend="openxla", dynamic=False)
        decode = torch.compile(decode, backend="openxla", dynamic=False)
    if args.donate:
        # The old cache is never read after a step: its buffers take the new one.
        prefill = tdx.donating(prefill, donate_argnums=(2,))
        decode = tdx.donating(decode, donate_argnums=(2,))
    return prefill, decode


def compiles() -> int:
    """XLA graphs compiled so far in this process (lazy and dynamo alike)."""
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


def dynamo_graphs() -> int:
    """Graphs torch.compile has traced so far (a re-trace that finds its XLA
    graph cached compiles nothing, but still costs host time)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settled_rss(quiet=0.25, limit=3.0) -> float:
    """The resident size once it has stopped falling for ``quiet`` seconds
    (at most ``limit``).  After the device is waited for, XLA still frees
    the buffers of inputs the last steps dropped on threads of its own: up
    to the whole 64 MiB old cache of the warm-up went within 50 ms, with
    four runs sharing two CPUs.  A base read before that counts memory the
    serving loop never needs, and the growth measured from it comes out a
    buffer short."""
    last, start = _status_mib("VmRSS:"), time.monotonic()
    since = start
    while time.monotonic() - start < limit and time.monotonic() - since < quiet:
        time.sleep(0.02)
        now = _status_mib("VmRSS:")
        if now < last - 0.5:
            last, since = now, time.monotonic()
    return last


def start_peak_memory() -> float:
    """Makes the peak resident size follow the live device buffers (XLA:CPU
    keeps them in host memory) and restarts it from now, once the buffers
    of the warm-up are freed; returns the resident size it starts from.
    Linux only."""
    import ctypes

    xm.wait_device_ops()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: big buffers return to the system when freed
    libc.malloc_trim(0)
    _settled_rss()
    libc.malloc_trim(0)  # what was freed meanwhile into the heap, too
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status_mib("VmRSS:")


class Server:
    """Holds the cache and runs requests through the two steps, counting the
    XLA graphs each kind of step compiles."""

    def __init__(self, model, cache, args):
        self.cache, self.args = cache, args
        self.prefill, self.decode = make_steps(model, args)
        self.compiled = {"prefill": 0, "first decode": 0, "later decode": 0}
        self.decode_steps = 0

    def _count(self, kind, before):
        self.compiled[kind] += compiles() - before

    def generate(self, prompt, steps):
        """prompt: [B, length] token ids on the host.  Returns the generated
        tokens [B, steps] on the host."""
        device = torch_xla.device()
        length = prompt.shape[1]
        ids = torch.zeros(prompt.shape[0], bucket_of(length, self.args.bucket), dtype=torch.long)
        ids[:, :length] = prompt
        before = compiles()
        token, pos, self.cache = self.prefill(ids.to(device), torch.tensor([length], device=device),
                                              self.cache)
        # The step barrier: a lazy step runs here, its new cache in the old
        # buffers (a compiled step ran, and donated, at its call).
        torch_xla.sync()
        self._count("prefill", before)
        tokens = [token]
        for _ in range(steps - 1):
            before = compiles()
            token, pos, self.cache = self.decode(token, pos, self.cache)
            torch_xla.sync()
            self._count("later decode" if self.decode_steps else "first decode", before)
            self.decode_steps += 1
            tokens.append(token)
        return torch.cat([t.cpu() for t in tokens], dim=1)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch_xla.device()
    model = TinyDecoder(args.vocab, args.positions, args.heads, args.head_dim, args.layers)
    model = model.eval().requires_grad_(False).to(device)  # inference: no autograd graph
    shape = (args.batch_size * args.heads, args.positions, args.head_dim)
    cache = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
             for _ in range(args.layers)]
    torch_xla.sync()
    setup = compiles()
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in cache)
    print(f"TinyDecoder: {args.layers} layers, width {args.heads * args.head_dim}, "
          f"{args.heads} heads, vocab {args.vocab}; KV cache {args.layers} x 2 x "
          f"f32{list(shape)} = {cache_bytes / MIB:.1f} MiB; "
          f"{'torch.compile(backend=openxla)' if args.compile else 'lazy'}; donation "
          f"{'on' if args.donate else 'off (--no-donate)'}")
    server = Server(model, cache, args)
    del cache  # the server's steps replace it (and donate it) from now on

    # Warm-up, as a server does before it takes requests: one prefill per
    # prompt bucket and two decode steps, so that every graph is compiled.
    buckets = list(range(args.bucket, bucket_of(args.prompt_max, args.bucket) + 1, args.bucket))
    buckets = [b for b in buckets if b >= bucket_of(args.prompt_min, args.bucket)]
    for bucket in buckets:
        server.generate(torch.zeros(args.batch_size, bucket, dtype=torch.long), steps=3)
    warm, warm_graphs = dict(server.compiled), dynamo_graphs()

    gen = torch.Generator().manual_seed(args.seed)
    digest, decoded = hashlib.sha256(), 0
    base = start_peak_memory()
    before, start = compiles(), time.perf_counter()
    for request in range(args.requests):
        length = int(torch.randint(args.prompt_min, args.prompt_max + 1, (), generator=gen))
        prompt = torch.randint(0, args.vocab, (args.batch_size, length), generator=gen)
        out = server.generate(prompt, args.new_tokens)
        decoded += out.numel()
        digest.update(out.numpy().tobytes())
        print(f"request {request}: prompt {length} tokens (bucket {bucket_of(length, args.bucket)}), "
              f"generated {out.shape[1]} x {args.batch_size}; row 0: {' '.join(map(str, out[0].tolist()))}")
    xm.wait_device_ops()
    elapsed, serving = time.perf_counter() - start, compiles() - before
    serving_graphs = dynamo_graphs() - warm_graphs
    tdx.settle()
    growth = _status_mib("VmHWM:") - base

    print(f"tokens sha256: {digest.hexdigest()[:16]}")
    print(f"compiles: setup {setup}; warm-up: prefill {warm['prefill']} "
          f"({len(buckets)} bucket(s): {', '.join(map(str, buckets))}), first decode step "
          f"{warm['first decode']}, later decode steps {warm['later decode']}; serving {serving}")
    if args.compile:
        print(f"dynamo graphs traced: warm-up {warm_graphs}, serving {serving_graphs}")
    print(f"serving: {decoded / elapsed:.1f} tokens/s ({decoded} tokens in {elapsed:.2f}s, "
          f"prefills included)")
    print(f"peak memory growth while serving: {growth:.1f} MiB "
          f"({'donated' if args.donate else 'not donated'}; the cache is "
          f"{cache_bytes / MIB:.1f} MiB)")
    print(tdx.summary())


if __name__ == "__main__":
    main()
