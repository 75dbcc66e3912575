"""Whether donation is switched off, and the warning that says so.

Two switches turn every donation into a no-op: the plugin's own
(``TORCH_XLA_DONATE_DISABLE=1`` or ``configure(enabled=False)``) and
torch_xla's ``XLA_ENABLE_PARAM_ALIASING=0``.  Marking (``donate_buffer``,
``donate``) and a compiled graph that donates its own inputs
(_hooks/dynamo.py) ask here, so that both warn alike.

The tricky case: a loop donates every step, so the warning is given once
per reason and process, not once per call.
"""
import warnings

from . import config, xla
from .errors import DonationDisabledWarning
from .sites import user_stacklevel

__all__ = ["warn_if_off"]

OFF = (
    "torch_xla_donate is switched off (TORCH_XLA_DONATE_DISABLE=1 or "
    "configure(enabled=False)): donate_buffer() does nothing and no "
    "tensor will be poisoned."
)
ALIASING_OFF = (
    "XLA_ENABLE_PARAM_ALIASING=0 turns off buffer donation in torch_xla: "
    "donate_buffer() does nothing and no tensor will be poisoned. Unset it "
    "to save the memory."
)

_disabled_warned = set()


def warn_if_off() -> bool:
    """True, with the once-per-reason ``DonationDisabledWarning`` at the
    user's line, when a switch turns donation off.

    >>> warn_if_off()
    False
    """
    if config.enabled() and xla.aliasing_enabled():
        return False
    message = OFF if not config.enabled() else ALIASING_OFF
    if message not in _disabled_warned:
        _disabled_warned.add(message)
        warnings.warn(message, DonationDisabledWarning, stacklevel=user_stacklevel())
    return True
