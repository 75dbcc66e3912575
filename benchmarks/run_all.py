"""Runs every benchmark and gathers their tables into results/summary.md.

    .venv/bin/pip install -r benchmarks/requirements.txt   # JAX, matplotlib
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/run_all.py [--quick]

Each benchmark writes results/<name>.{json,md,png}; see benchmarks/README.md.
``--quick`` runs fewer repetitions (a smoke run, noisier numbers).
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

BENCHMARKS = {
    "memory": ("bench_memory.py", [], ["--steps", "3", "--decode-steps", "5"]),
    "overhead": ("bench_overhead.py", [], ["--rounds", "4"]),
    "async": ("bench_async.py", [], ["--repeats", "1", "--windows", "3"]),
    "segments": ("bench_segments.py", [], ["--repeats", "1", "--rounds", "4"]),
    "compiles": ("bench_compiles.py", [], ["--steps", "10"]),
    "sharing": ("bench_sharing.py", [], ["--rounds", "3"]),
    "xnnpack_flag": ("bench_xnnpack_flag.py", [], ["--rounds", "1"]),
    "instructions": ("bench_instructions.py", [], ["--tensors", "50", "--steps", "2"]),
    "async_instructions": ("bench_async_instructions.py", [], ["--tensors", "50", "--steps", "2"]),
    "reads": ("bench_reads.py", [], ["--calls", "300"]),
    "crossings": ("bench_crossings.py", [], ["--steps", "2"]),
    "registry": ("bench_registry.py", [], ["--rounds", "5"]),
    "auto": ("bench_auto.py", [], ["--rounds", "3"]),
}
# Tools a benchmark needs beyond Python: without them it is skipped, and says so.
NEEDS = {"instructions": "valgrind", "async_instructions": "valgrind", "reads": "valgrind"}
# Result files a benchmark writes besides results/<its name>.md.
EXTRA_RESULTS = {"memory": ["memory_decode"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("names", nargs="*", help=f"some of {', '.join(BENCHMARKS)} (default: all)")
    args = ap.parse_args()
    names = args.names or list(BENCHMARKS)
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {list(BENCHMARKS)}")
    start = time.time()
    for name in names:
        script, full, quick = BENCHMARKS[name]
        if name in NEEDS and shutil.which(NEEDS[name]) is None:
            print(f"== {name}: skipped, needs {NEEDS[name]}", flush=True)
            continue
        cmd = [sys.executable, os.path.join(C.HERE, script), *(quick if args.quick else full)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, env=C.child_env(), check=True)
    parts = []
    for name in [n for b in BENCHMARKS for n in [b] + EXTRA_RESULTS.get(b, [])]:
        path = os.path.join(C.RESULTS, f"{name}.md")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f.read().strip())
    with open(os.path.join(C.RESULTS, "summary.md"), "w") as f:
        f.write("# torch_xla_donate benchmark results\n\n" + "\n\n".join(parts) + "\n")
    print(f"done in {time.time() - start:.0f} s; tables in {C.RESULTS}/summary.md")


if __name__ == "__main__":
    main()
