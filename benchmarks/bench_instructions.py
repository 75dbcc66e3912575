"""What donation costs on the host, counted in instructions, not timed.

On a shared 2-CPU VM, timings of the same loop differ by 20-40% from one
process to the next, more than the plugin's whole cost: a one-microsecond
target cannot be judged from them.  Valgrind's callgrind counts the
instructions a loop executes (every thread), the same to within a fraction
of a percent run after run, so the cost of each mode can be compared
exactly and a change to the hot path measured before the timings can see
it.  Instructions are not time (cache misses and the allocator's locks are
not in them); ``bench_overhead.py`` and ``bench_async.py`` give the times.
Each mode is counted twice: every thread of the process, and the loop's
thread alone, the one a host-bound loop waits for (torch_xla frees a
donated input's buffer object on the thread that ran the execution).

The loop is ``bench_overhead``'s: N small tensors (f32[16]) replaced each
step by ``torch._foreach_add(ts, 1.0)``, ``torch_xla.sync(wait=False)``,
``xm.wait_device_ops()``.  Modes:

* ``raw``               ``_set_buffer_donation(t, True)`` per tensor, the
                        plugin's hook removed;
* ``floor``             hook removed, only the torch_xla calls "ours until
                        committed" needs (``_common.floor_sync``);
* ``donate_buffer``     ``torch_xla_donate.donate_buffer(t)`` per tensor;
* ``raw, held`` and ``donate_buffer, held``: the loop still holds the old
                        tensors at the barrier (``old = ts`` ... ``del old``
                        after it), so the plugin must poison every donor.

Each mode runs in its own process under callgrind, instrumented only around
the measured steps (a client request from a tiny helper compiled with the
system's C compiler).  Needs ``valgrind`` (with its headers) and ``cc``.

    python benchmarks/bench_instructions.py [--tensors 200] [--steps 5] [--modes raw ...]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["raw", "floor", "donate_buffer", "raw, held", "donate_buffer, held"]
WARMUP = 3

_HELPER = r"""
#include <valgrind/callgrind.h>
void tdx_bench_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void tdx_bench_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def child(mode: str, n: int, steps: int, helper: str) -> None:
    import ctypes
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _hooks as step_hook

    counter = ctypes.CDLL(helper)
    xlac = torch_xla._XLAC
    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    if not mode.startswith("donate_buffer"):
        step_hook.uninstall()
    held = mode.endswith("held") or mode == "floor"

    def step():
        nonlocal ts
        if mode.startswith("raw"):
            for t in ts:
                xlac._set_buffer_donation(t, True)
        elif mode.startswith("donate_buffer"):
            for t in ts:
                tdx.donate_buffer(t)
        old = ts if held else None
        ts = torch._foreach_add(ts, 1.0)
        if mode == "floor":
            C.floor_sync(xlac, old, lambda: torch_xla.sync(wait=False))
        else:
            torch_xla.sync(wait=False)
        del old
        xm.wait_device_ops()

    for _ in range(WARMUP):
        step()
    gc.collect()
    counter.tdx_bench_start()
    for _ in range(steps):
        step()
    counter.tdx_bench_stop()


def _helper(tmp: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("bench_instructions: needs a C compiler (cc) for the callgrind helper")
    src, lib = os.path.join(tmp, "helper.c"), os.path.join(tmp, "libhelper.so")
    with open(src, "w") as f:
        f.write(_HELPER)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", lib], capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit("bench_instructions: could not build the callgrind helper (are valgrind's "
                 f"headers installed?):\n{done.stderr}")
    return lib


def _count(out_prefix: str) -> int:
    """Instructions of the dumped part (callgrind writes <prefix>.1 on the
    dump, <prefix>.1-01 for the dumping thread with separate threads)."""
    path = out_prefix + ".1" if not out_prefix.endswith("-01") else out_prefix[:-3] + ".1-01"
    with open(path) as f:
        for line in f:
            m = re.match(r"totals:\s+(\d+)", line)
            if m:
                return int(m.group(1))
    raise RuntimeError(f"no totals in {out_prefix}.1")


def counted(script: str, args: list, out: str, loop_thread: bool, extra_env=None) -> int:
    """Runs ``script args`` (a child that counts between the helper's start
    and stop) under callgrind, writing to ``out``; returns the instructions
    counted: every thread's, or with ``loop_thread`` those of the thread
    running the loop alone (callgrind's per-thread dump: the requesting
    thread's file, ``-01``).  bench_async_instructions.py counts with it too."""
    threads = ["--separate-threads=yes"] if loop_thread else []
    cmd = ["valgrind", "--tool=callgrind", *threads, "--instr-atstart=no",
           f"--callgrind-out-file={out}", "-q", sys.executable, os.path.abspath(script),
           *map(str, args)]
    done = subprocess.run(cmd, env=C.child_env(extra_env), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return _count(out + ("-01" if loop_thread else ""))


def measure(mode: str, n: int, steps: int, helper: str, tmp: str, loop_thread: bool = False) -> int:
    """Instructions of the counted steps (``counted``)."""
    out = os.path.join(tmp, f"cg.{MODES.index(mode)}{'.loop' if loop_thread else ''}")
    return counted(__file__, ["--child", mode, "--tensors", n, "--steps", steps, "--helper", helper],
                   out, loop_thread)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--child")
    p.add_argument("--helper")
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES, metavar="MODE",
                   help=f"the modes to count (default: all of {MODES})")
    args = p.parse_args()
    if args.child:
        return child(args.child, args.tensors, args.steps, args.helper)
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions: needs valgrind (apt-get install valgrind)")
    n, steps, modes = args.tensors, args.steps, [m for m in MODES if m in args.modes]
    with tempfile.TemporaryDirectory() as tmp:
        helper = _helper(tmp)
        counts, loop = {}, {}
        for mode in modes:
            counts[mode] = measure(mode, n, steps, helper, tmp)
            loop[mode] = measure(mode, n, steps, helper, tmp, loop_thread=True)
            print(f"{mode:22s} {counts[mode] / (n * steps):9.0f} instructions per tensor per step"
                  f" ({loop[mode] / (n * steps):.0f} on the loop's thread)", flush=True)
    per = {m: counts[m] / (n * steps) for m in modes}
    per_loop = {m: loop[m] / (n * steps) for m in modes}
    differences = [
        ("floor over raw", "floor", "raw"),
        ("**donate_buffer over the floor**", "donate_buffer", "floor"),
        ("donate_buffer over raw", "donate_buffer", "raw"),
        ("donate_buffer, held, over raw, held", "donate_buffer, held", "raw, held"),
    ]
    def cell(table, a, b, bold):
        return f"**{table[a] - table[b]:.0f}**" if bold else f"{table[a] - table[b]:.0f}"

    rows = [[name, cell(per, a, b, name.startswith("**")), cell(per_loop, a, b, False)]
            for name, a, b in differences if a in per and b in per]
    m = C.machine()
    md = "\n".join([
        "## Host instructions per donated tensor per step (callgrind)",
        "",
        C.machine_line(m),
        "",
        f"{n} tensors, {steps} steps counted after {WARMUP} warm-up steps, every thread of the "
        "process, and the loop's thread alone (torch_xla runs executions, and frees their "
        "inputs, on threads of its own); "
        "two processes per mode.",
        "",
        C.table(["mode", "instructions per tensor per step", "on the loop's thread"],
                [[mode, f"{per[mode]:.0f}", f"{per_loop[mode]:.0f}"] for mode in modes]),
        "",
        C.table(["difference", "instructions per tensor per step", "on the loop's thread"],
                rows),
    ])
    print()
    print(md)
    if modes != MODES:
        return  # a partial run: results/ keeps the last full one
    C.save("instructions", {"machine": m, "tensors": n, "steps": steps, "per_tensor_step": per,
                            "per_tensor_step_loop_thread": per_loop}, md)


if __name__ == "__main__":
    main()
