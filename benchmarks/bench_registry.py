"""What finding copies made in the donating step costs per barrier: the walk
of torch_xla's live tensors (csrc/live_tensors.cpp, ``_C.same_step_copies``)
that the commit's split runs at every barrier that donates (``Screen()`` in
csrc/commit.cpp),
and torch_xla's own walk of the same registry for scale.

1,000 donors (materialized f32[16]) among 2,000 and 10,000 live XLA tensors,
each read in the step (a cached device-data node: the walk asks its buffer);
the median of ``--rounds`` calls of each.

    PJRT_DEVICE=CPU python benchmarks/bench_registry.py [--rounds 30]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

DONORS = 1000
LIVE = (2000, 10000)


def _ms(fn, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return C.median(times)


def child(rounds):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from torch_xla_donate import _C
    from torch_xla_donate import _guards as guards
    from torch_xla_donate import _xla as xla

    dev = torch_xla.device()
    donors = [torch.ones(16).to(dev) + i for i in range(DONORS)]
    torch_xla.sync()
    xm.wait_device_ops()
    guards.decide(donors[0])
    assert xla.walk_in_use(), guards.state("walk")
    others, rows = [], []
    for live in LIVE:
        while xla.live_tensor_count() < live:
            others.append(torch.ones(16).to(dev) + len(others))
        torch_xla.sync()
        xm.wait_device_ops()
        for t in donors + others:  # read in the step: each caches its device-data node
            t + 0
        n = xla.live_tensor_count()
        walk = _ms(lambda: _C.same_step_copies(donors), rounds)
        own = _ms(lambda: xla.live_tensor_count(), rounds)
        rows.append({"live": n, "donors": DONORS, "walk_ms": walk,
                     "walk_us_per_live": walk * 1e3 / n, "torch_xla_walk_ms": own})
    C.emit({"rows": rows, "machine": C.machine()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--child", action="store_true")
    args, rest = ap.parse_known_args()
    if args.child:
        return child(int(rest[0]) if rest else args.rounds)
    result = C.run_child(os.path.abspath(__file__), [args.rounds])
    headers = ["live XLA tensors", "donors", "walk per barrier (ms)", "walk per live tensor (µs)",
               "torch_xla's own walk (ms)"]
    rows = [[r["live"], r["donors"], f"{r['walk_ms']:.2f}", f"{r['walk_us_per_live']:.3f}",
             f"{r['torch_xla_walk_ms']:.2f}"]
            for r in result["rows"]]
    text = (f"# Finding copies made in the donating step, per barrier\n\n"
            f"{C.machine_line(result['machine'])}\n\n{C.table(headers, rows)}\n")
    print(text)
    C.save("registry", result, text)


if __name__ == "__main__":
    main()
