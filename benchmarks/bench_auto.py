"""What finding dead step inputs costs (torch_xla_donate/_auto.py).

A step replaces 16 state tensors (f32[64,64]) functionally, ``xs = [x * 0.5
+ 1 for x in xs]``, while N live XLA tensors (f32[16]) are held besides,
then ``torch_xla.sync(wait=False)`` and ``xm.wait_device_ops()``.  Modes,
in one process, in blocks of steps, round-robin:

* ``plain``     nothing donated;
* ``explicit``  ``tdx.donate_buffer`` on the 16 before the update;
* ``auto``      ``configure(auto=True)``: the 16 found dead and donated.

Measured: host CPU time (thread time) of the step without the real barrier,
per step; and for ``auto`` the native search alone (the walk of torch_xla's
live tensors and of the step's IR, csrc/dead_inputs.cpp), per step and
per 1,000 live tensors.  The issue's target: at most 1 ms per step per
1,000 live tensors.

    python benchmarks/bench_auto.py [--sizes 1000 10000] [--rounds 6]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["plain", "explicit", "auto"]
STATE = 16
TARGET_MS_PER_1000 = 1.0


def child(n: int, rounds: int, block: int) -> dict:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _auto as auto
    from torch_xla_donate import _xla

    dev = torch_xla.device()
    others = [torch.full((16,), float(i)).to(dev) for i in range(n - STATE)]
    box = [[torch.full((64, 64), float(i)).to(dev) for i in range(STATE)]]
    torch_xla.sync()
    xm.wait_device_ops()
    inner = C.time_real_barrier(_xla)

    def step(mode):
        tdx.configure(auto=mode == "auto")
        inner[0] = 0.0
        c0 = time.thread_time()
        if mode == "explicit":
            for t in box[0]:
                tdx.donate_buffer(t)
        box.append([x * 0.5 + 1 for x in box.pop()])
        torch_xla.sync(wait=False)
        host = time.thread_time() - c0 - inner[0]
        xm.wait_device_ops()
        return host

    block_host = {m: [] for m in MODES}
    search = []
    for m in MODES:
        for _ in range(2):
            step(m)
    for r in range(rounds):
        for m in C.round_robin(MODES, r):
            gc.collect()
            step(m)
            before = auto.totals()
            block_host[m].append(sum(step(m) for _ in range(block - 1)) / (block - 1))
            if m == "auto":
                after = auto.totals()
                steps = after["steps"] - before["steps"]
                assert steps == block - 1 and after["armed"] - before["armed"] == STATE * steps
                search.append((after["search_seconds"] - before["search_seconds"]) / steps)
    tdx.configure(auto=False)
    tdx.settle()
    totals = auto.totals()
    assert totals["reused"] == totals["armed"], totals
    live = len(others) + STATE + 1  # the carrier
    return {"n": live, "host_ms_per_step": {m: C.median(v) * 1e3 for m, v in block_host.items()},
            "search_ms_per_step": C.median(search) * 1e3,
            "search_ms_per_1000_live": C.median(search) * 1e3 * 1000 / live,
            "reused": totals["reused"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("n", nargs="?", type=int)
    args = ap.parse_args()
    if args.child:
        C.emit(child(args.n, args.rounds, args.block))
        return
    results = [C.run_child(__file__, [n, "--rounds", args.rounds, "--block", args.block])
               for n in args.sizes]
    rows = []
    for r in results:
        h = r["host_ms_per_step"]
        rows.append([r["n"], f"{h['plain']:.2f}", f"{h['explicit']:.2f}", f"{h['auto']:.2f}",
                     f"{r['search_ms_per_step']:.3f}", f"{r['search_ms_per_1000_live']:.3f}"])
    markdown = "\n".join([
        "# Automatic donation: the dead-input search (thread CPU, medians)", "",
        C.machine_line(C.machine()), "",
        f"A step replaces {STATE} f32[64,64] tensors functionally; the other live XLA "
        "tensors are f32[16] held by Python. Host ms per step exclude the real barrier. "
        f"Target: search <= {TARGET_MS_PER_1000} ms per step per 1,000 live tensors.", "",
        C.table(["live XLA tensors", "plain ms/step", "explicit ms/step", "auto ms/step",
                 "search ms/step", "search ms per 1,000 live"], rows),
    ])
    print(markdown)
    C.save("auto", {"results": results}, markdown)


if __name__ == "__main__":
    main()
