"""Matching ``donate_argnums``/``donate_argnames`` to a function's parameters.

Resolved once, when ``donating`` wraps the function; each call then only
picks the selected arguments out of ``(args, kwargs)`` with plain indexing,
which dynamo can trace (``torch.compile(donating(f, ...))`` has no graph
break) and which costs next to nothing.  A call that does not fit the
signature is the function's own business: it raises its ``TypeError``, and
``donating`` cancels what it marked.

>>> def step(params, batch, *, lr=0.1): ...
>>> s = Selection(step, (0,), ("lr",))
>>> s.argnums, s.argnames
((0,), ('params', 'lr'))
>>> [label for label, _ in s.arguments(("P", "B"), {"lr": 0.5})]
['params', 'lr']

The tricky case for ``argnums``: a position past the named parameters is an
element of ``*args``, and is reported as selected (as JAX does):

>>> def f(*args): ...
>>> Selection(f, (0, 2), ()).argnums
(0, 2)
"""
import difflib
import inspect

import torch

__all__ = ["Selection"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Selection:
    """The donated parameters of one function.

    Each selected argument is one of: a named parameter (``("param", name)``),
    an element of ``*args`` (``("vararg", i)``), a key of ``**kwargs``
    (``("kwarg", key)``), or, for a callable without a signature, a position
    of the call (``("position", i)``).
    """

    def __init__(self, fn, argnums, argnames):
        self._fn_name = getattr(fn, "__qualname__", None) or repr(fn)
        # An nn.Module's own signature is __call__'s (*args, **kwargs); the
        # parameters a call binds to are forward's.
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
                f"donating({self._fn_name}) selects no argument, so it would donate "
                f"nothing. Name what to donate: donating(fn, donate_argnums=0) or "
                f"donate_argnames='{self._names[0] if self._names else 'x'}'. "
                f"Parameters: {self._describe()}."
            )
        targets = [self._from_index(i) for i in argnums]
        targets += [self._from_name(n) for n in argnames]
        self._targets = list(dict.fromkeys(targets))  # selected both ways: once
        names = [key for kind, key in self._targets if kind == "param"]
        # What was resolved, as in JAX: the positions of the selected
        # positional parameters and of the selected elements of *args.
        varargs = [len(self._positional) + key for kind, key in self._targets if kind == "vararg"]
        self.argnums = tuple(sorted({self._positional.index(n) for n in names
                                     if n in self._positional} | set(varargs)))
        self.argnames = tuple(n for n in self._names if n in names)

    def _no_signature(self, argnums, argnames, error) -> None:
        if argnames:
            raise TypeError(
                f"donating({self._fn_name}): donate_argnames needs the function's "
                f"signature, and it has none that Python can read ({error}). Select by "
                "position with donate_argnums, or wrap it in a Python function with "
                "named parameters."
            ) from None
        if not argnums:
            raise ValueError(
                f"donating({self._fn_name}) selects no argument, so it would donate "
                "nothing. Name what to donate: donating(fn, donate_argnums=0)."
            )
        negative = [i for i in argnums if i < 0]
        if negative:
            raise ValueError(
                f"donating({self._fn_name}): donate_argnums={negative[0]} is negative, but "
                "without a signature the number of parameters is unknown. Use a "
                "non-negative position."
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
                    f"donating({self._fn_name}): donate_argnums={index} is negative, "
                    f"which is ambiguous for a function with *{self._varargs}: "
                    f"{self._describe()}. Use a non-negative position."
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
        keyword_only = [n for n in self._names if n not in self._positional
                        and n not in (self._varargs, self._varkw)]
        hint = (
            f" Keyword-only parameters are selected by name: donate_argnames="
            f"{tuple(keyword_only)!r}." if keyword_only else ""
        )
        # Only reached without *args, where negative indices count from the end.
        valid = f"0..{count - 1}, or -{count}..-1" if count else "none"
        return ValueError(
            f"donating({self._fn_name}): donate_argnums={index} is out of range: "
            f"{self._describe()} takes {count} positional parameter(s) "
            f"{tuple(self._positional)!r} (valid indices: {valid}).{hint}"
        )

    def _from_name(self, name):
        if name in self._positional_only:
            position = self._positional.index(name)
            raise ValueError(
                f"donating({self._fn_name}): donate_argnames={name!r} names a "
                f"positional-only parameter of {self._describe()}, which no call can pass "
                f"by name. Select it by position: donate_argnums={position}."
            )
        if name in self._names:
            return ("param", name)
        if self._varkw is not None:
            return ("kwarg", name)
        close = difflib.get_close_matches(name, self._names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"donating({self._fn_name}): donate_argnames={name!r} is not a parameter "
            f"of {self._describe()}; its parameters are {tuple(self._names)!r}.{hint}"
        )

    def arguments(self, args, kwargs) -> list:
        """The ``(label, value)`` of each selected argument passed in this call
        (defaults are never picked: they are not passed)."""
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
                        picked.append((key, args[len(self._positional):]))
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
