"""What donation did: a report per step, a summary, a log line per step and
torch_xla counters.

Every number comes from the native ledger, which judges each donation once
its step ran:

* *donated*: committed by the step's barrier;
* *reused*: a step output took the buffer (the tensor is poisoned, unless
  the user had dropped it already: then it is simply freed);
* *unused*: no output could take it (it kept its value; a warning said so);
* *updated in place* after marking: an output itself, not a donor;
* *dropped* at the barrier: a view or alias appeared after marking;
* *failed*: the step failed, or donation was switched off after marking;
  the tensor kept its value;
* *lost*: the step failed and torch_xla lost the donated buffer with it
  (torch_xla 2.7 does when a step fails to compile): the value is gone;
* *in flight*: not judged yet.  After ``torch_xla.sync(wait=False)`` a step's
  verdicts are known only at the next barrier, the first use of a donated
  tensor, ``is_deleted`` or ``torch_xla_donate.settle()``.

Not a donation, but counted so that nothing is left out silently:
*skipped (on CPU)*, the 0-dim CPU tensors of an optimizer's state
(torch.optim's ``state["step"]``) that ``donate(optimizer)`` left out
(``Summary.skipped_on_cpu``, since import).

Ways to look:

* ``last_step_report()`` and ``summary()`` return small dataclasses; ``str()``
  of each reads well.
* ``TORCH_XLA_DONATE_LOG=1`` prints one line per step to stderr as soon as all
  of the step's verdicts are in (for a ``wait=False`` loop: at the next
  barrier)::

      torch_xla_donate: step 12: donated 200 (512.0 MiB): reused 199 (511.9 MiB),
      unused 1 (f32[3]), updated in place 0, dropped 0, failed 0

  (one line; wrapped here)

* torch_xla's own metrics: the plugin adds its counts to torch_xla counters
  named in ``COUNTERS`` (``DonatedBuffers``, ``DonatedBuffersReused``, ...), so
  ``torch_xla.debug.metrics.counter_value("DonatedBuffersReused")`` and
  ``metrics_report()`` show them.  ``metrics_report()`` here prints them, from
  the ledger, in the style of ``short_metrics_report()``.

>>> import torch_xla_donate as tdx
>>> tdx.last_step_report() is None or isinstance(tdx.last_step_report(), tdx.report.StepReport)
True
"""
import os
import sys
import threading
import warnings

from .._base import guards, xla, xla_cpu
from .._base.native import C
from . import auto, verdicts

# What a report is (its dataclasses) lives in step_report.py; here, where
# its numbers come from and where they go.
from .step_report import StepReport, Summary, _size

__all__ = [
    "StepReport",
    "Summary",
    "last_step_report",
    "summary",
    "metrics_report",
    "COUNTERS",
]

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
        auto=auto.describe_totals(_size),
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
      then ``Setting: name`` / ``Value: ...`` pairs: ``TensorReads``, how the
      plugin asks torch_xla about tensors ("native reads" or "_XLAC
      (<why>)"), ``LiveTensorRegistry``, whether copies made in the
      donating step are found by walking torch_xla's live tensors ("in
      use", "off (<why>)": searched in Python), ``Poisoning``, how a
      consumed tensor refuses operators, and on XLA:CPU ``XlaCpuXnnpackGuard``, the XNNPACK guard's
      state and what it means.
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
