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

import torch_xla_donate as tdx
from torch_xla_donate import _C
from helpers import buffer_ptr, materialize, run_python


def _untouched(t, expected=None):
    """Not marked, no armed donor flag, not poisoned, value as before."""
    assert not tdx.is_donated(t) and not tdx.is_deleted(t)
    if t.device.type == "xla" and not t._is_view():
        assert not torch_xla._XLAC._get_buffer_donation(t)
    if expected is not None:
        assert torch.equal(t.detach().cpu(), expected)
    assert _C.marked_count() == 0


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
        with pytest.raises(TypeError, match=r"got \w+\. For the tensors .* use torch_xla_donate\.donate\(tree\)"):
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
    with pytest.raises(ValueError, match=r"XLA device, got one on '(cpu|meta)'.*t\.to\(torch_xla\.device\(\)\)"):
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


# -- autograd ------------------------------------------------------------------


def test_parameter_saved_for_backward_is_refused_until_backward_ran(dev):
    w = torch.nn.Parameter(materialize(torch.full((4,), 3.0, device=dev)))
    loss = (w * w).sum()  # saves w for backward
    with pytest.raises(ValueError, match=r"saved for backward by a live autograd graph.*backward first"):
        tdx.donate_buffer(w)
    _untouched(w, torch.full((4,), 3.0))
    loss.backward()  # frees what it saved: now donating is safe
    grad = w.grad
    torch_xla.sync()
    assert grad.cpu().tolist() == [6.0] * 4
    tdx.donate_buffer(w)
    with torch.no_grad():
        new_w = w - 0.5 * grad
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and new_w.cpu().tolist() == [0.0] * 4


def test_graph_saving_a_marked_parameter_drops_the_mark_at_the_step(dev):
    """Marked first, saved for backward after: the barrier drops the mark
    (a warning), so the backward that follows still finds its input."""
    w = torch.nn.Parameter(materialize(torch.full((4,), 3.0, device=dev)))
    tdx.donate_buffer(w)
    loss = (w * w).sum()
    with pytest.warns(tdx.DroppedDonationWarning, match=r"f32\[4\].*saved for backward by a live autograd graph"):
        torch_xla.sync(wait=True)
    _untouched(w, torch.full((4,), 3.0))
    loss.backward()
    torch_xla.sync(wait=True)
    assert w.grad.cpu().tolist() == [6.0] * 4
    assert _C.step_stats()["dropped"] == 1  # the newest step that donated


def test_non_leaf_saved_for_backward_is_refused(dev):
    x = torch.nn.Parameter(materialize(torch.zeros(3, device=dev)))
    e = x.exp()  # exp saves its own result: an alias of e's buffer
    h = x * 2 + 1
    torch_xla.sync()
    with pytest.raises(ValueError, match="an autograd graph that saved it for backward"):
        tdx.donate_buffer(e)
    y = (h * h).sum() + e.sum()  # mul saves h itself
    with pytest.raises(ValueError, match="is saved for backward by a live autograd graph"):
        tdx.donate_buffer(h)
    y.backward()
    torch_xla.sync()
    assert x.grad.cpu().tolist() == pytest.approx([5.0] * 3)  # 2 * 2 * h + exp(0)


def test_leaf_requiring_grad_with_no_graph_can_be_donated(dev):
    w = torch.nn.Parameter(materialize(torch.ones(4, device=dev)))
    out = (w * 2).sum()  # a graph that saves only the constant
    tdx.donate_buffer(w)
    with torch.no_grad():
        new_w = w + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and isinstance(w, torch.nn.Parameter)
    assert new_w.cpu().tolist() == [2.0] * 4


# -- dtypes and shapes: documented correct behaviour -------------------------


@pytest.mark.parametrize("dtype,fill,update", [
    (torch.int32, 7, lambda t: t + 1),
    (torch.int64, -3, lambda t: t * 2),
    (torch.bool, True, lambda t: ~t),
    (torch.uint8, 200, lambda t: t // 2),
    (torch.complex64, 1 + 2j, lambda t: t * 1j),
    (torch.bfloat16, 1.5, lambda t: t * 2),
], ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else "")
def test_any_dtype_is_donated_like_float(dev, dtype, fill, update):
    t = materialize(torch.full((8,), fill, dtype=dtype, device=dev))
    expected = update(torch.full((8,), fill, dtype=dtype))
    tdx.donate_buffer(t)
    new = update(t)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t)
    with pytest.raises(tdx.DonatedBufferError):
        t.cpu()
    assert torch.equal(new.cpu(), expected)


def test_output_of_another_dtype_of_the_same_size_can_take_the_buffer(dev):
    """XLA pairs donated buffers with outputs by byte size: f32[4] can hold s32[4]."""
    t = materialize(torch.arange(4.0, device=dev))
    tdx.donate_buffer(t)
    as_int = (t * 2).to(torch.int32)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and as_int.cpu().tolist() == [0, 2, 4, 6]


def test_zero_size_tensor(dev):
    """Zero bytes: taken by a zero-byte output if there is one (and then
    poisoned like any donation), else an unused donation."""
    z = materialize(torch.empty(0, device=dev))
    tdx.donate_buffer(z)
    out = z + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(z) and out.shape == (0,)
    lonely = materialize(torch.empty(0, 3, device=dev))
    tdx.donate_buffer(lonely)
    other = torch.ones(2, device=dev) * 2
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[0,3\]"):
        torch_xla.sync(wait=True)
    _untouched(lonely)
    assert lonely.shape == (0, 3)


def test_scalars_are_refused_because_torch_xla_shares_their_buffers(dev):
    """torch_xla hands one cached device buffer to every 0-dim tensor of the
    same value moved to the device; donating one used to delete the value
    for all of them, and for the constant in ``t * 2.5`` too."""
    a = torch.tensor(2.5, device=dev)
    b = torch.tensor(2.5).to(dev)
    c = torch.full((), 2.5, device=dev)
    materialize(a, b, c)
    assert buffer_ptr(a) == buffer_ptr(b) == buffer_ptr(c)  # one buffer, three tensors
    computed = materialize(torch.ones(4, device=dev).sum())
    for s in (a, b, c, computed):
        with pytest.raises(ValueError, match=r"f32\[\] is 0-dimensional.*do not donate it"):
            tdx.donate_buffer(s)
    scaled = torch.ones(2, device=dev) * 2.5
    torch_xla.sync(wait=True)
    assert scaled.cpu().tolist() == [2.5, 2.5]
    for s in (a, b, c):
        _untouched(s, torch.tensor(2.5))


def test_donating_a_tree_skips_its_scalars(dev):
    """A functional optimizer's state holds a step counter: ``donate(tree)``
    marks the real buffers and leaves 0-dim tensors alone, as it does numbers."""
    w = materialize(torch.ones(4, device=dev))
    step = torch.tensor(7.0).to(dev)  # the cached buffer of 7.0
    materialize(step)
    assert tdx.donate({"w": w, "step": step, "lr": 0.1}) == 1
    assert tdx.is_donated(w) and not tdx.is_donated(step)
    new_w, new_step = w * 2, step + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(w) and new_w.cpu().tolist() == [2.0] * 4
    assert step.item() == 7.0 and new_step.item() == 8.0
    assert torch.tensor(7.0).to(dev).item() == 7.0  # the cache is intact


def test_tensor_moved_to_the_device_needs_no_step(dev):
    """``cpu_tensor.to(device)`` is device data at once: it can be donated
    before any step."""
    t = torch.arange(3.0).to(dev)
    tdx.donate_buffer(t)
    assert tdx.is_donated(t)
    new = t + 1
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and new.cpu().tolist() == [1.0, 2.0, 3.0]


# -- tensor subclasses ---------------------------------------------------------


class Tagged(torch.Tensor):
    def tag(self):
        return "tagged"


def test_as_subclass_is_a_view_and_says_so(dev):
    t = torch.ones(4, device=dev).as_subclass(Tagged)
    torch_xla.sync()
    with pytest.raises(ValueError, match=r"is a view \(.*as_subclass"):
        tdx.donate_buffer(t)
    _untouched(t, torch.ones(4))


def test_subclass_sharing_the_tensor_can_be_donated_and_keeps_its_methods(dev):
    plain = materialize(torch.ones(4, device=dev))
    t = torch.Tensor._make_subclass(Tagged, plain)
    del plain
    tdx.donate_buffer(t)
    new = torch.Tensor.add(t, 1)
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and isinstance(t, Tagged) and t.tag() == "tagged"
    with pytest.raises(tdx.DonatedBufferError):
        t + 1
    assert new.cpu().tolist() == [2.0] * 4


def test_wrapper_subclass_has_no_buffer_of_its_own(dev):
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                       device=inner.device)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    inner = materialize(torch.ones(4, device=dev))
    w = Wrapper(inner)
    with pytest.raises(TypeError, match="Wrapper is a tensor subclass with its own __torch_dispatch__.*"
                                        "Donate the XLA tensors it wraps"):
        tdx.donate_buffer(w)
    assert _C.marked_count() == 0
    _untouched(inner, torch.ones(4))
    tdx.donate_buffer(w.inner)  # the advice works
    assert tdx.is_donated(inner)
    tdx.undonate(inner)


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
    "settle(None)": lambda: _C.settle(None, V.CONSUMED),
    "settle('x')": lambda: _C.settle("x", V.CONSUMED),
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
print("junk step:", tdx.is_deleted(p), new.cpu().tolist(), stats["consumed"], stats["dropped"], stats["pending"])
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
