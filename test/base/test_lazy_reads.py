"""reads (csrc/lazy/lazy_reads.h, read through _xla.py): the native reads give
torch_xla's own answers (``_XLAC``, the reference here), in every state a
tensor can be in; they count the holders of a buffer; the guard declines
what it cannot read; a guard that disagrees switches donation off.
"""
import types

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import Wrapper, materialize, run_python

from torch_xla_donate import _C
from torch_xla_donate import _guards as guards
from torch_xla_donate import _xla as xla

X = torch_xla._XLAC
# torch_xla 2.7's owner query takes the output tensors only; 2.8 added the
# list of tensors to hand back uncloned.
_TAKES_UNCLONED = "uncloned" in (X._get_tensors_xla_device_data_node.__doc__ or "")


def _owner_query(t):
    """torch_xla's owner query for one tensor: the id its buffer is filed
    under (-1: none).  It caches an IR value on ``t``: ask it last."""
    args = ([t], [t]) if _TAKES_UNCLONED else ([t],)
    owner = X._get_tensors_xla_device_data_node(*args)[0][0]
    return -1 if owner == X._get_seed_info_id() else owner


@pytest.fixture
def R(dev, native_reads):
    """The native reads, by what each answers."""
    return types.SimpleNamespace(
        tensor_id=_C.lazy_tensor_id, is_pending=_C.lazy_is_pending,
        is_consumed=_C.lazy_is_consumed, buffer_key=xla.read_buffer_key,
        owner_ids=_C.lazy_owner_ids, holders=xla.read_holders, facts=xla.read_facts)


def _donated(dev):
    """A tensor whose buffer torch_xla's raw donation consumed, and its step's output."""
    donor = materialize(torch.ones(2, 3).to(dev) + 0)
    assert xla.real("_set_buffer_donation")(donor, True)
    out = donor * 3
    xla.real("_xla_sync_multi")([out, donor], devices=[], wait=True, sync_xla_data=True)
    xm.wait_device_ops()
    assert X._is_placecholder(donor)
    return donor, out


def _replaced(dev):
    """Two Python tensors sharing one XLATensor (``_replace_xla_tensor``)."""
    p, s = materialize(torch.zeros(4).to(dev) + 0, torch.ones(4).to(dev) + 0)
    X._replace_xla_tensor(p, s)
    return p, s


# Each state: dev -> (the tensor read, a tensor it may share its buffer with).
STATES = {
    "fresh": lambda dev: (torch.arange(6.0).to(dev),) * 2,
    "traced": lambda dev: (materialize(torch.arange(6.0).to(dev) + 1),) * 2,
    "pending": lambda dev: (materialize(torch.arange(6.0).to(dev) + 1) * 2,) * 2,
    "consumed": _donated,
    "output": lambda dev: _donated(dev)[::-1],
    "copied": lambda dev: (lambda s: (s.to(dev, copy=True), s))(materialize(torch.ones(3).to(dev) + 1)),
    "cloned": lambda dev: (lambda s: (s.clone(), s))(materialize(torch.ones(3).to(dev) + 1)),
    "replaced": _replaced,
    "view": lambda dev: (lambda s: (s[1:3], s))(materialize(torch.ones(5).to(dev) + 1)),
}


def _truth(t):
    """torch_xla's own answers, in the order of the reads' functions."""
    pending = X._check_tensor_need_materialization([t])[0]
    consumed = X._is_placecholder(t)
    live = not pending and not consumed
    handle = X._get_tensors_handle([t])[0] if live else 0
    owner = _owner_query(t) if live else None  # last: it caches an IR value
    return X._xla_get_tensor_id(t), pending, consumed, handle, owner


@pytest.mark.parametrize("state", sorted(STATES))
def test_every_read_agrees_with_xlac(R, state, dev):
    t, other = STATES[state](dev)
    assert _C.lazy_facts(t) is not None, f"the native read declined a {state} tensor"
    got_key, got_other_key = R.buffer_key(t), R.buffer_key(other)
    got = (R.tensor_id(t), R.is_pending(t), R.is_consumed(t), R.owner_ids([t])[0])
    tid, pending, consumed, handle, owner = _truth(t)
    other_handle = _truth(other)[3]
    assert got == (tid, pending, consumed, owner)
    # Keys: 0 exactly without a live buffer; equal exactly when one buffer.
    assert (got_key == 0) == (handle == 0)
    if handle:
        assert (got_key == got_other_key) == (handle == other_handle)


@pytest.mark.parametrize("state", ["traced", "copied", "cloned", "view"])
def test_owner_ids_of_a_list_are_per_tensor(R, state, dev):
    """torch_xla's list query names a shared buffer once; the reads answer per tensor."""
    t, other = STATES[state](dev)
    got = R.owner_ids([t, other, t])
    expected = [_truth(x)[4] for x in (t, other, t)]
    assert got == expected


def test_native_facts_name_the_buffer_and_its_handle(R, dev):
    t = materialize(torch.ones(2).to(dev) + 0)
    f = R.facts(t)
    assert (f.tensor_id, f.has_handle, f.has_value, f.pending) == (X._xla_get_tensor_id(t), True,
                                                                  True, False)
    assert f.handle == X._get_tensors_handle([t])[0] != 0
    assert f.buffer != 0 and f.is_functional


# -- Holders ------------------------------------------------------------------------


def _clean(dev):
    return materialize(torch.randn(4).to(dev) + 0)


def _read_into_op(dev):
    t = _clean(dev)
    _ = t * 2  # caches a device_data IR value on t: one more holder, expected
    return t


@pytest.mark.parametrize("make, expected", [(_clean, 1), (_read_into_op, 2)],
                         ids=["traced", "read into an op"])
def test_clean_tensors_have_the_expected_holders(R, make, expected, dev):
    t = make(dev)
    got = R.holders([t])[0]
    assert got == xla.Holders(expected, expected, 1)


def test_a_clone_read_before_its_step_is_an_extra_holder(R, dev):
    t = _clean(dev)
    c = t.clone()
    c.cpu()
    assert R.buffer_key(c) == R.buffer_key(t) != 0
    h = R.holders([t])[0]
    assert h.actual == h.expected + 1
    del c
    h = R.holders([t])[0]
    assert h.actual == h.expected


def test_a_copy_held_only_by_autograd_is_an_extra_holder(R, dev):
    t = _clean(dev)
    x = torch.randn(4).to(dev).requires_grad_()
    loss = (x * t.to(dev, copy=True)).sum()  # the copy lives on only in the graph
    materialize()
    held = R.holders([t])[0]
    del loss
    freed = R.holders([t])[0]
    assert held.actual == held.expected + 1
    assert freed.actual == freed.expected


def test_a_replaced_tensor_shares_its_xla_tensor(R, dev):
    p, s = _replaced(dev)
    got = R.holders([p, s, _clean(dev)])
    assert [h.xla_tensor_refs for h in got] == [2, 2, 1]
    assert R.tensor_id(p) == X._xla_get_tensor_id(s)


# -- The guard -------------------------------------------------------------------


def _stale_view(dev):
    base = materialize(torch.ones(4).to(dev) + 0)
    v = base[0:2]
    base.add_(1)  # v's functional wrapper must sync before torch_xla reads it
    return v


@pytest.mark.parametrize("make", [lambda dev: torch.ones(3), lambda dev: Wrapper(torch.ones(3)),
                                  _stale_view], ids=["cpu", "wrapper subclass", "stale view"])
def test_the_native_read_declines_what_it_cannot_read(make, dev, native_reads):
    t = make(dev)
    assert _C.lazy_facts(t) is None
    assert _C.lazy_tensor_id(t) is None and _C.lazy_holders([t]) == [None]
    if t.device.type == "xla" and type(t) is torch.Tensor:
        # No plain device data: pending, for marking and the commit alike.
        assert _C.pending_flags([t]) == [True]
    else:
        with pytest.raises(TypeError, match="takes XLA tensors"):
            _C.pending_flags([t])


def test_the_learned_type_is_checked_by_name(dev):
    assert "not a torch_xla::XLATensorImpl" in _C.lazy_learn(torch.ones(2))
    assert _C.lazy_learn(torch.ones(2).to(dev)) == ""


@pytest.mark.parametrize("field", ["tensor_id", "pending", "has_value", "handle"])
def test_the_guard_sees_a_wrong_native_answer(field, dev, monkeypatch):
    t = materialize(torch.ones(3).to(dev) + 0)
    monkeypatch.setattr(guards, "CORRUPT", field)
    why = guards._reads(t)
    assert why and why.startswith(f"{field if field != 'has_value' else 'consumed'}: native"), why
    monkeypatch.setattr(guards, "CORRUPT", None)
    assert guards._reads(t) is None


def test_the_guard_agrees_on_a_tensor_an_execution_still_writes(dev):
    """After ``sync()`` without a wait the output's buffer is filled by torch_xla's
    thread, maybe between the guard's native read and ``_XLAC``'s: the guard must not
    take that for a wrong read (it did about one time in six, switching donation off)."""
    w = materialize(torch.ones(64, 64).to(dev))
    disagreed = []
    for i in range(400):
        x = (w @ w + i).sum(0)
        torch_xla.sync()
        why = guards._reads(x)
        if why is not None:
            disagreed.append(why)
    assert disagreed == []


# -- The guard, in processes of their own ------------------------------------------

_FIRST_MARK = """
import warnings
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _guards as guards
assert guards.state("reads") == "not decided yet"
assert not torch_xla._XLAC._xla_runtime_is_initialized(), "import started the runtime"
{setup}
dev = torch_xla.device()
p = torch.ones(64, device=dev) * 2
g = torch.ones(64, device=dev)
torch_xla.sync(); xm.wait_device_ops()
met.clear_all()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(p)
    new = p - 0.5 * g
    torch_xla.sync(); xm.wait_device_ops(); tdx.settle()
print("PATH:", guards.state("reads"))
print("DELETED:", tdx.is_deleted(p))
kept = p.cpu().tolist() == [2.0] * 64 if not tdx.is_deleted(p) else "gone"
print("VALUE:", new.cpu().tolist() == [1.5] * 64, kept)
print("WARNED:", [w.category.__name__ for w in caught])
print("COMPILES:", met.metric_data("CompileTime")[0])
print("EXECUTIONS:", met.metric_data("ExecuteTime")[0])
print("ALIASES:", met.metric_data("InputOutputAliasCount")[1])
print("SUMMARY:", [l for l in str(tdx.summary()).splitlines() if "tensor reads" in l][0])
print("METRICS:", tdx.metrics_report().split("Setting: TensorReads\\n  Value: ")[1].splitlines()[0])
"""


def _first_mark(setup="", env=None):
    out = run_python(_FIRST_MARK.format(setup=setup), env=env).stdout
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


def test_the_first_donating_step_is_the_users_graph_alone():
    """The guard runs on the tensor being marked: no tensor or graph of its
    own, so torch_xla's metrics after ``met.clear_all()`` show one compile,
    one execution and one alias for a step that donates one tensor."""
    out = _first_mark()
    assert out["PATH"] == "native reads" and out["DELETED"] == "True"
    assert out["VALUE"] == "True gone"
    assert (out["COMPILES"], out["EXECUTIONS"], out["ALIASES"]) == ("1", "1", "1.0"), out
    assert out["SUMMARY"].endswith("tensor reads: native reads")
    assert out["METRICS"] == "native reads"


def test_a_guard_that_disagrees_switches_donation_off_and_says_why():
    out = _first_mark(setup='guards.CORRUPT = "tensor_id"')
    assert out["PATH"].startswith("off (tensor_id: native "), out
    assert out["DELETED"] == "False" and out["VALUE"] == "True True"
    assert out["WARNED"] == "['DonationDisabledWarning']"
    assert out["PATH"] in out["SUMMARY"] and out["PATH"] in out["METRICS"]


_NOT_TESTABLE_FIRST = """
from torch._subclasses.fake_tensor import FakeTensorMode
class W(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)
dev = torch_xla.device()
with FakeTensorMode():
    fake = torch.ones(3, device=dev)
    assert not guards.decide(fake)
assert not guards.decide(W(torch.ones(3).to(dev)))
assert guards.state("reads") == "not decided yet", guards.state("reads")
"""


def test_a_first_mark_the_guard_cannot_use_waits():
    """A fake tensor or a wrapper subclass on the XLA device, first: no verdict yet."""
    assert _first_mark(setup=_NOT_TESTABLE_FIRST)["PATH"] == "native reads"


_NO_FUNCTIONALIZATION = """
import torch, torch_xla
import torch_xla.core.xla_model as xm
from torch_xla_donate import _C
from torch_xla_donate import _guards as guards
from torch_xla_donate import _xla as xla
X = torch_xla._XLAC
dev = torch_xla.device()
def sync(): torch_xla.sync(); xm.wait_device_ops()
base = torch.arange(8.0).to(dev) + 1; sync()
v = base[2:5]                       # torch_xla's own view: base becomes one too
copy = base.to(dev, copy=True)
pending = base * 2
stale = base[0:2]; base.add_(1)     # a view with an update pending
guards.decide(copy)
for t in (copy, pending):
    n = [_C.lazy_tensor_id(t), _C.lazy_is_pending(t)]
    assert n == [X._xla_get_tensor_id(t), X._check_tensor_need_materialization([t])[0]], n
for t in (base, v, stale):  # torch_xla's own views (base is one now): no plain device data
    assert _C.lazy_tensor_id(t) is None and _C.pending_flags([t]) == [True]
    assert X._check_tensor_need_materialization([t]) == [True]
sync()
assert xla.read_holders([base, copy]) == [None, None]  # torch_xla's views hold buffers unseen
print("PATH:", guards.state("reads"))
print("FUNCTIONAL:", [_C.lazy_facts(t)[0] for t in (copy,) if _C.lazy_facts(t)])
"""


def test_without_functionalization_reads_agree():
    out = run_python(_NO_FUNCTIONALIZATION, env={"XLA_DISABLE_FUNCTIONALIZATION": "1"}).stdout
    assert "PATH: native reads" in out
    assert "FUNCTIONAL: [False]" in out  # read bare XLATensorImpls, not wrappers


# The process's first donation, made each way a user makes one: the guard
# decides at the first mark (or, for a compiled function's own, at its
# commit), and that first step's donations are used.
_FIRST_DONATION = """
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _guards as guards
dev = torch_xla.device()
p = torch.ones(64, device=dev) * 2; q = torch.ones(64, device=dev) * 3
g = torch.ones(64, device=dev)
torch_xla.sync()
assert not guards.decided()
def update(p, q, g):
    return p - 0.5 * g, q + g
how = {how!r}
if how == "donate_buffer":
    tdx.donate_buffer(p); tdx.donate_buffer(q); new = update(p, q, g)
elif how == "donate":
    tdx.donate([p, q]); new = update(p, q, g)
elif how == "donating":
    new = tdx.donating(update, donate_argnums=(0, 1))(p, q, g)
else:
    new = torch.compile(tdx.donating(update, donate_argnums=(0, 1)), backend="openxla")(p, q, g)
torch_xla.sync()
tdx.settle()
print("DELETED:", [tdx.is_deleted(p), tdx.is_deleted(q)])
print("VALUE:", [new[0].cpu().tolist() == [1.5] * 64, new[1].cpu().tolist() == [4.0] * 64])
print("PATH:", guards.state("reads"))
"""


@pytest.mark.parametrize("how", ["donate_buffer", "donate", "donating", "compiled"])
def test_the_first_donation_of_a_process_is_used(how):
    out = run_python(_FIRST_DONATION.format(how=how)).stdout
    got = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert got["DELETED"] == "[True, True]" and got["VALUE"] == "[True, True]", out
    assert got["PATH"] == "native reads"


# -- Many tensors at once ----------------------------------------------------------


@pytest.mark.usefixtures("native_reads")
def test_a_pass_over_many_tensors_answers_as_for_each_alone(dev):
    """The commit's passes prefetch, level by level for all their tensors
    at once, what the native reads will read (lazy_reads.h PrefetchLazy),
    stepping over whatever those reads decline.  A list that mixes every
    state with a stale view gets, tensor by tensor, the answers each gets
    alone: torch_xla's own (the stale view is declined: pending)."""
    tensors = [STATES[s](dev)[0] for s in sorted(STATES)] + [_stale_view(dev)]
    alone = [_C.pending_flags([t])[0] for t in tensors]
    assert _C.pending_flags(tensors) == alone
    assert alone[:len(STATES)] == [X._check_tensor_need_materialization([t])[0]
                                   for t in tensors[:len(STATES)]]
