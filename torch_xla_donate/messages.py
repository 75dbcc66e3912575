"""How the plugin words what happened to donations: one warning (or error)
naming each shape once, with its count and where it was marked.

>>> R = type("R", (), {})
>>> r = R(); r.shape_string, r.where = "f32[3]", "t.py:1"
>>> _describe([r, r])
'2 x f32[3] (donated at t.py:1)'
"""
import warnings
from collections import Counter

from .sites import user_stacklevel

__all__ = ["warn_records"]


def warn_records(category, template, records) -> None:
    """Warns (or raises, for an exception category) naming ``records``: each
    shape once with its count and the places that marked it.

    No step number in a warning: a loop that repeats the same unusable
    donation must repeat the same text, which Python's default filter then
    shows once.  A text per step would be shown, and remembered in the
    caller's ``__warningregistry__``, at every step, without bound.
    """
    items = _describe(records)
    if issubclass(category, Exception) and not issubclass(category, Warning):
        raise category(template.format(at_step=f" at step {records[0].step}", items=items))
    warnings.warn(template.format(at_step="", items=items), category, stacklevel=user_stacklevel())


def _describe(records) -> str:
    """``16 x f32[1024,1024] (donated at train.py:12)``, shapes in order of
    first appearance, at most 8 distinct shapes.

    >>> R = type("R", (), {})
    >>> rs = [R(), R(), R()]
    >>> for r, s in zip(rs, ["f32[3]", "f32[3]", "s64[2]"]):
    ...     r.shape_string, r.where = s, "t.py:1"
    >>> _describe(rs)
    '2 x f32[3] (donated at t.py:1), s64[2] (donated at t.py:1)'
    """
    groups = {}
    for r in records:
        counts = groups.setdefault(r.shape_string, Counter())
        counts[r.where] += 1
    parts = []
    for shape, places in list(groups.items())[:8]:
        n = sum(places.values())
        where = ", ".join(list(places)[:3]) + (" ..." if len(places) > 3 else "")
        parts.append(f"{f'{n} x ' if n > 1 else ''}{shape} (donated at {where})")
    more = len(groups) - 8
    return ", ".join(parts) + (f", and {more} more shape(s)" if more > 0 else "")
