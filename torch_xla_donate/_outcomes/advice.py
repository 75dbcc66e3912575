"""The advisor: which step inputs donation could have reused.

Example (``PJRT_DEVICE=CPU``)::

    with tdx.advise() as advice:
        for _ in range(2):
            xs = [x * 0.9 + 1 for x in xs]
            torch_xla.sync()
    print(advice)            # a table, largest first, with what to add
    advice.bytes             # what one step could have saved

At each step barrier inside the block the dead inputs (auto.py: the ones
nothing but the step's graph holds) are recorded, never donated; automatic
donation pauses meanwhile.  A tensor anything still holds is never listed,
nor one torch_xla already reuses by itself (an in-place update).

Where: the line of the *first read* of the tensor in the step, from torch's
lazy IR metadata, which torch_xla records only with ``XLA_IR_DEBUG=1`` set
before it starts; the line that created or last rebound the tensor is not
kept anywhere once the tensor is gone.  Without it ``line`` is None.
"""
import collections
import dataclasses

import torch

from . import auto

__all__ = ["Advice", "AdviceEntry", "advise"]


@dataclasses.dataclass(frozen=True)
class AdviceEntry:
    """Dead inputs of one shape, dtype and first-read line: ``count`` of
    them in one step (the most seen), ``bytes`` in all."""
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
    """What ``advise()`` recorded: ``steps`` barriers seen, ``entries``
    (``AdviceEntry``, largest first) and ``bytes`` (the largest total a
    single step could have reused)."""

    def __init__(self):
        self._steps = 0
        self._bytes = 0
        self._most = collections.Counter()  # (shape, dtype, line) -> most in one step
        self._size = {}

    def _record(self, inputs) -> None:
        self._steps += 1
        self._bytes = max(self._bytes, sum(i.nbytes for i in inputs))
        step = collections.Counter()
        for i in inputs:
            key = (i.shape, i.dtype, i.line)
            step[key] += 1
            self._size[key] = i.nbytes
        for key, n in step.items():
            self._most[key] = max(self._most[key], n)

    # A step's findings are judged once its execution ran (auto.settle):
    # each read below waits for the device if one is still open.
    @property
    def steps(self) -> int:
        auto.settle()
        return self._steps

    @property
    def bytes(self) -> int:
        auto.settle()
        return self._bytes

    @property
    def entries(self) -> list:
        auto.settle()
        out = [AdviceEntry(shape, dtype, n, n * self._size[(shape, dtype, line)], line)
               for (shape, dtype, line), n in self._most.items()]
        return sorted(out, key=lambda e: (-e.bytes, str(e.line), e.shape))

    def __str__(self) -> str:
        from .report import _size
        entries = self.entries
        head = (f"torch_xla_donate advice: {self.steps} step(s); a step could reuse "
                f"{_size(self.bytes)} of dead inputs")
        if not entries:
            return head + ": nothing to donate."
        rows = [("bytes", "count", "shape", "dtype", "first read at", "add")]
        rows += [(_size(e.bytes), str(e.count), str(list(e.shape)),
                  str(e.dtype).removeprefix("torch."), e.line or "?", e.annotation)
                 for e in entries]
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = [head + ":"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[5]
                  for r in rows]
        if any(e.line is None for e in entries):
            lines.append("  (lines: set XLA_IR_DEBUG=1 before torch_xla starts)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Advice(steps={self.steps}, bytes={self.bytes}, entries={len(self._most)})"


class advise:
    """``with tdx.advise() as advice:`` records, at every step barrier in
    the block, the step inputs nothing else holds (never donating them).

    Raises:
      AutoDonationUnavailableError: dead inputs cannot be found in this
        process (native reads off, no registry, SPMD, several devices).
    """

    def __enter__(self) -> Advice:
        auto.require()
        self.advice = Advice()
        auto.advisors.append(self.advice)
        return self.advice

    def __exit__(self, *exc_info):
        auto.settle()  # the last step's findings, judged
        auto.advisors.remove(self.advice)
