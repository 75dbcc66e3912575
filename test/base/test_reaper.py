"""The reaper (csrc/lazy/reaper.h): consumed buffers freed off the loop's
thread, live ones at once, nothing left behind at exit or in a fork.

The reaper's counters say who freed what: ``queued`` (handed to it),
``reaped`` (freed by its thread), ``inline`` (freed by a caller: drained or
stopped) and ``pending``.  Which thread is faster is not tested here:
benchmarks/bench_instructions.py counts the loop thread's instructions.
"""
import textwrap
import warnings

import torch
import torch_xla
from helpers import materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate._native import C

N = 32  # tensors per step: one handover's worth


def _loop(dev, steps):
    state = list(materialize(*[torch.full((16,), float(i), device=dev) for i in range(N)]))
    for _ in range(steps):
        for p in state:
            tdx.donate_buffer(p)
        state = [p * 2 + 1 for p in state]  # the old state let go: released at the commit
        torch_xla.sync(wait=False)
    tdx.settle()
    return state


def test_consumed_buffers_are_freed_by_the_reaper_thread(dev):
    C.reaper_drain()
    before = C.reaper_stats()
    state = _loop(dev, steps=3)
    C.reaper_hand_over()
    C.reaper_drain()
    after = C.reaper_stats()
    assert after["queued"] - before["queued"] == 3 * N, "consumed buffers were not queued"
    assert after["reaped"] > before["reaped"], "the reaper's thread freed nothing"
    assert after["pending"] == 0
    expected = torch.full((16,), 0.0)
    for _ in range(3):
        expected = expected * 2 + 1
    assert torch.equal(state[0].cpu(), expected)


def test_a_buffer_that_keeps_its_value_is_freed_at_once(dev):
    a = materialize(torch.ones(64, device=dev))
    C.reaper_drain()
    before = C.reaper_stats()
    tdx.donate_buffer(a)
    total = a.sum().reshape(1)  # no output of a's size: the donation goes unused
    del a  # released at the commit: the entry keeps only the buffer, with its value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        torch_xla.sync(wait=True)
        tdx.settle()
    C.reaper_drain()
    assert C.reaper_stats()["queued"] == before["queued"], "a live buffer went to the reaper"
    assert total.item() == 64.0


# The donating loop both subprocess tests run: n tensors, the old state let
# go each step, the verdicts of the last steps still open at the end.
_LOOP = """
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate._native import C

def loop(n, steps=3):
    dev = torch_xla.device()
    state = [torch.ones(16, device=dev) * i for i in range(n)]
    torch_xla.sync()
    for _ in range(steps):
        for p in state:
            tdx.donate_buffer(p)
        state = [p + 1 for p in state]
        torch_xla.sync(wait=False)
    return state
"""


def test_exit_frees_what_is_queued_and_stops_the_reaper():
    # An exit handler registered before the package's runs after its drain.
    proc = run_python(textwrap.dedent("""
        import atexit

        def report():
            from torch_xla_donate._native import C
            s = C.reaper_stats()
            print("AT EXIT", s["pending"], s["stopped"], s["queued"] > 0)

        atexit.register(report)
    """) + _LOOP + textwrap.dedent("""
        import torch_xla.core.xla_model as xm
        state = loop(8)
        xm.wait_device_ops()
        torch_xla.sync(wait=False)  # settles the last steps: fewer than a handover, left queued
    """))
    assert "AT EXIT 0 True True" in proc.stdout, proc.stdout + proc.stderr


def test_a_forked_child_starts_with_a_reaper_of_its_own():
    proc = run_python(_LOOP + textwrap.dedent("""
        import os
        loop(40)
        tdx.settle()
        C.reaper_hand_over()
        C.reaper_drain()
        parent = C.reaper_stats()
        assert parent["reaped"] > 0, parent
        pid = os.fork()
        if pid == 0:  # no XLA here: only the reaper's state is the child's
            s = C.reaper_stats()
            ok = s["queued"] == 0 and s["pending"] == 0
            C.reaper_drain()  # must not wait for the parent's thread
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
    """), timeout=120)
    assert "CHILD 0" in proc.stdout, proc.stdout + proc.stderr
