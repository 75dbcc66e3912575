"""The one owner of the native library ``torch_xla_donate._C``.

Every other module reaches the extension through this one, as JAX's
``jax/_src/lib`` owns jaxlib: a rebuild or a renamed binding breaks here
first, and the import checks that the extension matches the installed torch.

What the native code does: the ledger (marks, records, per-step stats and
their Python types ``Record``, ``Entry``, ``Verdict``, ``Via``), marking's
fast path, a commit's batch helpers, poisoning, and the trampolines that
stand in for torch_xla's functions (csrc/, whose folders mirror this
package's).  What it calls back into Python, bound at import in one
``C.bind(...)`` call by the package's install step (``_hooks/install.py``,
the one writer: it may import every layer), from each owner's
``NATIVE_HOOKS``:

* torch_xla's functions and torch's, from ``xla`` (the owner of every
  ``_XLAC`` call);
* the poisoned twin classes, from ``_outcomes.poison``;
* ``donate_buffer``'s Python half (the precise checks when the native fast
  path declines), from ``_marking.tensor``.

>>> Verdict.REUSED.name, Via.DONATE_BUFFER.value
('REUSED', 0)
"""
import atexit

import torch
import torch_xla  # noqa: F401  (its exit handler first: see below)

from .. import _C as C
from . import compat

__all__ = ["C", "Verdict", "Via"]

compat.check_build(C.BUILT_FOR_TORCH, torch.__version__)

# The consumed buffers the native reaper frees off the loop's thread
# (csrc/lazy/reaper.h): all freed before the interpreter and torch_xla's
# runtime go, and every later one at once.  Registered after torch_xla's
# own exit handler (``_prepare_to_exit``, at its import), so run before it.
atexit.register(C.reaper_drain, True)

Verdict = C.Verdict
Via = C.Via
