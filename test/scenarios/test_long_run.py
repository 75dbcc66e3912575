"""Long runs: thousands of donating steps keep memory and compiles flat.

One loop of tiny tensors (so the step costs are the plugin's and torch_xla's
bookkeeping, not arithmetic), with a donation consumed every step, a
deliberately unusable one every 10th step and a cancelled one every 7th.
After a warm-up, nothing may grow with the number of steps:

* the ledger: exact totals, a bounded per-step history, no marks left, at
  most one step's verdicts open;
* compiled graphs (torch_xla's ``CompileTime`` count): a fixed set, reused;
* the process: resident memory, Python objects alive (``gc``), the old,
  poisoned states (nothing keeps them alive), and the Python heap allocated
  by this package's code (``tracemalloc``, over a window of its own).

``TDX_LONG_RUN_STEPS`` sets the number of steps (default 10,000: about 10 s
here, so CI runs all of them).  Set it higher for a soak test::

    TDX_LONG_RUN_STEPS=200000 PJRT_DEVICE=CPU .venv/bin/python -m pytest -q -s test/scenarios/test_long_run.py
"""
import gc
import os
import time
import tracemalloc
import warnings
import weakref

import torch
import torch_xla
import torch_xla.debug.metrics as met
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C, report
from torch_xla_donate import _verdicts as verdicts

STEPS = int(os.environ.get("TDX_LONG_RUN_STEPS", 10_000))
WARMUP = max(STEPS // 5, 50)
SAMPLE_EVERY = max(STEPS // 10, 1)
PACKAGE_FILES = os.path.join(os.path.dirname(tdx.__file__), "*")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _report(request, line):
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + line)


class Loop:
    """The donating training loop, one ``step()`` at a time."""

    def __init__(self, dev):
        self.state = materialize(torch.zeros(16, device=dev))
        self.grad = materialize(torch.full((16,), 0.5, device=dev))
        self.spare = materialize(torch.ones(3, device=dev))  # no output of its size
        self.n = 0

    def step(self):
        self.n += 1
        tdx.donate_buffer(self.state)
        if self.n % 10 == 0:
            tdx.donate_buffer(self.spare)  # unusable: a warning, value kept
        if self.n % 7 == 0:
            tdx.donate_buffer(self.grad)
            assert tdx.undonate(self.grad)
        old = self.state
        self.state = self.state * 0.5 + self.grad
        torch_xla.sync()  # wait=False: verdicts settle at the next barrier
        return old


def test_ten_thousand_donating_steps_stay_flat(dev, request):
    loop = Loop(dev)
    totals_before = _C.totals()
    rss, objects, old_refs = {}, {}, []
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        for n in range(1, STEPS + 1):
            old = loop.step()
            if n % 1000 == 0:
                old_refs.append(weakref.ref(old))
            del old
            # The ledger never holds more than this step's marks and open verdicts.
            assert _C.marked_count() == 0 and verdicts.in_flight_count() <= 2
            if n == WARMUP:
                warm_compiles = _compiles()
            if n % SAMPLE_EVERY == 0:
                gc.collect()
                rss[n], objects[n] = _rss_mib(), len(gc.get_objects())
        tdx.settle()
    elapsed = time.monotonic() - start
    compiles = _compiles()

    # The state is right: s <- s/2 + 0.5 converges to 1.
    assert torch.allclose(loop.state.cpu(), torch.ones(16))
    # The ledger counted every donation once and kept a bounded history.
    totals = _C.totals()
    delta = {k: totals[k] - totals_before[k] for k in ("donated", "reused", "unused", "failed")}
    assert delta == {"donated": STEPS + STEPS // 10, "reused": STEPS, "unused": STEPS // 10, "failed": 0}
    assert _C.step_stats(_C.current_step() - _C.HISTORY_STEPS - 5) is None
    assert _C.step_stats()["step"] == _C.current_step()
    assert verdicts.in_flight_count() == 0
    # Old states are poisoned garbage: nothing holds them.
    assert all(ref() is None for ref in old_refs)
    # Compiles: the few graphs of the warm-up, reused ever after.
    assert compiles == warm_compiles, f"{compiles - warm_compiles} graphs compiled after the warm-up"
    # Memory and objects: flat after the warm-up.  (The weakrefs kept above
    # add one object per 1000 steps.)
    after = [n for n in rss if n >= WARMUP]
    half = [n for n in after if n >= STEPS // 2]
    rss_growth = rss[after[-1]] - rss[after[0]]
    late_growth = max(rss[n] for n in half) - rss[half[0]]
    assert rss_growth < 4, f"RSS grew {rss_growth:.2f} MiB after the warm-up: {rss}"
    assert late_growth < 1, f"RSS still growing in the second half: {rss}"
    object_growth = objects[after[-1]] - objects[after[0]]
    assert object_growth <= len(old_refs) + 20, f"{object_growth} more Python objects: {objects}"
    _report(request,
            f"long run: {STEPS} steps in {elapsed:.1f} s ({1e3 * elapsed / STEPS:.2f} ms/step); "
            f"compiles {warm_compiles} at step {WARMUP}, {compiles} at the end; RSS MiB by step "
            + ", ".join(f"{n}: {rss[n]:.2f}" for n in after)
            + f"; gc objects {objects[after[0]]} -> {objects[after[-1]]}")


def test_python_heap_of_the_package_stays_flat(dev, request):
    """tracemalloc over a window of steps, after a warm-up: whatever is
    allocated under this package's frames is freed again."""
    loop = Loop(dev)
    window = min(STEPS // 10, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        for _ in range(window):  # warm-up
            loop.step()
        gc.collect()
        tracemalloc.start(30)  # deep enough to see our frames under torch_xla's
        try:
            # One step first: the open verdicts and ledger entries alive at
            # any moment must be traced in both snapshots, not in one only.
            loop.step()
            before = tracemalloc.take_snapshot()
            for _ in range(window):
                loop.step()
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        tdx.settle()
    ours = tracemalloc.Filter(True, PACKAGE_FILES, all_frames=True)
    diff = after.filter_traces([ours]).compare_to(before.filter_traces([ours]), "filename")
    growth = sum(s.size_diff for s in diff)
    total = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert growth < 1024, f"torch_xla_donate's Python heap grew {growth} B in {window} steps"
    _report(request, f"python heap over {window} steps: {growth:+d} B under torch_xla_donate, "
                     f"{total:+d} B in all (torch_xla's own bookkeeping)")


def test_unused_donation_warnings_do_not_pile_up(dev, request):
    """A donation that is unusable every step warns every step.  Python's
    default warning filter remembers each distinct message it has shown:
    the message must not change from step to step, or that memory grows
    without bound and the same warning is printed over and over."""
    state = materialize(torch.zeros(16, device=dev))
    spare = materialize(torch.ones(3, device=dev))
    steps = min(STEPS, 2000)
    registry_sizes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default", tdx.UnusedDonationWarning)
        for n in range(steps):
            tdx.donate_buffer(state)
            tdx.donate_buffer(spare)
            state = state + 1
            torch_xla.sync(wait=True)
            if n in (steps // 4, steps - 1):
                registry_sizes.append(len(globals().get("__warningregistry__", {})))
    assert len(caught) == 1, f"the same unusable donation was reported {len(caught)} times"
    assert registry_sizes[0] == registry_sizes[1]
    _report(request, f"unused every step: {steps} steps, {len(caught)} warning shown")


def test_torch_xla_counters_are_pushed_when_read_not_every_step(dev, monkeypatch):
    """torch_xla 2.9's ``_xla_increment_counter`` allocates a new
    ``torch::lazy::Counter`` per call and never frees it (about 200 bytes a
    call).  Pushing the plugin's counters after every step made the RSS of a
    10,000-step loop grow by ~0.4 MiB per 1000 steps, without bound: the
    counters must be pushed when someone reads them, not per step."""
    calls = []
    real = torch_xla._XLAC._xla_increment_counter
    monkeypatch.setattr(torch_xla._XLAC, "_xla_increment_counter",
                        lambda name, value: (calls.append(name), real(name, value)))
    before = {name: met.counter_value(name) or 0 for name in report.COUNTERS}  # reading pushes
    calls.clear()
    loop = Loop(dev)
    steps = 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        for _ in range(steps):
            loop.step()
        tdx.settle()
    assert calls == [], f"{len(calls)} counter pushes during {steps} steps"
    # Read: up to date at once, one push per counter that changed.
    assert met.counter_value("DonatedBuffersReused") - before["DonatedBuffersReused"] == steps
    assert met.counter_value("DonatedBuffersUnused") - before["DonatedBuffersUnused"] == steps // 10
    assert "Counter: DonatedBuffersReused" in met.metrics_report()
    assert 0 < len(calls) <= len(report.COUNTERS)
