"""Compilations in steady state, with and without donation.

torch_xla keys its graph cache on the set of donated inputs too, so donation
must not make a loop recompile: once warm, a loop that donates the same
tensors every step compiles exactly as often as one that does not (never).
The count is ``torch_xla.debug.metrics.metric_data('CompileTime')``'s number
of samples.  A loop that donates only every other step runs two graphs (two
donor sets) and so compiles one more graph, once: shown for reference.

Each mode runs in its own process: a small MLP-like training step (forward,
backward, SGD as a functional update) over 8 parameters.

    python benchmarks/bench_compiles.py [--warmup 3] [--steps 30]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["no donation", "donate_buffer", "donate(list)", "donate_buffer every other step"]


def child(mode: str, warmup: int, steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    import torch_xla_donate as tdx

    torch.manual_seed(0)
    dev = torch_xla.device()
    sizes = [(64, 32), (64,), (64, 64), (64,), (64, 64), (64,), (10, 64), (10,)]
    params = [(torch.randn(*s) * 0.1).to(dev) for s in sizes]
    x = torch.randn(16, 32).to(dev)
    y = torch.randint(0, 10, (16,)).to(dev)
    torch_xla.sync()

    def loss_of(ps):
        h = x
        for i in range(0, len(ps) - 2, 2):
            h = torch.relu(h @ ps[i].T + ps[i + 1])
        return torch.nn.functional.cross_entropy(h @ ps[-2].T + ps[-1], y)

    def compiles():
        data = met.metric_data("CompileTime")
        return 0 if data is None else data[0]

    def step(i):
        nonlocal params
        ps = [p.detach().requires_grad_() for p in params]  # aliases of params
        grads = torch.autograd.grad(loss_of(ps), ps)
        del ps  # gone with the graph: params can be donated
        if mode == "donate_buffer" or (mode.endswith("every other step") and i % 2 == 0):
            for p in params:
                tdx.donate_buffer(p)
        elif mode == "donate(list)":
            tdx.donate(params)
        params = [p - 0.1 * g for p, g in zip(params, grads)]
        torch_xla.sync()

    for i in range(warmup):
        step(i)
    warm = compiles()
    for i in range(warmup, warmup + steps):
        step(i)
    torch_xla.sync()
    final = compiles()
    probe = float(params[0].sum().cpu())
    reused = tdx.summary().totals.reused  # evidence that donation happened
    return {"after_warmup": warm, "total": final, "steady_state": final - warm,
            "probe": probe, "reused": reused}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, warmup, steps = args.rest
        C.emit(child(mode, int(warmup), int(steps)))
        return

    machine = C.machine()
    results = {}
    for mode in MODES:
        print(f"compiles: {mode} ...", flush=True)
        results[mode] = C.run_child(__file__, [mode, args.warmup, args.steps])
    rows = [
        [m, r["after_warmup"], r["steady_state"], r["total"], r["reused"], f"{r['probe']:.6f}"]
        for m, r in results.items()
    ]
    base = results["no donation"]
    ok = all(results[m]["steady_state"] == base["steady_state"] for m in ("donate_buffer", "donate(list)"))
    same = len({round(r["probe"], 5) for r in results.values()}) == 1
    text = C.table(
        ["mode", f"compiles in {args.warmup} warm-up steps",
         f"compiles in the next {args.steps} steps", "total", "buffers reused",
         "sum(params[0]) after"],
        rows,
    )
    md = (
        f"## Compilations in steady state (`CompileTime` samples)\n\n"
        f"Machine: {C.machine_line(machine)}\n\n{text}\n\n"
        f"- Steady-state compiles with donation equal those without: "
        f"{'yes, target met' if ok else 'NO, TARGET MISSED'}.\n"
        f"- Every mode computes the same parameters: {'yes' if same else 'NO'}.\n"
    )
    print(md)
    C.save("compiles", {"machine": machine, "results": results}, md)
    chart(results, args)


def chart(results, args):
    plt = C.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(MODES))
    warm = [results[m]["after_warmup"] for m in MODES]
    steady = [results[m]["steady_state"] for m in MODES]
    ax.bar(xs, warm, color="#aec7e8", label=f"warm-up ({args.warmup} steps)")
    ax.bar(xs, steady, bottom=warm, color="#d62728", label=f"steady state ({args.steps} steps)")
    for x, w, s in zip(xs, warm, steady):
        ax.text(x, w + s + 0.05, f"{w} + {s}", ha="center", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(["no donation", "donate_buffer", "donate(list)", "donate every\nother step"],
                       fontsize=8)
    ax.set_ylabel("XLA compilations")
    ax.set_title("Graph compilations: donation does not cause recompiles")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(C.chart_path("compiles"), dpi=110)


if __name__ == "__main__":
    main()
