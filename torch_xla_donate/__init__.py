"""torch_xla_donate: buffer donation for PyTorch/XLA.

    import torch_xla_donate as tdx
    tdx.donate_buffer(params)       # or torch_xla._XLAC.donate_buffer(params)
    params = params - lr * grads
    xm.mark_step()                  # the new params reuse the old buffer

Re-exports only (``__all__``); how it works: docs/design.md.  Importing it switches XLA:CPU's
XNNPACK off where it can, hooks torch_xla's executions and installs ``_XLAC.donate_buffer``.
"""
__version__ = "0.4.0"

import torch_xla

from . import _native, _xla_cpu  # noqa: F401  (_native first: the release and build checks)

# Before torch_xla's runtime starts (XLA reads XLA_FLAGS then), and again until it does.
_xla_cpu.protect_at_import()
_xla_cpu.watch_runtime_start()

from . import _config, _hooks, errors, report  # noqa: E402
from ._auto import Advice, advise  # noqa: E402
from ._config import configure  # noqa: E402

if _config.auto():  # every step with dead inputs armed: no failed compile may corrupt the heap
    _xla_cpu.protect_compile_failures()
from ._donating import donating  # noqa: E402
from ._marking import donate_buffer, is_deleted, is_donated  # noqa: E402
from ._trees import donate, undonate  # noqa: E402
from ._verdicts import settle  # noqa: E402
from .errors import *  # noqa: E402, F403  (every error and warning: errors.__all__)
from .report import last_step_report, metrics_report, summary  # noqa: E402

__all__ = [
    "__version__",
    "donate_buffer", "undonate", "is_donated", "is_deleted", "donate", "donating",
    "configure", "advise", "Advice", "settle",
    "last_step_report", "summary", "metrics_report",
    "errors", "report",
] + errors.__all__

_hooks.install()
torch_xla._XLAC.donate_buffer = donate_buffer
