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

It composes with ``torch_xla.compile`` and ``torch.compile`` both ways:
``torch_xla.compile(donating(f, ...))`` marks inside the compiled region,
``donating(torch_xla.compile(f), ...)`` marks just before it (the flush the
block starts with commits nothing);  ``donating(torch.compile(f), ...)``
marks the compiled graph's inputs, and ``torch.compile(donating(f, ...))``
puts the donation into the graph itself (dynamo.py), with no graph break.

What a call promises, as in JAX:

* a donated argument that the function hands back (anywhere in its output
  pytree: an identity, a frozen parameter passed through a donated tree)
  stays alive and readable: its mark is cancelled when the call returns, and
  no unused-donation warning is given;
* a call that raises leaves nothing it marked behind: its marks are
  cancelled, and the arguments keep their values;
* default values are never donated: a default is shared by every call, and
  donating it would leave the next call a poisoned default.

The tricky case this module exists for is matching arguments to parameters.
An argument is donated however it is passed: ``step(p, s, b)`` and
``step(batch=b, opt_state=s, params=p)`` donate the same tensors, because
donation is decided per *parameter* of the function's signature.  (JAX's
documentation long admitted that arguments passed by keyword escaped
``donate_argnums``.)  The rules:

* ``donate_argnums`` are positions among the positional parameters, ``self``
  included for a method decorated in its class.  Negative indices count from
  the end when the function has no ``*args``.  An index past the named
  positional parameters picks an element of ``*args`` (nothing is donated on
  calls that pass fewer arguments).  A callable without an inspectable
  signature (``torch.add``, a builtin, a C extension) takes
  ``donate_argnums`` as plain positions of each call.
* ``donate_argnames`` are parameter names, keyword-only ones included; it
  needs a signature.  A positional-only parameter can never be passed by
  name, so naming one is an error (use its position).  The name of
  ``*args``/``**kwargs`` donates all of it; with ``**kwargs`` any other name
  donates that keyword when it is passed.
* The wrapper's ``donate_argnums`` and ``donate_argnames`` say what was
  resolved: every selected positional parameter's position (and every
  element of ``*args`` selected by position), and every selected
  parameter's name, however it was selected.
* Mistakes are caught when wrapping, not on the first call: an index out of
  range, an unknown name or an empty selection raise an error naming the
  function, its parameters and the fix.
* An ``nn.Module`` is matched against its ``forward``.
"""
import functools
import operator
from collections.abc import Callable, Sequence

import torch

from .._base.lock import lock
from .._base.native import C, Via
from .._base.sites import user_site
from . import graph_ops, trees
from .selection import Selection

__all__ = ["donating"]


def donating(fn: Callable | None = None, *, donate_argnums: int | Sequence[int] = (),
             donate_argnames: str | Sequence[str] = ()):
    """Wraps ``fn`` so that the chosen arguments are donated on every call.

    Each call marks every tensor of the selected arguments with ``donate``
    (all or nothing), then calls ``fn``.  Works as a decorator
    (``@donating(donate_argnums=0)``) or directly (``donating(fn,
    donate_argnums=0)``).

    Args:
      fn: the function (or module, or any callable) to wrap.
      donate_argnums: positions of the parameters to donate (see the module
        docstring for ``*args`` and callables without a signature).
      donate_argnames: names of the parameters to donate; an argument
        selected both ways is donated once.

    Returns:
      The wrapper, with ``donate_argnums`` and ``donate_argnames`` saying what
      was resolved.

    Raises at wrap time:
      TypeError: ``fn`` is not callable, an index/name has the wrong type, or
        ``donate_argnames`` is given for a callable without a signature.
      ValueError: nothing is selected, an index is out of range, or a name is
        not a parameter of ``fn`` or is positional-only.
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
    selection = Selection(fn, _as_tuple(donate_argnums, "donate_argnums", int),
                           _as_tuple(donate_argnames, "donate_argnames", str))

    @functools.wraps(fn)
    def donating_wrapper(*args, **kwargs):
        selected = selection.arguments(args, kwargs)
        if not selected:
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # dynamo traces this: graph ops
            graph_ops.donate_trees_in_graph(selected)
            return fn(*args, **kwargs)
        marked = _marks_of(selected, user_site())
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            _cancel(marked)
            raise
        _cancel(_handed_back(out, marked))
        return out

    if not torch.compiler.is_compiling():
        # A wrapper made while tracing lives only in the trace; torch 2.7's
        # dynamo cannot set attributes on it.
        donating_wrapper.donate_argnums = selection.argnums
        donating_wrapper.donate_argnames = selection.argnames
    return donating_wrapper


def _marks_of(selected, where) -> list:
    """Donates the ``(label, tree)`` pairs ``selected``; returns the tensors
    this call newly marked."""
    tensors = trees.tensors_in(selected)
    before = {id(t) for t in tensors if C.is_marked(t)}
    trees.donate_named(selected, where, Via.DONATING)
    return [t for t in tensors if id(t) not in before and C.is_marked(t)]


def _handed_back(out, marked) -> list:
    """The tensors of ``marked`` that are among the leaves of ``out``.

    >>> t = torch.ones(1)
    >>> _handed_back({"w": t, "n": 3}, [t, torch.ones(1)]) == [t]
    True
    """
    if not marked:
        return []
    returned = {id(t) for t in trees.tensors_in([("out", out)], refuse=False)}
    return [t for t in marked if id(t) in returned]


def _cancel(tensors) -> None:
    if tensors:
        with lock:
            for t in tensors:
                C.unmark(t)


def _as_tuple(value, what, kind) -> tuple:
    """``0`` -> ``(0,)``, ``"x"`` -> ``("x",)``, sequences as tuples; checks types.

    >>> _as_tuple(0, "donate_argnums", int), _as_tuple(["x"], "donate_argnames", str)
    ((0,), ('x',))
    """
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
