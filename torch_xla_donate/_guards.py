"""The guards of what the package reads below torch_xla's Python API, decided once per
process at the first mark, on the tensor being marked; one that fails switches donation
off for the process (docs/design.md, "Reading torch_xla")."""
import threading

import torch
from torch.utils import _python_dispatch

from . import _xla as xla
from ._native import C

__all__ = ["decide", "decided", "state", "holds_no_device_data", "CORRUPT"]

# Test hook: a LazyFacts field whose native answer the reads' guard gets wrong (flipped, or + 1).
CORRUPT = None

# What each guard guards (its failure's prefix), in the order they run; its state once passed.
_WHAT = {"reads": "native reads", "walk": "torch_xla's live-tensor registry",
         "poisoning": "poisoning's dispatch key"}
_PASSED = {"reads": "native reads", "walk": "in use", "poisoning": "native dispatch key"}
_GUARDS = tuple(_WHAT)
_lock = threading.Lock()


def decide(sample) -> bool:
    """Runs the guards on ``sample`` once per process if it can serve (a plain XLA tensor outside
    any dispatch mode: a FakeTensor or functorch wrapper waits for a later mark); True once decided."""
    if decided() or not _can_serve(sample):
        return decided()
    with _lock:
        if decided():
            return True
        for name, check in zip(_GUARDS, (_reads, _walk, _poisoning)):
            try:
                why = check(sample)
            except Exception as error:  # any surprise: donation stays off
                why = f"the guard raised {error!r}"
            if why is not None:
                C.lazy_set_enabled(False)
                C.live_set_arena(0)
                C.set_switches(failure=f"{_WHAT[name]}: {why}")
                break
        C.set_switches(decided=True)
    return True


def decided() -> bool:
    return C.switches()["decided"]


def state(name: str, switches=None) -> str:
    """A guard's state for the reports (``switches``: the process's by default):
    what it passed as, ``"off (<why>)"``, ``"not decided yet"`` or ``"not tried"``.

    >>> failed = {"decided": True, "failure": "native reads: tensor_id: native 3, _XLAC 2"}
    >>> state("reads", failed), state("walk", failed)
    ('off (tensor_id: native 3, _XLAC 2)', 'not tried')
    """
    switches = switches or C.switches()
    why = switches["failure"]
    if not switches["decided"]:
        return "not decided yet"
    if why is None:
        return _PASSED[name]
    failed = next(n for n in _GUARDS if why.startswith(_WHAT[n] + ": "))
    if _GUARDS.index(name) > _GUARDS.index(failed):
        return "not tried"
    return f"off ({why[len(_WHAT[name]) + 2:]})" if name == failed else _PASSED[name]


def holds_no_device_data(t) -> bool:
    """An XLA tensor of the type the reads know whose read declines: host data, not uploaded."""
    return xla.is_xla_tensor(t) and C.lazy_learn(t) == "" and C.lazy_facts(t, force=True) is None


def _can_serve(t) -> bool:
    """A plain XLA tensor outside dispatch modes that holds device data or IR (under SPMD an
    upload holds host data until the next sync: the read declines it, as it should)."""
    return (xla.is_xla_tensor(t) and _python_dispatch._get_current_dispatch_mode() is None
            and C.lazy_learn(t) == "" and C.lazy_facts(t, force=True) is not None)


# Each guard returns None when it passes, else why not.
def _reads(t):
    """The native read of ``t`` agrees with ``_XLAC``. An execution still writing ``t`` may fill
    its buffer between the two reads, so a disagreement counts once the device is idle."""
    why = C.lazy_learn(t)
    if why:
        return why
    why = _disagreement(t)
    if why is not None:
        xla.wait_device_ops(t.device)
        why = _disagreement(t)
    if why is None:
        C.lazy_set_enabled(True)
    return why


def _disagreement(t):
    facts = C.lazy_facts(t, force=True)
    if facts is None:
        return "the native read declined the first tensor marked"
    n = dict(zip(C.LAZY_FACT_FIELDS, facts))
    if CORRUPT in n:
        value = n[CORRUPT]
        n[CORRUPT] = (not value) if isinstance(value, bool) else (value or 0) + 1
    checks = [("tensor_id", n["tensor_id"], xla.tensor_id(t)),
              ("pending", n["pending"], xla.has_pending_ir([t])[0])]
    if n["has_handle"]:
        checks.append(("consumed", not n["has_value"], xla.buffer_deleted(t)))
    if n["has_value"]:
        checks.append(("handle", n["handle"], xla.buffer_handles([t])[0]))
    for what, native, expected in checks:
        if native != expected:
            return f"{what}: native {native}, _XLAC {expected}"
    return None


def _walk(t):
    """The walk counts torch_xla's live tensors and finds ``t``."""
    why = xla.find_arena()
    if why:
        return why
    for _ in range(5):  # torch_xla's threads may make or drop tensors meanwhile
        if C.live_count() == xla.live_tensor_count():
            break
        xla.wait_device_ops()  # an execution still running lets go of its inputs
    else:
        return f"the walk counts {C.live_count()} live tensors, torch_xla {xla.live_tensor_count()}"
    tid = C.lazy_tensor_id(t)
    if tid not in {row[0] for row in C.live_tensors()}:
        return f"the walk did not find the first tensor marked (torch_xla tensor {tid})"
    return None


def _poisoning(t):
    """The donated key refuses a probe and lets it go again."""
    return C.donated_key_self_test(torch.zeros(2)) or None
