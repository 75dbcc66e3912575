"""report: per-step reports, the summary, the per-step log and the torch_xla
counters agree with what really happened to the buffers."""
import io

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from helpers import buffer_ptr, materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _C, report
from torch_xla_donate import _auto as auto
from torch_xla_donate import _commit as commit


def _update_with_a_lonely_donation(dev, wait=True):
    """One step: p is replaced by p * 0.5 + g (its buffer can be reused);
    `lonely` is donated but no input of the step (unused).  Returns
    (old p, its buffer address, new p, lonely)."""
    p, g, lonely = materialize(
        torch.ones(64, 32, device=dev), torch.ones(64, 32, device=dev),
        torch.arange(3.0, device=dev),
    )
    ptr = buffer_ptr(p)
    tdx.donate_buffer(p)
    tdx.donate_buffer(lonely)
    new = p * 0.5 + g
    with pytest.warns(tdx.UnusedDonationWarning):
        torch_xla.sync(wait=wait)
        if not wait:
            torch_xla.sync()  # the next barrier judges the unused one
    return p, ptr, new, lonely


def test_step_report_counts_what_happened_to_each_buffer(dev):
    old, ptr, new, lonely = _update_with_a_lonely_donation(dev)
    step = _C.current_step()
    r = tdx.last_step_report()
    # The evidence: the old buffer now holds the new value, the old tensor is
    # poisoned, the lonely one kept its value.
    assert buffer_ptr(new) == ptr and new.cpu().eq(1.5).all()
    with pytest.raises(tdx.DonatedBufferError):
        old.sum()
    assert lonely.cpu().tolist() == [0.0, 1.0, 2.0]
    assert r.step == step
    assert (r.donated, r.donated_bytes) == (2, 64 * 32 * 4 + 12)
    assert (r.reused, r.reused_bytes, r.poisoned) == (1, 64 * 32 * 4, 1)
    assert (r.unused, r.unused_bytes, r.unused_shapes) == (1, 12, ("f32[3]",))
    assert (r.updated_in_place, r.dropped, r.failed, r.in_flight) == (0, 0, 0, 0)
    assert r.settled
    assert str(r) == (
        f"step {step}: donated 2 (8.0 KiB): reused 1 (8.0 KiB), unused 1 (f32[3]), "
        "updated in place 0, dropped 0, failed 0"
    )
    assert tdx.last_step_report(step) == r


def test_in_place_updates_and_dropped_marks_are_counted(dev):
    inplace, viewed = materialize(torch.ones(16, device=dev), torch.ones(8, device=dev))
    tdx.donate_buffer(inplace)
    tdx.donate_buffer(viewed)
    inplace.mul_(3)  # an output of the step now, not a donor
    head = viewed[0:2]  # a view appeared after marking: the mark is dropped
    doubled = viewed * 2
    with pytest.warns(tdx.DroppedDonationWarning):
        torch_xla.sync(wait=True)
    r = tdx.last_step_report()
    assert inplace.cpu().eq(3).all() and viewed.cpu().eq(1).all() and head.cpu().eq(1).all()
    assert (r.donated, r.reused, r.unused) == (2, 0, 0)
    assert (r.updated_in_place, r.updated_in_place_bytes) == (1, 64)
    assert (r.dropped, r.dropped_bytes) == (1, 32)
    assert "updated in place 1, dropped 1" in str(r)


def test_donations_of_a_failed_step_count_as_failed(dev, monkeypatch):
    t, g = materialize(torch.ones(32, device=dev), torch.ones(32, device=dev))
    tdx.donate_buffer(t)
    out = t + g

    def failing_barrier(*args, **kwargs):
        raise RuntimeError("step failed (simulated)")

    monkeypatch.setattr(torch_xla._XLAC, "_xla_step_marker",
                        _C.Trampoline(failing_barrier, commit.barrier_hook, commit.barrier_after))
    with pytest.raises(RuntimeError, match="simulated"):
        torch_xla.sync(wait=True)
    monkeypatch.undo()
    r = tdx.last_step_report()
    assert not tdx.is_deleted(t) and t.cpu().eq(1).all() and out.cpu().eq(2).all()
    assert (r.donated, r.failed, r.failed_bytes, r.reused, r.in_flight) == (1, 1, 128, 0, 0)
    assert "failed 1" in str(r)


def test_async_verdict_is_in_flight_until_the_next_barrier(dev):
    x, y = materialize(torch.arange(4.0, device=dev), torch.ones(4, device=dev))
    tdx.donate_buffer(x)  # no input of the step: unused, known only later
    z = y + 1
    torch_xla.sync(wait=False)
    r = tdx.last_step_report()
    assert (r.donated, r.in_flight, r.unused) == (1, 1, 0) and not r.settled
    assert "in flight 1" in str(r)
    assert tdx.summary().totals.in_flight == 1  # the totals too (earlier tests settled)
    with pytest.warns(tdx.UnusedDonationWarning):
        torch_xla.sync(wait=False)
    r = tdx.last_step_report(r.step)
    assert (r.in_flight, r.unused, r.unused_shapes) == (0, 1, ("f32[4]",)) and r.settled
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_summary_totals_add_up_over_steps(dev):
    # Counted from zero, so that every number is checked, not only a
    # difference (an offset would cancel out).
    tdx.settle()
    _C.reset()
    auto.reset_totals()
    state = materialize(torch.zeros(128, device=dev))
    first = buffer_ptr(state)
    for _ in range(3):
        tdx.donate_buffer(state)
        state = state + 1
        torch_xla.sync(wait=False)
    tdx.settle()
    assert buffer_ptr(state) == first  # every step reused the one buffer
    doubled = state * 2
    torch_xla.sync()  # a step that donates nothing is not counted
    after = tdx.summary()
    assert doubled.cpu().eq(6).all()
    assert after.steps == 3 and len(after.history) == 3
    assert (after.totals.donated, after.totals.reused) == (3, 3)
    assert (after.totals.donated_bytes, after.totals.reused_bytes) == (3 * 512, 3 * 512)
    assert after.totals.in_flight == 0
    assert after.history[-1] == tdx.last_step_report()
    assert [r.step for r in after.history] == [after.history[-1].step - 2 + i for i in range(3)]
    text = str(after)
    assert "torch_xla_donate: 3 step(s) donated 3 buffer(s)" in text
    assert str(after.history[-1]) in text


def test_log_writes_one_line_per_step_once_its_verdicts_are_in(dev):
    stream = io.StringIO()
    report._configure_log(True, stream)
    try:
        state, lonely = materialize(torch.zeros(64, device=dev), torch.ones(5, device=dev))
        tdx.donate_buffer(state)
        tdx.donate_buffer(lonely)  # unused: keeps this step open until the next barrier
        state = state + 1
        torch_xla.sync(wait=False)
        open_step = _C.current_step()
        assert f"step {open_step}:" not in stream.getvalue()
        tdx.donate_buffer(state)
        state = state * 2
        with pytest.warns(tdx.UnusedDonationWarning):
            torch_xla.sync(wait=True)
        torch_xla.sync(wait=True)  # nothing new: no line
    finally:
        report._configure_log(False)
    lines = stream.getvalue().splitlines()
    assert lines == [
        f"torch_xla_donate: step {open_step}: donated 2 (276 B): reused 1 (256 B), "
        "unused 1 (f32[5]), updated in place 0, dropped 0, failed 0",
        f"torch_xla_donate: step {open_step + 1}: donated 1 (256 B): reused 1 (256 B), "
        "unused 0, updated in place 0, dropped 0, failed 0",
    ]


def test_log_switch_is_an_environment_variable():
    proc = run_python(
        """
        import torch, torch_xla
        import torch_xla_donate as tdx
        dev = torch_xla.device()
        p = torch.ones(256, device=dev); torch_xla.sync()
        tdx.donate_buffer(p)
        p = p * 2
        torch_xla.sync()  # wait=False: the verdict is known at the next barrier
        print("value", p.sum().item())
        torch_xla.sync()
        """,
        env={"TORCH_XLA_DONATE_LOG": "1"},
    )
    assert "value 512.0" in proc.stdout
    assert "torch_xla_donate: step 2: donated 1 (1.0 KiB): reused 1 (1.0 KiB)" in proc.stderr


def _counter(name):
    return met.counter_value(name) or 0


def test_counters_reach_torch_xla_metrics(dev):
    before = {name: _counter(name) for name in report.COUNTERS}
    a, b, g = materialize(*(torch.ones(100, device=dev) for _ in range(3)))
    tdx.donate_buffer(a)
    tdx.donate_buffer(b)
    a2, b2 = a + g, b - g
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(a) and tdx.is_deleted(b)
    assert _counter("DonatedBuffers") - before["DonatedBuffers"] == 2
    assert _counter("DonatedBuffersReused") - before["DonatedBuffersReused"] == 2
    assert _counter("DonatedBufferBytesReused") - before["DonatedBufferBytesReused"] == 800
    # torch_xla's own report lists them next to its counters.
    assert "Counter: DonatedBuffersReused" in met.metrics_report()
    # Ours prints every counter, from the summary's totals, in the same format.
    totals = tdx.summary().totals
    text = tdx.metrics_report()
    assert f"Counter: DonatedBuffersReused\n  Value: {totals.reused}\n" in text
    assert text.count("Counter: ") == len(report.COUNTERS)


def test_no_report_for_a_step_without_donations(dev):
    x = materialize(torch.ones(4, device=dev))
    y = x + 1
    torch_xla.sync()
    assert tdx.last_step_report(_C.current_step()) is None
