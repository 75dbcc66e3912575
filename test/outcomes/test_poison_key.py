"""The donated dispatch key (csrc/outcomes/donated_key.h): a consumed
tensor refuses operators through a key of the plugin's own on the tensor
torch_xla computes with, whose native fallback asks poison.py; no Python
object is made for that tensor.  A key someone else took switches
donation off."""
import gc
import threading

import pytest
import torch
import torch_xla
from helpers import materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _guards as guards


def _consumed(dev, n=1):
    """``n`` tensors donated and consumed by a waited-for step, held."""
    xs = [materialize(torch.arange(8.0, device=dev) + i) for i in range(n)]
    for x in xs:
        tdx.donate_buffer(x)
    ys = [x * 2 + 1 for x in xs]
    torch_xla.sync()
    return xs, ys


def test_the_key_is_in_use_and_the_reports_say_so(dev):
    (x,), _ = _consumed(dev)
    assert _C.has_donated_key(torch._from_functional_tensor(x))  # poisoning took the key
    assert guards.state("poisoning") == "native dispatch key"
    assert "  poisoning: native dispatch key" in str(tdx.summary())
    assert "Setting: Poisoning\n  Value: native dispatch key\n" in tdx.metrics_report()


def test_the_tensor_torch_xla_computes_with_gets_the_key_and_no_python_object(dev):
    """Poisoning leaves the wrapped tensor without a Python object: its
    TensorImpl points at none."""
    (x,), _ = _consumed(dev)
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]  # before any look at it
    assert tdx.is_deleted(x)
    inner = torch._from_functional_tensor(x)
    assert not any(t is inner for t in tensors)  # its Python object is new: it had none
    assert _C.has_donated_key(inner)
    with pytest.raises(tdx.DonatedBufferError):
        x + 1


def test_a_use_on_another_thread_raises_there(dev):
    """The dispatcher runs the fallback without the GIL on any thread: the
    error reaches that thread's caller, typed."""
    (x,), _ = _consumed(dev)
    caught = []

    def use():
        try:
            x * 2
        except Exception as error:  # noqa: BLE001 - the type is the check
            caught.append(error)

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert len(caught) == 1 and isinstance(caught[0], tdx.DonatedBufferError), caught


def test_a_shallow_copy_of_the_wrapped_tensor_carries_no_record(dev):
    """torch copies a TensorImpl's key set into its shallow copies
    (``.data``), the donated key with it; the record tag stays behind, and a
    tensor with the key but no record is no donated tensor: the fallback
    lets it through, to torch_xla, as any copy of a consumed tensor."""
    (x,), _ = _consumed(dev)
    copy = torch._from_functional_tensor(x).data
    assert _C.tagged_record(copy) is None
    assert _C.has_donated_key(copy)
    with pytest.raises(Exception) as info:
        (copy * 2).cpu()
    assert not isinstance(info.value, tdx.DonatedBufferError)


# A fallback some other code registered on the key first (torch's
# TORCH_LIBRARY_IMPL, here through torch.library): the plugin must not
# replace it, and switches donation off.
_TAKEN = """
import warnings
import torch
lib = torch.library.Library("_", "IMPL")
lib.fallback(lambda *args, **kwargs: None, dispatch_key="TESTING_ONLY_GenericWrapper")
import torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _guards as guards
dev = torch_xla.device()
x = torch.arange(8.0, device=dev) + 0
torch_xla.sync()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(x)
y = x * 2
torch_xla.sync()
print("WARNED:", [str(w.message) for w in caught if w.category is tdx.DonationDisabledWarning])
print("KEPT:", x.cpu().tolist() == list(range(8)), y.cpu().tolist() == [2.0 * i for i in range(8)])
print("STATE:", guards.state("poisoning"))
"""


def test_a_key_someone_else_took_switches_donation_off():
    out = run_python(_TAKEN).stdout
    why = "its dispatch key already has a fallback"
    assert "KEPT: True True" in out, out
    assert f"STATE: off ({why})" in out, out
    assert f"poisoning's dispatch key: {why}" in out and "Please report" in out
