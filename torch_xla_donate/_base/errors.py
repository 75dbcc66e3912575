"""The exceptions and warnings a user of torch_xla_donate can meet."""

__all__ = [
    "DonatedBufferError",
    "UnusedDonationWarning",
    "UnusedDonationError",
    "DonationDisabledWarning",
    "DroppedDonationWarning",
    "StaleReadWarning",
    "ParameterDonationError",
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
    no longer marked.  Given once per line that marked it and shape (a loop
    repeats it at every step); ``summary()`` counts every one.
    """


class UnusedDonationError(RuntimeError):
    """Strict mode's form of ``UnusedDonationWarning``: raised where the
    warning would be given.  The tensors named keep their values."""


class DroppedDonationWarning(UserWarning):
    """A mark was dropped before the step because donating it was unsafe.

    This happens when a view or alias of the tensor (``t[0]``, ``t.detach()``)
    was created after ``donate_buffer(t)``: the step would destroy the view's
    data too.  The tensor keeps its value.
    """


class DonationDisabledWarning(UserWarning):
    """Donation is switched off, so ``donate_buffer`` does nothing.

    Either torch_xla's ``XLA_ENABLE_PARAM_ALIASING=0`` turned all buffer
    donation off, or the plugin's own off switch is set
    (``TORCH_XLA_DONATE_DISABLE=1`` or ``configure(enabled=False)``).
    """


class StaleReadWarning(UserWarning):
    """This process runs XLA:CPU with XNNPACK on, which can compute a matmul
    with a reused buffer's old contents after a donation: set
    ``XLA_FLAGS=--xla_cpu_use_xnnpack=false`` before torch_xla starts (the
    package does it at import when it still can; see ``xla_cpu``).  Given
    once, at the first donation."""


class ParameterDonationError(ValueError):
    """A model parameter or buffer was marked for donation before
    ``gradient_accumulation``, which would destroy it.  Raised before
    anything runs; the marks are left as they were."""


class AutoDonationUnavailableError(RuntimeError):
    """``advise()`` cannot find dead step inputs in this process: the native
    reads are off (``TORCH_XLA_DONATE_NATIVE_READS=0``), torch_xla's
    live-tensor registry was not found, SPMD is on, or more than one device
    runs in the process.  The message says which; donate explicitly."""


class AutoDonationUnavailableWarning(UserWarning):
    """``configure(auto=True)`` (``TORCH_XLA_DONATE_AUTO=1``) does nothing in
    this process, for a reason ``AutoDonationUnavailableError`` lists.
    Given once."""
