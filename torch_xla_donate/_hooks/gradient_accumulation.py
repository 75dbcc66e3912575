"""Donation around torch_xla's loop helpers: ``scan`` and ``gradient_accumulation``.

Both helpers stage their loop as one lazy node (an XLA ``While`` built with
``_xla_user_computation``): the loop runs at the next step barrier, together
with the rest of the step.  So marks made before the call are committed by
that barrier, like any other, and the tensors XLA consumed are poisoned after
it.  Neither helper needs, or should get, a barrier of its own: judging the
marks when the call returns would find every buffer still alive and call each
donation unused before the loop ran.

* ``torch_xla.experimental.scan.scan``: donating the initial carry lets the
  final carry take its buffer, step after step when the carry is fed back.
  ``xs`` cannot be reused by any output of a different size; such a donation
  gets an ``UnusedDonationWarning`` and ``xs`` keeps its value.  Nothing here
  wraps ``scan``.
* ``torch_xla.experimental.gradient_accumulation.gradient_accumulation``:
  donating a carried tensor lets the new carried tensor take its buffer.  The
  helper also calls ``_xla_sync_multi`` to materialize the slices of its
  inputs; that is no step barrier and torch_xla ignores donor flags there, so
  the marks wait for the real barrier.

The one trap is model state in ``gradient_accumulation``: every parameter and
buffer of ``model`` is an input of the loop that is passed through unchanged
and thrown away, and the helper never returns replacements.  A mark on one of
them can only hand its buffer to some other output and leave the model with a
destroyed parameter.  ``gradient_accumulation`` therefore refuses such marks
before anything runs, with ``ParameterDonationError``; the marks stay set and
no value is lost.  If your update builds new parameter tensors after the call,
donate the old ones after the call returns.

``install()`` runs when ``torch_xla_donate`` is imported.  It wraps the
module-level ``_gradient_accumulation`` that the public function calls, so the
check applies even to a ``gradient_accumulation`` imported before this
package.
"""
import functools
import inspect
import threading

import torch

from .._base.dtypes import shape_string
from .._base.errors import ParameterDonationError
from .._base.native import C
from .._outcomes import poison, sharing

__all__ = ["install", "uninstall", "installed"]


_lock = threading.Lock()
# (module, attribute name, original function) while installed.
_patched = None


def install() -> None:
    """Wraps ``gradient_accumulation`` with the model-state check (idempotent)."""
    global _patched
    with _lock:
        if _patched is not None:
            return
        from torch_xla.experimental import gradient_accumulation as module

        # The public function forwards to this private one, looked up at call
        # time: wrapping it also covers references taken before our import.
        name = ("_gradient_accumulation" if hasattr(module, "_gradient_accumulation")
                else "gradient_accumulation")
        original = getattr(module, name)
        setattr(module, name, _checking_model_state(original))
        _patched = (module, name, original)


def uninstall() -> None:
    global _patched
    with _lock:
        if _patched is not None:
            module, name, original = _patched
            setattr(module, name, original)
            _patched = None


def installed() -> bool:
    return _patched is not None


def _checking_model_state(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        # A consumed tensor passed in: torch_xla (2.7) may trace the loop on
        # placeholders and hand the real tensors straight to C++, where no
        # poison can see them; refuse it here, on every release alike.
        poison.refuse_consumed(arguments.get("iterable_tensors"), arguments.get("carried_tensors"))
        if C.marked_count():
            model = arguments.get("model")
            if isinstance(model, torch.nn.Module):
                _refuse_marked_model_state(model)
        result = original(*args, **kwargs)
        sharing.note_graph_holds_inputs()  # the next commit's graph holds its inputs
        return result

    wrapper.__torch_xla_donate_original__ = original
    return wrapper


def _refuse_marked_model_state(model: torch.nn.Module) -> None:
    """Raises ``ParameterDonationError`` if any parameter or buffer of
    ``model`` is marked; changes nothing."""
    marked = [
        (kind, name, t)
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
        for name, t in named
        if C.is_marked(t)
    ]
    if not marked:
        return
    shown = marked[:_SHOWN]
    items = ", ".join(f"{kind} '{name}' {shape_string(t)}" for kind, name, t in shown)
    if len(marked) > _SHOWN:
        items += f" and {len(marked) - _SHOWN} more"
    raise ParameterDonationError(
        f"gradient_accumulation: {items} of the model {'is' if len(marked) == 1 else 'are'} "
        "marked by donate_buffer(). gradient_accumulation passes model parameters and "
        "buffers through its loop unchanged and returns no replacement for them, so the "
        "step would give their buffers to other outputs and destroy them. Nothing has "
        "run and the marks are still set: undonate(model) cancels them. If you replace these "
        "tensors with new ones after the call, donate the old ones after "
        "gradient_accumulation returns."
    )


_SHOWN = 4  # marked model tensors named in the error; the rest are counted


