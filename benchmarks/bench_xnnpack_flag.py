"""What ``--xla_cpu_use_xnnpack=false`` costs on XLA:CPU.

torch_xla_donate switches XLA:CPU's XNNPACK off at import on the CPU
backend (torch_xla_donate/_xla_cpu.py): on some CPUs it computes a
matmul with a reused buffer's old contents.  This measures the price:
the time per step of matmul-heavy graphs with XLA's default settings and
with the flag, each setting in its own fresh process (XLA reads XLA_FLAGS
once), alternating over rounds:

* square matmuls ``a @ b`` in f32 and bf16 at 256, 1024 and 2048;
* an MLP's forward and backward (3 layers of width 1024, batch 64).

Reported: the median time per step of each, and the ratio flag / default.

    python benchmarks/bench_xnnpack_flag.py [--rounds 3] [--steps 20]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

SETTINGS = {"default": "--xla_cpu_use_xnnpack=true", "flag": "--xla_cpu_use_xnnpack=false"}
CASES = ["matmul f32 256", "matmul f32 1024", "matmul f32 2048", "matmul bf16 1024",
         "mlp f32 1024"]


def child(steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for case in CASES:
        kind, dtype_name, width = case.split()
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        width = int(width)
        if kind == "matmul":
            a = torch.randn(width, width, generator=gen).to(dtype).to(dev)
            b = torch.randn(width, width, generator=gen).to(dtype).to(dev)

            def step(a=a, b=b):
                return a @ b
        else:
            ws = [(torch.randn(width, width, generator=gen) / width ** 0.5).to(dev).requires_grad_()
                  for _ in range(3)]
            x = torch.randn(64, width, generator=gen).to(dev)

            def step(ws=ws, x=x):
                h = x
                for w in ws:
                    h = torch.tanh(h @ w)
                return torch.autograd.grad((h ** 2).mean(), ws)
        for _ in range(3):  # compile and warm up
            result = step()  # held through the sync: an output, so the graph runs
            torch_xla.sync()
            xm.wait_device_ops()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            result = step()
            torch_xla.sync()
            xm.wait_device_ops()
            times.append(time.perf_counter() - t0)
        del result
        out[case] = C.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.child:
        C.emit(child(args.steps))
        return
    runs = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in C.round_robin(list(SETTINGS), r):
            # The flag decides alone: the child's environment sets it either way.
            runs[name].append(C.run_child(__file__, ["--steps", args.steps],
                                          env={"XLA_FLAGS": SETTINGS[name]}))
    rows = []
    med = {name: {case: C.median([run[case] for run in v]) for case in CASES}
           for name, v in runs.items()}
    for case in CASES:
        d, f = med["default"][case], med["flag"][case]
        rows.append([case, f"{d * 1e3:.2f}", f"{f * 1e3:.2f}", f"{f / d:.2f}"])
    machine = C.machine()
    markdown = "\n".join([
        "# What --xla_cpu_use_xnnpack=false costs", "", C.machine_line(machine), "",
        C.table(["graph", "default ms/step", "flag ms/step", "flag / default"], rows), "",
        f"Median of {args.rounds} fresh processes per setting, {args.steps} steps each.",
    ])
    print(markdown)
    C.save("xnnpack_flag", {"machine": machine, "median_s": med}, markdown)


if __name__ == "__main__":
    main()
