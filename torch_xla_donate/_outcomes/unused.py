"""Telling the user about donations no output could take: once per place and
shape, with what to do about them.

Example (a model whose causal mask the step only reads)::

    model.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))
    for batch in loader:
        tdx.donate(model)      # parameters and buffers: the mask too
        loss(model(batch)).backward(); opt.step()
        torch_xla.sync()       # step 1: UnusedDonationWarning naming
                               # module.mask; steps 2, 3, ...: silent

The problem
-----------
A donation that no output can take at one step cannot at the next either: a
loop repeats it at every step.  Python's "once per location" filter does not
hold the repeats back reliably: it forgets what it showed whenever the
warning filters change (any ``warnings.catch_warnings()``, ``filterwarnings``
or ``simplefilter`` in the process, a module imported in the middle of a
step), and some setups show every warning (``-W always``, a notebook).

Once per place and shape
------------------------
So the plugin remembers what it said, as JAX warns once per compilation: a
warning names only donations whose key (the file and line that marked them,
dtype and shape) it has not named before.  A different line, or a new shape
at the same line, warns again.  The ledger still counts every unused
donation (``summary()``, ``last_step_report()``, ``metrics_report()``).

Strict mode (``UnusedDonationError``) raises every time: an error is not a
notice.  The memory holds the ``MEMORY`` keys seen last (one pushed out may
warn once more; 0 warns every time); ``forget()`` empties it (tests).

What to do
----------
The message names the fix.  A tensor that was a buffer of a module passed to
``donate`` (``module.mask``) is named with its path: leave buffers out, e.g.
``tdx.donate(list(model.parameters()))``.  Otherwise: donate only tensors an
output of the step replaces, not ones it only reads.
"""
import threading
import weakref
from collections import OrderedDict

from .._base import config
from .._base.errors import UnusedDonationError, UnusedDonationWarning
from .._base.messages import warn_records

__all__ = ["warn", "forget", "note_module_buffers", "MEMORY"]

MEMORY = 4096  # keys remembered, the least recently seen goes first; 0: warn every time

_lock = threading.RLock()  # weakref callbacks may run while it is held
_said = OrderedDict()  # (file, line, shape_string) -> None, oldest first

# id(tensor) -> (weak reference to it, its path, e.g. "module.mask"): the
# buffers of modules given to donate() that are still alive.
_buffers = {}

_TEMPLATE = (
    "Some donated buffers were not usable{at_step}: {items}. No output of the "
    "execution could take them (or they were no input of its graph); they keep "
    "their values and are no longer marked. "
)
_ONCE = " (Said once per line and shape; tdx.summary() counts every one.)"


def warn(entries) -> None:
    """Tells the user about the unused ``entries`` ((tensor, record) pairs):
    in strict mode raises ``UnusedDonationError`` for all of them; else warns
    about those whose place and shape it has not named before."""
    entries = list(entries)
    if config.strict():
        _say(UnusedDonationError, entries, once="")
        return
    new = _first_time(entries)
    if new:
        _say(UnusedDonationWarning, new, once=_ONCE)


def forget() -> None:
    """Forgets which places and shapes were warned about: the next unused
    donation of each warns again."""
    with _lock:
        _said.clear()


def note_module_buffers(named) -> None:
    """Remembers that the tensors of ``named`` ((path, tensor) pairs) are
    buffers of a module given to ``donate``, for as long as they live."""
    with _lock:
        for path, tensor in named:
            key = id(tensor)
            known = _buffers.get(key)
            if known is not None and known[0]() is tensor:
                continue
            _buffers[key] = (weakref.ref(tensor, _dropper(key)), path)


def _dropper(key):
    def drop(ref):
        with _lock:
            known = _buffers.get(key)
            if known is not None and known[0] is ref:
                del _buffers[key]
    return drop


def _buffer_path(tensor):
    known = _buffers.get(id(tensor))
    return known[1] if known is not None and known[0]() is tensor else None


def _first_time(entries) -> list:
    """The entries whose (place, shape) was not named before this call (all
    of them: "2 x f32[4]" counts both); remembers their keys."""
    with _lock:
        keys = [(r.file, r.line, r.shape_string) for _, r in entries]
        new = [e for e, key in zip(entries, keys) if key not in _said]
        for key in keys:
            _said[key] = None
            _said.move_to_end(key)
        while len(_said) > MEMORY:
            _said.popitem(last=False)
    return new


def _say(category, entries, once) -> None:
    with _lock:
        paths = [p for p in (_buffer_path(t) for t, _ in entries) if p is not None]
    template = _TEMPLATE + _escape(_fix(paths, len(entries))) + once
    warn_records(category, template, [record for _, record in entries])


def _fix(paths, count) -> str:
    """What to do, naming the module buffers among the unused donations.

    >>> print(_fix(["module.mask"], 1)[:60])
    module.mask is a buffer of a module passed to donate() (e.g.
    >>> _fix([], 2).startswith("Do not donate tensors")
    True
    """
    if not paths:
        return ("Do not donate tensors that no output can take: donate only what "
                "the step replaces with a result of the same size.")
    named = ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else "")
    verb = "is a buffer" if len(paths) == 1 else "are buffers"
    rest = "" if len(paths) == count else " The others: donate only what the step replaces."
    return (f"{named} {verb} of a module passed to donate() (e.g. a mask from "
            "register_buffer, which steps read but do not replace): leave the buffers "
            f"out, e.g. tdx.donate(list(model.parameters())).{rest}")


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
