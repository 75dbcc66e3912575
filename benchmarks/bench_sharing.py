"""What seeing shared device buffers costs (torch_xla_donate/_outcomes/sharing.py).

A step donates N small tensors (f32[16]) and replaces each by ``t + 1``,
then ``torch_xla.sync(wait=False)`` and ``xm.wait_device_ops()``.  Modes, in
one process, in blocks of steps, round-robin:

* ``no check``        the commit skips sharing.py (its screen is replaced by
                      the identity): the plugin before the check existed;
* ``always-on check`` as shipped: the walk of torch_xla's live tensors for
                      copies made in the step (_base/arena.py) and the
                      buffers' holder counts, natively;
* ``walk off``        the fallback without the walk (native reads off, the
                      registry not found): every donor's handle compared
                      with those of all live tensors (a walk of the garbage
                      collector's objects per step).

Measured: host CPU time (thread time) of the step without the real barrier
inside ``sync``, per donated tensor, and per step.  The always-on check is
held to at most 0.5 µs per tensor over ``no check`` (issue #20).

``--slices`` measures the owner query alone, per tensor, by the number of
tensors asked in one torch_xla call (how ``xla.OWNER_QUERY_SLICE`` was
chosen), and ``xla.owner_suspects`` natively and in Python at that size:
each variant in turn, 9 repetitions, the median.

    python benchmarks/bench_sharing.py [--sizes 1000 10000] [--rounds 8] [--slices]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["no check", "always-on check", "walk off"]
TARGET_US = 0.5


def child(n: int, rounds: int, block: int) -> dict:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate._base import arena
    from torch_xla_donate._base import xla as _xla
    from torch_xla_donate._outcomes import sharing

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    inner = C.time_real_barrier(_xla)
    screen = sharing.screen
    walk = arena.same_step_copies

    def step(mode):
        nonlocal ts
        sharing.screen = (lambda donors, notices: donors) if mode == "no check" else screen
        arena.same_step_copies = (lambda donors: None) if mode == "walk off" else walk
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


SLICES = [10, 25, 50, 100, 200, 500, None]  # None: all in one query


def child_slices(n: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate  # noqa: F401  (the plugin as shipped)
    from torch_xla_donate._base import xla as _xla

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    ts = torch._foreach_add(ts, 1.0)  # outputs of a graph, as donors are
    torch_xla.sync()
    xm.wait_device_ops()

    def ask(size):  # torch_xla's query alone, in this release's form
        size = size or n
        for i in range(0, n, size):
            _xla.buffer_owner_ids(ts[i:i + size])

    variants = {f"query, slices of {k or 'all'}": (lambda k=k: ask(k)) for k in SLICES}
    variants[f"owner_suspects, native ({_xla.OWNER_QUERY_SLICE})"] = lambda: _xla.owner_suspects(ts)
    variants[f"owner_suspects, Python ({_xla.OWNER_QUERY_SLICE})"] = (
        lambda: _xla.owner_suspects(ts, native=False))
    times = {name: [] for name in variants}
    for _ in range(9):
        for name, fn in variants.items():
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    return {"n": n, "us_per_tensor": {k: C.median(v) * 1e6 / n for k, v in times.items()}}


def main_slices(sizes) -> None:
    results = [C.run_child(__file__, [n, "--slices"]) for n in sizes]
    names = list(results[0]["us_per_tensor"])
    rows = [[name] + [f"{r['us_per_tensor'][name]:.2f}" for r in results] for name in names]
    machine = C.machine()
    markdown = "\n".join([
        "# The owner query by slice size (µs per tensor, thread CPU)", "",
        C.machine_line(machine), "",
        C.table(["variant"] + [f"{r['n']} tensors" for r in results], rows),
    ])
    print(markdown)
    C.save("sharing_slices", {"machine": machine, "results": results}, markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=6)
    parser.add_argument("--slices", action="store_true",
                        help="the owner query alone, by slice size")
    args, rest = parser.parse_known_args()
    if args.child:
        n = int(rest[0])
        C.emit(child_slices(n) if args.slices else child(n, args.rounds, args.block))
        return
    if args.slices:
        main_slices(args.sizes)
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
