"""What donation did: per-step reports, a summary, torch_xla counters.

``last_step_report()`` and ``summary()`` return the dataclasses below;
``TORCH_XLA_DONATE_LOG=1`` prints one line per step; torch_xla's metrics
show the counters in ``COUNTERS``.  See ``_outcomes/report.py``.

>>> import torch_xla_donate as tdx
>>> tdx.last_step_report() is None or isinstance(tdx.last_step_report(), StepReport)
True
"""
from ._outcomes.report import (
    COUNTERS,
    StepReport,
    Summary,
    last_step_report,
    metrics_report,
    summary,
)

__all__ = ["StepReport", "Summary", "last_step_report", "summary", "metrics_report", "COUNTERS"]
