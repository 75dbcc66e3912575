"""What donation did, from the native ledger: a report per step, a summary, torch_xla counters
(``COUNTERS``, pushed when someone reads them) and, with ``TORCH_XLA_DONATE_LOG=1``, a line per
step on stderr once all its verdicts are in.  A verdict still in flight is reported as such.

>>> print(StepReport(7, 1, 1024, 0, 0, 0, 0, (), 0, 0, 0, 0, 0, 0, in_flight=1))  # sync(wait=False)
step 7: donated 1 (1.0 KiB): reused 0 (0 B), unused 0, updated in place 0, dropped 0, failed 0, in flight 1
"""

import dataclasses
import os
import sys
import threading
import warnings
from collections import Counter

from . import _auto as auto
from . import _guards as guards
from . import _verdicts as verdicts
from . import _xla as xla
from . import _xla_cpu as xla_cpu
from ._messages import size
from ._native import C

__all__ = ["StepReport", "Summary", "last_step_report", "summary", "metrics_report", "COUNTERS"]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step's donations became (``step=None``: totals of all steps).  *dropped*: a
    holder appeared since marking; *failed*: the step failed or donation was off (values kept);
    *lost*: the step failed and torch_xla lost the buffer."""

    step: int | None
    donated: int
    donated_bytes: int
    reused: int
    reused_bytes: int
    unused: int
    unused_bytes: int
    unused_shapes: tuple[str, ...]
    updated_in_place: int
    updated_in_place_bytes: int
    dropped: int
    dropped_bytes: int
    failed: int
    failed_bytes: int
    in_flight: int
    lost: int = 0
    lost_bytes: int = 0
    auto_donated: int = 0  # dead inputs automatic donation armed (totals only; in ``donated``)
    auto_reused: int = 0  # of them, taken by an output (in ``reused``)

    @property
    def poisoned(self) -> int:
        """Tensors that now refuse every use: the reused ones the user marked (those the user
        had dropped are freed instead).  An in-flight donation is poisoned provisionally."""
        return self.reused - self.auto_reused

    @property
    def settled(self) -> bool:
        return self.in_flight == 0

    @classmethod
    def _from_stats(cls, stats: dict, step=...) -> "StepReport":
        fields = {f.name: stats.get(f.name, f.default) for f in dataclasses.fields(cls)}  # the ledger's names
        fields["unused_shapes"] = tuple(stats["unused_shapes"])
        if step is not ...:  # totals: every donation without a verdict yet is in flight
            judged = ("reused", "unused", "updated_in_place", "dropped", "failed", "lost")
            fields.update(step=step, in_flight=stats["donated"] - sum(stats[v] for v in judged))
        return cls(**fields)

    def __str__(self) -> str:
        unused = f"unused {self.unused}"
        if self.unused_shapes:
            shapes = Counter(self.unused_shapes)
            listed = ", ".join(s if n == 1 else f"{s} x{n}" for s, n in shapes.most_common(4))
            more = " ..." if len(shapes) > 4 else ""
            unused += f" ({listed}{more})"
        elif self.unused:
            unused += f" ({size(self.unused_bytes)})"
        parts = [
            f"reused {self.reused} ({size(self.reused_bytes)})",
            unused,
            f"updated in place {self.updated_in_place}",
            f"dropped {self.dropped}",
            f"failed {self.failed}",
        ]
        if self.lost:
            parts.append(f"lost {self.lost} ({size(self.lost_bytes)}, values gone)")
        if self.in_flight:
            parts.append(f"in flight {self.in_flight}")
        head = "all steps" if self.step is None else f"step {self.step}"
        return f"{head}: donated {self.donated} ({size(self.donated_bytes)}): " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Totals over every step since import (or ``C.reset()`` and ``auto.reset_totals()``), with
    automatic donation's dead inputs in them, and the reports of the last ``C.HISTORY_STEPS``
    steps that donated explicitly."""

    steps: int
    totals: StepReport
    history: tuple[StepReport, ...]
    skipped_on_cpu: int = 0  # optimizer counters on the CPU donate() left out
    cpu_guard: str = ""  # the XNNPACK guard (_xla_cpu.py), in words
    reads: str = ""  # the guards (_guards.py): how each passed, or "off (<why>)"
    live_tensors: str = ""
    poisoning: str = ""
    auto: str = ""  # automatic donation of dead step inputs (_auto.py), in words; "" if none

    @property
    def unused_shapes(self) -> Counter:
        """How often each shape went unused within the history window."""
        return Counter(s for r in self.history for s in r.unused_shapes)

    def __str__(self) -> str:
        t = self.totals
        rows = [
            ("reused (poisoned)" if not t.auto_donated else "reused", t.reused, t.reused_bytes),
            ("unused", t.unused, t.unused_bytes),
            ("updated in place", t.updated_in_place, t.updated_in_place_bytes),
            ("dropped", t.dropped, t.dropped_bytes),
            ("failed", t.failed, t.failed_bytes),
            ("lost", t.lost, t.lost_bytes),
        ]
        if t.in_flight:
            rows.append(("in flight", t.in_flight, None))
        if t.auto_donated:  # not poisoned: no tensor of the user's held them
            rows.insert(1, ("  of them automatic", t.auto_reused, None))
        lines = [
            f"torch_xla_donate: {self.steps} step(s) donated {t.donated} buffer(s) ({size(t.donated_bytes)})"
        ]
        lines += [
            f"  {name:<18} {count:>8}" + (f"  {size(nbytes)}" if nbytes is not None else "")
            for name, count, nbytes in rows
        ]
        if self.skipped_on_cpu:
            lines.append(
                f"  {'skipped (on CPU)':<18} {self.skipped_on_cpu:>8}  not donated: "
                "optimizer counters torch.optim keeps on the CPU (state['step'])"
            )
        if self.unused_shapes:
            common = ", ".join(f"{s} x{n}" for s, n in self.unused_shapes.most_common(5))
            lines.append(f"  unused shapes (last {len(self.history)} steps): {common}")
        if self.history:
            lines.append(f"  last steps (of {len(self.history)} kept):")
            lines += [f"    {r}" for r in self.history[-5:]]
        if self.cpu_guard:
            lines.append(f"  XLA:CPU: {self.cpu_guard}")
        if self.auto:
            lines.append(f"  automatic: {self.auto}")
        if self.live_tensors:
            lines.append(f"  live-tensor registry walk: {self.live_tensors}")
        if self.reads:
            lines.append(f"  tensor reads: {self.reads}")
        if self.poisoning:
            lines.append(f"  poisoning: {self.poisoning}")
        return "\n".join(lines)


LOG_ENV = "TORCH_XLA_DONATE_LOG"

# torch_xla counter name -> ledger totals field.  One prefix, so that they sort together in
# torch_xla's reports.
COUNTERS = {
    "DonatedBuffers": "donated",
    "DonatedBufferBytes": "donated_bytes",
    "DonatedBuffersReused": "reused",
    "DonatedBufferBytesReused": "reused_bytes",
    "DonatedBuffersUnused": "unused",
    "DonatedBufferBytesUnused": "unused_bytes",
    "DonatedBuffersUpdatedInPlace": "updated_in_place",
    "DonatedBuffersDropped": "dropped",
    "DonatedBuffersFailed": "failed",
    "DonatedBuffersLost": "lost",
}


def last_step_report(step: int | None = None) -> StepReport | None:
    """The report of the newest step that donated, or of ``step``; None if there is none in
    the history.  Verdicts still in flight say so: ``settle()`` first waits for them."""
    stats = C.step_stats(-1 if step is None else step)
    return None if stats is None else StepReport._from_stats(stats)


def _totals() -> dict:
    """The ledger's totals with automatic donation's dead inputs in them: armed counts as
    donated, taken by an output as reused, settled and not taken as unused."""
    totals, a = dict(C.totals()), auto.totals()
    settled, settled_bytes = a["armed"] - a["in_flight"], a["armed_bytes"] - a["in_flight_bytes"]
    for field, value in (("steps", a["steps_alone"]), ("donated", a["armed"]),
                         ("donated_bytes", a["armed_bytes"]), ("reused", a["reused"]),
                         ("reused_bytes", a["reused_bytes"]), ("unused", settled - a["reused"]),
                         ("unused_bytes", settled_bytes - a["reused_bytes"])):
        totals[field] += value
    totals.update(auto_donated=a["armed"], auto_reused=a["reused"])
    return totals


def summary() -> Summary:
    """Totals across steps, the reports of the steps still in history, and the guards' states."""
    totals = _totals()
    return Summary(
        steps=totals["steps"],
        totals=StepReport._from_stats(totals, step=None),
        history=tuple(StepReport._from_stats(s) for s in C.history()),
        skipped_on_cpu=_skipped_on_cpu,
        cpu_guard=xla_cpu.describe(),
        reads=guards.state("reads"),
        live_tensors=guards.state("walk"),
        poisoning=guards.state("poisoning"),
        auto=auto.describe_totals(),
    )


_skipped_on_cpu = 0


def note_skipped_on_cpu(count: int) -> None:
    """Counts optimizer state tensors on the CPU that ``donate`` left out (``state["step"]``)."""
    global _skipped_on_cpu
    if count:
        with _lock:
            _skipped_on_cpu += count


def metrics_report() -> str:
    """The plugin's counters (``COUNTERS``) and guards' states, in the format of
    ``torch_xla.debug.metrics.short_metrics_report()``."""
    totals = _totals()
    text = "".join(f"Counter: {name}\n  Value: {totals[field]}\n" for name, field in COUNTERS.items())
    for name, guard in (("TensorReads", "reads"), ("LiveTensorRegistry", "walk"), ("Poisoning", "poisoning")):
        text += f"Setting: {name}\n  Value: {guards.state(guard)}\n"
    if xla_cpu.state() != "none":
        text += f"Setting: XlaCpuXnnpackGuard\n  Value: {xla_cpu.state()} ({xla_cpu.describe()})\n"
    return text


# -- Listening: ``_on_settled`` runs whenever verdicts may have changed and writes the per-step
# log (the ledger's generation says in one native call whether anything happened);
# torch_xla's counters are pushed only when read (``_push_before_reading``).

_lock = threading.Lock()
_seen_generation = -1
_pushed = {}  # counter -> value already added to torch_xla's counter
_counters_ok = True
_log_enabled = os.environ.get(LOG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
_log_from = 0  # every step before this one is logged (or left the history)
_logged = set()  # steps >= _log_from logged already (settled out of order)
_log_stream = None  # None: sys.stderr at the time of writing


def _on_settled() -> None:
    global _seen_generation
    try:
        with _lock:
            generation = C.generation()
            if generation == _seen_generation:
                return
            _seen_generation = generation
            if _log_enabled:
                _log_settled_steps()
    except Exception as error:  # a report must never break a training step
        warnings.warn(f"torch_xla_donate.report failed: {error!r}", RuntimeWarning, stacklevel=2)


def _push_before_reading() -> None:
    """Adds what happened since the last push to torch_xla's counters.  Not per step: torch_xla
    2.9's ``_xla_increment_counter`` leaks a ``torch::lazy::Counter`` (~200 bytes) per call."""
    global _counters_ok
    try:
        with _lock:
            if not _counters_ok:
                return
            totals = _totals()
            for name, field in COUNTERS.items():
                value = totals[field]
                delta = value - _pushed.get(name, 0)
                if delta < 0:  # the ledger was reset: count again from there
                    delta = value
                if delta and not xla.increment_counter(name, delta):
                    _counters_ok = False
                    return
                _pushed[name] = value
    except Exception as error:  # a report must never break a metrics read
        warnings.warn(f"torch_xla_donate.report failed: {error!r}", RuntimeWarning, stacklevel=2)


def _log_settled_steps() -> None:
    """A line per step once its verdicts are all in, in step order as far as they settle so."""
    global _log_from
    stream = _log_stream or sys.stderr
    first_open = None
    newest = _log_from - 1
    for stats in C.history(_log_from):
        step = stats["step"]
        newest = step
        if step in _logged:
            continue
        if stats["in_flight"]:
            if first_open is None:
                first_open = step
            continue
        stream.write(f"torch_xla_donate: {StepReport._from_stats(stats)}\n")
        _logged.add(step)
    _log_from = first_open if first_open is not None else newest + 1
    _logged.difference_update([s for s in _logged if s < _log_from])
    stream.flush()


def _configure_log(enabled: bool, stream=None) -> None:
    """Switches the per-step log on or off from the next step (tests; users set ``LOG_ENV``)."""
    global _log_enabled, _log_stream, _log_from
    with _lock:
        _log_enabled, _log_stream = enabled, stream
        _log_from = C.current_step() + 1
        _logged.clear()


if _on_settled not in verdicts.settled_listeners:
    verdicts.settled_listeners.append(_on_settled)
xla.call_before_metric_reads(_push_before_reading)
