"""What seeing shared device buffers costs (``Screen()`` in csrc/commit.cpp).

A step donates N small tensors (f32[16]) and replaces each by ``t + 1``,
then ``torch_xla.sync(wait=False)`` and ``xm.wait_device_ops()``, the plugin
as shipped.  Its commit screens the donors for shared buffers at every
barrier that donates: the walk of torch_xla's live tensors for copies made
in the step (``SameStepCopies``, csrc/live_tensors.cpp) and the buffers'
holder counts (``ExcessHolders``, csrc/xla_reads.cpp).  Both run inside the
native split (``C.commit``), which has no switch to leave them out, so the
check is timed on its own: the same two native calls on the step's donors
(``C.same_step_copies``, ``C.lazy_excess``), just before the barrier that
runs them again, outside the step's host time.

Measured: host CPU time (thread time) of the step without the real barrier
inside ``sync``, and of the check alone, per step and per donated tensor,
the median over blocks of steps.  The check is held to at most 0.5 µs per
tensor (issue #20).

    python benchmarks/bench_sharing.py [--sizes 1000 10000] [--rounds 8]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET_US = 0.5


def child(n: int, rounds: int, block: int) -> dict:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _C, _xla

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    inner = C.time_real_barrier(_xla)

    def step():
        nonlocal ts
        inner[0] = 0.0
        c0 = time.thread_time()
        for t in ts:
            tdx.donate_buffer(t)
        donors, ts = ts, torch._foreach_add(ts, 1.0)
        c1 = time.thread_time()
        # The commit's screen, alone: what the barrier below runs again.
        copies = _C.same_step_copies(donors, False)
        _C.lazy_excess(donors)
        check = time.thread_time() - c1
        assert copies is not None, "the walk of live tensors is off"
        del donors  # as the loop rebinds its names: the barrier releases them
        c2 = time.thread_time()
        torch_xla.sync(wait=False)
        host = (c1 - c0) + (time.thread_time() - c2) - inner[0]
        xm.wait_device_ops()
        return host, check

    for _ in range(2):
        step()
    host, check = [], []
    for _ in range(rounds):
        gc.collect()
        step()
        got = [step() for _ in range(block - 1)]
        host.append(sum(h for h, _ in got) / len(got))
        check.append(sum(c for _, c in got) / len(got))
    tdx.settle()
    return {"n": n, "live_objects": len(gc.get_objects()),
            "host_ms_per_step": C.median(host) * 1e3,
            "check_ms_per_step": C.median(check) * 1e3,
            "check_us_per_tensor": C.median(check) * 1e6 / n}


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
    rows = [[r["n"], f"{r['host_ms_per_step']:.2f}", f"{r['check_ms_per_step']:.2f}",
             f"{r['check_us_per_tensor']:.2f}", r["live_objects"]] for r in results]
    machine = C.machine()
    met = all(r["check_us_per_tensor"] <= TARGET_US for r in results)
    markdown = "\n".join([
        "# Seeing shared buffers: cost", "", C.machine_line(machine), "",
        C.table(["tensors", "host ms/step", "check ms/step", "check µs/tensor",
                 "live objects"], rows), "",
        f"The check (walk for same-step copies and holder counts, timed alone) within "
        f"{TARGET_US} µs per tensor: {'met' if met else 'MISSED'}.",
    ])
    print(markdown)
    C.save("sharing", {"machine": machine, "results": results}, markdown)


if __name__ == "__main__":
    main()
