"""The public calls about one tensor: ``donate_buffer``, ``is_donated``,
``is_deleted``.

Example (``PJRT_DEVICE=CPU python this_file.py``)::

    import torch, torch_xla, torch_xla.core.xla_model as xm
    import torch_xla_donate as tdx

    params = torch.randn(1024, 1024, device=torch_xla.device())
    grads = torch.randn(1024, 1024, device=torch_xla.device())
    xm.mark_step()                       # materialize: only device data donates

    old = params
    tdx.donate_buffer(params)            # the old params are never read again
    params = params - 0.1 * grads        # functional update
    xm.mark_step()                       # new params live in the old buffer
    tdx.is_deleted(old)                  # True; old.sum() raises DonatedBufferError
"""
import sys

import torch

from .._base.native import C, Via
from .._outcomes import poison
from . import graph_ops
from .refusals import check_tensor, mark

__all__ = ["donate_buffer", "is_donated", "is_deleted"]


def donate_buffer(tensor: torch.Tensor) -> None:
    """Donates ``tensor``'s device buffer to the outputs of the next step.

    At the next step barrier the buffer may hold one of the step's outputs;
    ``tensor`` is then poisoned and any use raises ``DonatedBufferError``.
    If no output can take the buffer, the tensor keeps its value and an
    ``UnusedDonationWarning`` says so.  Marking twice before a step counts
    once.  Under ``torch.compile`` it is a graph op (no graph break): the
    compiled graph donates the tensor.

    Args:
      tensor: a materialized XLA tensor of at least one dimension.

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor (or cannot be poisoned).
      ValueError: it is not on an XLA device, has pending computation (call
        ``xm.mark_step()`` first), is a view or has live views/aliases, is
        saved for backward by a live autograd graph, or is a 0-dim scalar.
      DonatedBufferError: it was donated already.
    """
    # One native call decides and marks (its rules: csrc/marking/marking.cpp
    # Classify); a refusal is worded, or resolved, in refusals.py.
    if C.try_mark(tensor):
        check_tensor("donate_buffer", tensor)
        frame = sys._getframe(1)
        mark(tensor, (frame.f_code.co_filename, frame.f_lineno))


@torch.compiler.substitute_in_graph(C.try_mark, skip_signature_check=True)
def _try_mark_in_graph(tensor, via=Via.DONATE_BUFFER, where=1, held_ok=False, locked=False) -> int:
    """What dynamo traces for ``donate_buffer``'s mark: a graph op, no graph
    break (graph_ops.py)."""
    graph_ops.donate_in_graph([tensor])
    return 0


def is_donated(tensor: torch.Tensor) -> bool:
    """True while ``tensor`` is marked and waiting for the next step.

    The tricky case: a mark is the plugin's until an execution commits it,
    so torch_xla's own donor flag (``_get_buffer_donation``) stays False
    while this says True.

    >>> import torch, torch_xla
    >>> t = torch.ones(4, device=torch_xla.device()) * 2
    >>> torch_xla.sync()
    >>> donate_buffer(t); is_donated(t), torch_xla._XLAC._get_buffer_donation(t)
    (True, False)
    >>> from torch_xla_donate import undonate
    >>> undonate(t), is_donated(t)
    (True, False)

    Args:
      tensor: any torch.Tensor.

    Returns:
      Whether ``tensor`` is marked for the next execution that commits marks.

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
    """
    check_tensor("is_donated", tensor, None)
    return C.is_marked(tensor)


def is_deleted(tensor: torch.Tensor) -> bool:
    """True if a step consumed ``tensor``'s buffer through donation.

    May wait for the device: right after ``sync(wait=False)`` whether XLA
    took the buffer is not known until the step has been dispatched.  A
    donation no output could take leaves the tensor as it was (``b``):

    >>> import torch, torch_xla
    >>> a = torch.ones(4, device=torch_xla.device()) * 2
    >>> b = torch.ones(3, device=torch_xla.device()) * 2
    >>> torch_xla.sync()
    >>> donate_buffer(a); donate_buffer(b)
    >>> new_a, new_b = a + 1, b.sum().reshape(1)  # no output of b's 12 bytes
    >>> import warnings, torch_xla_donate
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # b's UnusedDonationWarning
    ...     torch_xla.sync(); torch_xla_donate.settle()
    >>> is_deleted(a), is_deleted(b), b.cpu().tolist()
    (True, False, [2.0, 2.0, 2.0])

    Args:
      tensor: any torch.Tensor.

    Returns:
      Whether a step's output took ``tensor``'s buffer (then any use of
      ``tensor`` raises ``DonatedBufferError``).

    Raises:
      TypeError: ``tensor`` is not a torch.Tensor.
    """
    check_tensor("is_deleted", tensor, None)
    return poison.consumed(tensor)
