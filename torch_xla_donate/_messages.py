"""Every text a user reads of the plugin's outcomes, and how it is given: at the user's line, one
warning naming each shape with its count and where it was marked, held back until a commit is whole
(docs/design.md, "Where each rule lives")."""

import sys
import warnings
from collections import Counter

from ._native import C

# -- Where: the user's line. Never the plugin, torch_xla (torch_xla.compile calls the function it
# wraps), torch (the dispatcher, dynamo) nor the stdlib wrappers in between.
_INTERNAL = ("torch_xla_donate", "torch_xla", "torch", "contextlib", "functools")


def _outside(frame):
    """The first frame from ``frame`` outwards that is no module of ``_INTERNAL``, and its level."""
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL:
        level, frame = level + 1, frame.f_back
    return level, frame


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's warning point at the user's line."""
    level, frame = _outside(sys._getframe(1))
    return level if frame is not None else 1


def user_site():
    """(file, line) of the innermost frame outside the plugin, torch_xla and torch."""
    _, frame = _outside(sys._getframe(1))
    return ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


# The calls that mark, by ``record.via``.
VIA = {
    C.Via.DONATE_BUFFER: "donate_buffer()",
    C.Via.DONATE: "donate()",
    C.Via.DONATING: "a donating() function",
    C.Via.GRAPH_OP: "torch.ops.xla.dynamo_set_buffer_donor_()",
}


# -- Naming a tensor, a size ---------------------------------------------------------
def size(nbytes: int) -> str:
    """A byte count for people: ``512.0 MiB``, ``12 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def shape_string(t) -> str:
    """``t``'s dtype and shape as XLA prints them (``bf16[2,3]``), as the ledger names them."""
    return C.shape_string(t)


def describe(t) -> str:
    return f"the tensor {shape_string(t)}"


# -- Marking's refusals (csrc/marking.cpp Classify decides them) ---------------------
SCALARS = (
    "torch_xla keeps one device buffer per scalar value moved to the device (torch.tensor(2.5, "
    "device=...), torch.full((), ...), t.to(device)) and hands it to every such tensor and constant: "
    "donating it would delete that value for all of them. A scalar saves no memory; do not donate it."
)


def refusal(t, why) -> str:
    """Why ``t`` cannot be donated (a ``C.Refusal``), and what to do; ``t`` may be a FakeTensor."""
    R = C.Refusal
    if why == R.NOT_TENSOR:
        return f"donate_buffer expects a torch.Tensor, got {type(t).__name__}."
    if why == R.WRAPPER:
        return (
            f"donate_buffer: {type(t).__name__} is a tensor subclass with its own __torch_dispatch__ (a "
            "wrapper made with _make_wrapper_subclass): it has no XLA buffer of its own to donate. Donate "
            "the XLA tensors it wraps instead."
        )
    if why == R.NOT_XLA:
        return (
            f"donate_buffer expects a tensor on an XLA device, got one on '{t.device}'. Move it first: "
            "t = t.to(torch_xla.device())."
        )
    if why == R.VIEW:
        return (
            f"donate_buffer: {describe(t)} is a view (t[...], reshape, transpose, t.as_subclass(...), "
            "...) of another tensor's buffer; only plain device data can be donated. Donate its base "
            "tensor, or materialize a copy first: t = t.clone(); xm.mark_step()."
        )
    if why == R.ZERO_DIM:
        return f"donate_buffer: {describe(t)} is 0-dimensional. {SCALARS}"
    if why == R.COPY:
        return (
            f"donate_buffer: {describe(t)} has no buffer of its own yet: it is a copy or clone made since "
            "the last step (s.clone(), t.copy_(s), s.to(device, copy=True), torch.tensor(s), ...), and "
            "torch_xla backs it with its source's buffer until the next step, so donating it would "
            "destroy the source. Call torch_xla.sync() first, then donate it."
        )
    if why == R.UNDECIDED:
        return (
            f"donate_buffer: torch_xla_donate cannot check {describe(t)} here (inside a dispatch mode, "
            "before any plain XLA tensor was donated). Donate it outside."
        )
    return (
        f"donate_buffer: {describe(t)} has pending computation, so it has no buffer yet. Call "
        "xm.mark_step() (or torch_xla.sync()) first to materialize it, then donate it."
    )


def unpoisonable(cls, error) -> str:
    name = cls.__qualname__
    return (
        f"cannot donate a {name}: after the step torch_xla_donate marks a consumed tensor by giving it "
        f"a twin of its class, and {name} refuses that ({error}). Donate a plain tensor with the same "
        "value instead (torch.Tensor._make_subclass(torch.Tensor, t) shares its buffer), or give "
        f"{name} a layout its subclasses can share (no __slots__)."
    )


# -- Holders: why a donation is refused or dropped ---------------------------------
HELD = "donate_buffer: cannot donate {tensor}: {why}."
GRAD_SLOT = (
    "it is the .grad of {slot}, which keeps holding it: take it out of the slot first (g = p.grad; "
    "p.grad = None), then donate g"
)
SAVED_FOR_BACKWARD = (
    "it is saved for backward by a live autograd graph (e.g. loss = (w * w).sum() saves w until "
    "loss.backward()); donated, that backward would fail on a deleted buffer. Call backward first (it "
    "frees what it saved), or drop the graph (del loss)"
)
ALIAS = (
    "it shares its buffer with a live view or alias (t[0:2], t.detach(), nn.Parameter(t), a "
    "state_dict(), ...), which donating would destroy too: delete it first, or donate a copy "
    "(t.clone(), then a step)"
)
CPP_ALIAS = (
    "it shares its buffer with tensors only C++ code holds: most likely an autograd graph that saved "
    "it for backward (or a view of it); call backward first, or drop the graph"
)
SHARES = (
    "it shares its device buffer with {names}: torch_xla backs copies made by load_state_dict, copy_, "
    "t.to(device, copy=True), torch.tensor(t) or x[...] = t with their source's buffer, and donating "
    "it would destroy that tensor too. Make such copies with .clone(), which torch_xla gives a buffer "
    "of its own"
)
CPP_HOLDERS = (
    "its device buffer is also held where Python cannot reach it ({n} more reference(s) than its own: "
    "an autograd graph that saved a copy of it, made by t.to(device, copy=True), load_state_dict, "
    "copy_ or torch.tensor(t), or other C++ code), and donating it would destroy that copy too. Let "
    "the graph go (backward() or del loss) before the step that donates it"
)
SAME_STEP = (
    "it shares its device buffer with {holder}, a copy made from it in this step (load_state_dict, "
    "copy_, t.to(device, copy=True), torch.tensor(t), x[...] = t) that the step would back with this "
    "buffer: donating it would destroy the copy. Make the copy with .clone() (copy.deepcopy for a "
    "module), which torch_xla gives a buffer of its own; for load_state_dict, load a state_dict of "
    "clones"
)
UNREAD = (
    "torch_xla_donate could not read its device buffer (it is no plain device data any more), so it "
    "cannot tell who else holds it"
)
REFUSED_FLAG = (
    "torch_xla refused them as donors: their values are not plain device data (a view, or a copy "
    "that has not run)"
)
DROPPED = (
    "Donations dropped before a step{at_step}: {items}. Since they were marked, {why}. These tensors "
    "keep their values."
)
UNDECIDED = (
    "Donations dropped before a step{{at_step}}: {{items}}. torch_xla_donate could not decide whether "
    "they could be donated ({error}); the step ran without them and these tensors keep their values. "
    "Please report this with the message."
)
AUTO_SKIPPED = "Automatic donation skipped a step{{at_step}}{{items}}: {error}. Please report this."


# -- Verdicts -------------------------------------------------------------------------
UNUSED = (
    "Some donated buffers were not usable{at_step}: {items}. No output of the execution could take "
    "them (or they were no input of its graph); they keep their values and are no longer marked. "
)


def unused_fix(paths, count) -> str:
    """What to do about unused donations, naming the module buffers (``paths``) among them."""
    if not paths:
        return (
            "Do not donate tensors that no output can take: donate only what the step replaces with a "
            "result of the same size."
        )
    named = ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else "")
    verb = "is a buffer" if len(paths) == 1 else "are buffers"
    rest = "" if len(paths) == count else " The others: donate only what the step replaces."
    return (
        f"{named} {verb} of a module passed to donate() (e.g. a mask from register_buffer, which steps "
        f"read but do not replace): leave the buffers out, e.g. tdx.donate(list(model.parameters())).{rest}"
    )


def donated(record, note, shape) -> str:
    """The ``DonatedBufferError`` of a consumed tensor; ``note``: how a companion (``shape``) lost it."""
    via, where, step = VIA[record.via], record.where, record.step
    if note:
        return (
            f"This tensor ({shape}) lost its buffer with a donation: {note}. {via} at {where} donated "
            f"that buffer ({record.shape_string}) and step {step} reused it for an output, so this value "
            "is gone too. Use the step's results instead (for a module, load them into it), or donate a "
            "copy that shares nothing with it."
        )
    if record.verdict == C.Verdict.LOST:
        return (
            f"This tensor ({record.shape_string}, {record.nbytes} bytes) was donated by {via} at {where}; "
            f"step {step} failed, and torch_xla lost the donated buffer with it (torch_xla 2.7 does when a "
            "step fails to compile), so its value is gone. Recompute or reload it."
        )
    return (
        f"This tensor ({record.shape_string}, {record.nbytes} bytes) was donated by {via} at {where}, "
        f"and step {step} reused its buffer for an output, so its value is gone. Use the step's result "
        "instead, or, if you still need this tensor, do not donate it (undonate(t) cancels a mark "
        "before the step)."
    )


def unpoisoned(t, record, message, more) -> str:
    return (
        f"torch_xla_donate could not mark the donated {type(t).__qualname__} {record.shape_string}{more} "
        f"as donated after step {record.step} ({message}). The step ran and its results are intact, and "
        "operators on the tensor still raise DonatedBufferError, but Python code that only looks at the "
        "object will not be told. Do not change the class of a tensor between donating it and the step."
    )


# -- Switched off ---------------------------------------------------------------------
OFF = (
    "torch_xla_donate is switched off (TORCH_XLA_DONATE_DISABLE=1 or configure(enabled=False)): "
    "donate_buffer() does nothing and no tensor will be poisoned."
)
ALIASING_OFF = (
    "XLA_ENABLE_PARAM_ALIASING=0 turns off buffer donation in torch_xla: donate_buffer() does nothing "
    "and no tensor will be poisoned. Unset it to save the memory."
)
GUARD = (
    "torch_xla_donate switched donation off for this process: {why}. This torch_xla build does not "
    "match what the package reads natively; nothing is donated or poisoned, and every tensor keeps its "
    "value. Please report this message with your torch and torch_xla versions."
)


# -- Giving warnings ------------------------------------------------------------------
def warn_records(category, template, records) -> None:
    """Warns (raises, for an exception category) naming ``records``, at the line that marked the first.

    No step number in a warning: a loop repeating the same unusable donation repeats the same text at
    the same line, which Python's filters then show once by default.
    """
    items = _describe(records)
    if not records:  # about the step, not a mark (auto's search failed): at the user's line
        warnings.warn(template.format(at_step="", items=items), category, stacklevel=user_stacklevel())
        return
    if issubclass(category, Exception) and not issubclass(category, Warning):
        raise category(template.format(at_step=f" at step {records[0].step}", items=items))
    first = records[0]
    registry = _registries.setdefault(first.file, {})
    warnings.warn_explicit(
        template.format(at_step="", items=items), category, first.file, first.line, registry=registry
    )


# Python's "seen" registry per marking file, as a module's __warningregistry__
# (warnings.catch_warnings and a filter change reset them).
_registries = {}


def _describe(records) -> str:
    """Each shape once, with its count and where it was marked; at most 8 shapes."""
    groups = {}
    for r in records:
        groups.setdefault(r.shape_string, Counter())[r.where] += 1
    parts = []
    for shape, places in list(groups.items())[:8]:
        n = sum(places.values())
        where = ", ".join(list(places)[:3]) + (" ..." if len(places) > 3 else "")
        parts.append(f"{f'{n} x ' if n > 1 else ''}{shape} (donated at {where})")
    more = len(groups) - 8
    return ", ".join(parts) + (f", and {more} more shape(s)" if more > 0 else "")


def escape(text: str) -> str:
    """``text`` safe inside a ``warn_records`` template."""
    return text.replace("{", "{{").replace("}", "}}")


class Notices:
    """Warnings held back until a commit is whole: a filter that makes an error of one (``-W error``)
    then raises it once the step's results are intact, not in the middle of the commit.

    >>> notices, R = Notices(), type("R", (), dict(shape_string="f32[2]", where="t.py:1", file="t.py",
    ...                                            line=1, step=3))
    >>> notices.add(UserWarning, "held back{at_step}: {items}", [R(), R()])
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     notices.deliver()
    >>> str(caught[0].message)
    'held back: 2 x f32[2] (donated at t.py:1)'
    """

    __slots__ = ("_items", "_error")

    def __init__(self):
        self._items, self._error = [], None

    def __bool__(self):
        return bool(self._items) or self._error is not None

    def add(self, category, template, records) -> None:
        self._items.append((category, template, records))

    def fail(self, error) -> None:
        """An error to raise once the commit is whole (the first one wins)."""
        self._error = self._error or error

    def deliver(self, quietly: bool = False) -> None:
        """Gives the warnings, then raises the first error (held, or a filter's), unless ``quietly``."""
        items, self._items = self._items, []
        first, self._error = self._error, None
        for category, template, records in items:
            try:
                warn_records(category, template, records)
            except Exception as error:  # a filter made an error of it
                first = first or error
        if first is not None and not quietly:
            raise first
