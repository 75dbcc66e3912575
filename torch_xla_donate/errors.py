"""The exceptions and warnings a user of torch_xla_donate can meet.

>>> issubclass(DonatedBufferError, RuntimeError)  # caught where torch's own errors are
True
"""

__all__ = [
    "DonatedBufferError",
    "UnusedDonationWarning",
    "UnusedDonationError",
    "DroppedDonationWarning",
    "DonationDisabledWarning",
    "StaleReadWarning",
    "ParameterDonationError",
    "AutoDonationUnavailableError",
    "AutoDonationUnavailableWarning",
]


class DonatedBufferError(RuntimeError):
    """A donated tensor was used (raised at that line), or ``donate_buffer`` met one already gone."""


class UnusedDonationWarning(UserWarning):
    """A step could not use a donated buffer (no input of its graph, or no output of its byte
    size left); the tensor keeps its value.  Shown once per marking line and shape by default."""


class UnusedDonationError(RuntimeError):
    """Strict mode's ``UnusedDonationWarning``; the tensors named keep their values."""


class DroppedDonationWarning(UserWarning):
    """A mark dropped before the step as unsafe (a holder of its buffer appeared after
    marking, or a check could not decide); the tensor keeps its value."""


class DonationDisabledWarning(UserWarning):
    """Donation is off (``XLA_ENABLE_PARAM_ALIASING=0``, ``TORCH_XLA_DONATE_DISABLE=1``,
    ``configure(enabled=False)`` or a failed guard), so ``donate_buffer`` does nothing."""


class StaleReadWarning(UserWarning):
    """XLA:CPU with XNNPACK on can compute a matmul with a reused buffer's old contents
    (docs/xnnpack.md); given once, at the first donation."""


class ParameterDonationError(ValueError):
    """A model parameter or buffer was marked before ``gradient_accumulation``, which would
    destroy it; raised before anything runs, the marks kept."""


class AutoDonationUnavailableError(RuntimeError):
    """``advise()`` cannot find dead step inputs in this process (a guard switched donation
    off, SPMD, or several devices); the message says which."""


class AutoDonationUnavailableWarning(UserWarning):
    """``configure(auto=True)`` does nothing in this process; given once, saying why."""
