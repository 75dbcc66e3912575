"""What donation did: a report per step, a summary, a log line per step and
torch_xla counters, all from the native ledger.

* ``last_step_report()`` and ``summary()`` return small frozen dataclasses
  whose ``str()`` reads well; a step whose verdicts are still in flight
  (after ``sync(wait=False)``) says so, never as if its donations were kept;
* ``TORCH_XLA_DONATE_LOG=1`` prints one line per step to stderr once all of
  its verdicts are in;
* torch_xla's own metrics show the counters in ``COUNTERS``
  (``DonatedBuffersReused``, ...), pushed when someone reads them.

The words: *reused* (the tensor is poisoned, or freed if the user dropped
it), *unused* (value kept, warned), *updated in place* (an output, no
donor), *dropped* (a holder appeared since marking), *failed* (the step
failed or donation was switched off; value kept), *lost* (the step failed
and torch_xla lost the buffer), *in flight*, and *skipped (on CPU)*, the
optimizer counters ``donate(optimizer)`` left out.

>>> import torch_xla_donate as tdx
>>> tdx.last_step_report() is None or isinstance(tdx.last_step_report(), StepReport)
True
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
    """What one step's donations became (``step=None``: totals of all steps)."""

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

    @property
    def poisoned(self) -> int:
        """Tensors that now refuse every use: exactly the reused ones (those
        the user had dropped before the step are freed instead: nobody can
        use them).  An in-flight donation is poisoned provisionally until it
        is judged."""
        return self.reused

    @property
    def settled(self) -> bool:
        """True once every donation of the step has its verdict."""
        return self.in_flight == 0

    @classmethod
    def _from_stats(cls, stats: dict, step=...) -> "StepReport":
        donated = stats["donated"]
        judged = (stats["reused"] + stats["unused"] + stats["updated_in_place"]
                  + stats["dropped"] + stats["failed"] + stats["lost"])
        return cls(
            step=stats["step"] if step is ... else step,
            donated=donated,
            donated_bytes=stats["donated_bytes"],
            reused=stats["reused"],
            reused_bytes=stats["reused_bytes"],
            unused=stats["unused"],
            unused_bytes=stats["unused_bytes"],
            unused_shapes=tuple(stats["unused_shapes"]),
            updated_in_place=stats["updated_in_place"],
            updated_in_place_bytes=stats["updated_in_place_bytes"],
            dropped=stats["dropped"],
            dropped_bytes=stats["dropped_bytes"],
            failed=stats["failed"],
            failed_bytes=stats["failed_bytes"],
            # The ledger counts open verdicts per step; for totals, every
            # donation without a verdict yet.
            in_flight=stats["in_flight"] if step is ... else donated - judged,
            lost=stats["lost"],
            lost_bytes=stats["lost_bytes"],
        )

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
    """Totals over every step since import (or ``C.reset()``), and the
    reports of the last ``C.HISTORY_STEPS`` steps that donated."""

    steps: int
    totals: StepReport
    history: tuple[StepReport, ...]
    skipped_on_cpu: int = 0  # optimizer counters on the CPU donate() left out
    # The CPU backend's XNNPACK guard (_xla_cpu.py), in words.
    cpu_guard: str = ""
    # The guards (_guards.py): each says how it passed, or "off (<why>)".
    reads: str = ""
    live_tensors: str = ""
    poisoning: str = ""
    # Automatic donation of dead step inputs (_auto.py), in words; "" if none.
    auto: str = ""

    @property
    def unused_shapes(self) -> Counter:
        """How often each shape went unused within the history window."""
        return Counter(s for r in self.history for s in r.unused_shapes)

    def __str__(self) -> str:
        t = self.totals
        rows = [
            ("reused (poisoned)", t.reused, t.reused_bytes),
            ("unused", t.unused, t.unused_bytes),
            ("updated in place", t.updated_in_place, t.updated_in_place_bytes),
            ("dropped", t.dropped, t.dropped_bytes),
            ("failed", t.failed, t.failed_bytes),
            ("lost", t.lost, t.lost_bytes),
        ]
        if t.in_flight:
            rows.append(("in flight", t.in_flight, None))
        lines = [
            f"torch_xla_donate: {self.steps} step(s) donated {t.donated} buffer(s) "
            f"({size(t.donated_bytes)})"
        ]
        lines += [
            f"  {name:<18} {count:>8}" + (f"  {size(nbytes)}" if nbytes is not None else "")
            for name, count, nbytes in rows
        ]
        if self.skipped_on_cpu:
            lines.append(f"  {'skipped (on CPU)':<18} {self.skipped_on_cpu:>8}  not donated: "
                         "optimizer counters torch.optim keeps on the CPU (state['step'])")
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

# torch_xla counter name -> ledger totals field.  One prefix, so that they
# sort together in torch_xla's reports.
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
    """The report of the newest step that donated, or of ``step``.

    Args:
      step: a step number (``StepReport.step``); None: the newest.

    Returns:
      The step's ``StepReport``; None before any step donated, or when
      ``step`` donated nothing or is older than the history window.  Verdicts
      still in flight are reported as such: call ``torch_xla_donate.settle()``
      first to wait for them.
    """
    stats = C.step_stats(-1 if step is None else step)
    return None if stats is None else StepReport._from_stats(stats)


def summary() -> Summary:
    """Totals across steps, plus the reports of the steps still in history.

    Returns:
      A ``Summary``: ``steps``, ``totals`` (a ``StepReport`` without a step),
      ``history`` (the last ``HISTORY_STEPS`` steps that donated) and
      ``skipped_on_cpu`` (optimizer counters ``donate`` left out).
    """
    totals = C.totals()
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
    """Counts ``count`` optimizer state tensors on the CPU that ``donate``
    left out (torch.optim's ``state["step"]``)."""
    global _skipped_on_cpu
    if count:
        with _lock:
            _skipped_on_cpu += count


def metrics_report() -> str:
    """The plugin's counters in the format of
    ``torch_xla.debug.metrics.short_metrics_report()``.

    Returns:
      One ``Counter: name`` / ``Value: n`` pair per entry of ``COUNTERS``,
      then ``Setting: name`` / ``Value: ...`` pairs: the guards
      (``TensorReads``, ``LiveTensorRegistry``, ``Poisoning``: how each
      passed, or "off (<why>)") and on XLA:CPU ``XlaCpuXnnpackGuard``, the
      XNNPACK guard's state and what it means.
    """
    totals = C.totals()
    text = "".join(f"Counter: {name}\n  Value: {totals[field]}\n" for name, field in COUNTERS.items())
    text += f"Setting: TensorReads\n  Value: {guards.state('reads')}\n"
    text += f"Setting: LiveTensorRegistry\n  Value: {guards.state('walk')}\n"
    text += f"Setting: Poisoning\n  Value: {guards.state('poisoning')}\n"
    if xla_cpu.state() != "none":
        text += f"Setting: XlaCpuXnnpackGuard\n  Value: {xla_cpu.state()} ({xla_cpu.describe()})\n"
    return text


# -- Listening to the step hook ------------------------------------------------
#
# The step hook calls ``_on_settled`` whenever verdicts may have changed
# (after every barrier, and when a use or settle() judges a
# donation); it writes the per-step log.  The ledger's generation number tells
# in one native call whether anything happened at all.  torch_xla's counters
# are pushed only when read (``_push_before_reading``).

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
    """Runs before torch_xla's metric readers (``counter_value``,
    ``metrics_report``, ...): the counters are pushed when someone looks.

    Not after every step: torch_xla 2.9's ``_xla_increment_counter`` allocates
    a new ``torch::lazy::Counter`` on every call and never frees it (about
    200 bytes), so pushing per step grew a long run's memory without bound.
    """
    try:
        with _lock:
            _push_counters()
    except Exception as error:  # a report must never break a metrics read
        warnings.warn(f"torch_xla_donate.report failed: {error!r}", RuntimeWarning, stacklevel=2)


def _push_counters() -> None:
    """Adds what happened since the last push to torch_xla's counters."""
    global _counters_ok
    if not _counters_ok:
        return
    totals = C.totals()
    for name, field in COUNTERS.items():
        value = totals[field]
        delta = value - _pushed.get(name, 0)
        if delta < 0:  # the ledger was reset: count again from there
            delta = value
        if delta:
            if not xla.increment_counter(name, delta):
                _counters_ok = False
                return
        _pushed[name] = value


def _log_settled_steps() -> None:
    """Writes one line per step whose verdicts are all in, once, in step order
    as far as they settle in order."""
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
    """Switches the per-step log on or off (tests; ``TORCH_XLA_DONATE_LOG``
    is the user's switch), starting from the next step."""
    global _log_enabled, _log_stream, _log_from
    with _lock:
        _log_enabled, _log_stream = enabled, stream
        _log_from = C.current_step() + 1
        _logged.clear()


if _on_settled not in verdicts.settled_listeners:
    verdicts.settled_listeners.append(_on_settled)
xla.call_before_metric_reads(_push_before_reading)
