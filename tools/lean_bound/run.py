"""How close could any design that poisons and gives verdicts come to raw
donation?  The bound for bench_async.py's host-bound held loop.

Builds a throw-away copy of this worktree with ``lean_design.cpp`` (the
leanest such design, see its header) added to the extension, then runs, in
each of ``--processes`` processes, the loop of bench_async.py's "400 x 64 KiB
(host-bound)" workload (the old state held through the barrier) in three
modes, in windows taken round-robin: raw ``_set_buffer_donation``, the
plugin's ``donate_buffer``, and the lean design.  Prints each process's
ratios to raw and their medians; checks every mode computed the update's
closed form and the lean design's verdicts read the buffers consumed.

    python tools/lean_bound/run.py [--processes 8] [--windows 12] [--keep]

Not in CI (a rebuild, then about 25 s a process).  Its children run in
bench_async.py's environment (``_common.child_env``), with the copy's
package, and its windows (``_common.interleaved_rates``).  The distance
between the two medians is what the plugin's own bookkeeping costs
(records, the ledger, entries, the commit's checks, its Python hooks).
"""
import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common as C  # noqa: E402
import bench_async  # noqa: E402

# bench_async.py's held workload (the old state held through the barrier),
# measured as it measures it.
COUNT, NUMEL, _ = bench_async.WORKLOADS["400 x 64 KiB (host-bound)"]
STEPS = 20
MODES = ["raw", "donate_buffer", "lean"]


def child(windows: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _C

    dev = torch_xla.device()
    state = [torch.full((NUMEL,), 1.0 + i, device=dev) for i in range(COUNT)]
    torch_xla.sync()
    xm.wait_device_ops()
    set_donation = torch_xla._XLAC._set_buffer_donation
    # One record tags every tensor the lean design poisons.
    scratch = torch.zeros(2, device=dev)
    torch_xla.sync()
    record = _C.mark(scratch, "lean", 1, [2], "f32", 8, 0, -1)
    _C.unmark(scratch)
    taken = 0

    def step(mode):
        nonlocal state, taken
        taken += 1
        if mode == "raw":
            for p in state:
                set_donation(p, True)
        elif mode == "donate_buffer":
            for p in state:
                tdx.donate_buffer(p)
        else:
            _C.lean_settle()  # the previous step's verdicts
            for p in state:
                _C.lean_mark(p)
        old = state
        state = [p - 0.01 * (p * 0.5 + 0.1) for p in state]
        if mode == "lean":
            _C.lean_arm(set_donation)
            torch_xla.sync(wait=False)
            _C.lean_after(record)
        else:
            torch_xla.sync(wait=False)
        del old

    got = C.interleaved_rates(step, MODES, windows, STEPS, xm.wait_device_ops)
    rates, collections = got["rates"], got["collections"]
    consumed, read, verdicts = _C.lean_settle()
    torch_xla.sync()
    rate = {m: C.median(r) for m, r in rates.items()}
    return {"plugin": rate["donate_buffer"] / rate["raw"], "lean": rate["lean"] / rate["raw"],
            "value": float(state[0][0].cpu()), "expected": bench_async.closed_form(taken),
            "consumed": consumed, "read": read, "verdicts": verdicts,
            "gc_per_step": {m: [n / (windows * STEPS) for n in c]
                            for m, c in collections.items()}}


def build_copy(dest: str) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from mutants import make_copy, rebuild

    make_copy(dest)
    os.makedirs(os.path.join(dest, "csrc", "lean_bound"), exist_ok=True)
    shutil.copy2(os.path.join(HERE, "lean_design.cpp"),
                 os.path.join(dest, "csrc", "lean_bound", "lean_design.cpp"))
    module = os.path.join(dest, "csrc", "module.cpp")
    with open(module) as f:
        text = f.read()
    anchor = "  RegisterDeadInputs(m);\n"
    if text.count(anchor) != 1 or text.count("PYBIND11_MODULE(_C, m) {") != 1:
        sys.exit("csrc/module.cpp changed: update tools/lean_bound/run.py's anchors")
    text = text.replace(anchor, anchor + "  torch_xla_donate::RegisterLeanBound(m);\n")
    text = text.replace("PYBIND11_MODULE(_C, m) {",
                        "namespace torch_xla_donate {\nvoid RegisterLeanBound(py::module_&);\n}\n"
                        "PYBIND11_MODULE(_C, m) {")
    with open(module, "w") as f:
        f.write(text)
    print("building the copy with the lean design ...", flush=True)
    rebuild(dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--keep", action="store_true", help="leave the copy in place")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        C.emit(child(args.windows))
        return 0
    dest = tempfile.mkdtemp(prefix="lean_bound-")
    try:
        build_copy(dest)
        got = {"plugin": [], "lean": []}
        bad = []
        for i in range(args.processes):
            # bench_async.py's children's environment, with the copy's package.
            r = C.run_child(os.path.abspath(__file__), ["--windows", args.windows],
                            env={"PYTHONPATH": dest})
            # Every step donates all its inputs, and XLA takes nearly every
            # one (0.8% of them, a step here and there, were not: the lean
            # design does not ask why); fewer says its verdicts read nothing.
            if abs(r["value"] - r["expected"]) > 1e-4 or r["consumed"] < 0.98 * r["verdicts"]:
                bad.append(r)
            for k in got:
                got[k].append(round(100 * r[k], 1))
            gcs = {m: "/".join(f"{n:.2g}" for n in r["gc_per_step"][m]) for m in MODES}
            print(f"process {i + 1}: plugin {got['plugin'][-1]}% lean {got['lean'][-1]}% of raw "
                  f"({r['consumed']} of {r['verdicts']} lean verdicts consumed; collections a "
                  f"step, generations 0/1/2: {gcs})", flush=True)
        print(f"median over {args.processes} processes, % of raw donation's throughput: "
              f"plugin {C.median(got['plugin']):.1f}%, "
              f"lean design {C.median(got['lean']):.1f}%")
        if bad:
            print(f"WRONG: {len(bad)} processes computed another value or left a lean donation "
                  f"unconsumed: {bad}")
            return 1
        return 0
    finally:
        if args.keep:
            print(f"copy kept in {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
