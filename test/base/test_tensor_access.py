"""How the native hot path reaches a tensor's TensorImpl (csrc/base/variable.h).

The hot path reads the TensorImpl address straight from the tensor's Python
object instead of asking ``t._cdata``; every kind of object it may be handed
must give the same answer as the Python route, and anything that is no
tensor gives 0.
"""
import pytest
import torch
from helpers import Guarded, Pinned, Tagged, Wrapper, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C

KINDS = {
    "xla": lambda dev: torch.ones(4, device=dev) * 2,
    "cpu": lambda dev: torch.ones(4),
    "parameter": lambda dev: torch.nn.Parameter(torch.ones(4, device=dev) * 2),
    "view": lambda dev: (torch.ones(4, device=dev) * 2)[1:],
    "subclass": lambda dev: torch.Tensor._make_subclass(Tagged, torch.ones(4, device=dev) * 2),
    "guarded": lambda dev: torch.Tensor._make_subclass(Guarded, torch.ones(4, device=dev) * 2),
    "pinned class": lambda dev: torch.Tensor._make_subclass(Pinned, torch.ones(4, device=dev)),
    "wrapper": lambda dev: Wrapper(torch.ones(4, device=dev)),
    "inference": lambda dev: _inference(dev),
    "requires grad": lambda dev: (torch.ones(4, device=dev) * 2).requires_grad_(),
}


def _inference(dev):
    with torch.inference_mode():
        return torch.ones(4, device=dev) * 2


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_impl_address_is_what_python_reads(dev, kind):
    t = KINDS[kind](dev)
    assert _C.impl_address(t) == torch.Tensor._cdata.__get__(t) != 0


def test_impl_address_of_a_poisoned_tensor_is_its_own(dev):
    t = materialize(torch.ones(64, device=dev) * 2)
    old = t
    tdx.donate_buffer(t)
    t = t + 1
    materialize(t)
    assert tdx.is_deleted(old)  # poisoned: its class and dispatch changed
    assert _C.impl_address(old) == torch.Tensor._cdata.__get__(old) != _C.impl_address(t)


@pytest.mark.parametrize("obj", [None, 3, "t", object(), [torch.ones(1)]],
                         ids=["None", "int", "str", "object", "list"])
def test_impl_address_of_anything_else_is_zero(obj):
    assert _C.impl_address(obj) == 0
