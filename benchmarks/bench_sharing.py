"""What seeing shared device buffers costs (torch_xla_donate/_outcomes/sharing.py).

A step donates N small tensors (f32[16]) and replaces each by ``t + 1``,
then ``torch_xla.sync(wait=False)`` and ``xm.wait_device_ops()``.  Modes, in
one process, in blocks of steps, round-robin:

* ``no check``        the commit skips sharing.py (its screen is replaced by
                      the identity): the plugin before the check existed;
* ``always-on check`` as shipped: the walk of torch_xla's live tensors for
                      copies made in the step (_base/arena.py) and the
                      buffers' holder counts, natively.

Measured: host CPU time (thread time) of the step without the real barrier
inside ``sync``, per donated tensor, and per step.  The always-on check is
held to at most 0.5 µs per tensor over ``no check`` (issue #20).

    python benchmarks/bench_sharing.py [--sizes 1000 10000] [--rounds 8]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["no check", "always-on check"]
TARGET_US = 0.5


def child(n: int, rounds: int, block: int) -> dict:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _xla
    from torch_xla_donate import _holders as sharing

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    inner = C.time_real_barrier(_xla)
    screen = sharing.screen

    def step(mode):
        nonlocal ts
        sharing.screen = (lambda donors, notices: donors) if mode == "no check" else screen
        inner[0] = 0.0
        c0 = time.thread_time()
        for t in ts:
            tdx.donate_buffer(t)
        ts = torch._foreach_add(ts, 1.0)
        torch_xla.sync(wait=False)
        host = time.thread_time() - c0 - inner[0]
        xm.wait_device_ops()
        return host

    block_host = {m: [] for m in MODES}
    for m in MODES:
        for _ in range(2):
            step(m)
    for r in range(rounds):
        for m in C.round_robin(MODES, r):
            gc.collect()
            step(m)
            block_host[m].append(sum(step(m) for _ in range(block - 1)) / (block - 1))
    tdx.settle()
    base = block_host["no check"]
    added = {m: C.median([a - b for a, b in zip(block_host[m], base)]) for m in MODES[1:]}
    return {"n": n, "live_objects": len(gc.get_objects()),
            "host_ms_per_step": {m: C.median(v) * 1e3 for m, v in block_host.items()},
            "added_us_per_tensor": {m: added[m] * 1e6 / n for m in added},
            "added_ms_per_step": {m: added[m] * 1e3 for m in added}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=6)
    args, rest = parser.parse_known_args()
    if args.child:
        n = int(rest[0])
        C.emit(child(n, args.rounds, args.block))
        return
    results = [C.run_child(__file__, [n, "--rounds", args.rounds, "--block", args.block])
               for n in args.sizes]
    rows = []
    for r in results:
        for m in MODES[1:]:
            rows.append([r["n"], m, f"{r['host_ms_per_step'][m]:.2f}",
                         f"{r['added_ms_per_step'][m]:+.2f}",
                         f"{r['added_us_per_tensor'][m]:+.2f}", r["live_objects"]])
    machine = C.machine()
    met = all(r["added_us_per_tensor"]["always-on check"] <= TARGET_US for r in results)
    markdown = "\n".join([
        "# Seeing shared buffers: cost", "", C.machine_line(machine), "",
        C.table(["tensors", "mode", "host ms/step", "added ms/step", "added µs/tensor",
                 "live objects"], rows), "",
        f"Always-on check within {TARGET_US} µs per tensor over no check: "
        f"{'met' if met else 'MISSED'}.",
    ])
    print(markdown)
    C.save("sharing", {"machine": machine, "results": results}, markdown)


if __name__ == "__main__":
    main()
