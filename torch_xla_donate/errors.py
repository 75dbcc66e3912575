"""The exceptions and warnings a user of torch_xla_donate can meet.

>>> import torch_xla_donate as tdx
>>> issubclass(tdx.errors.DonatedBufferError, RuntimeError)
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
    """A tensor whose buffer was donated to a step's output was used.

    Raised at the line that touched the tensor, and also by ``donate_buffer``
    when asked to donate a tensor that is already gone.
    """


class UnusedDonationWarning(UserWarning):
    """A step could not use a donated buffer.

    The tensor was not an input of the step's graph, or no output of the same
    byte size was left to take its buffer.  The tensor keeps its value and is
    no longer marked.  The text names the line that marked it and the
    shape, so Python's filters show it once per place by default;
    ``summary()`` counts every one.
    """


class UnusedDonationError(RuntimeError):
    """Strict mode's form of ``UnusedDonationWarning``: raised where the
    warning would be given.  The tensors named keep their values."""


class DroppedDonationWarning(UserWarning):
    """A mark was dropped before the step because donating it was unsafe: a
    holder of its buffer appeared after marking (a view, a copy), or a check
    could not decide.  The tensor keeps its value."""


class DonationDisabledWarning(UserWarning):
    """Donation is switched off, so ``donate_buffer`` does nothing: torch_xla's
    ``XLA_ENABLE_PARAM_ALIASING=0``, the plugin's own switch
    (``TORCH_XLA_DONATE_DISABLE=1`` or ``configure(enabled=False)``), or a
    guard of what the plugin reads of torch_xla failed (the message says
    which, and what to report)."""


class StaleReadWarning(UserWarning):
    """This process runs XLA:CPU with XNNPACK on, which can compute a matmul
    with a reused buffer's old contents after a donation: set
    ``XLA_FLAGS=--xla_cpu_use_xnnpack=false`` before torch_xla starts (the
    package does it at import when it still can).  Given once, at the first
    donation."""


class ParameterDonationError(ValueError):
    """A model parameter or buffer was marked for donation before
    ``gradient_accumulation``, which would destroy it.  Raised before
    anything runs; the marks are left as they were."""


class AutoDonationUnavailableError(RuntimeError):
    """``advise()`` cannot find dead step inputs in this process (donation
    switched off by a guard, SPMD, or more than one device in the process).
    The message says which; donate explicitly."""


class AutoDonationUnavailableWarning(UserWarning):
    """``configure(auto=True)`` (``TORCH_XLA_DONATE_AUTO=1``) does nothing in
    this process, for a reason ``AutoDonationUnavailableError`` lists.
    Given once."""
