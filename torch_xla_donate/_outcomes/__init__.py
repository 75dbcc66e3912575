"""What becomes of donations: poisoned, judged, reported.

* ``poison``: a consumed tensor refuses every use at the use site;
* ``ownership``: who else holds a marked buffer, and what that means for
  its donation (with ``holders``: finding them, ``autograd_holds``: what
  autograd holds and the wait for its worker thread, ``companions``: those
  taken down with a donation); ``sharing``: buffers torch_xla shares
  between distinct tensors;
* ``verdicts``: reused, unused, failed, lost; ``failures``: failed steps;
  ``devices``: several devices in one process;
* ``report``: per-step reports, summaries, counters (``step_report``: the
  report and summary dataclasses).

The one link against the import order: a use of a poisoned tensor whose
verdict is still open must settle it first, and settling (``verdicts``)
lifts the poison (``poison``).  ``poison`` therefore takes the settling
function as a callable, handed to it here, once.
"""
from . import poison, verdicts

poison.set_settler(verdicts.settle_one)
