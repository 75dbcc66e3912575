"""What autograd holds of a tensor, and the wait for its worker thread.

Two questions ownership.py asks before it judges a tensor's holders: does
an autograd graph (or a ``.grad`` slot) hold its TensorImpl
(``held_by_autograd``), and has autograd's worker thread let go of the
graphs of the backward passes it finished (``settle_autograd``)?

The tricky case is the second: for a few milliseconds after
``torch.func.grad`` returns, that thread is still releasing the graph's
references; waiting for it makes the outcome independent of timing.
"""
import torch

__all__ = ["held_by_autograd", "settle_autograd"]


def held_by_autograd(t) -> bool:
    """True when C++ code besides ``t`` itself holds ``t``'s TensorImpl: an
    autograd graph that saved it for backward (``w * w`` saves ``w``), or a
    parameter's ``.grad`` slot.

    Python references do not count, and neither does the AccumulateGrad node a
    leaf that requires grad gets once a graph uses it (it never reads the
    value).  Not a tensor: False.

    >>> w = torch.ones(2, requires_grad=True)
    >>> held_by_autograd(w)
    False
    >>> loss = (w * w).sum()
    >>> held_by_autograd(w)
    True
    >>> loss.backward()
    >>> held_by_autograd(w)
    False
    """
    if not isinstance(t, torch.Tensor):
        return False
    return t._use_count() > 1 + (t.is_leaf and t.requires_grad)


def settle_autograd(device) -> None:
    """Waits until autograd's worker thread for ``device`` has released the
    graphs of the backward passes it finished.

    The thread drops its last references to a graph (and the tensors the
    graph saved) a moment after the caller of ``grad()``/``backward()`` got
    its result.  A backward on the same device is queued behind that: once
    it has run, the earlier graph is gone.  Nothing is executed on the
    device (the lazy result is dropped).

    The tricky case: the caller's grad mode.  Optimizer updates run under
    ``torch.no_grad()``, serving under ``torch.inference_mode()``, and a
    ``torch.compile`` call runs with grad off; the probe backward needs
    autograd on whatever the caller's mode is, so it switches it on for
    itself only.

    >>> import torch_xla
    >>> with torch.inference_mode():
    ...     settle_autograd(torch_xla.device())
    >>> torch.is_grad_enabled()
    True

    (On an XLA device: autograd sizes its device queues at its first
    backward, and a first backward on the CPU before torch_xla's runtime is
    up would leave XLA's out.)
    """
    with torch.inference_mode(False), torch.enable_grad():
        # Shape (1,): a 0-dim tensor moved to the device becomes a constant
        # in torch_xla's IR (pending), not device data.
        x = torch.zeros(1).to(device).requires_grad_()
        one = torch.ones(1).to(device)
        torch.autograd.grad(_Probe.apply(x), x, grad_outputs=one)


class _Probe(torch.autograd.Function):
    """The probe backward of ``settle_autograd``, which computes nothing.

    The tricky case: autograd's worker thread holds the probe's own graph a
    moment after ``grad()`` returns too.  A probe computing ``x * 1.0``
    left a lazy tensor (the gradient it captured) alive in that thread, and
    one still alive at the step barrier that follows became an extra output
    of the user's graph: a new graph and a compile, now and then, under
    load.  Here every tensor is device data uploaded from the host and the
    backward hands its gradient through: nothing pending, nothing to sync.
    """

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad
