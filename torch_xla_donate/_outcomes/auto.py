"""Dead step inputs: automatic donation and the advisor's records.

Example (``PJRT_DEVICE=CPU``)::

    tdx.configure(auto=True)                  # or TORCH_XLA_DONATE_AUTO=1
    xs = [x * 0.9 + 1 for x in xs]            # the old list is gone
    torch_xla.sync()                          # its buffers hold the new values

The problem
-----------
A functional update rebinds its names: the old tensors die, their buffers
live on only inside the step's pending IR (each ``xla::device_data`` node
holds one) until the barrier computed the new values.  Donating them saves
the memory of one copy of the state, but no Python object is left to mark.

What is found, natively (csrc/auto/dead_inputs.h)
-------------------------------------------------
At a step barrier's commit: torch_xla's live tensors (its registry, found
by _base/arena.py) are walked once, the pending ones' IR down to its
device-data nodes; a buffer nothing but its node holds (shared_ptr count)
is dead.  Never listed: a buffer any live tensor holds (a Python name, an
autograd graph, an optimizer's state, a view's base: each keeps its
XLATensor), one a live tensor's IR *is* (a copy made since the last
barrier), a cached constant or the RNG seed (torch_xla holds those), a
0-dim buffer, and one torch_xla aliases itself: natively when the pending
tensor is the buffer's own (in place, functionalization off); under
functionalization the link is in torch_xla's own Data, which is not read
(one layout fact only): such an input is armed too, harmlessly (torch_xla
merges its own donors with the flagged ones), and the advisor drops it once
the step consumed it without being armed.  About 0.1-0.3 µs per live tensor plus the walk of the
step's IR (``benchmarks/bench_auto.py``).

Ours until committed
--------------------
Dead inputs are armed only in the commit of a step barrier (which syncs
every live tensor of its device), right after the marked donors, and
disarmed when the graph is built, like them; never in a partial sync
(``_xla_sync_multi``), a step block's prologue or a compiled call.  Their
verdict (``reused``: the buffer is gone) is read at the next barrier of the
device or at ``settle()``; until then this module holds the buffers (an
unused one is freed one step later than without).

Not available (a typed error from ``advise()``, a warning once with
``auto=True``): with donation switched off by a guard (guards.py),
under SPMD, or with more than one device per process.
"""
import re
import threading
import warnings
from typing import NamedTuple

import torch

from .._base import arena, config, guards, switches, xla
from .._base.errors import AutoDonationUnavailableError, AutoDonationUnavailableWarning
from .._base.native import C

__all__ = ["Input", "prepare", "unavailable", "require", "at_commit", "after_graph", "abandon", "settle",
           "totals", "advisors"]

# XLA's element types, as the device-data node's xla_shape names them.
_DTYPES = {
    "pred": torch.bool, "s8": torch.int8, "u8": torch.uint8, "s16": torch.int16,
    "s32": torch.int32, "s64": torch.int64, "f16": torch.float16, "bf16": torch.bfloat16,
    "f32": torch.float32, "f64": torch.float64, "c64": torch.complex64,
    "c128": torch.complex128, "u16": torch.uint16, "u32": torch.uint32, "u64": torch.uint64,
}
_SHAPE = re.compile(r"xla_shape=(\w+)\[([\d,]*)\]")
_LIBRARY = ("/torch/", "/torch_xla/", "/torch_xla_donate/", "<frozen")


class Input(NamedTuple):
    """One dead step input: ``line`` is ``file:line`` of the first read of
    it in the step (torch's lazy IR metadata, recorded only with
    ``XLA_IR_DEBUG=1``), else None."""
    shape: tuple
    dtype: torch.dtype | None
    nbytes: int
    line: str | None


def _describe(node_text: str, frames) -> Input:
    """An ``Input`` from a device-data node's text and its source frames.

    >>> _describe("xla::device_data, xla_shape=f32[4,2]{1,0}, device=CPU:0", [])
    Input(shape=(4, 2), dtype=torch.float32, nbytes=32, line=None)
    """
    m = _SHAPE.search(node_text)
    if m is None:
        return Input((), None, 0, None)
    dtype = _DTYPES.get(m.group(1))
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * (dtype.itemsize if dtype is not None else 0)
    line = next((f"{file}:{n}" for file, _, n in frames
                 if not any(part in file for part in _LIBRARY)), None)
    return Input(shape, dtype, nbytes, line)


_lock = threading.Lock()
_state = {"warned": False, "carriers": {}, "prepared": False}
_totals = {"steps": 0, "armed": 0, "armed_bytes": 0, "reused": 0, "reused_bytes": 0,
           "aliased": 0, "search_seconds": 0.0}
_in_flight = []  # (DeadInputs, [Input]) armed at a commit, verdict not read yet
_advised = []    # (DeadInputs, [Input], [Advice]) found while advising, not yet judged
advisors = []    # the open ``advise()`` blocks (advice.py), innermost last


def prepare(force: bool = False) -> None:
    """Outside any commit (a step barrier calls it before taking the lock,
    ``advise()`` on entry): decides the native reads and the registry walk
    on a sample tensor of the plugin's own (an upload: no graph), once, if
    auto or an advisor is on and nothing decided them yet."""
    wanted = force or advisors or config.auto()
    if _state["prepared"] or not wanted or C.lock_holders() > 0:
        return
    _state["prepared"] = True
    sample = torch.arange(4.0).to(xla.default_device())
    guards.decide(sample)
    switches.refresh()


def unavailable() -> str | None:
    """Why dead inputs cannot be found here, or None."""
    if not guards.decided():
        return "native reads not decided yet"
    if guards.state("reads") != "native reads":
        return f"native reads are off: {guards.state('reads')}"
    if xla.spmd():
        return "SPMD is on (sharded buffers are not looked at)"
    if xla.local_device_count() > 1:
        return "more than one device in this process"
    if not arena.in_use():
        return f"torch_xla's live-tensor registry walk is {guards.state('walk')}"
    return None


def require() -> None:
    """Raises ``AutoDonationUnavailableError`` if dead inputs cannot be
    found in this process (and runs the checks outside any commit)."""
    prepare(force=True)
    why = unavailable()
    if why:
        raise AutoDonationUnavailableError(
            f"torch_xla_donate cannot find dead step inputs here: {why}. Donate explicitly "
            "(tdx.donate_buffer / tdx.donate) instead.")


def at_commit(device):
    """In a step barrier's commit, after the marked donors were armed: finds
    the dead inputs; open advisors record them (nothing is armed while one
    is open); with ``auto`` they are armed.  Returns what ``after_graph``
    takes, or None.  Costs nothing unless auto or an advisor is on."""
    if not advisors and not config.auto():
        return None
    _settle_in_flight()
    if _advised:  # judged only once the execution that read them ran
        xla.wait_device_ops()
        _settle_advised()
    why = unavailable()
    if why == "native reads not decided yet":
        return None  # decided before the next barrier (prepare)
    if why:
        if not advisors and not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"TORCH_XLA_DONATE_AUTO / configure(auto=True) does nothing: {why}",
                          AutoDonationUnavailableWarning, stacklevel=2)
        return None
    found = C.find_dead_inputs(describe=bool(advisors))
    inputs = [_describe(text, frames) for text, frames in found.describe()]
    mask = [bool(i.shape) and i.dtype is not None for i in inputs]  # never a 0-dim buffer
    found.keep(mask)
    inputs = [i for i, keep in zip(inputs, mask) if keep]
    with _lock:
        _totals["search_seconds"] += found.seconds
        _totals["aliased"] += found.aliased
    if advisors:
        # Judged after the execution: an input the step consumed without
        # being armed was one torch_xla aliases itself (an in-place update
        # under functionalization), nothing to advise.
        with _lock:
            _advised.append((found, inputs, list(advisors)))
        return None
    if not inputs:
        return None
    xla.set_unheld_flags(device, found.point, len(inputs), True)
    return found, inputs, device


def after_graph(token) -> None:
    """Once the execution's graph is built: disarm, and keep the buffers
    until their verdict."""
    if token is None:
        return
    found, inputs, device = token
    xla.set_unheld_flags(device, found.point, len(inputs), False)
    with _lock:
        _totals["steps"] += 1
        _totals["armed"] += len(inputs)
        _totals["armed_bytes"] += sum(i.nbytes for i in inputs)
        _in_flight.append((found, inputs))


def abandon(token) -> None:
    """The execution failed: disarm, release, count nothing."""
    if token is not None:
        found, inputs, device = token
        xla.set_unheld_flags(device, found.point, len(inputs), False)
        found.release()


def _settle_in_flight() -> None:
    with _lock:
        entries = _in_flight[:]
        del _in_flight[:]
    for found, inputs in entries:
        for consumed, i in zip(found.consumed(), inputs):
            if consumed:
                _totals["reused"] += 1
                _totals["reused_bytes"] += i.nbytes
        found.release()


def _settle_advised() -> None:
    with _lock:
        entries = _advised[:]
        del _advised[:]
    for found, inputs, open_advice in entries:
        kept = [i for consumed, i in zip(found.consumed(), inputs) if not consumed]
        with _lock:
            _totals["aliased"] += len(inputs) - len(kept)
        for advice in open_advice:
            advice._record(kept)
        found.release()


def settle() -> None:
    """Waits for the device and reads the verdicts of the armed dead inputs
    and the advisors' findings (``torch_xla_donate.settle()``)."""
    if _in_flight or _advised:
        xla.wait_device_ops()
        _settle_in_flight()
        _settle_advised()


def braces_safe(error) -> str:
    return str(error).replace("{", "(").replace("}", ")")


def totals() -> dict:
    """steps, armed (count, bytes), reused (count, bytes), in flight,
    aliased (dead inputs torch_xla reuses itself), search seconds."""
    with _lock:
        out = dict(_totals)
        out["in_flight"] = sum(len(i) for _, i in _in_flight)
    return out


def describe_totals(_size) -> str:
    """The summary's line (sizes written by ``_size``), '' when nothing was
    armed."""
    t = totals()
    if not t["armed"] and not t["in_flight"]:
        return ""
    text = (f"{t['armed']} dead input(s) ({_size(t['armed_bytes'])}) in {t['steps']} step(s), "
            f"reused {t['reused']} ({_size(t['reused_bytes'])})")
    return text + (f", in flight {t['in_flight']}" if t["in_flight"] else "")
