"""``donating``: a function whose chosen arguments are donated on every call.

JAX users write ``jax.jit(step, donate_argnums=0)``.  Here tracing is lazy and
the step ends at the next barrier, so donation does not need a compiler
wrapper: ``donating(step, donate_argnums=0)`` donates the first argument
(every tensor of it, see ``donate``) each time ``step`` is called, and the
step barrier that follows lets the outputs reuse those buffers::

    @tdx.donating(donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        ...
        return new_params, new_opt_state, loss

    params, opt_state, loss = train_step(params, opt_state, batch)
    torch_xla.sync()

It composes with ``torch_xla.compile`` both ways:
``torch_xla.compile(donating(f, donate_argnums=0))`` marks inside the compiled
region, ``donating(torch_xla.compile(f), donate_argnums=0)`` marks just before
it (the flush that ``compile`` starts with keeps the marks for the compiled
graph).

The tricky case this module exists for is matching arguments to parameters.
An argument is donated however it is passed: ``step(p, s, b)`` and
``step(batch=b, opt_state=s, params=p)`` donate the same tensors, because each
call is bound to the function's signature (``inspect.signature``) and
donation is decided per *parameter*.  (JAX's documentation long admitted that
arguments passed by keyword escaped ``donate_argnums``.)  The rules:

* ``donate_argnums`` are positions among the positional parameters, ``self``
  included for a method decorated in its class.  Negative indices count from
  the end when the function has no ``*args``.  An index past the named
  positional parameters picks an element of ``*args`` (nothing is donated on
  calls that pass fewer arguments).
* ``donate_argnames`` are parameter names, keyword-only and positional-only
  ones included.  The name of ``*args``/``**kwargs`` donates all of it; with
  ``**kwargs`` any other name donates that keyword when it is passed.
* Default values are never donated: a default is shared by every call, and
  donating it would leave the next call a poisoned default.
* Mistakes are caught when wrapping, not on the first call: an index out of
  range, an unknown name or an empty selection raise an error naming the
  function, its parameters and the fix.
* A call that does not fit the signature donates nothing and raises the
  function's own ``TypeError``.
* An ``nn.Module`` is matched against its ``forward``.  A function that hides
  its parameters behind ``(*args, **kwargs)`` (a wrapper without
  ``functools.wraps``) can only be matched by position for ``*args`` and by
  keyword for ``**kwargs``: wrap the real function instead.
"""
import difflib
import functools
import inspect
import operator

import torch

from . import api, pytree
from .sites import user_site

__all__ = ["donating"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def donating(fn=None, *, donate_argnums=(), donate_argnames=()):
    """Wraps ``fn`` so that the chosen arguments are donated on every call.

    ``donate_argnums`` (an int or a sequence of ints) and ``donate_argnames``
    (a str or a sequence of str) select parameters; an argument selected both
    ways is donated once.  Each call marks every tensor of the selected
    arguments with ``donate`` (all or nothing), then calls ``fn``.  Works as a
    decorator (``@donating(donate_argnums=0)``) or directly
    (``donating(fn, donate_argnums=0)``).

    Raises at wrap time:
      TypeError: ``fn`` is not callable, or an index/name has the wrong type.
      ValueError: nothing is selected, an index is out of range or a name is
        not a parameter of ``fn``.
    """
    if fn is None:
        return functools.partial(
            donating, donate_argnums=donate_argnums, donate_argnames=donate_argnames
        )
    if not callable(fn):
        raise TypeError(
            f"donating() expects the function to wrap as its first argument, got "
            f"{fn!r}. Pass the selection by keyword: donating(fn, donate_argnums=0) "
            "or @donating(donate_argnums=0)."
        )
    selection = _Selection(fn, _as_tuple(donate_argnums, "donate_argnums", int),
                           _as_tuple(donate_argnames, "donate_argnames", str))

    @functools.wraps(fn)
    def donating_wrapper(*args, **kwargs):
        trees = selection.arguments(args, kwargs)
        if trees:
            pytree._donate_named(trees, user_site(), api.VIA_DONATING)
        return fn(*args, **kwargs)

    donating_wrapper.donate_argnums = selection.argnums
    donating_wrapper.donate_argnames = selection.argnames
    return donating_wrapper


def _as_tuple(value, what, kind) -> tuple:
    """``0`` -> ``(0,)``, ``"x"`` -> ``("x",)``, sequences as tuples; checks types."""
    items = (value,) if isinstance(value, (int, str)) else tuple(value)
    for item in items:
        if kind is int:
            ok = not isinstance(item, bool) and _is_index(item)
        else:
            ok = isinstance(item, str)
        if not ok:
            raise TypeError(
                f"donating(): {what} must be {'ints' if kind is int else 'strs'} "
                f"or a sequence of them, got {item!r} ({type(item).__name__})."
            )
    return tuple(operator.index(i) for i in items) if kind is int else items


def _is_index(item) -> bool:
    try:
        operator.index(item)
        return True
    except TypeError:
        return False


class _Selection:
    """The donated parameters of one function, resolved once at wrap time.

    Each selected argument is one of: a named parameter (``("param", name)``),
    an element of ``*args`` (``("vararg", i)``) or a key of ``**kwargs``
    (``("kwarg", key)``).
    """

    def __init__(self, fn, argnums, argnames):
        self.argnums, self.argnames = argnums, argnames
        self._fn_name = getattr(fn, "__qualname__", None) or repr(fn)
        # An nn.Module's own signature is __call__'s (*args, **kwargs); the
        # parameters a call binds to are forward's.
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            self._signature = inspect.signature(target)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"donating({self._fn_name}): cannot read its signature ({error}), so "
                "arguments cannot be matched to parameters. Wrap it in a Python "
                "function with named parameters."
            ) from None
        params = list(self._signature.parameters.values())
        self._positional = [p.name for p in params if p.kind in _POSITIONAL]
        self._varargs = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        self._varkw = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
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
        """The ``(label, value)`` of each selected argument passed in this call."""
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError:
            return []  # the call itself is wrong: let fn raise its own error
        trees = []
        for kind, key in self._targets:
            if kind == "param":
                if key in bound:
                    trees.append((key, bound[key]))
            elif kind == "vararg":
                extra = bound.get(self._varargs, ())
                if key < len(extra):
                    trees.append((f"{self._varargs}[{key}]", extra[key]))
            else:
                extra = bound.get(self._varkw, {})
                if key in extra:
                    trees.append((f"{self._varkw}[{key!r}]", extra[key]))
        return trees
