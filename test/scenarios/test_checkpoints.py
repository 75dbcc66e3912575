"""Checkpoints of marked tensors.

``xm.save(model.state_dict(), path)`` of a model whose tensors are marked
saves the right values and keeps the marks; the step that follows donates
them.  A ``state_dict()`` still alive at the step holds aliases of the
marked tensors, so the step drops those marks (``DroppedDonationWarning``)
rather than destroying the checkpoint's tensors.
"""
import warnings

import pytest
import torch
import torch_xla.core.xla_model as xm
from helpers import materialize

import torch_xla_donate as tdx


def _marked_model(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)).to(dev)
    materialize(model[0].weight)
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    assert tdx.donate(model) == 4
    return model, expected


def _functional_step(model):
    """New parameters from the old ones (which the step may consume)."""
    return {k: v * 0.5 + 1 for k, v in model.named_parameters()}


def test_xm_save_of_a_marked_model_keeps_values_and_marks(dev, tmp_path):
    model, expected = _marked_model(dev)
    path = tmp_path / "ckpt.pt"
    xm.save(model.state_dict(), str(path))
    saved = torch.load(path)
    for k in expected:
        assert torch.equal(saved[k], expected[k]), k
    # The save only read the tensors: they are still marked and intact.
    assert all(tdx.is_donated(p) for p in model.parameters())
    assert torch.equal(model[0].weight.cpu(), expected["0.weight"])
    # The following step donates them as planned.
    old = list(model.parameters())
    new = _functional_step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdx.DroppedDonationWarning)
        materialize(*new.values())
    assert all(tdx.is_deleted(p) for p in old)
    for k, v in new.items():
        torch.testing.assert_close(v.cpu(), expected[k] * 0.5 + 1)
    # A checkpoint of the consumed model fails clearly instead of saving garbage.
    with pytest.raises(tdx.DonatedBufferError):
        xm.save(model.state_dict(), str(tmp_path / "late.pt"))


def test_state_dict_alive_at_the_step_cancels_the_marks(dev):
    model, expected = _marked_model(dev)
    checkpoint = model.state_dict()  # detached aliases of the marked tensors
    new = _functional_step(model)
    with pytest.warns(tdx.DroppedDonationWarning, match="view or alias"):
        materialize(*new.values())
    # Nothing was destroyed: the checkpoint, the model and the step's results.
    for k in expected:
        assert torch.equal(checkpoint[k].cpu(), expected[k]), k
    assert not any(tdx.is_deleted(p) for p in model.parameters())
    assert model(torch.ones(1, 6, device=dev)).shape == (1, 3)
    for k, v in new.items():
        torch.testing.assert_close(v.cpu(), expected[k] * 0.5 + 1)


def test_save_with_a_pending_in_place_update_of_a_marked_tensor(dev, tmp_path):
    """pytorch/xla#8422: xm.save syncs only some tensors; it must not donate
    (and so delete) a buffer the next step still reads."""
    t0, t1 = torch.tensor([1.0], device=dev), torch.tensor([2.0], device=dev)
    materialize(t0)
    tdx.donate([t0])
    t2 = t0 + t1  # reads the marked t0 and t1
    t1.add_(1)  # an in-place update pending at the save
    xm.save(t1, str(tmp_path / "t1.pt"))
    assert torch.load(tmp_path / "t1.pt").item() == 3.0
    assert tdx.is_donated(t0)
    materialize(t2)
    assert t2.item() == 3.0 and t1.item() == 3.0
    assert tdx.is_deleted(t0)
