"""Dead step inputs: buffers only the step's pending IR holds, found natively at a barrier's
commit (docs/design.md, "Where each rule lives").  With ``configure(auto=True)`` they are armed
with the marked donors through a carrier tensor (docs/design.md, "Reading torch_xla"); an open
``advise()`` records them instead, for the user to donate explicitly."""

import collections
import dataclasses
import math
import re
import threading
import warnings
from typing import NamedTuple

import torch

from . import _config as config
from . import _guards as guards
from . import _xla as xla
from ._messages import size, user_stacklevel
from ._native import C
from .errors import AutoDonationUnavailableError, AutoDonationUnavailableWarning

__all__ = ["Input", "prepare", "unavailable", "at_commit", "after_graph", "abandon", "settle", "totals",
           "advisors", "Advice", "AdviceEntry", "advise"]  # fmt: skip

# XLA's element types, as the device-data node's xla_shape names them.
_DTYPES = {
    "pred": torch.bool, "s8": torch.int8, "u8": torch.uint8, "s16": torch.int16,
    "s32": torch.int32, "s64": torch.int64, "f16": torch.float16, "bf16": torch.bfloat16,
    "f32": torch.float32, "f64": torch.float64, "c64": torch.complex64,
    "c128": torch.complex128, "u16": torch.uint16, "u32": torch.uint32, "u64": torch.uint64,
}  # fmt: skip
_SHAPE = re.compile(r"xla_shape=(\w+)\[([\d,]*)\]")
_LIBRARY = ("/torch/", "/torch_xla/", "/torch_xla_donate/", "<frozen")


class Input(NamedTuple):
    """One dead step input; ``line``: ``file:line`` of its first read in the step (known while an
    ``advise()`` is open, which keeps IR frames), None outside one or when only libraries read it."""

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
    nbytes = math.prod(shape) * (dtype.itemsize if dtype is not None else 0)
    line = next((f"{file}:{n}" for file, _, n in frames if not any(part in file for part in _LIBRARY)), None)
    return Input(shape, dtype, nbytes, line)


_lock = threading.Lock()
_state = {"warned": False, "prepared": False, "ir_debug": False}
_totals = {"steps": 0, "steps_alone": 0, "armed": 0, "armed_bytes": 0, "reused": 0, "reused_bytes": 0,
           "aliased": 0, "held_back": 0, "held_back_bytes": 0, "search_seconds": 0.0}  # fmt: skip
_in_flight = []  # (DeadInputs, [Input]) armed at a commit, verdict not read yet
_donor_sets = collections.OrderedDict()  # pending-IR hash -> dead-input indices it first armed
_DONOR_SETS = 4096  # graphs remembered, oldest forgotten first
_advised = []  # (DeadInputs, [Input], [Advice]) found while advising, not yet judged
advisors = []  # the open ``advise()`` blocks, innermost last


def prepare(force: bool = False) -> None:
    """Outside any commit, once, if auto or an advisor is on: decides the guards on a sample
    tensor of the plugin's own (an upload: no graph)."""
    wanted = force or advisors or config.auto()
    if _state["prepared"] or not wanted or C.lock.depth > 0 or _unsupported():
        return  # where auto cannot run, the user's own first mark decides the guards
    _state["prepared"] = True
    guards.decide(torch.arange(4.0).to(xla.default_device()))
    config.refresh()


def _unsupported() -> str | None:
    if xla.spmd():
        return "SPMD is on (sharded buffers are not looked at)"
    if xla.local_device_count() > 1:
        return "more than one device in this process"
    return None


def unavailable() -> str | None:
    """Why dead inputs cannot be found here, or None."""
    why = _unsupported()
    if why:
        return why
    if not guards.decided():
        return "native reads not decided yet"
    if guards.state("reads") != "native reads":
        return f"native reads are off: {guards.state('reads')}"
    if not xla.walk_in_use():
        return f"torch_xla's live-tensor registry walk is {guards.state('walk')}"
    return None


def at_commit(device):
    """In a barrier's commit, after the donors were armed: finds the dead inputs, for the open
    advisors or, with ``auto``, armed.  Returns ``after_graph``'s token or None."""
    if not advisors and not config.auto():
        return None
    _settle_in_flight(final=False)
    if _advised:  # judged only once the execution that read them ran
        settle()
    why = unavailable()
    if why == "native reads not decided yet":
        return None  # decided before the next barrier (prepare)
    if why:
        if not advisors and not _state["warned"]:
            _state["warned"] = True
            message = f"TORCH_XLA_DONATE_AUTO / configure(auto=True) does nothing: {why}"
            warnings.warn(message, AutoDonationUnavailableWarning, stacklevel=user_stacklevel())
        return None
    found = C.find_dead_inputs(describe=bool(advisors))
    if found.blocked:
        # An execution still running holds or writes some: they are dead once it ends, so
        # decide after it (as a donor's excess holders are), not by how far it got.
        found.release()
        xla.wait_device_ops(device)
        _settle_in_flight()
        found = C.find_dead_inputs(describe=bool(advisors))
    inputs = [_describe(text, frames) for text, frames in found.describe()]
    mask = [bool(i.shape) and i.dtype is not None for i in inputs]  # never a 0-dim buffer
    found.keep(mask)
    inputs = [i for i, keep in zip(inputs, mask) if keep]
    with _lock:
        _totals["search_seconds"] += found.seconds
        _totals["aliased"] += found.aliased
    if advisors:
        # Judged after the execution: an input the step consumed without being armed was one
        # torch_xla aliases itself (an in-place update under functionalization).
        with _lock:
            _advised.append((found, inputs, list(advisors)))
        return None
    same = _same_donors(found.graph, found.indices())
    found.keep(same)
    with _lock:
        _totals["held_back"] += same.count(False)
        _totals["held_back_bytes"] += sum(i.nbytes for i, keep in zip(inputs, same) if not keep)
    inputs = [i for i, keep in zip(inputs, same) if keep]
    if not inputs:
        return None
    xla.set_unheld_flags(device, found.point, len(inputs), True)
    return found, inputs, device


def _same_donors(graph: str, indices) -> list:
    """Which dead inputs to arm: a graph's first execution decides, later ones arm none other
    (another donor set is another executable, and auto must not add a compile to a loop whose
    graph is stable).  Those the first one armed but are held now cannot be helped.

    >>> _same_donors("doctest graph", [0, 2]), _same_donors("doctest graph", [0, 1, 2])
    ([True, True], [True, False, True])
    """
    with _lock:
        first = _donor_sets.get(graph)
        if first is None:
            _donor_sets[graph] = frozenset(indices)
            if len(_donor_sets) > _DONOR_SETS:
                _donor_sets.popitem(last=False)
            return [True] * len(indices)
    return [i in first for i in indices]


def after_graph(token, step: int) -> None:
    """Once the execution's graph is built: disarm, and keep the buffers until their verdict.
    A ``step`` the ledger did not count (no explicit donor) counts as one of auto's alone."""
    if token is None:
        return
    found, inputs, device = token
    xla.set_unheld_flags(device, found.point, len(inputs), False)
    alone = C.step_stats(step) is None
    with _lock:
        _totals["steps"] += 1
        _totals["steps_alone"] += alone
        _totals["armed"] += len(inputs)
        _totals["armed_bytes"] += sum(i.nbytes for i in inputs)
        _in_flight.append((found, inputs))


def abandon(token) -> None:
    """The execution failed: disarm, release, count nothing."""
    if token is not None:
        found, inputs, device = token
        xla.set_unheld_flags(device, found.point, len(inputs), False)
        found.release()


def _settle_in_flight(final: bool = True) -> None:
    """Counts and releases armed dead inputs; ``final=False`` (the device may still be running
    their step): only those all taken, the others wait for a verdict after the device."""
    with _lock:
        entries = _in_flight[:]
        del _in_flight[:]
    waiting = []
    for found, inputs in entries:
        consumed = found.consumed()
        if not final and not all(consumed):
            waiting.append((found, inputs))
            continue
        for taken, i in zip(consumed, inputs):
            if taken:
                _totals["reused"] += 1
                _totals["reused_bytes"] += i.nbytes
        found.release()
    with _lock:
        _in_flight[:0] = waiting


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
    """Waits for the device, then judges the armed dead inputs and the advisors' findings."""
    if _in_flight or _advised:
        xla.wait_device_ops()
        _settle_in_flight()
        _settle_advised()


def braces_safe(error) -> str:
    return str(error).replace("{", "(").replace("}", ")")


def totals() -> dict:
    """steps (``steps_alone``: of them without explicit donors), armed (count, bytes), reused
    (count, bytes), in flight (count, bytes), aliased (dead inputs torch_xla reuses itself),
    search seconds."""
    with _lock:
        out = dict(_totals)
        out["in_flight"] = sum(len(i) for _, i in _in_flight)
        out["in_flight_bytes"] = sum(i.nbytes for _, inputs in _in_flight for i in inputs)
    return out


def reset_totals() -> None:
    """Counts from zero again (tests, beside ``C.reset()``); armed buffers stay in flight."""
    with _lock:
        _totals.update((k, type(v)()) for k, v in _totals.items())


def describe_totals() -> str:
    """The summary's line; '' when nothing was armed."""
    t = totals()
    if not t["armed"] and not t["in_flight"]:
        return ""
    text = f"{t['armed']} dead input(s) ({size(t['armed_bytes'])}) in {t['steps']} step(s), "
    text += f"reused {t['reused']} ({size(t['reused_bytes'])})"
    if t["held_back"]:
        text += (f"; {t['held_back']} ({size(t['held_back_bytes'])}) held back: their graph's first "
                 "execution could not donate them, and another donor set would compile it again")
    return text + (f", in flight {t['in_flight']}" if t["in_flight"] else "")


@dataclasses.dataclass(frozen=True)
class AdviceEntry:
    """Dead inputs of one shape, dtype and first-read line: ``count`` of them in one step (the
    most seen), ``bytes`` in all."""

    shape: tuple
    dtype: torch.dtype
    count: int
    bytes: int
    line: str | None

    @property
    def annotation(self) -> str:
        where = f" (read at {self.line})" if self.line else ""
        return f"tdx.donate(<the old value>{where}) before it is rebound, or configure(auto=True)"


class Advice:
    """What ``advise()`` recorded: ``steps`` barriers seen, ``entries`` (largest first) and
    ``bytes`` (the most a single step could have reused).  Each read waits for open findings."""

    def __init__(self):
        self._steps = 0
        self._bytes = 0
        self._most = collections.Counter()  # (shape, dtype, line) -> most in one step
        self._size = {}

    def _record(self, inputs) -> None:
        self._steps += 1
        self._bytes = max(self._bytes, sum(i.nbytes for i in inputs))
        keys = [(i.shape, i.dtype, i.line) for i in inputs]
        self._size.update(zip(keys, (i.nbytes for i in inputs)))
        self._most |= collections.Counter(keys)  # | keeps the larger count of each key

    @property
    def steps(self) -> int:
        settle()
        return self._steps

    @property
    def bytes(self) -> int:
        settle()
        return self._bytes

    @property
    def entries(self) -> list:
        settle()
        out = [
            AdviceEntry(shape, dtype, n, n * self._size[(shape, dtype, line)], line)
            for (shape, dtype, line), n in self._most.items()
        ]
        return sorted(out, key=lambda e: (-e.bytes, str(e.line), e.shape))

    def __str__(self) -> str:
        entries, nbytes = self.entries, size(self.bytes)
        head = f"torch_xla_donate advice: {self.steps} step(s); a step could reuse {nbytes} of dead inputs"
        if not entries:
            return head + ": nothing to donate."
        rows = [("bytes", "count", "shape", "dtype", "first read at", "add")]
        for e in entries:
            dtype = str(e.dtype).removeprefix("torch.")
            rows.append((size(e.bytes), str(e.count), str(list(e.shape)), dtype, e.line or "?", e.annotation))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = [head + ":"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[5] for r in rows]
        if any(e.line is None for e in entries):
            lines.append("  (?: read only inside libraries; the line calling them reads it)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Advice(steps={self.steps}, bytes={self.bytes}, entries={len(self._most)})"


class advise:
    """``with tdx.advise() as advice:`` records the step inputs nothing else holds at every
    barrier in the block, donating none.  Raises ``AutoDonationUnavailableError`` where they
    cannot be found (native reads off, no registry, SPMD, several devices)."""

    def __enter__(self) -> Advice:
        prepare(force=True)  # the checks, outside any commit
        why = unavailable()
        if why:
            raise AutoDonationUnavailableError(
                f"torch_xla_donate cannot find dead step inputs here: {why}. Donate explicitly "
                "(tdx.donate_buffer / tdx.donate) instead."
            )
        self.advice = Advice()
        if not advisors:  # the first read's line: IR nodes keep their frames while advising
            _state["ir_debug"] = xla.set_ir_debug(True)
        advisors.append(self.advice)
        return self.advice

    def __exit__(self, *exc_info):
        settle()  # the last step's findings, judged
        advisors.remove(self.advice)
        if not advisors:
            xla.set_ir_debug(_state["ir_debug"])
