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

Design: the life of one donated tensor
======================================

One tensor ``p``, from ``donate_buffer(p)`` to a read of it after the step
consumed it.  Each stage is one function; its module docstring names the
tricky cases.

Marking
-------
``donate_buffer(p)`` is ``C.donate_buffer`` (csrc/marking/marking.cpp): the
common case checks ``p`` and records a mark in the native ledger (verdict
MARKED) in one call.  Anything unusual goes to
``_marking/tensor.donate_buffer_checked`` and ``_marking/marks.mark_checked``
(each refusal with its own error: ``_marking/checks.check_donatable``).
Trees go through ``_marking/walk.walk`` first (``donate``, ``donating``, an
optimizer).  A mark only records: no torch_xla flag is set yet.

Commit: begin, decide, arm
--------------------------
Both executions that take marks, the step barrier (``torch_xla.sync()``)
and a call of a ``torch.compile``d graph, commit them through the same
functions of ``_hooks/commit.py``.  The barrier runs through a native
trampoline (``_hooks/executions.barrier_trampoline``) whose first half is
``_hooks/commit.barrier_before``; a compiled call through
``_hooks/dynamo._CompiledGraph.__call__``:

* begin: ``_hooks/commit.begin`` takes the marks into a new step: the
  barrier device's (``_outcomes/devices.begin_step_on``), or the compiled
  call's arguments';
* decide: ``_hooks/commit.decide`` -> ``split`` keeps ``p`` as a donor unless
  it was updated in place (UPDATED_IN_PLACE) or another holder shares its
  buffer (``_outcomes/ownership.judge_at_commit``,
  ``_outcomes/sharing.screen``: DROPPED, value kept); then the switches
  (switched off since marking: DISABLED, value kept);
* arm: torch_xla's donor flag is set on ``p``'s buffer.  The barrier arms
  at once (``_hooks/commit.arm``); a compiled call only while torch_xla's
  bridge extracts an executable for its donation pattern
  (``_hooks/dynamo._arming``), the one moment the flag counts there.
  Once armed, a barrier lets go of the donors nothing but their entry
  refers to (``_hooks/commit.release_unheld``): the entry keeps only the
  buffer, which the pending IR reads anyway.

Execution
---------
torch_xla builds the graph (its donor set is fixed now: an output of
``p``'s size and dtype may take the buffer) and runs it: the real barrier
dispatches it, a compiled call runs its executable.

Finish or fail, settle and verdicts
-----------------------------------
The barrier trampoline's second half, ``_hooks/commit.barrier_after``, and
a compiled call once it returns end in ``_hooks/commit.finish``: ``p``
poisoned in one native call (``C.disarm_and_poison``), its verdict
IN_FLIGHT (``_outcomes/verdicts.after_commit``); its flag is cleared
there if its entry keeps ``p``, else (one device, native reads: the entry
keeps the buffer) by that verdict or by the next execution's commit,
whichever comes first, if the step did not consume the buffer.  An execution
that raised ends in ``_hooks/commit.fail`` instead: flags cleared, the
failure noted (``_outcomes/failures.note_failure``) and ``p`` kept
(``_outcomes/verdicts.failed``: STEP_FAILED, or LOST if torch_xla lost the
buffer).  Once the step is known to be dispatched (the next barrier,
``settle()``, ``is_deleted`` or a use of ``p``),
``_outcomes/verdicts._settle`` (or, for one tensor about to be used,
``_outcomes/verdicts.settle_one``) decides.

Each verdict is set in one place; in Python, only ``_outcomes/verdicts``
calls ``C.settle``:

* REUSED (the buffer was taken): natively, ``C.settle_entries``
  (csrc/hooks/commit.cpp), for a barrier and a use alike;
* UPDATED_IN_PLACE: natively, at the commit (``C.split_committed``);
* UNUSED (value kept, poison lifted, ``UnusedDonationWarning``),
  STEP_FAILED (the step failed or never ran: value kept, quietly) and
  DISABLED (switched off after marking): ``_outcomes/verdicts._keep``;
* LOST (a failed step took the buffer with it): ``_outcomes/verdicts._lose``;
* DROPPED (decided against at the commit, value kept):
  ``_outcomes/verdicts.drop``, called by ``_outcomes/ownership.drop`` (with
  its warning) and by the commit's fallbacks.

Poisoning
---------
``_outcomes/poison.poison`` (natively, ``C.disarm_and_poison``) gives the
tensor torch_xla computes with a class whose ``__torch_dispatch__``
refuses operators.  A read of ``p`` lands there:
``_outcomes/poison.settled_consumed`` settles the verdict first (through
``_outcomes/verdicts.settle_one``), and if it is REUSED raises
``_outcomes/poison.donated_error``: ``DonatedBufferError`` naming the line
that donated ``p`` and the step that reused its buffer.

Report
------
Every verdict is counted in the native ledger; ``last_step_report()`` and
``summary()`` (``_outcomes/report.py``) read it, and the settled-step
listener (``_outcomes/report._on_settled``) writes the per-step log.
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
