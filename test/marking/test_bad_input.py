"""A catalogue of wrong calls: each gets a clear typed error (or a documented
correct behaviour), loses no data and crashes nothing.

Every refused call is checked for three things: the exception type, a
message that says what to do, and that the tensor is untouched (its value
intact, not marked, torch_xla's donor flag not set).  Garbage handed straight
to the native module runs in a subprocess, so a crash would fail one test
instead of killing the run.
"""
import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import assert_untouched as _untouched
from helpers import buffer_ptr, materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _C

# -- not a tensor ------------------------------------------------------------

NOT_TENSORS = {
    "None": None,
    "int": 3,
    "numpy array": np.ones(3, dtype=np.float32),
    "torch.Size": torch.Size([2, 3]),
    "string": "params",
}


@pytest.mark.parametrize("bad", NOT_TENSORS.values(), ids=NOT_TENSORS.keys())
@pytest.mark.parametrize("fn", [tdx.donate_buffer, tdx.is_donated, tdx.is_deleted],
                         ids=lambda f: f.__name__)
def test_not_a_tensor_is_a_type_error_everywhere(fn, bad):
    with pytest.raises(TypeError, match=rf"{fn.__name__} expects a torch.Tensor, got \w+\.$"):
        fn(bad)
    assert _C.marked_count() == 0


@pytest.mark.parametrize("bad", NOT_TENSORS.values(), ids=NOT_TENSORS.keys())
def test_undonate_takes_what_donate_takes(bad):
    # undonate takes trees as donate does: the same objects are refused
    # (an opaque root) or hold nothing to cancel.
    if isinstance(bad, np.ndarray):
        for fn in (tdx.donate, tdx.undonate):
            with pytest.raises(TypeError, match=rf"{fn.__name__}: tree is a ndarray.*register_pytree_node"):
                fn(bad)
    else:
        assert tdx.undonate(bad) == 0 and tdx.donate(bad) == 0
    assert _C.marked_count() == 0


def test_a_container_of_tensors_points_at_donate(dev):
    t = materialize(torch.ones(3, device=dev))
    module = torch.nn.Linear(2, 2).to(dev)
    for bad in ([t], (t,), {"w": t}, module):
        with pytest.raises(TypeError,
                           match=r"got \w+\. For the tensors .* use torch_xla_donate\.donate\(tree\)"):
            tdx.donate_buffer(bad)
    _untouched(t, torch.ones(3))
    assert not tdx.is_donated(module.weight)


# -- not on an XLA device ----------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: torch.ones(3),
    lambda: torch.ones(3, device="meta"),
    lambda: torch.ones(3).to_sparse(),
], ids=["cpu", "meta", "sparse cpu"])
def test_not_on_an_xla_device_says_how_to_move_it(make):
    t = make()
    with pytest.raises(ValueError,
                       match=r"XLA device, got one on '(cpu|meta)'.*t\.to\(torch_xla\.device\(\)\)"):
        tdx.donate_buffer(t)
    assert _C.marked_count() == 0
    if t.device.type == "cpu":
        assert t.to_dense().tolist() == [1.0] * 3


def test_sparse_xla_tensors_do_not_exist():
    """torch_xla cannot hold a sparse tensor at all, so there is nothing to
    refuse: the mistake is caught by torch_xla when moving it."""
    with pytest.raises(NotImplementedError, match="SparseXLA"):
        torch.ones(3).to_sparse().to(torch_xla.device())


# -- no plain device data ----------------------------------------------------


def test_pending_computation_says_to_sync_first(dev):
    t = torch.arange(4.0, device=dev) * 3
    with pytest.raises(ValueError, match=r"pending computation.*torch_xla\.sync\(\)"):
        tdx.donate_buffer(t)
    _untouched(t, torch.arange(4.0) * 3)


def test_updated_in_place_since_the_last_step_is_pending(dev):
    t = materialize(torch.ones(4, device=dev))
    t.add_(1)
    with pytest.raises(ValueError, match="pending computation"):
        tdx.donate_buffer(t)
    _untouched(t, torch.full((4,), 2.0))


# torch_xla's own in-place functions bypass functionalization: the tensor
# keeps its torch_xla id and version and gets pending computation all the
# same, which only torch_xla can tell (marking's fast path asks it again
# after one of them ran, until the next barrier).
_INPLACE_BY_TORCH_XLA = {
    "optimization_barrier_": lambda t: xm.optimization_barrier_([t]),
    "all_reduce in place": lambda t: xm.all_reduce(xm.REDUCE_SUM, [t]),
}


@pytest.mark.parametrize("how", ["donate_buffer", "donate"])
@pytest.mark.parametrize("inplace", list(_INPLACE_BY_TORCH_XLA))
def test_torch_xla_in_place_functions_leave_pending_computation(dev, inplace, how,
                                                                monkeypatch):
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # world size 1 would skip it
    t = materialize(torch.arange(4.0, device=dev) + 1)
    _INPLACE_BY_TORCH_XLA[inplace](t)
    mark = tdx.donate_buffer if how == "donate_buffer" else lambda x: tdx.donate([x])
    with pytest.raises(ValueError, match="pending computation"):
        mark(t)
    _untouched(t, torch.arange(4.0) + 1)
    materialize(t)  # the barrier runs what was pending: now it can be donated
    mark(t)
    assert tdx.is_donated(t)
    tdx.undonate(t)


def test_transpose_is_a_view_even_after_a_step(dev):
    """``x.t()`` of a materialized x is a view, and stays one after a step
    and after x is gone; ``contiguous()`` on XLA returns the same view."""
    x = materialize(torch.arange(6.0, device=dev).reshape(2, 3).clone())
    expected = x.cpu().t()
    v = x.t()
    del x
    materialize(v)
    assert v.contiguous() is v
    with pytest.raises(ValueError, match=r"f32\[3,2\] is a view .*t = t\.clone\(\)"):
        tdx.donate_buffer(v)
    _untouched(v, expected)
    c = materialize(v.clone())  # the advice works
    tdx.donate_buffer(c)
    assert tdx.is_donated(c)
    tdx.undonate(c)


def test_expanded_view_is_a_view(dev):
    base = materialize(torch.arange(3.0, device=dev))
    wide = base.expand(2, 3)
    with pytest.raises(ValueError, match=r"f32\[2,3\] is a view"):
        tdx.donate_buffer(wide)
    _untouched(base, torch.arange(3.0))


def test_data_alias_alive_refuses(dev):
    t = materialize(torch.ones(4, device=dev))
    alias = t.data
    with pytest.raises(ValueError, match="shares its buffer with a live view or alias"):
        tdx.donate_buffer(t)
    _untouched(t, torch.ones(4))
    assert alias.cpu().tolist() == [1.0] * 4


def test_permuted_non_contiguous_tensor_is_a_view(dev):
    x = materialize(torch.arange(24.0, device=dev).reshape(2, 3, 4).clone())
    expected = torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1)
    p = x.permute(2, 0, 1)  # XLA tensors have no strides: is_contiguous() says True
    with pytest.raises(ValueError, match=r"f32\[4,2,3\] is a view"):
        tdx.donate_buffer(p)
    _untouched(p, expected)
    _untouched(x, torch.arange(24.0).reshape(2, 3, 4))


def test_parameter_wrapping_a_live_tensor_refuses_both(dev):
    """``nn.Parameter(t)`` shares ``t``'s buffer: while both are alive,
    neither may be donated (the step would destroy the other)."""
    t = materialize(torch.full((4,), 2.0, device=dev))
    w = torch.nn.Parameter(t)
    for x in (w, t):
        with pytest.raises(ValueError, match="shares its buffer with a live view or alias"):
            tdx.donate_buffer(x)
        _untouched(x, torch.full((4,), 2.0))
    del t, x  # the advice: drop the alias; the parameter is then donatable
    tdx.donate_buffer(w)
    with torch.no_grad():
        new_w = w * 3
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and isinstance(w, torch.nn.Parameter)
    assert new_w.cpu().tolist() == [6.0] * 4


def test_undonate_and_queries_of_a_tensor_never_marked(dev):
    """Documented behaviour, not an error: ``undonate`` returns False and the
    queries say no, also for tensors that could never be donated."""
    t = materialize(torch.ones(4, device=dev))
    ptr = buffer_ptr(t)
    for x in (t, torch.ones(3), t[0:2], torch.ones(2, device="meta")):
        assert tdx.undonate(x) is False
        assert tdx.is_donated(x) is False and tdx.is_deleted(x) is False
    _untouched(t, torch.ones(4))
    assert buffer_ptr(t) == ptr


def test_a_bad_leaf_in_a_tree_marks_nothing_and_names_its_path(dev):
    good = materialize(torch.ones(4, device=dev))
    base = materialize(torch.arange(4.0, device=dev))
    tree = {"params": [good, base[1:]], "cpu": torch.ones(2)}
    with pytest.raises(ValueError, match=r"\['params'\]\[1\].*is a view"):
        tdx.donate(tree)
    _untouched(good, torch.ones(4))  # all or nothing: the good leaf is not marked either
    _untouched(base, torch.arange(4.0))


# -- already donated ---------------------------------------------------------


def test_donating_a_consumed_tensor_again(dev):
    t = materialize(torch.ones(4, device=dev))
    tdx.donate_buffer(t)
    new = t * 2
    torch_xla.sync(wait=True)
    with pytest.raises(tdx.DonatedBufferError, match=r"f32\[4\].*reused its buffer"):
        tdx.donate_buffer(t)
    with pytest.raises(tdx.DonatedBufferError):
        tdx.undonate(t)
    assert new.cpu().tolist() == [2.0] * 4


def test_donating_an_in_flight_tensor_settles_it_first(dev):
    t = materialize(torch.ones(4, device=dev))
    tdx.donate_buffer(t)
    new = t * 2
    torch_xla.sync(wait=False)  # verdict open
    with pytest.raises(tdx.DonatedBufferError):
        tdx.donate_buffer(t)
    assert new.cpu().tolist() == [2.0] * 4


# -- garbage straight into the native module ---------------------------------

_NATIVE_GARBAGE = r"""
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _C
V = _C.Verdict
t = torch.ones(2)
calls = {
    "mark()": lambda: _C.mark(),
    "mark file=5": lambda: _C.mark(t, 5, 1, (), "f32", 0),
    "mark line='1'": lambda: _C.mark(t, "f", "1", (), "f32", 0),
    "mark line=2**40": lambda: _C.mark(t, "f", 2**40, (), "f32", 0),
    "mark shape='ab'": lambda: _C.mark(t, "f", 1, "ab", "f32", 0),
    "mark shape=(2**70,)": lambda: _C.mark(t, "f", 1, (2**70,), "f32", 0),
    "mark shape=None": lambda: _C.mark(t, "f", 1, None, "f32", 0),
    "mark dtype=None": lambda: _C.mark(t, "f", 1, (), None, 0),
    "mark nbytes=1.5": lambda: _C.mark(t, "f", 1, (), "f32", 1.5),
    "mark(None)": lambda: _C.mark(None, "f", 1, (), "f32", 0),
    "mark nbytes=-5": lambda: _C.mark(t, "f", 1, (), "f32", -5),
    "mark shape=(-3,)": lambda: _C.mark(t, "f", 1, (-3,), "f32", 4),
    "settle(None)": lambda: _C.settle(None, V.REUSED),
    "settle('x')": lambda: _C.settle("x", V.REUSED),
    "settle(verdict=None)": lambda: _C.settle(_C.unmark(t) or None, None),
    "step_stats('x')": lambda: _C.step_stats("x"),
    "step_stats(2**70)": lambda: _C.step_stats(2**70),
    "begin_step(1)": lambda: _C.begin_step(1),
    "Record()": lambda: _C.Record(),
    "unmark()": lambda: _C.unmark(),
}
for name, call in calls.items():
    try:
        call()
        print(name, "-> returned")
    except (TypeError, ValueError) as e:
        print(name, "->", type(e).__name__)
    assert _C.marked_count() == 0, name

# A committed record and verdicts that are not final, or unknown.
r = _C.mark(torch.ones(1), "f", 1, (), "f32", 4)
_, _, (committed,) = _C.begin_step()
for name, v in [("MARKED", V.MARKED), ("IN_FLIGHT", V.IN_FLIGHT), ("99", 99), ("-1", -1),
                ("None", None), ("'x'", "x")]:
    try:
        _C.settle(committed, v)
        print("settle", name, "-> returned")
    except (TypeError, ValueError) as e:
        print("settle", name, "->", type(e).__name__)

# Junk in the ledger must not break the next step, nor the real marks in it.
dev = torch_xla.device()
p = torch.ones(4, device=dev)
torch_xla.sync()
tdx.donate_buffer(p)
_C.mark(object(), "junk.py", 1, (), "f32", 0)
_C.mark(torch.ones(2), "junk.py", 2, (2,), "f32", 8)
new = p + 1
torch_xla.sync(wait=True)
stats = _C.step_stats()
print("junk step:", tdx.is_deleted(p), new.cpu().tolist(), stats["reused"], stats["dropped"],
      stats["in_flight"])
print("done")
"""


def test_native_module_garbage_raises_and_never_crashes():
    out = run_python(_NATIVE_GARBAGE).stdout
    lines = dict(line.split(" -> ") for line in out.splitlines() if " -> " in line)
    for name in ["mark()", "mark file=5", "mark line='1'", "mark line=2**40", "mark shape='ab'",
                 "mark shape=(2**70,)", "mark shape=None", "mark dtype=None", "mark nbytes=1.5",
                 "settle(None)", "settle('x')", "settle(verdict=None)", "step_stats('x')",
                 "step_stats(2**70)", "begin_step(1)", "Record()", "unmark()", "mark(None)",
                 "settle None", "settle 'x'"]:
        assert lines[name] == "TypeError", (name, lines.get(name))
    for name in ["settle MARKED", "settle IN_FLIGHT", "settle 99", "settle -1", "mark nbytes=-5",
                 "mark shape=(-3,)"]:
        assert lines[name] == "ValueError", (name, lines.get(name))
    assert "junk step: True [2.0, 2.0, 2.0, 2.0] 1 2 0" in out
    assert out.rstrip().endswith("done")
