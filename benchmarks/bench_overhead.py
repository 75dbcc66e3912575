"""What donation costs on the host, per donated tensor per step.

A step donates N small tensors (f32[16]) and replaces each by ``t + 1``
(``torch._foreach_add``), then ``torch_xla.sync(wait=False)`` and
``xm.wait_device_ops()``.  Modes, each in the same process, in blocks of
consecutive steps, round-robin (so slow drift of the machine hits every mode
alike):

* ``plain, no plugin``   no donation, torch_xla_donate's step hook removed;
* ``plain``              no donation, the hook installed (its fixed cost);
* ``raw torch_xla``      ``torch_xla._XLAC._set_buffer_donation(t, True)``
                         per tensor, hook removed: donation without checks,
                         verdicts or poisoning;
* ``floor``              hook removed; only the torch_xla calls that "ours
                         until committed" needs: one pending-IR query for
                         the list, then per tensor the donor flag armed just
                         before the barrier and cleared after it, and one
                         ``_is_placecholder`` verdict.  What the plugin adds
                         over this is its own cost;
* ``donate_buffer``      ``torch_xla_donate.donate_buffer(t)`` per tensor;
* ``donate(list)``       one ``torch_xla_donate.donate(ts)`` call (the pytree
                         API) per step;
* ``donate_buffer, kept`` as ``donate_buffer``, but the loop still holds the
                         old tensors during the barrier (it lets go right
                         after), so the barrier must poison them.  In the
                         other modes the loop drops them before the barrier
                         (``ts = torch._foreach_add(ts, 1.0)``), and a donor
                         nobody can reach is not poisoned.

What the plugin adds is measured directly: the time of the donate calls plus
the hook's own work at the barrier (``torch_xla.sync`` minus the real
``_xla_step_marker`` inside it), which covers committing the marks, the
safety checks, poisoning and settling the verdicts.  End-to-end step times
are reported too; on a busy 2-CPU machine they are noisier than the
difference being measured.

    python benchmarks/bench_overhead.py [--sizes 1000 10000] [--rounds 12]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["plain, no plugin", "plain", "raw torch_xla", "floor", "donate_buffer", "donate(list)",
         "donate_buffer, kept"]
HOOKED = {"plain", "donate_buffer", "donate(list)", "donate_buffer, kept"}
TARGET_US = 1.0  # what the plugin may add over the floor


# The barrier's stages, timed where the hook calls them: the native ones on
# ``_C``, the Python ones on ``_commit`` (docs/design.md, "The step's life").
# None calls another, so their times add up.
PHASES = {
    "commit": "_C",            # begin and split: the marks taken, the rules, the buffer checks
    "arm": "_commit",          # torch_xla's donor flag set on each donor's buffer
    "release_unheld": "_C",    # donors nothing else refers to let go (their entry keeps the buffer)
    "finish": "_C",            # the donors the user still holds poisoned
    "disarm": "_commit",       # the flags of the donors the entries keep cleared
    "settle_entries": "_C",    # the verdicts: REUSED read from the buffers
}


def child(n: int, rounds: int, block: int) -> dict:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _C, _commit, _xla
    from torch_xla_donate import _hooks as step_hook

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()

    # Thread CPU time (robust to other processes on the machine) of the real
    # barrier inside the hook and of the hook's stages.
    cpu = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[name] = cpu.get(name, 0.0) + time.thread_time() - start
        return wrapper

    # The real barrier the plugin's trampoline calls (and torch_xla's own,
    # when the plugin is out): timed, and put back in place.
    _xla.REAL["_xla_step_marker"] = timed("inner", _xla.real("_xla_step_marker"))
    step_hook.uninstall()
    torch_xla._XLAC._xla_step_marker = _xla.real("_xla_step_marker")
    step_hook.install()
    owners = {"_C": _C, "_commit": _commit}
    for name, owner in PHASES.items():
        setattr(owners[owner], name, timed(name, getattr(owners[owner], name)))
    gc_wall = [0.0, 0.0]
    gc_runs = [0, 0, 0]  # collections of each generation in this step

    def on_gc(phase, info):
        if phase == "start":
            gc_wall[1] = time.perf_counter()
            gc_runs[info["generation"]] += 1
        else:
            gc_wall[0] += time.perf_counter() - gc_wall[1]

    gc.callbacks.append(on_gc)
    set_donation = torch_xla._XLAC._set_buffer_donation

    def step(mode):
        nonlocal ts
        if (mode in HOOKED) != step_hook.installed():
            step_hook.install() if mode in HOOKED else step_hook.uninstall()
        cpu.clear()
        gc_wall[0] = 0.0
        gc_runs[:] = [0, 0, 0]
        c0, t0 = time.thread_time(), time.perf_counter()
        if mode == "raw torch_xla":
            for t in ts:
                set_donation(t, True)
        elif mode.startswith("donate_buffer"):
            for t in ts:
                tdx.donate_buffer(t)
        elif mode == "donate(list)":
            tdx.donate(ts)
        kept = ts if mode in ("donate_buffer, kept", "floor") else None
        c1 = time.thread_time()
        ts = torch._foreach_add(ts, 1.0)
        c2 = time.thread_time()
        if mode == "floor":  # the calls the design needs, and nothing else
            C.floor_sync(torch_xla._XLAC, kept, lambda: torch_xla.sync(wait=False))
        else:
            torch_xla.sync(wait=False)
        del kept  # poisoned by now; the hook frees them at the next barrier
        c3, t3 = time.thread_time(), time.perf_counter()
        xm.wait_device_ops()
        t4 = time.perf_counter()
        inner = cpu.get("inner", 0.0)
        out = {
            "mark": c1 - c0,
            "trace": c2 - c1,
            "hook": c3 - c2 - inner,  # sync() minus the real barrier
            "inner": inner,
            "host": c3 - c0 - inner,  # host CPU of the step, barrier excluded
            "host_wall": t3 - t0,
            "full_wall": t4 - t0,
            "gc_wall": gc_wall[0],
            "gc_runs": list(gc_runs),
        }
        for name in PHASES:
            out[name] = cpu.get(name, 0.0)
        return out

    samples = {m: [] for m in MODES}
    block_host = {m: [] for m in MODES}  # per round: the block's mean host time
    for m in MODES:  # compile every graph once before measuring
        for _ in range(2):
            step(m)
    for r in range(rounds):
        for m in C.round_robin(MODES, r):
            # Every block starts from a collected heap, so the collections
            # in it are due to its own mode's allocations, not to the modes
            # before it.
            gc.collect()
            # The first step of a block may settle verdicts left by the
            # previous block's mode; the others are steady state.
            step(m)
            steps = [step(m) for _ in range(block - 1)]
            samples[m] += steps
            block_host[m].append(sum(x["host"] for x in steps) / len(steps))
    med = {
        m: {k: C.median([s[k] for s in v]) for k in v[0] if k != "gc_runs"}
        for m, v in samples.items()
    }
    gc_per_100 = {
        m: [round(100 * sum(s["gc_runs"][g] for s in v) / len(v), 1) for g in range(3)]
        for m, v in samples.items()
    }
    mean_gc = {m: sum(s["gc_wall"] for s in v) / len(v) for m, v in samples.items()}
    return {"n": n, "steps_per_mode": len(samples[MODES[0]]), "median_s": med,
            "mean_gc_s": mean_gc, "gc_collections_per_100_steps": gc_per_100,
            "paired_us_per_tensor": paired(n, block_host)}


def paired(n: int, block_host: dict) -> dict:
    """What each donating mode adds to the host time of a step, per tensor,
    from differences within each round (the blocks of one round ran seconds
    apart, so the machine's slower drift cancels): the quartiles over rounds
    of (mode's block - raw's block), and of (mode's block - plain, no
    plugin's block)."""
    def quartiles(xs):
        xs = sorted(xs)
        at = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
        return [at(0.25) * 1e6 / n, at(0.5) * 1e6 / n, at(0.75) * 1e6 / n]

    out = {}
    for m in ("donate_buffer", "donate(list)", "donate_buffer, kept", "floor"):
        out[m] = {
            base: quartiles([a - b for a, b in zip(block_host[m], block_host[ref])])
            for base, ref in (("vs_raw", "raw torch_xla"), ("vs_plain", "plain, no plugin"),
                              ("vs_floor", "floor"))
        }
    return out


def derive(n: int, med: dict, mean_gc: dict, pair: dict) -> dict:
    per = 1e6 / n  # seconds per step -> µs per tensor
    d, raw, plain, base = (med[m] for m in ("donate_buffer", "raw torch_xla", "plain",
                                            "plain, no plugin"))
    phases = sum(d[p] for p in PHASES)
    return {
        # What the plugin adds, host CPU of the whole step (barrier excluded):
        # the median of the differences paired within rounds (see `paired`),
        # which a drifting machine disturbs less than a difference of medians.
        "added_vs_raw_us_per_tensor": pair["donate_buffer"]["vs_raw"][1],
        "floor_vs_raw_us_per_tensor": pair["floor"]["vs_raw"][1],
        "added_vs_floor_us_per_tensor": pair["donate_buffer"]["vs_floor"][1],
        "donate_list_added_vs_floor_us_per_tensor": pair["donate(list)"]["vs_floor"][1],
        "added_vs_plain_us_per_tensor": pair["donate_buffer"]["vs_plain"][1],
        "donate_list_added_vs_raw_us_per_tensor": pair["donate(list)"]["vs_raw"][1],
        "kept_added_vs_raw_us_per_tensor": pair["donate_buffer, kept"]["vs_raw"][1],
        "kept_poison_us_per_tensor": sum(med["donate_buffer, kept"][p]
                                         for p in ("finish", "disarm")) * per,
        # ... and wall clock, end to end (noisier on a shared machine).
        "wall_vs_raw_us_per_tensor": (d["full_wall"] - raw["full_wall"]) * per,
        "wall_vs_plain_us_per_tensor": (d["full_wall"] - base["full_wall"]) * per,
        # Where it goes.
        "donate_buffer_us_per_tensor": d["mark"] * per,
        "raw_set_buffer_donation_us_per_tensor": raw["mark"] * per,
        "barrier_native_us_per_tensor": phases * per,
        "phases_us_per_tensor": {p: d[p] * per for p in PHASES},
        "hook_rest_us_per_tensor": (d["hook"] - phases - plain["hook"]) * per,
        "trace_shift_us_per_tensor": (d["trace"] - raw["trace"]) * per,
        "hook_fixed_us_per_step": (plain["host"] - base["host"]) * 1e6,
        "hook_idle_us_per_step": plain["hook"] * 1e6,
        "gc_ms_per_step": {m: v * 1e3 for m, v in mean_gc.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chart-only", action="store_true",
                    help="redraw the chart from results/overhead.json")
    args = ap.parse_args()
    if args.child:
        n, rounds, block = args.rest
        C.emit(child(n, rounds, block))
        return
    if args.chart_only:
        import json

        with open(os.path.join(C.RESULTS, "overhead.json")) as f:
            chart(json.load(f)["runs"])
        return

    machine = C.machine()
    runs = []
    for n in args.sizes:
        print(f"overhead: {n} tensors ...", flush=True)
        # Small sizes are quick: more rounds, for about the same run time.
        rounds = max(args.rounds, args.rounds * 3000 // n)
        res = C.run_child(__file__, [n, rounds, args.block])
        res["derived"] = derive(n, res["median_s"], res["mean_gc_s"], res["paired_us_per_tensor"])
        runs.append(res)
    machine["load_avg_1m_end"] = round(os.getloadavg()[0], 2)

    def q(r, mode, base="vs_raw"):
        lo, mid, hi = r["paired_us_per_tensor"][mode][base]
        return f"{mid:.1f} ({lo:.1f} to {hi:.1f})"

    rows = []
    for r in runs:
        d = r["derived"]
        rows.append([
            r["n"],
            q(r, "floor"),
            f"**{q(r, 'donate_buffer', 'vs_floor')}**",
            q(r, "donate(list)", "vs_floor"),
            q(r, "donate_buffer"),
            q(r, "donate_buffer", "vs_plain"),
            q(r, "donate(list)"),
            f"{q(r, 'donate_buffer, kept')}; poisoning {d['kept_poison_us_per_tensor']:.2f}",
            f"{d['wall_vs_raw_us_per_tensor']:+.1f} / {d['wall_vs_plain_us_per_tensor']:+.1f}",
            f"{d['hook_fixed_us_per_step']:.0f}",
        ])
    summary = C.table(
        ["tensors", "floor adds vs raw", "donate_buffer adds vs floor",
         "donate(list) adds vs floor", "donate_buffer adds vs raw", "vs no donation",
         "donate(list) adds vs raw",
         "donate_buffer, old tensors kept, adds vs raw",
         "wall clock vs raw / vs no donation", "idle hook µs/step"],
        rows,
    )
    brows = []
    for r in runs:
        d, ph = r["derived"], r["derived"]["phases_us_per_tensor"]
        brows.append([
            r["n"], f"{d['raw_set_buffer_donation_us_per_tensor']:.2f}",
            f"{d['donate_buffer_us_per_tensor']:.2f}",
            *(f"{ph[p]:.2f}" for p in PHASES),
            f"{d['hook_rest_us_per_tensor']:.2f}", f"{d['trace_shift_us_per_tensor']:+.2f}",
        ])
    breakdown = C.table(
        ["tensors", "raw _set_buffer_donation", "donate_buffer", "commit (begin, split)", "arm",
         "release_unheld", "finish (poison)", "disarm", "settle_entries", "rest of hook",
         "tracing (vs raw)"],
        brows,
    )
    step_rows = []
    for r in runs:
        for m in MODES:
            s = r["median_s"][m]
            step_rows.append([
                r["n"], m, f"{s['mark'] * 1e3:.1f}", f"{s['trace'] * 1e3:.1f}",
                f"{s['hook'] * 1e3:.1f}" if m in HOOKED else "-", f"{s['inner'] * 1e3:.1f}",
                f"{s['host'] * 1e3:.1f}", f"{s['full_wall'] * 1e3:.1f}",
                f"{r['derived']['gc_ms_per_step'][m]:.2f}",
                "/".join(f"{c:g}" for c in r["gc_collections_per_100_steps"][m]),
            ])
    steps = C.table(
        ["tensors", "mode", "donate ms", "trace ms", "hook ms", "barrier ms",
         "host CPU ms (no barrier)", "wall ms/step", "GC ms/step (mean)",
         "GC runs per 100 steps (gen 0/1/2)"],
        step_rows,
    )
    md = (
        f"## Host overhead per donated tensor per step (µs, thread CPU time)\n\n"
        f"Machine: {C.machine_line(machine)}\n\n{summary}\n\n"
        f"Target: the plugin adds ≤ {TARGET_US} µs per tensor per step over the floor.  "
        f"Host CPU time of a step "
        f"(the real barrier excluded), per donated tensor: the median over rounds of "
        f"the difference to the other mode's block in the same round, and in brackets "
        f"the quartiles of those differences (the spread the machine's noise makes).\n\n"
        f"### Where the time goes (µs per tensor per step, thread CPU)\n\n{breakdown}\n\n"
        f"### Median step (1 thread CPU ms unless marked wall)\n\n{steps}\n"
    )
    print(md)
    C.save("overhead", {"machine": machine, "runs": runs, "target_us": TARGET_US}, md)
    chart(runs)


def chart(runs):
    """Per size: what raw donation costs, and what the plugin adds on top,
    split by where it goes.  'Other' is the rest of the hook minus what it
    saved tracing (the previous step's tensors are freed in the hook rather
    than while tracing), plus the idle hook."""
    plt = C.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    x = list(range(len(runs)))
    w = 0.35
    raw = [r["derived"]["raw_set_buffer_donation_us_per_tensor"] for r in runs]
    floor = [r["derived"]["floor_vs_raw_us_per_tensor"] for r in runs]
    ax.bar([i - w / 2 for i in x], raw, w, label="raw torch_xla: _set_buffer_donation itself",
           color="#999999")
    ax.bar([i - w / 2 for i in x], floor, w, bottom=raw,
           label="floor: the torch_xla calls the design needs, over raw", color="#ff7f0e")
    ph = lambda d, *names: sum(d["phases_us_per_tensor"][n] for n in names)

    def other(d):
        # Negative when the freeing the hook takes over from tracing saves
        # more than the rest of the hook costs: then the parts overshoot.
        return d["added_vs_raw_us_per_tensor"] - (
            d["donate_buffer_us_per_tensor"] - d["raw_set_buffer_donation_us_per_tensor"]
        ) - ph(d, *PHASES)

    parts = [
        ("donate_buffer() beyond the raw call",
         lambda d: d["donate_buffer_us_per_tensor"] - d["raw_set_buffer_donation_us_per_tensor"],
         "#1f77b4"),
        ("barrier: commit (begin, split, buffer checks)", lambda d: ph(d, "commit"), "#6baed6"),
        ("barrier: arm the flags", lambda d: ph(d, "arm"), "#c6dbef"),
        ("barrier: release, poison and disarm the donors",
         lambda d: ph(d, "release_unheld", "finish", "disarm"), "#9ecae1"),
        ("barrier: verdicts", lambda d: ph(d, "settle_entries"), "#c6dbef"),
        ("other (rest of hook, net of work moved out of tracing)",
         lambda d: max(0.0, other(d)), "#deebf7"),
    ]
    bottom = [0.0] * len(runs)
    for label, get, color in parts:
        vals = [get(r["derived"]) for r in runs]
        ax.bar([i + w / 2 for i in x], vals, w, bottom=bottom, label=label, color=color,
               edgecolor="white", linewidth=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        v = r["derived"]["added_vs_raw_us_per_tensor"]
        note = f"+{v:.1f} µs"
        if other(r["derived"]) < 0:
            note += (f"\n(parts {bottom[i]:.1f}, less {-other(r['derived']):.1f}"
                     "\nof freeing moved out of tracing)")
        ax.text(i + w / 2, max(bottom[i], v) + 0.3, note, ha="center", fontsize=8)
    ax.set_ylim(0, max(bottom + [a + b for a, b in zip(raw, floor)]) * 1.35 + 0.5)
    for i, f in enumerate(floor):  # the target: the floor, plus what the plugin may add
        ax.hlines(f + TARGET_US, i, i + w, color="red", linestyle="--", linewidth=1,
                  label=f"target: floor + {TARGET_US} µs" if i == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['n']:,} tensors" for r in runs])
    ax.set_ylabel("µs per donated tensor per step (host CPU)")
    ax.set_title("Host time per donated tensor over raw donation: the floor and the plugin")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(C.chart_path("overhead"), dpi=110)


if __name__ == "__main__":
    main()
