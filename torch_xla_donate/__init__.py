"""torch_xla_donate: buffer donation for PyTorch/XLA.

    import torch_xla_donate as tdx
    tdx.donate_buffer(params)       # or torch_xla._XLAC.donate_buffer(params)
    params = params - lr * grads
    xm.mark_step()                  # the new params reuse the old buffer

This module is the public face: it only re-exports (``__all__``).  How it
works, and where each rule lives: docs/design.md.  Importing the package
switches XLA:CPU's XNNPACK off where it still can (_xla_cpu.py), hooks
torch_xla's executions (_hooks.py) and installs
``torch_xla._XLAC.donate_buffer``.
"""
__version__ = "0.4.0"

import torch_xla

from . import (
    _native,  # noqa: F401  (first: the release and build checks)
    _xla_cpu,
)

# Before torch_xla's runtime starts: XLA reads XLA_FLAGS once, at its start;
# and again until it starts: XLA_FLAGS may be replaced after this import.
_xla_cpu.protect_at_import(torch_xla._XLAC)
_xla_cpu.watch_runtime_start()

from . import _hooks, errors, report  # noqa: E402
from ._auto import Advice, advise  # noqa: E402
from ._config import configure  # noqa: E402
from ._donating import donating  # noqa: E402
from ._marking import donate_buffer, is_deleted, is_donated  # noqa: E402
from ._trees import donate, undonate  # noqa: E402
from ._verdicts import settle  # noqa: E402
from .errors import (  # noqa: E402
    AutoDonationUnavailableError,
    AutoDonationUnavailableWarning,
    DonatedBufferError,
    DonationDisabledWarning,
    DroppedDonationWarning,
    ParameterDonationError,
    StaleReadWarning,
    UnusedDonationError,
    UnusedDonationWarning,
)
from .report import last_step_report, metrics_report, summary  # noqa: E402

__all__ = [
    "__version__",
    "donate_buffer",
    "undonate",
    "is_donated",
    "is_deleted",
    "donate",
    "donating",
    "configure",
    "advise",
    "Advice",
    "settle",
    "last_step_report",
    "summary",
    "metrics_report",
    "errors",
    "report",
    "DonatedBufferError",
    "UnusedDonationWarning",
    "UnusedDonationError",
    "DroppedDonationWarning",
    "DonationDisabledWarning",
    "StaleReadWarning",
    "ParameterDonationError",
    "AutoDonationUnavailableError",
    "AutoDonationUnavailableWarning",
]

_hooks.install()
torch_xla._XLAC.donate_buffer = donate_buffer
