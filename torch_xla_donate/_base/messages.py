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
    caller's ``__warningregistry__``, at every step, without bound.  (That
    filter forgets whenever the filters change: the unused warning does not
    rely on it, see _outcomes/unused.py.)
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


class Notices:
    """Warnings held back until a commit is whole.

    The tricky case: a filter that turns warnings into errors
    (``-W error``, ``warnings.simplefilter("error")``).  A warning given in
    the middle of a commit would then raise there: before the real barrier
    it would skip the user's step, and in the middle of a loop over entries
    it would leave some of them unsettled.  So a commit collects its
    warnings here and ``deliver``s them once the step ran and every entry
    has its verdict; an error a filter makes of one is raised then, with the
    step's results intact.

    >>> notices = Notices()
    >>> R = type("R", (), {"shape_string": "f32[2]", "where": "t.py:1", "step": 3})
    >>> notices.add(UserWarning, "held back{at_step}: {items}", [R()])
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     notices.deliver()
    >>> str(caught[0].message)
    'held back: f32[2] (donated at t.py:1)'
    """

    __slots__ = ("_items", "_error")

    def __init__(self):
        self._items = []
        self._error = None

    def __bool__(self):
        return bool(self._items) or self._error is not None

    def add(self, category, template, records) -> None:
        self._items.append((category, template, list(records)))

    def fail(self, error: Exception) -> None:
        """An error to raise once the commit is whole (the first one wins)."""
        self._error = self._error or error

    def deliver(self, quietly: bool = False) -> None:
        """Gives every warning held back, then raises the error held back or
        the first error a warning filter made of a warning (``quietly``:
        raises nothing, for when another error is already on its way)."""
        items, self._items = self._items, []
        first, self._error = self._error, None
        for category, template, records in items:
            try:
                warn_records(category, template, records)
            except Exception as error:  # a filter made an error of it
                first = first or error
        if first is not None and not quietly:
            raise first
