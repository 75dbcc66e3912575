"""What one question about an XLA tensor costs: the native read
(csrc/xla_reads.cpp, through ``_C.lazy_*``) against torch_xla's
``_XLAC`` call that answers it, in instructions (callgrind) or time.

Each row runs one call ``N`` times in a Python loop on a clean materialized
f32[16] tensor (the list rows: on 50 such tensors at once, counted per
tensor); ``loop + id(t)`` is the loop's own cost, included in every row.
``C++ read alone`` is ``_C.lazy_read_loop``: the native read of every fact
with no Python around it.

    python benchmarks/bench_reads.py            # callgrind (needs valgrind, cc)
    python benchmarks/bench_reads.py --time     # perf_counter, ns per call
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_instructions as BI  # noqa: E402

LIST = 50


def _rows():
    """[(row name, per-call divisor, callable)]: built in the child."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from torch_xla_donate import _C
    from torch_xla_donate import _guards as guards

    X = torch_xla._XLAC
    dev = torch_xla.device()
    ts = [torch.ones(16).to(dev) + i for i in range(LIST)]
    torch_xla.sync()
    xm.wait_device_ops()
    t = ts[0]
    guards.decide(t)  # the first mark runs the guards
    assert guards.state("reads") == "native reads", guards.state("reads")
    return [
        ("loop + id(t)", 1, lambda: id(t)),
        ("tensor id: native", 1, lambda: _C.lazy_tensor_id(t)),
        ("tensor id: _XLAC._xla_get_tensor_id", 1, lambda: X._xla_get_tensor_id(t)),
        ("pending: native", 1, lambda: _C.lazy_is_pending(t)),
        ("pending: _XLAC._check_tensor_need_materialization([t])", 1,
         lambda: X._check_tensor_need_materialization([t])),
        ("consumed: native", 1, lambda: _C.lazy_is_consumed(t)),
        ("consumed: _XLAC._is_placecholder", 1, lambda: X._is_placecholder(t)),
        ("buffer key: native", 1, lambda: _C.lazy_buffer_key(t)),
        ("buffer key: _XLAC._get_tensors_handle([t])", 1, lambda: X._get_tensors_handle([t])),
        (f"owner ids, per tensor of {LIST}: native", LIST, lambda: _C.lazy_owner_ids(ts)),
        (f"owner ids, per tensor of {LIST}: _XLAC._get_tensors_xla_device_data_node", LIST,
         lambda: X._get_tensors_xla_device_data_node(ts, ts)),
        (f"holders, per tensor of {LIST}: native (no _XLAC equivalent)", LIST,
         lambda: _C.lazy_holders(ts)),
        ("C++ read alone (every fact)", 1000, lambda: _C.lazy_read_loop(t, 1000)),
    ]


def child(n: int, helper: str | None) -> None:
    import ctypes

    rows = _rows()
    counter = ctypes.CDLL(helper) if helper else None
    for name, per, fn in rows:
        for _ in range(50):  # warm up
            fn()
        reps = max(1, n // per) if per > 1 else n
        if counter:
            counter.tdx_bench_start()
        start = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        elapsed = time.perf_counter_ns() - start
        if counter:
            counter.tdx_bench_stop()
        print(f"ROW\t{name}\t{reps * per}\t{elapsed}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--time", action="store_true", help="time instead of counting instructions")
    p.add_argument("--child", action="store_true")
    p.add_argument("--helper")
    args = p.parse_args()
    if args.child:
        return child(args.calls, args.helper)
    me = [sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.time:
            done = subprocess.run(me, env=C.child_env(), capture_output=True, text=True)
        else:
            if shutil.which("valgrind") is None:
                sys.exit("bench_reads: needs valgrind (or --time)")
            out = os.path.join(tmp, "cg")
            done = subprocess.run(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                 f"--callgrind-out-file={out}", "-q"] + me + ["--helper", BI._helper(tmp)],
                env=C.child_env(), capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            sys.exit(f"bench_reads: child failed\n{done.stderr[-3000:]}")
        rows = [line.split("\t")[1:] for line in done.stdout.splitlines()
                if line.startswith("ROW\t")]
        for k, (name, calls, ns) in enumerate(rows, start=1):
            calls = int(calls)
            if args.time:
                value = f"{int(ns) / calls:.0f} ns"
            else:
                value = f"{_dump_total(out, k) / calls:.0f}"
            results.append((name, value))
            print(f"{name:75s} {value:>10}", flush=True)
    unit = "ns per call (perf_counter)" if args.time else "instructions per call (callgrind)"
    m = C.machine()
    md = "\n".join([f"## One question about an XLA tensor: native read vs _XLAC, {unit}", "",
                    C.machine_line(m), "", C.table(["call", unit], [list(r) for r in results])])
    print()
    print(md)
    C.save("reads_time" if args.time else "reads", {"machine": m, "rows": results}, md)


def _dump_total(prefix: str, k: int) -> int:
    """Instructions of the k-th dump (callgrind numbers them from 1)."""
    with open(f"{prefix}.{k}") as f:
        for line in f:
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {prefix}.{k}")


if __name__ == "__main__":
    main()
