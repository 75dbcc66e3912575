"""What torch_xla knows about an XLA tensor, asked natively or through
``_XLAC``: two twins with one API (as torch's ``_pytree`` / ``_cxx_pytree``)
and one selector.

Design
------
The problem: each question the plugin asks torch_xla about a tensor (its
id, pending IR, a consumed buffer, the tensor its buffer is filed under) is
one ``torch_xla._XLAC`` call of 1.8k+ instructions, mostly pybind11's
dispatch; and who else holds a buffer cannot be asked at all (Python sees
Python holders only: not a ``.clone()`` read before its first step, not a
copy held only by an autograd graph).

The native twin (csrc/lazy/lazy_reads.h) reads the same answers in place
through torch's lazy-tensor headers, about a hundred instructions, plus the
buffer's ``shared_ptr`` holders.  The only torch_xla fact it relies on is
where XLATensorImpl keeps its XLATensor.

The guard: the native reader learns XLATensorImpl's vtable from a known XLA
tensor (checking its RTTI name) and declines every other type; a self-test
(``reads_check.py``) compares every read with ``_XLAC`` on fresh, traced,
pending, copied and consumed tensors, once, at the first read of an XLA
tensor (importing the package must not start torch_xla's runtime).  Any
mismatch or error turns native reads off for the process, and ``path()``
says why; ``TORCH_XLA_DONATE_NATIVE_READS=0`` turns them off from the
start.

The fallback: with native reads off, or for a tensor the native reader
declines (a CPU tensor, a subclass with no XLATensorImpl, a functional
wrapper awaiting a sync, an XLA view with functionalization off), every
function asks ``_XLAC`` (``_base/xla.py``).  Holder counts have no
``_XLAC`` equivalent: the fallback answers None ("unknown") and the caller
keeps its Python-side checks.

API (``native`` and ``xlac`` give each twin; the module's functions use the
selected one):

* ``tensor_id(t)``: torch_xla's id of the XLA tensor behind ``t``;
* ``is_pending(t)``: needs a computation before it has a value;
* ``pending_flags(ts)``: ``is_pending`` of each tensor, as a list (one
  ``_XLAC`` call for the list; natively, ``_XLAC`` asked only about the
  tensors the read declines);
* ``is_consumed(t)``: its buffer was donated (meaningful without pending IR);
* ``buffer_key(t)``: equal for two tensors exactly when they share one live
  buffer; 0 with no live buffer (pending, consumed, still computing).  The
  twins' keys differ in value (a BackendData address, a device handle):
  compare keys of one twin only;
* ``owner_ids(ts)``: per tensor, the tensor id torch_xla's owner query
  (``_get_tensors_xla_device_data_node``) files its live buffer under
  (``xla.NO_OWNER``: none), None without a live buffer.  The native twin
  answers without the query's side effects (it caches a device_data IR
  value on the tensor, one more buffer holder, and files a buffer without
  one under the tensor itself); ``facts(t).owner_tensor_id`` is the id the
  buffer carries now;
* ``holders(ts)``: per tensor with a handle, ``Holders(expected, actual,
  xla_tensor_refs)``: the buffer holders a clean tensor has (1 + its cached
  device_data IR + an output still dispatching), those it has, and how many
  own its XLATensor (2+: ``_replace_xla_tensor`` made Python tensors share
  it); None when unknown.  One native call for a list: what an ownership
  decision asks per donor;
* ``excess(ts)``: the donors whose holders exceed what the donors sharing
  their buffer account for (the holders' sum of ``expected``, one XLATensor
  owner each), as ``[(index, extra)]``; ``[]`` for none, with no Python
  object per tensor (what a commit asks of every donor); None when any
  tensor's holders are unknown;
* ``facts(t)``: every native fact (``LazyFacts``), None when unknown.

Native code (the ledger's hot path) reads the same facts with
``ReadLazyFacts`` (csrc/lazy/lazy_reads.h) once ``LazyReadsEnabled()``: no
Python at all, 259 instructions for every fact (benchmarks/bench_reads.py).

>>> path() in ("native reads", "not decided yet") or path().startswith("_XLAC (")
True
"""
import os
import threading
import types
from typing import NamedTuple

from torch.utils import _python_dispatch

from . import reads_check, xla
from .native import C

__all__ = ["ENV", "LazyFacts", "Holders", "native", "xlac", "path", "decide_on", "decided",
           "tensor_id", "is_pending", "pending_flags", "is_consumed", "buffer_key", "owner_ids",
           "holders", "excess", "facts"]

ENV = "TORCH_XLA_DONATE_NATIVE_READS"

LazyFacts = NamedTuple("LazyFacts", [(name, object) for name in C.LAZY_FACT_FIELDS])
LazyFacts.__doc__ = "Every fact the native reader gives (csrc/lazy/lazy_reads.h)."


class Holders(NamedTuple):
    expected: int
    actual: int
    xla_tensor_refs: int


# -- The _XLAC twin -------------------------------------------------------------

def _xlac_is_pending(t) -> bool:
    return xla.has_pending_ir([t])[0]


def _xlac_buffer_key(t) -> int:
    if xla.has_pending_ir([t])[0] or xla.buffer_deleted(t):
        return 0
    return xla.buffer_handles([t])[0]


def _xlac_owner_ids(tensors) -> list:
    """One query per tensor: torch_xla's answer for a list lists a shared
    buffer once.  Caches an IR value on each tensor asked (torch_xla's
    query does), one more buffer holder."""
    return [None if xla.has_pending_ir([t])[0] or xla.buffer_deleted(t)
            else xla.buffer_owner_ids([t])[0] for t in tensors]


xlac = types.SimpleNamespace(
    tensor_id=xla.tensor_id,
    is_pending=_xlac_is_pending,
    pending_flags=xla.has_pending_ir,
    is_consumed=xla.buffer_deleted,
    buffer_key=_xlac_buffer_key,
    owner_ids=_xlac_owner_ids,
    holders=lambda tensors: [None for _ in tensors],
    excess=lambda tensors: None,
    facts=lambda t: None,
)


# -- The native twin (asks _XLAC where the read declines) --------------------------

def _native_tensor_id(t) -> int:
    r = C.lazy_tensor_id(t)
    return xla.tensor_id(t) if r is None else r


def _native_is_pending(t) -> bool:
    r = C.lazy_is_pending(t)
    return _xlac_is_pending(t) if r is None else r


def _native_is_consumed(t) -> bool:
    r = C.lazy_is_consumed(t)
    return xla.buffer_deleted(t) if r is None else r


def _native_buffer_key(t) -> int:
    r = C.lazy_buffer_key(t)
    return _xlac_buffer_key(t) if r is None else r


_HAS_VALUE = C.LAZY_FACT_FIELDS.index("has_value")


def _native_owner_ids(tensors) -> list:
    tensors = list(tensors)
    out = []
    for t, owner in zip(tensors, C.lazy_owner_ids(tensors)):
        if owner is None:  # no live buffer, or ask _XLAC
            f = C.lazy_facts(t)
            owner = None if f is not None and not f[_HAS_VALUE] else _xlac_owner_ids([t])[0]
        elif owner == -1:
            owner = xla.NO_OWNER
        out.append(owner)
    return out


def _native_holders(tensors) -> list:
    return [None if h is None else Holders(*h) for h in C.lazy_holders(tensors)]


def _native_facts(t):
    f = C.lazy_facts(t)
    return None if f is None else LazyFacts(*f)


native = types.SimpleNamespace(
    tensor_id=_native_tensor_id,
    is_pending=_native_is_pending,
    # Natively where the read answers, one _check_tensor_need_materialization
    # for the rest (csrc/base/tensor_access.h PendingFlags).
    pending_flags=C.pending_flags,
    is_consumed=_native_is_consumed,
    buffer_key=_native_buffer_key,
    owner_ids=_native_owner_ids,
    holders=_native_holders,
    excess=C.lazy_excess,
    facts=_native_facts,
)


# -- The selector -------------------------------------------------------------------

_lock = threading.Lock()
_why_off = None  # why native reads are off; None: on, or not decided
_decided = False


def path() -> str:
    """The reads in use: ``"native reads"``, ``"_XLAC (<why>)"``, or ``"not
    decided yet"`` before the first read of an XLA tensor."""
    if not _decided:
        return "not decided yet" if _env_allows() else f"_XLAC ({ENV}=0)"
    return "native reads" if _why_off is None else f"_XLAC ({_why_off})"


def _env_allows() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _decide(sample) -> None:
    """Runs the self-test on ``sample`` (an XLA tensor) once per process."""
    global _decided, _why_off
    with _lock:
        if _decided:
            return
        if not _env_allows():
            why = f"{ENV}=0"
        else:
            try:
                why = reads_check.run(sample)
            except Exception as error:  # any surprise: the reads stay off
                why = f"self-test raised {error!r}"
        C.lazy_set_enabled(why is None)
        _why_off, _decided = why, True


def _selected(t):
    """The twin to ask about ``t``, deciding at the first read of a real
    XLA tensor.

    The tricky case: a first read inside a commit (the plugin's lock held,
    a step barrier half done).  The self-test runs graphs of its own, which
    must never happen inside another execution's commit (measured: that
    step's donations all went unused); so a commit asks ``_XLAC`` until a
    read outside one has decided (marking decides: ``decide_on``)."""
    if not _decided:
        if isinstance(t, list):
            return _selected(t[0]) if t else xlac
        if not _can_decide_on(t) or C.lock_holders() > 0:
            return xlac
        _decide(t)
    return native if _why_off is None else xlac


def decide_on(t) -> bool:
    """Decides the reads with ``t`` if not done yet and ``t`` can serve
    (see ``_selected``); True once decided.  Marking calls it before its
    critical section, so the first commit finds the reads decided."""
    if not _decided:
        _selected(t)
    return _decided


def decided() -> bool:
    """True once the first read has decided which twin answers."""
    return _decided


def _can_decide_on(t) -> bool:
    """The self-test needs a plain XLA tensor outside any dispatch mode: a
    first read on a FakeTensor, a functorch wrapper or a wrapper subclass
    (which may say it is on the XLA device), or under a tracing mode, waits
    for a later read rather than turn native reads off for good."""
    if not xla.is_xla_tensor(t) or _python_dispatch._get_current_dispatch_mode() is not None:
        return False
    return C.lazy_learn(t) == ""


def tensor_id(t) -> int:
    return _selected(t).tensor_id(t)


def is_pending(t) -> bool:
    return _selected(t).is_pending(t)


def pending_flags(tensors) -> list:
    tensors = list(tensors)
    return _selected(tensors).pending_flags(tensors)


def is_consumed(t) -> bool:
    return _selected(t).is_consumed(t)


def buffer_key(t) -> int:
    return _selected(t).buffer_key(t)


def owner_ids(tensors) -> list:
    tensors = list(tensors)
    return _selected(tensors).owner_ids(tensors)


def holders(tensors) -> list:
    tensors = list(tensors)
    return _selected(tensors).holders(tensors)


def excess(tensors):
    tensors = list(tensors)
    return _selected(tensors).excess(tensors)


def facts(t):
    return _selected(t).facts(t)
