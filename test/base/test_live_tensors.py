"""torch_xla's live-tensor registry, walked natively (csrc/lazy/live_tensors.h
and _xla.py): the walk sees what torch_xla's own walk sees, finds the
copies a barrier would back with a donor's buffer and nothing else, and its
guards leave it off when the arena cannot be found or trusted.

The tricky case: a copy made since the last barrier holds the donor's own
device-data node as its IR value, exactly as the donor does; a ``t * 2``
reads that node too but is computed anew.  Only the first is a holder.
"""
import pytest
import torch
import torch_xla
from helpers import COPIES, collector_off, materialize, run_python

from torch_xla_donate import _guards as guards
from torch_xla_donate import _xla as xla
from torch_xla_donate._native import C


@pytest.fixture
def walk(dev):
    t = materialize(torch.randn(8, 8).to(dev))
    guards.decide(t)  # the first mark decides the guards
    assert xla.walk_in_use(), guards.state("walk")
    return t


def test_the_walk_counts_what_torch_xla_counts(walk, dev):
    # The counts are the process's: the collector, were it to run in
    # between, could free an earlier test's tensor left in a reference cycle.
    with collector_off():
        before = C.live_count()
        assert before == xla.live_tensor_count()
        kept = [walk + i for i in range(3)]
        assert C.live_count() == before + 3 == xla.live_tensor_count()
        ids = {row[0] for row in C.live_tensors()}
        assert {xla.tensor_id(t) for t in kept + [walk]} <= ids
        del kept
        assert C.live_count() == before


@pytest.mark.parametrize("copy", list(COPIES))
def test_a_copy_made_since_the_barrier_is_found(walk, copy):
    c = COPIES[copy](walk)
    found = C.same_step_copies([walk]).get(0)
    assert xla.tensor_id(c) in found


READS = {
    "t * 2": lambda t: t * 2,
    "a view": lambda t: t[0:2],
    "a matmul": lambda t: t @ t,
    "a batch from the CPU": lambda t: torch.randn(8, 8).to(t.device),
}


@pytest.mark.parametrize("use", list(READS))
def test_what_only_reads_the_donor_is_no_holder(walk, use):
    out = READS[use](walk)
    assert C.same_step_copies([walk]) == {}, out


def test_a_donor_that_is_itself_a_copy_finds_its_source(walk):
    c = walk.to(walk.device, copy=True)
    assert xla.tensor_id(walk) in C.same_step_copies([c])[0]
    # Donated together: neither holds the other's value against the step.
    assert C.same_step_copies([walk, c]) == {}


# An older tensor (one that got its own buffer at the last barrier) becomes a
# copy of a donor in the donating step: ``x.copy_(t)`` keeps x's XLA tensor
# and its id, so the walk cannot skip the tensors older than the step (a
# narrower walk, tried on 2026-11-27, destroyed x).  The promise matrix
# checks the donation end to end in every context.

def test_a_copy_into_an_older_tensor_is_found(walk):
    x = materialize(torch.zeros(8, 8).to(walk.device))  # its own buffer, at a barrier
    older = xla.tensor_id(x)
    x.copy_(walk)
    assert xla.tensor_id(x) == older  # the same XLA tensor, now reading walk's node
    assert older in C.same_step_copies([walk])[0]


# Without functionalization (a process of its own): the same, end to end.
_OLDER_COPY = """
import warnings, torch, torch_xla
import torch_xla_donate as tdx
dev = torch_xla.device()
t = torch.arange(16.0).to(dev) + 1
x = torch.zeros(16).to(dev)
torch_xla.sync()
value = t.cpu()
print("FUNCTIONAL:", torch._is_functional_tensor(t))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x.copy_(t)  # x: an older tensor whose value is now t's buffer
    tdx.donate_buffer(t)
    t2 = t * 2
    torch_xla.sync()
    tdx.settle()
dropped = [w for w in caught if issubclass(w.category, tdx.DroppedDonationWarning)]
print("KEPT:", torch.equal(x.cpu(), value), len(dropped))
"""


def test_without_functionalization_a_copy_into_an_older_tensor_keeps_its_value():
    out = run_python(_OLDER_COPY, env={"XLA_DISABLE_FUNCTIONALIZATION": "1"}).stdout
    assert "FUNCTIONAL: False" in out
    assert "KEPT: True 1" in out, out


def test_after_the_barrier_a_copy_holds_a_buffer_of_its_own_kind(walk):
    c = walk.to(walk.device, copy=True)
    torch_xla.sync()
    # It now shares the buffer as a handle (holder counts see that), not as IR.
    assert C.same_step_copies([walk]) == {}
    assert xla.read_buffer_key(c) == xla.read_buffer_key(walk)


def test_an_unreadable_donor_is_none(walk):
    assert C.same_step_copies([walk, torch.ones(2), walk * 2]) == {1: None, 2: None}


_GUARD = """
import torch, torch_xla, warnings
import torch_xla_donate as tdx
from torch_xla_donate import _guards as guards
from torch_xla_donate import _xla as xla
{setup}
dev = torch_xla.device()
t = torch.randn(8, 8).to(dev)
torch_xla.sync()
print("IN USE:", guards.decide(t) and xla.walk_in_use())
print("STATE:", guards.state("walk"))
print("SUMMARY:", [l for l in str(tdx.summary()).splitlines() if "registry" in l][0])
print("METRICS:", tdx.metrics_report().split("LiveTensorRegistry\\n  Value: ")[1].splitlines()[0])
# A copy made in the donating step keeps its value: donated, or donation off.
value = t.cpu()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(t)
    c = t.to(dev, copy=True)
    new = t * 2
    torch_xla.sync()
    tdx.settle()
dropped = [w for w in caught if issubclass(w.category, tdx.DroppedDonationWarning)]
off = [w for w in caught if issubclass(w.category, tdx.DonationDisabledWarning)]
print("KEPT:", torch.equal(c.cpu(), value) and torch.equal(t.cpu(), value), len(dropped), len(off))
print("OFF:", str(off[0].message) if off else "")
"""


def _guarded(setup="", env=None):
    out = run_python(_GUARD.format(setup=setup), env=env).stdout
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


GUARDS = {
    "a symbol the library lacks": ("xla.SYMBOL = b'_ZZN9torch_xla6NoSuchE5arena'", None,
                                   "is not in"),
    "a count torch_xla disagrees with": ("xla.live_tensor_count = lambda: -1", None,
                                         "the walk counts"),
}


@pytest.mark.parametrize("guard", list(GUARDS))
def test_each_guard_switches_donation_off_says_why_and_values_hold(guard):
    setup, env, why = GUARDS[guard]
    out = _guarded(setup, env)
    assert out["IN USE"] == "False"
    assert out["STATE"].startswith("off (") and why in out["STATE"], out["STATE"]
    assert out["SUMMARY"].endswith(out["STATE"]) and out["METRICS"] == out["STATE"]
    assert out["KEPT"] == "True 0 1"  # nothing donated; one DonationDisabledWarning
    assert why in out["OFF"] and "Please report" in out["OFF"]


def test_the_native_guard_refuses_an_object_of_another_type(walk):
    address = C.live_arena()
    try:
        why = C.live_set_arena(walk._cdata)  # a TensorImpl: polymorphic, not the arena
        assert "FunctionalTensorWrapper" in why and "XLAGraphExecutor::DeviceContextArena" in why
        assert C.live_arena() == 0 and C.live_count() is None
        assert C.same_step_copies([walk]) is None
    finally:
        assert C.live_set_arena(address) == ""
    assert C.live_count() == xla.live_tensor_count()


def test_in_use_by_default():
    out = _guarded()
    assert out["IN USE"] == "True" and out["STATE"] == "in use"
    assert out["SUMMARY"].endswith("walk: in use") and out["METRICS"] == "in use"
    assert out["KEPT"] == "True 1 0"
