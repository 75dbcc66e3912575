"""Which refusal poisoning uses: the plugin's own dispatch key, or its twin,
torch's Python dispatch key (poison.py has both).

The key (csrc/outcomes/donated_key.h) makes no Python object per donor and
step; it rests on one c10 key torch keeps for its C++ tests and on the
TensorImpl's key set, so it is tried before it is trusted: at the first
commit that poisons, on a probe tensor of that commit's device (a probe made
at import would start torch_xla's runtime before ``use_spmd``).  Off with
``TORCH_XLA_DONATE_NATIVE_POISON=0``, when the key already has a fallback
of someone else's, or when the probe is not refused with the key and
served without it.

>>> key_state().split(" (")[0] in ("native dispatch key", "Python dispatch key")
True
"""
import torch

from .._base.native import C
from . import poison

__all__ = ["decide_key", "key_state"]

_decided = False
_why = "not decided yet (no tensor was poisoned)"


def decide_key(device) -> bool:
    """Whether poisoning uses the donated key, decided once (later calls
    only read it); ``device``: where the probe is made."""
    global _decided, _why
    if not _decided:
        _decided = True
        try:
            _why = C.donated_key_self_test(torch.zeros(2, device=device),
                                           poison.on_donated_dispatch)
        except Exception as error:  # a probe that could not be made
            _why = f"{type(error).__name__}: {error}"
    return C.donated_key_in_use()


def key_state() -> str:
    """How a consumed tensor refuses operators, in words (``tdx.summary()``,
    ``tdx.metrics_report()``'s ``Setting: Poisoning``)."""
    if C.donated_key_in_use():
        return "native dispatch key"
    return f"Python dispatch key ({_why})"
