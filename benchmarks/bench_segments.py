"""Where a host-bound step's main-thread time goes, segment by segment:
raw donation against the plugin, in the loop bench_async.py times.

Each step of bench_async.py's host-bound workload (400 x 64 KiB) is cut
into segments timed with the main thread's CPU clock (``thread_time``: the
XLA threads running the previous step on the other core do not count):

* ``mark``: the donation calls (``_set_buffer_donation`` / ``donate_buffer``);
* ``trace``: the update ``p - 0.01 * (p * 0.5 + 0.1)`` of every tensor;
* ``barrier``: ``torch_xla.sync(wait=False)`` (the plugin's commit included;
  in the rebound loop also the old state let go just before it);
* ``after``: ``del old``, then one 4 KiB allocation.

The tricky case is the last one.  A barrier frees many small heap chunks,
and glibc consolidates them at the next allocation of 1 KiB or more,
whoever makes it: raw donation's loop pays that in its next ``trace``, the
plugin's commit inside its own ``barrier``.  The 4 KiB allocation after
the barrier makes both pay it there, so that ``trace`` compares like with
like; ``--no-probe`` leaves it out, to see the shift.

Modes alternate in windows of steps (the order rotating each round) in one
process per repeat; a segment's figure is the median over its windows of
the per-step mean, and the plugin's column is its difference to raw's.

    python benchmarks/bench_segments.py [--repeats 3] [--rounds 24] [--no-probe]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_async  # noqa: E402

# bench_async.py's host-bound workload, measured in both of its loops.
COUNT, NUMEL, _ = bench_async.WORKLOADS["400 x 64 KiB (host-bound)"]
MODES = ["raw", "donate_buffer"]
SEGMENTS = ["mark", "trace", "barrier", "after", "step"]
LOOPS = {"held": 1, "rebound": 0}  # whether the old state is held through the barrier
STEPS, WARM = 20, 3


def child(hold: int, rounds: int, probe: int) -> dict:
    import time

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx

    dev = torch_xla.device()
    state = [torch.full((NUMEL,), 1.0 + i, device=dev) for i in range(COUNT)]
    torch_xla.sync()
    xm.wait_device_ops()
    set_donation = torch_xla._XLAC._set_buffer_donation
    clock = time.thread_time_ns
    spent = {m: {s: [] for s in SEGMENTS} for m in MODES}
    taken = 0

    def step(mode, sums):
        nonlocal state, taken
        taken += 1
        t0 = clock()
        if mode == "raw":
            for p in state:
                set_donation(p, True)
        else:
            for p in state:
                tdx.donate_buffer(p)
        t1 = clock()
        old = state
        state = [p - 0.01 * (p * 0.5 + 0.1) for p in state]
        t2 = clock()
        if not hold:
            old = None
        torch_xla.sync(wait=False)
        t3 = clock()
        del old
        if probe:
            chunk = bytearray(4096)  # glibc consolidates here (see above)
            del chunk
        t4 = clock()
        for name, ns in zip(SEGMENTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            sums[name] += ns

    for r in range(rounds):
        for mode in C.round_robin(MODES, r):
            xm.wait_device_ops()
            sums = dict.fromkeys(SEGMENTS, 0)
            for _ in range(WARM):
                step(mode, dict(sums))
            for _ in range(STEPS):
                step(mode, sums)
            for name in SEGMENTS:
                spent[mode][name].append(sums[name] / STEPS / 1e3)  # µs a step
    torch_xla.sync()
    value, expected = float(state[0][0].cpu()), bench_async.closed_form(taken)
    if abs(value - expected) > 1e-4:  # every mode computes the same update
        raise SystemExit(f"bench_segments: the state reads {value}, not {expected}")
    return {m: {s: statistics.median(v) for s, v in segs.items()} for m, segs in spent.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        hold, rounds, probe = (int(a) for a in args.rest)
        C.emit(child(hold, rounds, probe))
        return
    machine = C.machine()
    probe = 0 if args.no_probe else 1
    runs = {loop: [] for loop in LOOPS}
    for loop, hold in LOOPS.items():
        for rep in range(args.repeats):
            print(f"segments: {loop} loop, run {rep + 1} ...", flush=True)
            runs[loop].append(C.run_child(__file__, [hold, args.rounds, probe]))
    rows = []
    for loop in LOOPS:
        for seg in SEGMENTS:
            raw = [r["raw"][seg] for r in runs[loop]]
            diff = [r["donate_buffer"][seg] - r["raw"][seg] for r in runs[loop]]
            rows.append([loop, seg, f"{C.median(raw):.0f}", f"{C.median(diff):+.0f}",
                         " ".join(f"{d:+.0f}" for d in diff)])
    text = "\n".join([
        "## Main-thread CPU of a host-bound step, by segment (µs a step)", "",
        f"Machine: {C.machine_line(machine)}", "",
        f"{COUNT} x 64 KiB, {args.repeats} processes, {args.rounds} rounds of {STEPS} steps; "
        f"the 4 KiB allocation after the barrier {'on' if probe else 'off'}.", "",
        C.table(["loop", "segment", "raw", "donate_buffer - raw", "per process"], rows)])
    print(text)
    C.save("segments", {"machine": machine, "probe": bool(probe), "runs": runs}, text)


if __name__ == "__main__":
    main()
