"""How often a donating step switches between Python and C++, counted.

Issue 33 asks for native code that Python calls as a leaf: no callback from
C++ into Python on the hot path.  This counts, per step of a loop donating
N tensors (``bench_instructions``' loop: ``donate_buffer`` per tensor,
``torch._foreach_add``, ``torch_xla.sync(wait=False)``, then
``xm.wait_device_ops()``), with ``sys.setprofile``:

* Python -> ``torch_xla_donate._C``: calls of the plugin's native functions
  from Python code (``c_call`` events of builtins whose module is ``_C``);
* Python -> ``torch_xla._XLAC``: calls of torch_xla's bindings from
  Python code;
* C++ -> Python: a Python function entered while its caller is inside one
  of those native calls (a ``C.bind`` hook written in Python, such as
  ``_marking.refused`` or ``_poison.on_donated_dispatch``), or entered by a
  ``C.Trampoline`` (the step hook's halves around ``_xla_step_marker``).

What the profiler cannot see: a builtin called by another builtin, not by
Python code.  A bound hook that is itself a builtin, called from C++, would
be one; there is none now (the hooks ``C.bind`` takes, csrc/module.cpp, are
Python functions and classes).  ``_commit.arm`` calls torch_xla's
``_set_buffer_donation`` per donor through ``map()``: the child puts a
pass-through Python function in its place (``_xla.REAL``), so that each of
those calls is made from Python code and counted.

Counted in the marking calls (per tensor) and in the barrier (per step,
split into the part that grows with N and the part that does not, from two
sizes).  A count, so the machine's load does not move it.

    python benchmarks/bench_crossings.py [--tensors 1 100] [--steps 5]
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ["donate_buffer", "donate_buffer, held"]
_PACKAGE = os.sep + "torch_xla_donate" + os.sep
WARMUP = 3


class _Counter:
    """A ``sys.setprofile`` function counting the crossings of one phase."""

    def __init__(self, trampoline_codes):
        self.trampoline_codes = trampoline_codes
        self.counts = collections.Counter()
        self.names = collections.Counter()
        # id(frame) -> depth of open native calls it made (ids: holding the
        # frame would keep its locals, the donors among them, alive)
        self.open_native = {}
        self.phase = None

    def __call__(self, frame, event, arg):
        if self.phase is None:
            return
        if event == "c_call":
            module = getattr(arg, "__module__", None) or ""
            self_mod = getattr(getattr(arg, "__self__", None), "__name__", "")
            kind = None
            if module.startswith("torch_xla_donate._C") or self_mod == "torch_xla_donate._C":
                kind = "py->_C"
            elif (module.startswith("torch_xla._XLAC") or module == "_XLAC"  # pybind11's name
                  or self_mod == "torch_xla._XLAC"):
                kind = "py->_XLAC"
            if kind:
                self.counts[(self.phase, kind)] += 1
                self.names[(self.phase, kind, arg.__name__)] += 1
                self.open_native[id(frame)] = self.open_native.get(id(frame), 0) + 1
        elif event in ("c_return", "c_exception"):
            depth = self.open_native.get(id(frame))
            if depth:
                if depth == 1:
                    del self.open_native[id(frame)]
                else:
                    self.open_native[id(frame)] = depth - 1
        elif event == "call":
            parent = frame.f_back
            by_native = parent is not None and self.open_native.get(id(parent))
            # A trampoline's half, unless the plugin's own Python called it.
            by_trampoline = frame.f_code in self.trampoline_codes and (
                parent is None or _PACKAGE not in parent.f_code.co_filename)
            if by_native or by_trampoline:
                self.counts[(self.phase, "C++->py")] += 1
                self.names[(self.phase, "C++->py", frame.f_code.co_name)] += 1


def _trampoline_codes():
    """The Python halves ``C.Trampoline`` hooks call (a Trampoline exposes
    only ``real``): the before and after of every ``_XLAC`` trampoline
    (``_hooks._TRAMPOLINES``, ``_dynamo.TRAMPOLINES``: the step barrier's
    first half is ``_commit.barrier_hook``), and the functions of the hook
    modules named ``*_before`` / ``*_after`` (the step blocks')."""
    import inspect

    from torch_xla_donate import _commit, _dynamo, _hooks, _verdicts

    codes = {fn.__code__ for _, *halves in _hooks._TRAMPOLINES + _dynamo.TRAMPOLINES
             for fn in halves}
    for module in (_commit, _dynamo, _hooks, _verdicts):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.endswith(("before", "after")) and fn.__module__ == module.__name__:
                codes.add(fn.__code__)
    return codes


def child(mode: str, n: int, steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_donate as tdx
    from torch_xla_donate import _xla

    # The plugin's own calls of _set_buffer_donation, seen by the profiler
    # also where a builtin (map) makes them (see the docstring).
    set_buffer_donation = _xla.REAL["_set_buffer_donation"]
    _xla.REAL["_set_buffer_donation"] = lambda t, flag: set_buffer_donation(t, flag)

    dev = torch_xla.device()
    ts = [torch.full((16,), float(i), device=dev) for i in range(n)]
    torch_xla.sync()
    xm.wait_device_ops()
    held = mode.endswith("held")
    counter = _Counter(_trampoline_codes())

    def step():
        nonlocal ts
        counter.phase = "marking" if counting else None
        for t in ts:
            tdx.donate_buffer(t)
        counter.phase = None
        old = ts if held else None
        ts = torch._foreach_add(ts, 1.0)
        counter.phase = "barrier" if counting else None
        torch_xla.sync(wait=False)
        del old
        counter.phase = None
        xm.wait_device_ops()

    counting = False
    for _ in range(WARMUP):
        step()
    counting = True
    sys.setprofile(counter)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return {
        "counts": {f"{p}|{k}": v / steps for (p, k), v in counter.counts.items()},
        "names": {f"{p}|{k}|{name}": v / steps for (p, k, name), v in counter.names.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, nargs=2, default=[1, 100])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--child")
    p.add_argument("--n", type=int)
    args = p.parse_args()
    if args.child:
        return C.emit(child(args.child, args.n, args.steps))
    small, large = args.tensors
    rows, detail = [], []
    for mode in MODES:
        got = {n: C.run_child(__file__, [mode, "--n", n, "--steps", args.steps]) for n in (small, large)}
        for phase in ("marking", "barrier"):
            for kind in ("py->_C", "py->_XLAC", "C++->py"):
                key = f"{phase}|{kind}"
                a, b = got[small]["counts"].get(key, 0), got[large]["counts"].get(key, 0)
                per_tensor = (b - a) / (large - small)
                fixed = a - per_tensor * small
                rows.append([mode, phase, kind, f"{fixed:.1f}", f"{per_tensor:.2f}"])
        for name, v in sorted(got[large]["names"].items()):
            detail.append([mode, f"{large}", *name.split("|"), f"{v:.1f}"])
    m = C.machine()
    md = "\n".join([
        "## Python <-> C++ crossings per donating step (sys.setprofile)",
        "",
        C.machine_line(m),
        "",
        f"{args.steps} steps counted after {WARMUP} warm-up steps, at {small} and {large} "
        "tensors; per step: a fixed part and a part per donated tensor.",
        "",
        C.table(["mode", "phase", "crossing", "per step", "per tensor"], rows),
        "",
        f"Per call site, per step at {large} tensors:",
        "",
        C.table(["mode", "tensors", "phase", "crossing", "function", "calls per step"], detail),
    ])
    print(md)
    C.save("crossings", {"machine": m, "rows": rows, "detail": detail}, md)


if __name__ == "__main__":
    main()
