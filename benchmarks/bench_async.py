"""Throughput of a training loop that never waits for the device.

Each step replaces every state tensor ``p`` by ``p - 0.01 * (p * 0.5 + 0.1)``
and ends with ``torch_xla.sync(wait=False)``: the host traces step N+1 while
the device runs step N.  The loop must keep doing so with donation: the
plugin may not block to learn a verdict (it learns it at the next barrier).

Workloads: many small tensors (host-bound: 400 x 64 KiB) and a few large
ones (device-bound: 16 x 16 MiB).  The loop holds the old state through the
barrier (``old = state`` ... ``sync`` ... ``del old``), so the plugin must
poison every donor there.  The host-bound workload also runs with the old
state let go before the barrier (the loop only rebinds its names, as
``p = p - lr * g`` does): the donors are then unreachable and nothing is
poisoned (the floor still holds them: its calls after the barrier need
them).

Modes: no donation, ``donate_buffer`` per tensor, ``donate(list)`` once per
step, torch_xla's raw ``_set_buffer_donation`` (the reference: donation
with no checks, verdicts or poisoning), and ``floor``: only the torch_xla
calls that "ours until committed" needs (one pending-IR query for the list,
the donor flag armed just before the barrier and cleared after it, one
``_is_placecholder`` per tensor), with raw's loop otherwise.  One process
per workload and repeat runs every mode, in windows of steps taken round-robin (so the drift
of a shared machine, and the luck of a process's memory layout, hit every
mode alike); throughput is steps per second over a window, the wait for the
device at its end included.  A mode's rate is the median of its windows, and
the ratio to "no donation" is taken per process, then the median over
processes.  Beside the rates, the collections Python's garbage collector ran
per step in each mode's windows (a count): the median of windows drops a
window with a full collection in it, the count does not.

The verdict
-----------
The target (``TARGET`` of raw donation's throughput) is judged on the
*paired* ratio: in each round, the mode's window over raw donation's window
of the same round, the median of those per process, then the median over
processes.  A round's windows run within seconds of each other, so the drift
of a shared machine, which moves a process's rates by 10% and more from
round to round, cancels in the pair and not in a ratio of medians (the
"vs raw donation" column, kept beside it).

    python benchmarks/bench_async.py [--repeats 5] [--windows 8] [--steps 20]
        [--workloads host] [--modes donate_buffer]

``--workloads``: only the workloads whose name contains one of the given
words; ``--modes``: only these modes besides ``ALWAYS`` (the verdict's and
its ratios'), e.g. none but those for a long A/B of the verdict alone.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# name: (tensors, elements each, whether the loop holds the old state
# through the barrier)
WORKLOADS = {
    "400 x 64 KiB (host-bound)": (400, 16 * 1024, 1),
    "400 x 64 KiB, rebound (host-bound)": (400, 16 * 1024, 0),
    "16 x 16 MiB (device-bound)": (16, 4 * 1024 * 1024, 1),
}
RAW = "raw _set_buffer_donation"
MODES = ["no donation", "donate_buffer", "donate(list)", RAW, "floor"]
ALWAYS = ["no donation", "donate_buffer", RAW]
TARGET = 0.98  # of raw donation's throughput


def make_loop(count: int, numel: int, hold: int):
    """The loop's state on the device and its ``step(mode)``, which also
    counts the steps taken (``step.taken``): every benchmark that runs this
    loop runs this one (bench_async_instructions.py counts it)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx

    dev = torch_xla.device()
    state = [torch.full((numel,), 1.0 + i, device=dev) for i in range(count)]
    torch_xla.sync()
    xm.wait_device_ops()
    set_donation = torch_xla._XLAC._set_buffer_donation

    def step(mode):
        nonlocal state
        step.taken += 1
        if mode == "donate_buffer":
            for p in state:
                tdx.donate_buffer(p)
        elif mode == "donate(list)":
            tdx.donate(state)
        elif mode == RAW:
            for p in state:
                set_donation(p, True)
        old = state
        state = [p - 0.01 * (p * 0.5 + 0.1) for p in state]
        if not hold and mode != "floor":
            old = None  # only the names were rebound: no donor is reachable
        if mode == "floor":  # the calls the design needs, and nothing else
            C.floor_sync(torch_xla._XLAC, old, lambda: torch_xla.sync(wait=False))
        else:
            torch_xla.sync(wait=False)
        del old

    step.taken = 0
    step.state = lambda: state
    return step


def child(count: int, numel: int, hold: int, windows: int, steps: int, modes=MODES) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm

    step = make_loop(count, numel, hold)
    got = C.interleaved_rates(step, modes, windows, steps, xm.wait_device_ops)
    torch_xla.sync()
    first = float(step.state()[0][0].cpu())
    rates = got["rates"]
    return {"steps_per_s": {m: C.median(r) for m, r in rates.items()}, "windows": rates,
            "loop_cpu": got["loop_cpu"], "process_cpu": got["process_cpu"],
            "gc_per_step": {m: [n / (windows * steps) for n in c]
                            for m, c in got["collections"].items()},
            "value": first, "expected": closed_form(step.taken)}


def paired_ratio(windows: dict, mode: str, base: str) -> float:
    """The median over rounds of ``mode``'s rate over ``base``'s in the same
    round (``windows``: rates by mode, one per round, as ``child`` returns).

    The tricky case: the machine drifts between rounds.  Below, "a" runs at
    90% of "b" in the first round; the ratio of the two medians (12 / 15)
    would say 80%, mixing the second round's "a" with the third's "b":

    >>> paired_ratio({"a": [9.0, 22.0, 12.0], "b": [10.0, 20.0, 15.0]}, "a", "b")
    0.9
    """
    return C.median([m / b for m, b in zip(windows[mode], windows[base])])


def closed_form(taken: int) -> float:
    """The first state tensor (1.0 at the start) after ``taken`` steps of
    ``p <- 0.995 p - 0.001``: every mode computes it, whatever was donated
    on the way."""
    return -0.2 + 1.2 * 0.995 ** taken


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--workloads", nargs="*", default=None,
                    help="only workloads whose name contains one of these words")
    ap.add_argument("--modes", nargs="*", default=None, choices=MODES,
                    help=f"only these modes besides {', '.join(ALWAYS)}, which always run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        count, numel, hold, windows, steps = (int(a) for a in args.rest[:5])
        C.emit(child(count, numel, hold, windows, steps, args.rest[5].split(",")))
        return

    workloads = {w: v for w, v in WORKLOADS.items()
                 if not args.workloads or any(word in w for word in args.workloads)}
    if not workloads:
        ap.error(f"--workloads {args.workloads} matches none of {list(WORKLOADS)}")
    modes = [m for m in MODES if m in ALWAYS or args.modes is None or m in args.modes]
    machine = C.machine()
    runs = {}
    for wname, (count, numel, hold) in workloads.items():
        for rep in range(args.repeats):
            print(f"async: {wname}, run {rep + 1} ...", flush=True)
            runs.setdefault(wname, []).append(
                C.run_child(__file__, [count, numel, hold, args.windows, args.steps,
                                       ",".join(modes)]))
    machine["load_avg_1m_end"] = round(os.getloadavg()[0], 2)

    summary, rows, verdicts = {}, [], []
    for wname in workloads:
        procs = runs[wname]
        for mode in modes:
            rate = C.median([r["steps_per_s"][mode] for r in procs])
            ratio = C.median([r["steps_per_s"][mode] / r["steps_per_s"]["no donation"]
                              for r in procs])
            vs_raw = C.median([r["steps_per_s"][mode] / r["steps_per_s"][RAW] for r in procs])
            spread = [round(100 * r["steps_per_s"][mode] / r["steps_per_s"]["no donation"])
                      for r in procs]
            raw_spread = [round(100 * r["steps_per_s"][mode] / r["steps_per_s"][RAW])
                          for r in procs]
            paired = [paired_ratio(r["windows"], mode, RAW) for r in procs]
            vs_raw_paired = C.median(paired)
            summary[f"{wname} | {mode}"] = {"steps_per_s": rate, "vs_no_donation": ratio,
                                            "vs_raw": vs_raw, "vs_raw_paired": vs_raw_paired,
                                            "vs_no_donation_per_process_pct": spread,
                                            "vs_raw_per_process_pct": raw_spread,
                                            "vs_raw_paired_per_process_pct":
                                                [round(100 * x, 1) for x in paired]}
            rows.append([wname, mode, f"{rate:.1f}", f"{100 * ratio:.1f}%", f"{100 * vs_raw:.1f}%",
                         f"{100 * vs_raw_paired:.1f}%",
                         " ".join(f"{100 * x:.0f}%" for x in paired)])
        wrong = [r["value"] for r in procs if abs(r["value"] - r["expected"]) > 1e-4]
        gcs = {m: [C.median([r["gc_per_step"][m][i] for r in procs]) for i in range(3)]
               for m in ("donate_buffer", RAW)}
        summary[f"{wname} | collections per step (gen 0, 1, 2)"] = gcs
        # CPU per step over raw donation's, paired by round: the loop's
        # thread, and the whole process.
        cpu = {key: C.median([paired_ratio(r[key], "donate_buffer", RAW) for r in procs])
               for key in ("loop_cpu", "process_cpu")}
        summary[f"{wname} | donate_buffer CPU per step over raw, paired"] = cpu
        ratio = summary[f"{wname} | donate_buffer"]["vs_raw_paired"]
        plain = summary[f"{wname} | donate_buffer"]["vs_no_donation"]
        verdicts.append(
            f"- {wname}: donate_buffer runs at {100 * ratio:.1f}% of raw donation's throughput, "
            f"paired by round ({100 * plain:.1f}% of no donation): "
            f"{'target met' if ratio >= TARGET else 'TARGET MISSED'} (≥ {100 * TARGET:.0f}% of raw)."
            + " Python's collector, per step (generations 0 / 1 / 2): donate_buffer "
            + " / ".join(f"{n:.3g}" for n in gcs["donate_buffer"]) + ", raw "
            + " / ".join(f"{n:.3g}" for n in gcs[RAW]) + "."
            + f" CPU per step over raw donation's: the loop's thread {100 * cpu['loop_cpu']:.1f}%,"
            + f" the process {100 * cpu['process_cpu']:.1f}%."
            + ("" if not wrong else f" WRONG VALUES (not the update's closed form): {wrong}")
        )
    text = C.table(["workload", "mode", "steps/s", "vs no donation", "vs raw donation",
                    "vs raw, paired by round", "paired, per process"], rows)
    md = (
        f"## Throughput of a loop that never waits (`torch_xla.sync(wait=False)`)\n\n"
        f"Machine: {C.machine_line(machine)}\n\n{text}\n\n" + "\n".join(verdicts) + "\n"
    )
    print(md)
    if list(workloads) != list(WORKLOADS) or modes != MODES:
        print("(a subset of workloads or modes: results/async.* left as they are)")
        return
    C.save("async", {"machine": machine, "runs": runs, "summary": summary, "target": TARGET}, md)
    chart(summary)


def chart(summary):
    plt = C.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.16
    colors = ["#999999", "#1f77b4", "#2ca02c", "#aec7e8", "#ff7f0e"]
    for i, mode in enumerate(MODES):
        vals = [100 * summary[f"{wl} | {mode}"]["vs_no_donation"] for wl in WORKLOADS]
        xs = [j + (i - 2) * w for j in range(len(WORKLOADS))]
        ax.bar(xs, vals, w, label=mode, color=colors[i])
        for x, v in zip(xs, vals):
            ax.text(x, v + 1, f"{v:.0f}", ha="center", fontsize=7)
    raw = [100 * summary[f"{wl} | {RAW}"]["vs_no_donation"] for wl in WORKLOADS]
    for j, r in enumerate(raw):
        ax.hlines(TARGET * r, j - 2.5 * w, j + 2.5 * w, color="red", linestyle="--", linewidth=1,
                  label=f"target: {100 * TARGET:.0f}% of raw" if j == 0 else None)
    ax.set_xticks(range(len(WORKLOADS)))
    ax.set_xticklabels(list(WORKLOADS))
    ax.set_ylabel("steps/s, % of the loop without donation")
    ax.set_title("A loop that never waits: throughput with donation")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(C.chart_path("async"), dpi=110)


if __name__ == "__main__":
    main()
