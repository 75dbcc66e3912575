"""Companions: tensors taken down with a donation (ownership.py decides
which: module parameters and accumulated leaves sharing the donor's
storage).

They are poisoned with the donor after the execution, given back with it if
the donation goes unused or fails, and kept poisoned if it was consumed.
The tricky case: a companion's fate is provisional, as the donor's is,
until the step's verdict (``settle_companions``, called by verdicts.py).
"""
from .._base.native import C
from . import poison

__all__ = ["companions_by_record", "register_companions", "poison_companions",
           "settle_companions"]

companions_by_record = {}  # record id -> (record, [(tensor, note)]) while its verdict is open


def register_companions(record, companions) -> None:
    if companions:
        companions_by_record[record.id] = (record, list(companions))


def poison_companions(records_ids) -> None:
    """After the execution: the companions of these donations share their
    fate (provisionally, as the donors do, until the verdict)."""
    for rid in records_ids:
        entry = companions_by_record.get(rid)
        if entry is not None:
            record, companions = entry
            for t, note in companions:
                poison.poison(t, record, note)


def settle_companions() -> None:
    """Companions of donations judged since: given back with an unused or
    failed donation, kept poisoned with a consumed one, forgotten."""
    if not companions_by_record:
        return
    for rid, (record, companions) in list(companions_by_record.items()):
        if record.verdict in (C.Verdict.MARKED, C.Verdict.IN_FLIGHT):
            continue
        del companions_by_record[rid]
        if record.verdict != C.Verdict.REUSED:
            for t, _ in companions:
                if poison.is_poisoned(t):
                    poison.unpoison(t)
