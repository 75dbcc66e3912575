"""torch_xla_donate: explicit buffer donation for PyTorch/XLA.

    import torch_xla_donate as tdx
    tdx.donate_buffer(params)       # or torch_xla._XLAC.donate_buffer(params)
    params = params - lr * grads
    xm.mark_step()                  # the new params reuse the old buffer

Importing the package hooks torch_xla's step barrier, installs
``torch_xla._XLAC.donate_buffer`` and guards ``gradient_accumulation``
against donated model parameters (see ``integrations``).
"""
__version__ = "0.2.0"

import torch
import torch_xla

from . import _compat

_compat.check_versions(torch.__version__, torch_xla.__version__)

from . import xla_cpu  # noqa: E402

# Before torch_xla's runtime starts: XLA reads XLA_FLAGS once, at its start.
xla_cpu.protect_at_import(torch_xla._XLAC)

from . import _C  # noqa: E402

_compat.check_build(_C.BUILT_FOR_TORCH, torch.__version__)

from . import integrations, step_hook  # noqa: E402
from .api import donate_buffer, is_deleted, is_donated, undonate
from .config import configure
from .donating import donating
from .pytree import donate
from .errors import (
    DonatedBufferError,
    DonationDisabledWarning,
    DroppedDonationWarning,
    StaleReadWarning,
    UnusedDonationError,
    UnusedDonationWarning,
)
from .integrations import ParameterDonationError
from . import report
from .report import last_step_report, metrics_report, summary
from .verdicts import settle_in_flight as settle

__all__ = [
    "__version__",
    "donate_buffer",
    "undonate",
    "is_donated",
    "is_deleted",
    "donate",
    "donating",
    "configure",
    "DonatedBufferError",
    "UnusedDonationWarning",
    "UnusedDonationError",
    "DroppedDonationWarning",
    "DonationDisabledWarning",
    "StaleReadWarning",
    "ParameterDonationError",
    "settle",
    "last_step_report",
    "summary",
    "metrics_report",
]

step_hook.install()
integrations.install()
torch_xla._XLAC.donate_buffer = donate_buffer
