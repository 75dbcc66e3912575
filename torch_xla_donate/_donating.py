"""``donating``, and how its selection matches the parameters: once, when wrapping, so that a call
only picks the selected arguments out of ``(args, kwargs)``, which dynamo traces without a graph break.

>>> def step(params, batch, *, lr=0.1): ...
>>> s = Selection(step, (0,), ("lr",))
>>> s.argnums, s.argnames, [label for label, _ in s.arguments(("P", "B"), {"lr": 0.5})]
((0,), ('params', 'lr'), ['params', 'lr'])
"""

import difflib
import functools
import inspect
import operator
from collections.abc import Callable, Sequence

import torch

from . import _trees as trees
from ._messages import user_site
from ._native import C, Via, lock

__all__ = ["donating"]


def donating(
    fn: Callable | None = None,
    *,
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
):
    """Wraps ``fn`` (a function, module or any callable) so that the chosen arguments are donated on
    every call: every tensor of them is marked with ``donate`` (all or nothing), then ``fn`` runs.

    As in JAX, an argument is donated however it is passed, a donated argument ``fn`` hands back stays
    alive (its mark is cancelled), a call that raises leaves nothing marked, and default values are
    never donated.  Works as a decorator (``@donating(donate_argnums=0)``) or directly
    (``donating(fn, donate_argnums=0)``), and returns the wrapper, whose ``donate_argnums`` and
    ``donate_argnames`` say what was resolved.

    Args:
      donate_argnums: positions of the parameters to donate (a module's: its ``forward``'s); one past
        the named positional parameters picks an element of ``*args``; for a callable without a
        signature, positions of each call.
      donate_argnames: names of the parameters to donate; an argument selected both ways is donated
        once.

    Raises at wrap time (naming the function, its parameters and the fix):
      TypeError: ``fn`` is not callable, an index/name has the wrong type, or ``donate_argnames`` is
        given for a callable without a signature.
      ValueError: nothing is selected, an index is out of range, or a name is not a parameter of
        ``fn`` or is positional-only.
    """
    if fn is None:
        return functools.partial(donating, donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    if not callable(fn):
        raise TypeError(
            f"donating() expects the function to wrap as its first argument, got {fn!r}. Pass the "
            "selection by keyword: donating(fn, donate_argnums=0) or @donating(donate_argnums=0)."
        )
    argnums = _as_tuple(donate_argnums, "donate_argnums", int)
    selection = Selection(fn, argnums, _as_tuple(donate_argnames, "donate_argnames", str))

    @functools.wraps(fn)
    def donating_wrapper(*args, **kwargs):
        selected = selection.arguments(args, kwargs)
        if not selected:
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # dynamo traces this: graph ops
            trees.donate_trees_in_graph(selected)
            return fn(*args, **kwargs)
        tensors = trees.tensors_in(selected)
        before = {id(t) for t in tensors if C.is_marked(t)}
        trees.donate_named(selected, user_site(), Via.DONATING)
        marked = [t for t in tensors if id(t) not in before and C.is_marked(t)]
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            _cancel(marked)
            raise
        if marked:  # those handed back stay alive
            returned = {id(t) for t in trees.tensors_in([("out", out)], refuse=False)}
            _cancel([t for t in marked if id(t) in returned])
        return out

    if not torch.compiler.is_compiling():
        # A wrapper made while tracing lives only in the trace; torch 2.7's
        # dynamo cannot set attributes on it.
        donating_wrapper.donate_argnums = selection.argnums
        donating_wrapper.donate_argnames = selection.argnames
    return donating_wrapper


def _cancel(tensors) -> None:
    if tensors:
        with lock:
            for t in tensors:
                C.unmark(t)


def _as_tuple(value, what, kind) -> tuple:
    """``0`` -> ``(0,)``, ``"x"`` -> ``("x",)``, a sequence as a tuple of ``kind`` (int: any index)."""
    out = []
    for item in (value,) if isinstance(value, (int, str)) else tuple(value):
        try:
            if (kind is str and not isinstance(item, str)) or (kind is int and isinstance(item, bool)):
                raise TypeError
            out.append(operator.index(item) if kind is int else item)
        except TypeError:
            raise TypeError(
                f"donating(): {what} must be {'ints' if kind is int else 'strs'} or a sequence of them, "
                f"got {item!r} ({type(item).__name__})."
            ) from None
    return tuple(out)


# -- Matching the selection to the parameters ---------------------------------------
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Selection:
    """The donated parameters of one function, each ``("param", name)``, ``("vararg", i)`` (an element
    of ``*args``), ``("kwarg", key)`` (of ``**kwargs``) or ``("position", i)`` (no signature)."""

    def __init__(self, fn, argnums, argnames):
        self._fn_name = getattr(fn, "__qualname__", None) or repr(fn)
        # An nn.Module's own signature is __call__'s (*args, **kwargs); a call binds forward's.
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            self._signature = inspect.signature(target)
        except (TypeError, ValueError) as error:
            self._signature = None
            self._no_signature(argnums, argnames, error)
            return
        params = list(self._signature.parameters.values())
        self._positional = [p.name for p in params if p.kind in _POSITIONAL]
        self._positional_only = {p.name for p in params if p.kind == p.POSITIONAL_ONLY}
        # Lists, not next(generator): torch 2.7's dynamo cannot trace the
        # latter when donating() is called inside a compiled function.
        varargs = [p.name for p in params if p.kind == p.VAR_POSITIONAL]
        varkw = [p.name for p in params if p.kind == p.VAR_KEYWORD]
        self._varargs = varargs[0] if varargs else None
        self._varkw = varkw[0] if varkw else None
        self._names = [p.name for p in params]
        if not argnums and not argnames:
            raise ValueError(
                f"donating({self._fn_name}) selects no argument, so it would donate nothing. Name what "
                f"to donate: donating(fn, donate_argnums=0) or donate_argnames="
                f"'{self._names[0] if self._names else 'x'}'. Parameters: {self._describe()}."
            )
        targets = [self._from_index(i) for i in argnums] + [self._from_name(n) for n in argnames]
        self._targets = list(dict.fromkeys(targets))  # selected both ways: once
        names = [key for kind, key in self._targets if kind == "param"]
        # What was resolved, as in JAX: the positions of the selected positional parameters and of
        # the selected elements of *args.
        varargs = [len(self._positional) + key for kind, key in self._targets if kind == "vararg"]
        positions = {self._positional.index(n) for n in names if n in self._positional}
        self.argnums = tuple(sorted(positions | set(varargs)))
        self.argnames = tuple(n for n in self._names if n in names)

    def _no_signature(self, argnums, argnames, error) -> None:
        if argnames:
            raise TypeError(
                f"donating({self._fn_name}): donate_argnames needs the function's signature, and it has "
                f"none that Python can read ({error}). Select by position with donate_argnums, or wrap "
                "it in a Python function with named parameters."
            ) from None
        if not argnums:
            raise ValueError(
                f"donating({self._fn_name}) selects no argument, so it would donate nothing. Name what "
                "to donate: donating(fn, donate_argnums=0)."
            )
        negative = [i for i in argnums if i < 0]
        if negative:
            raise ValueError(
                f"donating({self._fn_name}): donate_argnums={negative[0]} is negative, but without a "
                "signature the number of parameters is unknown. Use a non-negative position."
            )
        self._targets = [("position", i) for i in dict.fromkeys(argnums)]
        self.argnums, self.argnames = tuple(sorted(set(argnums))), ()

    def _describe(self) -> str:
        return f"{self._fn_name}{self._signature}"

    def _from_index(self, index):
        count = len(self._positional)
        if index < 0:
            if self._varargs is not None:
                raise ValueError(
                    f"donating({self._fn_name}): donate_argnums={index} is negative, which is "
                    f"ambiguous for a function with *{self._varargs}: {self._describe()}. Use a "
                    "non-negative position."
                )
            index += count
            if index < 0:
                raise self._out_of_range(index - count)
        if index < count:
            return ("param", self._positional[index])
        if self._varargs is not None:
            return ("vararg", index - count)
        raise self._out_of_range(index)

    def _out_of_range(self, index) -> ValueError:
        count = len(self._positional)
        keyword_only = [n for n in self._names if n not in self._positional + [self._varargs, self._varkw]]
        hint = ""
        if keyword_only:
            hint = f" Keyword-only parameters are selected by name: donate_argnames={tuple(keyword_only)!r}."
        # Only reached without *args, where negative indices count from the end.
        valid = f"0..{count - 1}, or -{count}..-1" if count else "none"
        return ValueError(
            f"donating({self._fn_name}): donate_argnums={index} is out of range: {self._describe()} takes "
            f"{count} positional parameter(s) {tuple(self._positional)!r} (valid indices: {valid}).{hint}"
        )

    def _from_name(self, name):
        if name in self._positional_only:
            raise ValueError(
                f"donating({self._fn_name}): donate_argnames={name!r} names a positional-only parameter "
                f"of {self._describe()}, which no call can pass by name. Select it by position: "
                f"donate_argnums={self._positional.index(name)}."
            )
        if name in self._names:
            return ("param", name)
        if self._varkw is not None:
            return ("kwarg", name)
        close = difflib.get_close_matches(name, self._names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"donating({self._fn_name}): donate_argnames={name!r} is not a parameter of "
            f"{self._describe()}; its parameters are {tuple(self._names)!r}.{hint}"
        )

    def arguments(self, args, kwargs) -> list:
        """The ``(label, value)`` of each selected argument this call passes (a default is not)."""
        picked = []
        for kind, key in self._targets:
            if kind == "position":
                if key < len(args):
                    picked.append((f"args[{key}]", args[key]))
            elif kind == "param":
                if key in kwargs and key not in self._positional_only:
                    picked.append((key, kwargs[key]))
                elif key == self._varargs:
                    if len(args) > len(self._positional):
                        picked.append((key, args[len(self._positional) :]))
                elif key == self._varkw:
                    extra = {k: v for k, v in kwargs.items() if k not in self._names}
                    if extra:
                        picked.append((key, extra))
                elif key in self._positional:
                    index = self._positional.index(key)
                    if index < len(args):
                        picked.append((key, args[index]))
            elif kind == "vararg":
                index = len(self._positional) + key
                if index < len(args):
                    picked.append((f"{self._varargs}[{key}]", args[index]))
            elif key in kwargs and key not in self._names:  # kind == "kwarg"
                picked.append((f"{self._varkw}[{key!r}]", kwargs[key]))
        return picked
