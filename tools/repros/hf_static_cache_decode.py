"""Hugging Face transformers' ``StaticCache`` in a lazy XLA decode loop:
what donation can and cannot save, and which attention form lets XLA:CPU
read the cache without copying it.  Needs ``transformers`` (4.56 or later,
not a requirement of this package); no download: a tiny Llama with random
weights.

    pip install transformers          # or: pip install --target DIR ... and PYTHONPATH=DIR
    PJRT_DEVICE=CPU python tools/repros/hf_static_cache_decode.py [--compile] [CASE ...]

The model has 4 layers, 8 heads of 64, and a ``StaticCache`` of 2,048
positions for a batch of 4: per layer two f32[4, 8, 2048, 64] tensors,
128 MiB in all (32 MiB with 2 key/value heads).  Each case runs 6 greedy
decode steps (one token, its position a device tensor, one graph for every
step) in a process of its own and prints how much the peak resident memory
grew over the last 4, the largest temporary XLA allocates for a step's graph
(``*memory-usage-report.txt`` of ``--xla_dump_to``), whether the cache is
still in its first buffers, the time per step, what ``torch_xla_donate``
reported for the step, and how far the last logits are from the first case
with the same number of key/value heads.

``StaticLayer.update`` writes the cache in place
(``keys.index_copy_(2, cache_position, key_states)``), so torch_xla already
aliases every cache tensor to its updated self (``input_output_alias`` in the
HLO): there is no second cache for donation to remove.  ``tdx.donate`` of
the cache tensors before the step is reported as "updated in place" and
changes nothing.  What the peak keeps are XLA temporaries made by the
attention's reads of the updated 4-D cache: ``torch.matmul`` (HF's
``eager`` and the ``sdpa`` math path on XLA) reshapes it to 3-D, and
XLA:CPU then recomputes the update into a copy for that reader and copies
each value cache twice (the aliased output must not overwrite what another
reader still needs), and lays the keys out transposed in a copy; with
grouped heads ``repeat_kv`` adds an expanded copy.  ``einsum`` over the 4-D
cache, grouped heads as a dimension of the queries, takes none of these.

Cases: ``sdpa`` (transformers' default), ``eager``, ``einsum`` (the function
below, registered with ``AttentionInterface``), ``+ donate`` (``tdx.donate``
of every cache tensor before each step), ``2 kv heads`` (grouped-query
attention).  ``--compile`` runs the model through
``torch.compile(backend="openxla")``.

Measured on 2026-11-26 (transformers 4.57.1, torch_xla 2.9.0, XLA:CPU,
2 CPUs), peak growth (XLA's largest temporary), lazy:

    sdpa, eager (+ donate or not)   +82 MiB (80.3 MiB), cache in its first buffers
    einsum (+ donate or not)        +2 MiB (0.5 MiB), logits within 1.3e-6, 2-5x faster
    2 kv heads (32 MiB cache)       eager 32.3 MiB of temporaries, einsum 0.5 MiB

and compiled: +97 to +187 MiB without donation (a new cache each step, 32.3
MiB of temporaries), +82 to +105 donated (80.3 MiB), with either attention (dynamo
lowers ``einsum`` to ``bmm`` on 3-D reshapes).  ``tdx.donate`` reports
"updated in place 8" lazily and "reused 8" compiled.  See README.md,
"Decoding with a KV cache".
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

CASES = ["sdpa", "sdpa + donate", "eager", "einsum", "einsum + donate",
         "eager, 2 kv heads", "einsum, 2 kv heads"]
BATCH, HEADS, HEAD_DIM, POSITIONS, LAYERS, STEPS, MEASURED = 4, 8, 64, 2048, 4, 6, 4


def einsum_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """HF's eager attention written with ``einsum`` over the 4-D cache
    ([batch, kv_heads, positions, head_dim]): no reshape of the cache, no
    ``repeat_kv`` (the query heads of a group share a dimension instead), the
    queries scaled instead of the keys.  Lazy XLA lowers ``einsum`` to one
    ``dot_general`` that reads the updated cache where it is."""
    import torch

    b, heads, t, d = query.shape
    groups = key.shape[1]
    scaling = d ** -0.5 if scaling is None else scaling
    q = (query * scaling).view(b, groups, heads // groups, t, d)
    scores = torch.einsum("bgrtd,bgkd->bgrtk", q, key)
    if attention_mask is not None:  # [b, 1, t, k]: the same for every head
        mask = attention_mask[:, :, :, : key.shape[-2]].unsqueeze(1)
        if mask.dtype == torch.bool:  # True: attend
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:  # additive, as the eager mask
            scores = scores + mask
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.einsum("bgrtk,bgkd->bgrtd", weights, value).reshape(b, heads, t, d)
    return out.transpose(1, 2).contiguous(), None


def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(case, dump, compiled, logits_path):
    import ctypes

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, StaticCache
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    import torch_xla_donate as tdx

    attention = case.split(" ")[0].rstrip(",")
    kv_heads = 2 if "2 kv heads" in case else HEADS
    AttentionInterface.register("einsum", einsum_attention)
    AttentionMaskInterface.register("einsum", eager_mask)  # the mask eager attention gets
    config = LlamaConfig(vocab_size=512, hidden_size=HEADS * HEAD_DIM, intermediate_size=1024,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=kv_heads, max_position_embeddings=POSITIONS,
                         attn_implementation=attention)
    torch.manual_seed(0)
    dev = torch_xla.device()
    model = LlamaForCausalLM(config).eval().requires_grad_(False).to(dev)
    cache = StaticCache(config=config, max_cache_len=POSITIONS)
    cache.early_initialization(BATCH, kv_heads, HEAD_DIM, torch.float32, dev)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    forward = torch.compile(model, backend="openxla", dynamic=False) if compiled else model
    ids = torch.randint(0, 512, (BATCH, 1)).to(dev)
    pos = torch.tensor([5], device=dev)
    torch_xla.sync()

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed buffers leave the resident set
    pointer = torch_xla._XLAC._unsafe_buffer_pointer
    xm.wait_device_ops()  # on CPU only this waits for the buffers to exist
    first = [pointer(t) for t in tensors]
    with torch.no_grad():
        for step in range(STEPS):
            if step == STEPS - MEASURED:  # compiled by now: measure from here
                xm.wait_device_ops()
                libc.malloc_trim(0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS
                base, start = _status_mib("VmRSS:"), __import__("time").perf_counter()
            if "donate" in case:
                tdx.donate(tensors)
            out = forward(input_ids=ids, position_ids=pos[None], cache_position=pos,
                          past_key_values=cache, use_cache=True)
            ids, pos = out.logits[:, -1:].argmax(-1), pos + 1
            torch_xla.sync()
            xm.wait_device_ops()
    ms = (__import__("time").perf_counter() - start) / MEASURED * 1e3
    growth = _status_mib("VmHWM:") - base
    kept = [pointer(t) for t in tensors] == first
    torch.save(out.logits.cpu(), logits_path)
    temp = 0.0
    for path in glob.glob(os.path.join(dump, "*memory-usage-report.txt")):
        with open(path) as f:
            for line in f:
                match = re.search(r"size ([\d.]+)(B|KiB|MiB|GiB), preallocated-temp", line)
                if match:
                    scale = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10}[match[2]]
                    temp = max(temp, float(match[1]) * scale)
    report = tdx.last_step_report() if "donate" in case else None
    print(f"XLA temporaries {temp:6.1f} MiB, peak grew {growth:6.1f} MiB (cache "
          f"{sum(t.nbytes for t in tensors) / 2**20:.0f} MiB, in its first buffers: {kept}), "
          f"{ms:4.0f} ms/step" + (f"; tdx: {report}" if report else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true",
                        help='run the model through torch.compile(backend="openxla")')
    parser.add_argument("cases", nargs="*", default=CASES, help=f"of {CASES}")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.cases[0], args.child[0], args.compile, args.child[1])
    try:
        import transformers
    except ImportError:
        sys.exit("hf_static_cache_decode.py needs transformers (4.56 or later), which "
                 "torch_xla_donate does not require: pip install transformers")
    if not hasattr(transformers, "AttentionInterface") or not hasattr(
            transformers.StaticCache, "early_initialization"):
        sys.exit(f"transformers {transformers.__version__} is too old: 4.56 or later is needed "
                 "(StaticCache.early_initialization, AttentionInterface)")
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; cases: {CASES}")
    import torch

    print(f"transformers {transformers.__version__}, "
          f"{'torch.compile(backend=openxla)' if args.compile else 'lazy'}")
    reference = {}
    with tempfile.TemporaryDirectory() as out:
        for i, case in enumerate(args.cases):
            with tempfile.TemporaryDirectory() as dump:
                logits = os.path.join(out, f"{i}.pt")
                env = dict(os.environ, PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2",
                           XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                                     "--xla_cpu_use_xnnpack=false")
                command = [sys.executable, __file__, case, "--child", dump, logits]
                proc = subprocess.run(command + (["--compile"] if args.compile else []), env=env,
                                      check=False, capture_output=True, text=True)
            if proc.returncode:
                print(f"{case:20s} failed:\n{proc.stderr[-3000:]}")
                continue
            heads = "2 kv heads" in case
            values = torch.load(logits)
            first = reference.setdefault(heads, (case, values))
            diff = (values - first[1]).abs().max().item()
            print(f"{case:20s} {proc.stdout.strip()}; logits vs {first[0]!r}: max diff {diff:.1e}")


if __name__ == "__main__":
    main()
