"""The report of a step and the summary of all steps: small frozen
dataclasses whose ``str()`` reads well.  report.py fills them from the
native ledger; this module only holds and prints them.

The tricky case: a step whose verdicts are still in flight (after
``torch_xla.sync(wait=False)``) is reported as such, ``settled`` False,
never as if its donations had been kept.
"""
import dataclasses
from collections import Counter

__all__ = ["StepReport", "Summary"]


def _size(nbytes: int) -> str:
    """Human-readable byte count.

    >>> _size(512 << 20), _size(12), _size(1536)
    ('512.0 MiB', '12 B', '1.5 KiB')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step's donations became (``step=None``: totals of all steps)."""

    step: int | None
    donated: int
    donated_bytes: int
    reused: int
    reused_bytes: int
    unused: int
    unused_bytes: int
    unused_shapes: tuple[str, ...]
    updated_in_place: int
    updated_in_place_bytes: int
    dropped: int
    dropped_bytes: int
    failed: int
    failed_bytes: int
    in_flight: int
    lost: int = 0
    lost_bytes: int = 0

    @property
    def poisoned(self) -> int:
        """Tensors that now refuse every use: exactly the reused ones (those
        the user had dropped before the step are freed instead: nobody can
        use them).  An in-flight donation is poisoned provisionally until it
        is judged."""
        return self.reused

    @property
    def settled(self) -> bool:
        """True once every donation of the step has its verdict."""
        return self.in_flight == 0

    @classmethod
    def _from_stats(cls, stats: dict, step=...) -> "StepReport":
        donated = stats["donated"]
        judged = (stats["reused"] + stats["unused"] + stats["updated_in_place"]
                  + stats["dropped"] + stats["failed"] + stats["lost"])
        return cls(
            step=stats["step"] if step is ... else step,
            donated=donated,
            donated_bytes=stats["donated_bytes"],
            reused=stats["reused"],
            reused_bytes=stats["reused_bytes"],
            unused=stats["unused"],
            unused_bytes=stats["unused_bytes"],
            unused_shapes=tuple(stats["unused_shapes"]),
            updated_in_place=stats["updated_in_place"],
            updated_in_place_bytes=stats["updated_in_place_bytes"],
            dropped=stats["dropped"],
            dropped_bytes=stats["dropped_bytes"],
            failed=stats["failed"],
            failed_bytes=stats["failed_bytes"],
            # The ledger counts open verdicts per step; for totals, every
            # donation without a verdict yet.
            in_flight=stats["in_flight"] if step is ... else donated - judged,
            lost=stats["lost"],
            lost_bytes=stats["lost_bytes"],
        )

    def __str__(self) -> str:
        unused = f"unused {self.unused}"
        if self.unused_shapes:
            shapes = Counter(self.unused_shapes)
            listed = ", ".join(s if n == 1 else f"{s} x{n}" for s, n in shapes.most_common(4))
            more = " ..." if len(shapes) > 4 else ""
            unused += f" ({listed}{more})"
        elif self.unused:
            unused += f" ({_size(self.unused_bytes)})"
        parts = [
            f"reused {self.reused} ({_size(self.reused_bytes)})",
            unused,
            f"updated in place {self.updated_in_place}",
            f"dropped {self.dropped}",
            f"failed {self.failed}",
        ]
        if self.lost:
            parts.append(f"lost {self.lost} ({_size(self.lost_bytes)}, values gone)")
        if self.in_flight:
            parts.append(f"in flight {self.in_flight}")
        head = "all steps" if self.step is None else f"step {self.step}"
        return f"{head}: donated {self.donated} ({_size(self.donated_bytes)}): " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Totals over every step since import (or ``C.reset()``), and the
    reports of the last ``C.HISTORY_STEPS`` steps that donated."""

    steps: int
    totals: StepReport
    history: tuple[StepReport, ...]
    skipped_on_cpu: int = 0  # optimizer counters on the CPU donate() left out
    # The CPU backend's XNNPACK guard (``_base/xla_cpu.py``), in words.
    cpu_guard: str = ""
    # How the plugin asks torch_xla about tensors: "native reads", or
    # "off (<why>)" (_base/reads.py).
    reads: str = ""
    # Whether the walk of torch_xla's live tensors finds copies made in the
    # donating step: "in use", "off (<why>)" or "not decided yet"
    # (_base/arena.py); off, donation is off.
    live_tensors: str = ""
    # How a consumed tensor refuses operators: "native dispatch key" or
    # "Python dispatch key (<why>)" (_outcomes/poison.py).
    poisoning: str = ""
    # Automatic donation of dead step inputs (auto.py), in words; "" if none.
    auto: str = ""

    @property
    def unused_shapes(self) -> Counter:
        """How often each shape went unused within the history window."""
        return Counter(s for r in self.history for s in r.unused_shapes)

    def __str__(self) -> str:
        t = self.totals
        rows = [
            ("reused (poisoned)", t.reused, t.reused_bytes),
            ("unused", t.unused, t.unused_bytes),
            ("updated in place", t.updated_in_place, t.updated_in_place_bytes),
            ("dropped", t.dropped, t.dropped_bytes),
            ("failed", t.failed, t.failed_bytes),
            ("lost", t.lost, t.lost_bytes),
        ]
        if t.in_flight:
            rows.append(("in flight", t.in_flight, None))
        lines = [
            f"torch_xla_donate: {self.steps} step(s) donated {t.donated} buffer(s) "
            f"({_size(t.donated_bytes)})"
        ]
        lines += [
            f"  {name:<18} {count:>8}" + (f"  {_size(nbytes)}" if nbytes is not None else "")
            for name, count, nbytes in rows
        ]
        if self.skipped_on_cpu:
            lines.append(f"  {'skipped (on CPU)':<18} {self.skipped_on_cpu:>8}  not donated: "
                         "optimizer counters torch.optim keeps on the CPU (state['step'])")
        if self.unused_shapes:
            common = ", ".join(f"{s} x{n}" for s, n in self.unused_shapes.most_common(5))
            lines.append(f"  unused shapes (last {len(self.history)} steps): {common}")
        if self.history:
            lines.append(f"  last steps (of {len(self.history)} kept):")
            lines += [f"    {r}" for r in self.history[-5:]]
        if self.cpu_guard:
            lines.append(f"  XLA:CPU: {self.cpu_guard}")
        if self.auto:
            lines.append(f"  automatic: {self.auto}")
        if self.live_tensors:
            lines.append(f"  live-tensor registry walk: {self.live_tensors}")
        if self.reads:
            lines.append(f"  tensor reads: {self.reads}")
        if self.poisoning:
            lines.append(f"  poisoning: {self.poisoning}")
        return "\n".join(lines)
