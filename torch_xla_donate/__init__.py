"""torch_xla_donate: explicit buffer donation for PyTorch/XLA.

    import torch_xla_donate as tdx
    tdx.donate_buffer(params)       # or torch_xla._XLAC.donate_buffer(params)
    params = params - lr * grads
    xm.mark_step()                  # the new params reuse the old buffer

This module is the public face: it only re-exports (``__all__``).  The
implementation lives in private subpackages by role, each importing only
those before it (test/base/test_layering.py checks):

* ``_base``: the native library, torch_xla's ``_XLAC``, config, errors;
* ``_outcomes``: what becomes of donations (poison, ownership, verdicts);
* ``_marking``: ``donate_buffer``, ``donate``, ``donating``;
* ``_hooks``: where torch_xla's executions commit the marks.

Importing the package switches XLA:CPU's XNNPACK off where it still can
(``_base/xla_cpu.py``), hooks torch_xla's executions, installs
``torch_xla._XLAC.donate_buffer`` and guards ``gradient_accumulation``
against donated model parameters.
"""
__version__ = "0.3.0"

import torch
import torch_xla

from ._base import compat as _compat

_compat.check_versions(torch.__version__, torch_xla.__version__)

from ._base import xla_cpu as _xla_cpu  # noqa: E402

# Before torch_xla's runtime starts: XLA reads XLA_FLAGS once, at its start.
_xla_cpu.protect_at_import(torch_xla._XLAC)
# ... and again until it starts: XLA_FLAGS may be replaced after this import.
_xla_cpu.watch_runtime_start()

from . import errors, report  # noqa: E402
from ._base.config import configure  # noqa: E402
from ._hooks import install as _install  # noqa: E402
from ._marking.donating import donating  # noqa: E402
from ._marking.tensor import donate_buffer, is_deleted, is_donated  # noqa: E402
from ._marking.trees import donate, undonate  # noqa: E402
from ._outcomes.advice import Advice, advise  # noqa: E402
from ._outcomes.verdicts import settle  # noqa: E402
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

_install.install()
torch_xla._XLAC.donate_buffer = donate_buffer
