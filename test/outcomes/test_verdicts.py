"""Verdicts: what became of each committed donation, settled without
blocking the loop: after ``sync(wait=False)`` a step's verdicts wait in
flight and are settled by the next barrier, the first use, ``is_deleted``
or ``settle()``; an unused donation is readable right after its step and
can never fire later."""
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
import torch_xla_donate._outcomes.verdicts
from torch_xla_donate import _C
from torch_xla_donate._base import xla as _xla


def test_async_loop_never_blocks_and_every_verdict_is_right(dev, monkeypatch):
    waits = []
    real_wait = _xla.wait_device_ops
    monkeypatch.setattr(_xla, "wait_device_ops", lambda: (waits.append(1), real_wait()))
    state = materialize(torch.zeros(128, 128, device=dev))
    first_ptr = buffer_ptr(state)
    old_states = []
    for _ in range(10):
        tdx.donate_buffer(state)
        old_states.append(state)
        state = state + 1
        torch_xla.sync(wait=False)
    assert waits == [], "the hook must not wait for the device in a wait=False loop"
    xm.wait_device_ops()
    assert all(tdx.is_deleted(s) for s in old_states)
    assert buffer_ptr(state) == first_ptr  # the state kept one buffer throughout
    assert state.cpu().eq(10).all()


def test_async_unused_donation_is_readable_right_after_the_step(dev):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)
    with pytest.warns(tdx.UnusedDonationWarning):
        assert x.cpu().tolist() == [0.0, 1.0, 2.0]  # settles, then reads
    assert type(x) is torch.Tensor


def test_async_unused_donation_settles_at_the_next_barrier(dev):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[3\]"):
        torch_xla.sync(wait=False)
    assert type(x) is torch.Tensor and x.cpu().tolist() == [0.0, 1.0, 2.0]
    assert not torch_xla._XLAC._get_buffer_donation(x), "the verdict clears the donor flag"


def test_async_unused_donation_cannot_fire_in_the_step_that_first_uses_it(dev):
    # Its donor flag stays set while the verdict is open; the first use
    # settles it (clearing the flag) before the use joins a new graph.
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)
    ptr = buffer_ptr(x)
    with pytest.warns(tdx.UnusedDonationWarning):
        later = x + 1  # same size as x: it would take x's buffer if flagged
    assert not torch_xla._XLAC._get_buffer_donation(x)
    torch_xla.sync(wait=True)
    assert buffer_ptr(later) != ptr
    assert x.cpu().tolist() == [0.0, 1.0, 2.0] and later.cpu().tolist() == [1.0, 2.0, 3.0]


def test_open_verdicts_are_not_tracked_by_the_garbage_collector(dev):
    # A step with thousands of donations keeps them all until the next
    # barrier; as tuples they would make full collections run far more often.
    import gc
    states = list(materialize(*[torch.full((4,), float(i), device=dev) for i in range(50)]))
    for s in states:
        tdx.donate_buffer(s)
    states = [s * 2 for s in states]
    torch_xla.sync(wait=False)
    entries = torch_xla_donate._outcomes.verdicts._in_flight
    assert len(entries) == 50
    assert not any(gc.is_tracked(e) for e in entries)
    t, record = entries[0]
    assert (t, record) == (entries[0][0], entries[0][1]) and record.shape_string == "f32[4]"
    tdx.settle()
    assert all(record.verdict == _C.Verdict.REUSED for _, record in entries)
    assert [s.cpu()[0].item() for s in states[:3]] == [0.0, 2.0, 4.0]
