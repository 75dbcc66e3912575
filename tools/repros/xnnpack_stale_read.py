"""XLA:CPU reading a reused buffer's old contents in a matmul (XNNPACK).

No torch_xla_donate here.  A loop computes ``loss = mean(tanh(x @ p) ** 2)``
and then replaces ``p``, in one of three ways:

* ``inplace``: ``p.sub_(0.05 * g)``: torch_xla's own aliasing of in-place
  updates gives the new ``p`` the old buffer (same ``_unsafe_buffer_pointer``);
* ``donated``: ``_set_buffer_donation(p, True); p = p - 0.05 * g``: the same
  buffer reuse, explicitly;
* ``plain``: ``p = p - 0.05 * g``: a new buffer every step, the reference.

Each step's loss of the two reusing variants is compared bit for bit with
the plain run.  On some x86 CPUs, torch_xla 2.9's XLA:CPU computes the
matmul after a reuse with the buffer's *old* contents (an earlier VM of this
project, 2026-11-23: 0.3925115 where the right value was 0.3925575, widths
768 and 1024, not 256 or 512), and ``--xla_cpu_use_xnnpack=false`` makes
every variant right.  torch_xla_donate adds that flag at import on the CPU
backend (torch_xla_donate/_xla_cpu.py).

    PJRT_DEVICE=CPU python tools/repros/xnnpack_stale_read.py [--width 1024] [--xnnpack default]
    PJRT_DEVICE=CPU python tools/repros/xnnpack_stale_read.py --xnnpack off

``--xnnpack default|off|greedy`` runs each configuration in a fresh process
with XLA_FLAGS set accordingly (greedy: XNNPACK fusions forced on); the
report says which XLA:CPU options the compiled graphs had (the debug options
XLA dumps) and whether their optimized HLO holds XNNPACK fusions.  Exit
status 1 when a variant read stale data.

``--op`` picks what the step reads ``p`` with: ``matmul`` (``x @ p``, p the
right operand, the default), ``matmul_lhs`` (``p @ x.T``), ``elementwise``
or ``reduce``.  ``--xnnpack package`` gives no flag and imports
torch_xla_donate first in each process, as a user does (its import adds the
flag on the CPU backend).  The XNNPACK-fusion count is no signal: the stale
runs below compiled with none in their optimized HLO.

Measured on 2026-11-24 on this repository's VM (AMD EPYC with AVX2, no
AVX-512, 2 CPUs), 3 steps, losses compared bit for bit:

* torch_xla 2.9.0, XLA's defaults: STALE, in place and donated alike, for
  ``matmul`` in f32 at widths 768, 1024 and 2048; right at 256 and 512, in
  bf16 (512, 1024), for ``matmul_lhs``, ``elementwise`` and ``reduce`` at
  every width.  Only the right operand of a dot, f32, from 768 on: what
  XNNPACK packs ahead of a fully connected op and can keep per address.
* torch_xla 2.9.0 with ``--xla_cpu_use_xnnpack=false``, or with
  ``--xnnpack package``: right everywhere.
* torch_xla 2.8.1 and 2.7.0, their defaults, ``matmul`` f32 at 768 and
  1024: right.  2.8's XLA has XNNPACK off by default (its graphs list the
  option only when set on); 2.7's writes no options file to tell.

An earlier VM of this project (AMD EPYC with AVX-512, 2026-11-23/24) computed
``matmul`` right with 2.9's defaults too: the bug depends on the CPU.  What
the flag costs: benchmarks/bench_xnnpack_flag.py.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

FLAGS = {
    "default": "",
    "package": "",  # no flag given: torch_xla_donate, imported first, decides
    "off": "--xla_cpu_use_xnnpack=false",
    "greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
}


# What the step reads ``p`` with: XNNPACK serves dots only, so the other
# operations are the control (``x`` is f32[64, width]).
OPS = {
    "matmul": lambda torch, x, p: torch.tanh(x @ p),      # p as the right operand
    "matmul_lhs": lambda torch, x, p: torch.tanh(p @ x.T),  # p as the left operand
    "elementwise": lambda torch, x, p: torch.tanh(p * 3.0 + 1.0),
    "reduce": lambda torch, x, p: p.sum(dim=0, keepdim=True).tanh(),
}


def child(variant: str, width: int, dtype_name: str, steps: int, op: str = "matmul") -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dtype = getattr(torch, dtype_name)
    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(width, width, generator=gen) / 32).to(dtype).to(dev)
    g = (torch.randn(width, width, generator=gen) * 0.01).to(dtype).to(dev)
    xs = [torch.randn(64, width, generator=gen).to(dtype) for _ in range(steps)]
    torch_xla.sync()
    xm.wait_device_ops()
    losses, reused = [], []
    for s in range(steps):
        loss = (OPS[op](torch, xs[s].to(dev), p) ** 2).float().mean()
        torch_xla.sync()
        xm.wait_device_ops()
        losses.append(loss.item())
        before = torch_xla._XLAC._unsafe_buffer_pointer(p)
        if variant == "inplace":
            p.sub_(0.05 * g)
        elif variant == "donated":
            torch_xla._XLAC._set_buffer_donation(p, True)
            p = p - 0.05 * g
        else:
            p = p - 0.05 * g
        torch_xla.sync()
        xm.wait_device_ops()
        reused.append(torch_xla._XLAC._unsafe_buffer_pointer(p) == before)
    print(json.dumps({"losses": losses, "reused": reused}))


def run(variant, width, dtype, steps, xnnpack, op="matmul"):
    with tempfile.TemporaryDirectory() as dump:
        flags = f"{FLAGS[xnnpack]} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="2")
        cmd = [sys.executable, __file__, "--child", variant, "--width", str(width),
               "--dtype", dtype, "--steps", str(steps), "--op", op]
        if xnnpack == "package":
            cmd.append("--import-package")
        proc = subprocess.run(cmd,
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        options = set()
        for path in glob.glob(os.path.join(dump, "*.debug_options")):
            with open(path) as f:
                options.update(line.strip() for line in f if "xnn" in line)
        hlo = "".join(open(path).read()
                      for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")))
        out["xnn_options"] = sorted(options)
        out["xnn_fusions"] = hlo.count("__xnn_fusion") + hlo.count("xnn_fusion")
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=1, metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--xnnpack", default="default", choices=list(FLAGS))
    parser.add_argument("--op", default="matmul", choices=list(OPS))
    parser.add_argument("--import-package", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.import_package:
            import torch_xla_donate  # noqa: F401  (its import sets XLA_FLAGS on CPU)
        child(args.child[0], args.width, args.dtype, args.steps, args.op)
        return 0
    runs = {v: run(v, args.width, args.dtype, args.steps, args.xnnpack, args.op)
            for v in ("plain", "inplace", "donated")}
    reference = runs["plain"]["losses"]
    print(f"{args.op}, width {args.width}, {args.dtype}, {args.steps} steps, XLA_FLAGS: "
          f"{FLAGS[args.xnnpack] or '(default)'}"
          + (" (torch_xla_donate imported first)" if args.xnnpack == "package" else ""))
    print(f"XLA:CPU options the graphs had: {runs['plain']['xnn_options'] or 'defaults'}; "
          f"XNNPACK fusions in the optimized HLO: {runs['plain']['xnn_fusions']}")
    stale = False
    for variant in ("inplace", "donated"):
        losses = runs[variant]["losses"]
        same = [a == b for a, b in zip(losses, reference)]
        stale |= not all(same)
        print(f"{variant:8s} buffer reused {runs[variant]['reused']} losses "
              f"{[f'{x:.7f}' for x in losses]}: {'OK' if all(same) else 'STALE'}")
    print(f"plain    losses {[f'{x:.7f}' for x in reference]}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
