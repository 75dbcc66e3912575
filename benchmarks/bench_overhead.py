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
* ``donate_buffer``      ``torch_xla_donate.donate_buffer(t)`` per tensor;
* ``donate(list)``       one ``torch_xla_donate.donate(ts)`` call (the pytree
                         API) per step.

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

MODES = ["plain, no plugin", "plain", "raw torch_xla", "donate_buffer", "donate(list)"]
HOOKED = {"plain", "donate_buffer", "donate(list)"}
TARGET_US = 3.0


def child(n: int, rounds: int, block: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import step_hook

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    # Time the real barrier inside the hook: the rest of sync() is the hook.
    inner = C.Stopwatch(step_hook._real_step_marker)
    step_hook._real_step_marker = inner
    set_donation = torch_xla._XLAC._set_buffer_donation

    def step(mode):
        nonlocal ts
        if (mode in HOOKED) != step_hook.installed():
            step_hook.install() if mode in HOOKED else step_hook.uninstall()
        inner.total = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        if mode == "raw torch_xla":
            for t in ts:
                set_donation(t, True)
        elif mode == "donate_buffer":
            for t in ts:
                tdx.donate_buffer(t)
        elif mode == "donate(list)":
            tdx.donate(ts)
        c1, t1 = time.thread_time(), time.perf_counter()
        ts = torch._foreach_add(ts, 1.0)
        t2 = time.perf_counter()
        c2 = time.thread_time()
        torch_xla.sync(wait=False)
        c3, t3 = time.thread_time(), time.perf_counter()
        xm.wait_device_ops()
        t4 = time.perf_counter()
        return {
            "mark": t1 - t0,
            "mark_cpu": c1 - c0,
            "trace": t2 - t1,
            "barrier": t3 - t2,
            "hook": t3 - t2 - inner.total,
            "hook_cpu": (c3 - c2) - inner.total if mode in HOOKED else 0.0,
            "device": t4 - t3,
            "host": t3 - t0,
            "full": t4 - t0,
        }

    samples = {m: [] for m in MODES}
    for m in MODES:  # compile every graph once before measuring
        for _ in range(2):
            step(m)
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for m in order:
            # The first step of a block may settle verdicts left by the
            # previous block's mode; the others are steady state.
            step(m)
            for _ in range(block - 1):
                samples[m].append(step(m))
    med = {
        m: {k: C.median([s[k] for s in v]) for k in v[0]} for m, v in samples.items()
    }
    return {"n": n, "steps_per_mode": len(samples[MODES[0]]), "median_s": med}


def derive(n: int, med: dict) -> dict:
    us = 1e6
    p, d, raw = med["plain"], med["donate_buffer"], med["raw torch_xla"]
    base = med["plain, no plugin"]
    hook_fixed = p["hook"] * us
    added = (d["mark"] + d["hook"]) * us - hook_fixed
    return {
        "donate_buffer_us_per_tensor": d["mark"] * us / n,
        "hook_us_per_tensor": (d["hook"] * us - hook_fixed) / n,
        "plugin_added_us_per_tensor": added / n,
        "plugin_added_cpu_us_per_tensor": ((d["mark_cpu"] + d["hook_cpu"]) * us - p["hook_cpu"] * us) / n,
        "donate_list_added_us_per_tensor": (
            (med["donate(list)"]["mark"] + med["donate(list)"]["hook"]) * us - hook_fixed
        ) / n,
        "raw_set_buffer_donation_us_per_tensor": raw["mark"] * us / n,
        "extra_vs_raw_us_per_tensor": added / n - raw["mark"] * us / n,
        "hook_fixed_us_per_step": hook_fixed,
        "host_vs_raw_us_per_tensor": (d["host"] - raw["host"]) * us / n,
        "host_vs_plain_us_per_tensor": (d["host"] - base["host"]) * us / n,
        "full_vs_raw_us_per_tensor": (d["full"] - raw["full"]) * us / n,
        "full_vs_plain_us_per_tensor": (d["full"] - base["full"]) * us / n,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        n, rounds, block = args.rest
        C.emit(child(n, rounds, block))
        return

    machine = C.machine()
    runs = []
    for n in args.sizes:
        print(f"overhead: {n} tensors ...", flush=True)
        res = C.run_child(__file__, [n, args.rounds, args.block])
        res["derived"] = derive(n, res["median_s"])
        runs.append(res)
    machine["load_avg_1m_end"] = round(os.getloadavg()[0], 2)

    us = 1e6
    step_rows = []
    for r in runs:
        for m in MODES:
            s = r["median_s"][m]
            step_rows.append([
                r["n"], m, f"{s['mark'] * us / r['n']:.2f}", f"{s['trace'] * 1e3:.1f}",
                f"{s['barrier'] * 1e3:.1f}",
                f"{s['hook'] * 1e3:.2f}" if m in HOOKED else "-",
                f"{s['host'] * 1e3:.1f}", f"{s['device'] * 1e3:.1f}",
            ])
    steps = C.table(
        ["tensors", "mode", "donate µs/tensor", "trace ms", "sync ms", "hook ms",
         "host ms/step", "device ms/step"],
        step_rows,
    )
    rows = []
    for r in runs:
        d = r["derived"]
        rows.append([
            r["n"],
            f"{d['donate_buffer_us_per_tensor']:.2f}",
            f"{d['hook_us_per_tensor']:.2f}",
            f"**{d['plugin_added_us_per_tensor']:.2f}**",
            f"{d['plugin_added_cpu_us_per_tensor']:.2f}",
            f"{d['raw_set_buffer_donation_us_per_tensor']:.2f}",
            f"{d['extra_vs_raw_us_per_tensor']:.2f}",
            f"{d['donate_list_added_us_per_tensor']:.2f}",
            f"{d['hook_fixed_us_per_step']:.0f}",
            f"{d['host_vs_raw_us_per_tensor']:+.2f} / {d['host_vs_plain_us_per_tensor']:+.2f}",
        ])
    summary = C.table(
        ["tensors", "donate_buffer", "hook", "plugin adds", "(CPU time)",
         "raw _set_buffer_donation", "extra vs raw", "donate(list) adds",
         "hook fixed µs/step", "end-to-end host vs raw / vs plain"],
        rows,
    )
    md = (
        f"## Host overhead per donated tensor per step (µs)\n\n"
        f"Machine: {C.machine_line(machine)}\n\n{summary}\n\n"
        f"Target: plugin adds ≤ {TARGET_US} µs per tensor per step.\n\n"
        f"### Median step times\n\n{steps}\n"
    )
    print(md)
    C.save("overhead", {"machine": machine, "runs": runs, "target_us": TARGET_US}, md)
    chart(runs)


def chart(runs):
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['n']:,} tensors" for r in runs]
    x = range(len(runs))
    w = 0.25
    donate = [r["derived"]["donate_buffer_us_per_tensor"] for r in runs]
    hook = [r["derived"]["hook_us_per_tensor"] for r in runs]
    raw = [r["derived"]["raw_set_buffer_donation_us_per_tensor"] for r in runs]
    lst = [r["derived"]["donate_list_added_us_per_tensor"] for r in runs]
    ax.bar([i - w for i in x], raw, w, label="raw _set_buffer_donation", color="#999999")
    ax.bar(list(x), donate, w, label="donate_buffer()", color="#1f77b4")
    ax.bar(list(x), hook, w, bottom=donate, label="hook at barrier (commit, checks, poison, settle)", color="#aec7e8")
    ax.bar([i + w for i in x], lst, w, label="donate(list) + hook", color="#2ca02c")
    ax.axhline(TARGET_US, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_US} µs")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("µs per donated tensor per step")
    ax.set_title("Host time torch_xla_donate adds per donated tensor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(C.chart_path("overhead"), dpi=110)


if __name__ == "__main__":
    main()
