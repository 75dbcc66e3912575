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

from .._base import xla
from .._base.native import C
from .._outcomes import poison
from . import graph_ops
from .checks import check_tensor, zero_dim
from .marks import mark_checked

__all__ = ["donate_buffer", "is_donated", "is_deleted"]


# The public function is native (csrc/marking/marking.cpp): the common case
# is one call from the user's line, with no Python frame of ours.  Its
# docstring is there; help(donate_buffer) shows it.
donate_buffer = C.donate_buffer


def donate_buffer_checked(tensor) -> None:
    """``donate_buffer``'s Python half, called with the tensor when the
    native fast path declines: anything unusual (a subclass, a view, pending
    computation, a scalar, donation switched off, a commit running on
    another thread) gets its precise error or warning here, or is marked.

    The tricky case: the native caller has no Python frame, so
    ``sys._getframe(1)`` is the user's line, the one the record blames.

    >>> donate_buffer_checked(torch.ones(2))
    Traceback (most recent call last):
    ...
    ValueError: donate_buffer expects a tensor on an XLA device, got one on 'cpu'. ...
    """
    check_tensor("donate_buffer", tensor)
    torch._check_value(
        tensor.dim() > 0 or not xla.is_xla(tensor) or poison.is_poisoned(tensor),
        lambda: zero_dim(tensor),
    )
    frame = sys._getframe(1)
    mark_checked(tensor, (frame.f_code.co_filename, frame.f_lineno))


# Where ``C.donate_buffer`` hands a tensor it declines: the package's install
# step binds it (_hooks/install.py).
NATIVE_HOOKS = dict(donate_buffer_checked=donate_buffer_checked)


@torch.compiler.substitute_in_graph(C.donate_buffer)
def _donate_buffer_in_graph(tensor) -> None:
    """What dynamo traces for a ``donate_buffer`` call: a graph op, no
    graph break (graph_ops.py)."""
    graph_ops.donate_in_graph([tensor])


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
