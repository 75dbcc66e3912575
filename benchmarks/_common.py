"""Shared plumbing of the benchmark scripts: machine description, child
processes, tables, result files and charts.

Every benchmark runs each measured configuration in a fresh interpreter
(``run_child``), so that peak memory, compile caches and allocator state of
one configuration cannot leak into another.  Children print one JSON line.
"""
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MiB = 1 << 20


def machine() -> dict:
    """Date and machine the numbers were taken on."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    import torch
    import torch_xla

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(ram / (1 << 30), 1) if ram else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['date']} | {m['nproc']} CPUs ({m['cpu']}) | {m['ram_gib']} GiB RAM | "
        f"load avg {m['load_avg_1m']} | torch {m['torch']}, torch_xla {m['torch_xla']}"
    )


def child_env(extra=None) -> dict:
    """The environment of a child: this checkout's package first on the path
    (the benchmarks measure the code next to them, installed or not), and
    XLA:CPU's XNNPACK off in every mode alike, also in those that never
    import the package (raw donation, no plugin): the package switches it
    off at import for values that can be trusted (torch_xla_donate/_xla_cpu.py),
    and modes compared with each other must run the same XLA."""
    env = dict(os.environ)
    repo = os.path.dirname(HERE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    env.setdefault("PJRT_DEVICE", "CPU")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    if "--xla_cpu_use_xnnpack" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_use_xnnpack=false".strip()
    return env


def run_child(script: str, args, env=None, timeout=3600) -> dict:
    """Runs ``python script --child args...`` and returns its JSON result."""
    cmd = [sys.executable, script, "--child", *map(str, args)]
    proc = subprocess.run(
        cmd, env=child_env(env), capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"child {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return json.loads(lines[-1])


def emit(result: dict) -> None:
    """A child's last act: its result as one JSON line."""
    print(json.dumps(result), flush=True)


def peak_rss() -> int:
    """VmHWM of this process in bytes: the peak resident set size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def median(xs):
    return statistics.median(xs)


def round_robin(modes, r):
    """The order of the modes in round ``r``: each round starts one mode
    later, so no mode always runs first (or right after the same other).

    >>> round_robin(["a", "b", "c"], 4)
    ['b', 'c', 'a']
    """
    k = r % len(modes)
    return modes[k:] + modes[:k]


def interleaved_rates(step, modes, windows: int, steps: int, wait) -> dict:
    """Runs ``step(mode)`` for every mode in one process: 5 steps each to
    compile its graph, then ``windows`` rounds in which each mode, in
    ``round_robin`` order, runs ``steps`` steps (after one that settles what
    the previous mode left open).  ``wait()`` waits for the device, also at
    the end of each window.  Returns, by mode:

    * ``rates``: steps per second of each window;
    * ``loop_cpu`` and ``process_cpu``: CPU seconds per step of each window,
      of the loop's thread and of the whole process (every thread: the
      loop's and XLA's).  Beside the rate they tell a loop that computes
      more from one that waits more (a lock, the device, the other CPU
      taken by another thread);
    * ``collections``: the collections Python's garbage collector ran per
      generation during the mode's windows: a count, which does not drift,
      and which a median of windows does not drop the way it drops a
      window with a full collection in it."""
    for mode in modes:
        for _ in range(5):
            step(mode)
    wait()
    out = {key: {mode: [] for mode in modes} for key in ("rates", "loop_cpu", "process_cpu")}
    out["collections"] = {mode: [0, 0, 0] for mode in modes}
    for w in range(windows):
        for mode in round_robin(modes, w):
            step(mode)
            wait()
            before = [g["collections"] for g in gc.get_stats()]
            start, thread0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(steps):
                step(mode)
            wait()
            out["rates"][mode].append(steps / (time.perf_counter() - start))
            out["loop_cpu"][mode].append((time.thread_time() - thread0) / steps)
            out["process_cpu"][mode].append((time.process_time() - process0) / steps)
            for i, g in enumerate(gc.get_stats()):
                out["collections"][mode][i] += g["collections"] - before[i]
    return out


def floor_sync(xlac, donors, sync) -> None:
    """One barrier with only the torch_xla calls that keeping marks "ours
    until committed" needs, and no plugin: one pending-IR query for the
    list, the donor flag armed just before the barrier and cleared after
    it, and one ``_is_placecholder`` verdict per donor.  ``sync`` runs the
    barrier.  What the plugin adds over this is its own cost."""
    set_donation, is_placeholder = xlac._set_buffer_donation, xlac._is_placecholder
    xlac._check_tensor_need_materialization(donors)
    for t in donors:
        set_donation(t, True)
    sync()
    for t in donors:
        set_donation(t, False)
    for t in donors:
        is_placeholder(t)


def time_real_barrier(xla) -> list:
    """Replaces torch_xla's real barrier, as the plugin calls it
    (``xla.REAL["_xla_step_marker"]``), with one that adds its thread CPU
    time to the returned one-element list: a step's host time minus it is
    the time spent outside torch_xla's barrier.  The plugin's trampolines
    take the real function when they are installed, so they are put in
    again around the timed one (which cancels every mark: call it first)."""
    inner = [0.0]
    real_barrier = xla.real("_xla_step_marker")

    def timed_barrier(*args, **kwargs):
        start = time.thread_time()
        try:
            return real_barrier(*args, **kwargs)
        finally:
            inner[0] += time.thread_time() - start

    xla.REAL["_xla_step_marker"] = timed_barrier
    hooks = sys.modules.get(xla.__name__.rpartition(".")[0] + "._hooks")
    if hooks is not None and hooks.installed():
        hooks.uninstall()
        hooks.install()
    return inner


def table(headers, rows) -> str:
    """A GitHub-flavoured markdown table, also readable on a terminal."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])


def save(name: str, data: dict, markdown: str) -> None:
    """Writes results/<name>.json and results/<name>.md."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(markdown.rstrip() + "\n")


def pyplot():
    """matplotlib's pyplot (headless), or None when matplotlib is missing:
    the results are saved before any chart, and a chart is skipped with a
    note (benchmarks/requirements.txt installs it)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: chart skipped (pip install -r "
              "benchmarks/requirements.txt)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_path(name: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, f"{name}.png")


class Stopwatch:
    """Accumulates wall (perf_counter) seconds of the wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start
