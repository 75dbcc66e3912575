"""The exceptions and warnings a user of torch_xla_donate can meet.

>>> import torch_xla_donate as tdx
>>> issubclass(tdx.errors.DonatedBufferError, RuntimeError)
True
"""
from ._base.errors import (
    AutoDonationUnavailableError,
    AutoDonationUnavailableWarning,
    DonatedBufferError,
    DonationDisabledWarning,
    DroppedDonationWarning,
    ParameterDonationError,
    StaleReadWarning,
    UnusedDonationError,
    UnusedDonationWarning,
)

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
