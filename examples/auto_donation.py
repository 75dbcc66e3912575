"""One functional loop three ways: plain, annotated, and automatic donation.

    PJRT_DEVICE=CPU python examples/auto_donation.py [--mib 256] [--tensors 8] [--steps 4]

The state is ``--tensors`` float32 tensors of ``--mib`` MiB in all, updated
functionally each step (``state = [s * 0.99 + 0.01 for s in state]``): the
old list is dropped, so its buffers are dead once the step has run.  Each
mode runs in a process of its own (peak memory only grows):

* ``plain``      nothing donated: at peak the old and the new state;
* ``annotated``  ``tdx.donate(state)`` before each update;
* ``auto``       no annotation, ``tdx.configure(auto=True)``: the barrier
                 donates the inputs nothing but the step holds.

Printed per mode: the growth of the peak resident memory over the loop,
the median step time, and a checksum of the final state (equal in all
three).  Then the advisor's table for the plain loop (``tdx.advise()``):
what it would tell you to annotate.  ``--mode`` runs one mode here.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402

MIB = 1 << 20
MODES = ["plain", "annotated", "auto"]


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts over from the current memory
    except OSError:
        pass


def make_state(mib: int, tensors: int):
    n = mib * MIB // 4 // tensors
    dev = torch_xla.device()
    state = [torch.full((n,), float(i)).to(dev) for i in range(tensors)]
    torch_xla.sync()
    xm.wait_device_ops()
    return state


def step(state):
    return [s * 0.99 + 0.01 for s in state]


def run_mode(mode: str, mib: int, tensors: int, steps: int) -> None:
    state = make_state(mib, tensors)
    tdx.configure(auto=mode == "auto")
    times = []
    reset_peak_rss()
    base = peak_rss_mib()
    for _ in range(steps):
        start = time.perf_counter()
        if mode == "annotated":
            tdx.donate(state)
        state = step(state)
        torch_xla.sync()
        xm.wait_device_ops()
        times.append(time.perf_counter() - start)
    growth = peak_rss_mib() - base
    tdx.settle()
    checksum = sum(float(s[0].item()) for s in state)
    print(f"{mode}: peak growth {growth:.0f} MiB, step {statistics.median(times) * 1e3:.1f} ms, "
          f"checksum {checksum:.6f}")
    if mode == "auto":
        print(f"summary: {tdx.summary().auto}")


def advise(mib: int, tensors: int) -> None:
    state = make_state(mib, tensors)
    with tdx.advise() as advice:
        state = step(state)
        torch_xla.sync()
    print(advice)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the whole state")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mode", choices=MODES + ["advise"], help="run one mode in this process")
    args = ap.parse_args()
    if args.mode == "advise":
        advise(args.mib, args.tensors)
    elif args.mode:
        run_mode(args.mode, args.mib, args.tensors, args.steps)
    else:
        print(f"state: {args.tensors} tensors, {args.mib} MiB in all, {args.steps} steps")
        for mode in MODES + ["advise"]:
            cmd = [sys.executable, __file__, "--mode", mode, "--mib", str(args.mib),
                   "--tensors", str(args.tensors), "--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            print(out.rstrip())


if __name__ == "__main__":
    main()
