"""reads (csrc/lazy/lazy_reads.h and _base/reads.py): the native twin and the
``_XLAC`` twin give torch_xla's own answers, in every state a tensor can be
in; the native one also counts the holders of a buffer; the guard declines
what it cannot read; the self-test and the environment switch fall back.

Each twin is tested against ``_XLAC`` itself.  For the native twin, the test
also checks that the native read answered (no silent fallback).
"""
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import Wrapper, materialize, run_python

from torch_xla_donate import _C
from torch_xla_donate._base import reads, reads_check, xla

X = torch_xla._XLAC
TWINS = ["native", "xlac"]


@pytest.fixture(params=TWINS)
def twin(request, dev):
    if request.param == "native":
        reads.tensor_id(torch.zeros(1).to(dev))  # the first read decides
        assert reads.path() == "native reads"
    return request.param


def _twin(name):
    return getattr(reads, name)


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
    """torch_xla's own answers, in the order of the twins' functions."""
    pending = X._check_tensor_need_materialization([t])[0]
    consumed = X._is_placecholder(t)
    live = not pending and not consumed
    handle = X._get_tensors_handle([t])[0] if live else 0
    owner = xla.buffer_owner_ids([t])[0] if live else None  # last: it caches an IR value
    return X._xla_get_tensor_id(t), pending, consumed, handle, owner


@pytest.mark.parametrize("state", sorted(STATES))
def test_every_read_agrees_with_xlac(twin, state, dev):
    t, other = STATES[state](dev)
    R = _twin(twin)
    if twin == "native":
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
def test_owner_ids_of_a_list_are_per_tensor(twin, state, dev):
    """torch_xla's list query names a shared buffer once; the twins answer per tensor."""
    t, other = STATES[state](dev)
    got = _twin(twin).owner_ids([t, other, t])
    expected = [_truth(x)[4] for x in (t, other, t)]
    assert got == expected


def test_native_facts_name_the_buffer_and_its_handle(twin, dev):
    if twin == "xlac":
        assert reads.xlac.facts(materialize(torch.ones(2).to(dev) + 0)) is None
        return
    t = materialize(torch.ones(2).to(dev) + 0)
    f = reads.native.facts(t)
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
def test_clean_tensors_have_the_expected_holders(twin, make, expected, dev):
    t = make(dev)
    got = _twin(twin).holders([t])[0]
    if twin == "xlac":
        assert got is None  # no _XLAC equivalent: unknown
        return
    assert got == reads.Holders(expected, expected, 1)


def test_a_clone_read_before_its_step_is_an_extra_holder(twin, dev):
    t = _clean(dev)
    c = t.clone()
    c.cpu()
    R = _twin(twin)
    assert R.buffer_key(c) == R.buffer_key(t) != 0
    h = R.holders([t])[0]
    if twin == "native":
        assert h.actual == h.expected + 1
    del c
    if twin == "native":
        h = R.holders([t])[0]
        assert h.actual == h.expected


def test_a_copy_held_only_by_autograd_is_an_extra_holder(twin, dev):
    t = _clean(dev)
    x = torch.randn(4).to(dev).requires_grad_()
    loss = (x * t.to(dev, copy=True)).sum()  # the copy lives on only in the graph
    materialize()
    R = _twin(twin)
    held = R.holders([t])[0]
    del loss
    freed = R.holders([t])[0]
    if twin == "xlac":
        assert held is None and freed is None
        return
    assert held.actual == held.expected + 1
    assert freed.actual == freed.expected


def test_a_replaced_tensor_shares_its_xla_tensor(twin, dev):
    p, s = _replaced(dev)
    got = _twin(twin).holders([p, s, _clean(dev)])
    if twin == "xlac":
        assert got == [None] * 3
        return
    assert [h.xla_tensor_refs for h in got] == [2, 2, 1]
    assert _twin(twin).tensor_id(p) == X._xla_get_tensor_id(s)


# -- The guard -------------------------------------------------------------------


def _stale_view(dev):
    base = materialize(torch.ones(4).to(dev) + 0)
    v = base[0:2]
    base.add_(1)  # v's functional wrapper must sync before torch_xla reads it
    return v


@pytest.mark.parametrize("make", [lambda dev: torch.ones(3), lambda dev: Wrapper(torch.ones(3)),
                                  _stale_view], ids=["cpu", "wrapper subclass", "stale view"])
def test_the_native_read_declines_what_it_cannot_read(make, dev):
    reads.tensor_id(torch.zeros(1).to(dev))
    t = make(dev)
    assert _C.lazy_facts(t) is None
    assert _C.lazy_tensor_id(t) is None and _C.lazy_holders([t]) == [None]
    if t.device.type == "xla" and type(t) is torch.Tensor:  # the fallback answers
        assert reads.native.tensor_id(t) == X._xla_get_tensor_id(t)


def test_the_learned_type_is_checked_by_name(dev):
    assert "not a torch_xla::XLATensorImpl" in _C.lazy_learn(torch.ones(2))
    assert _C.lazy_learn(torch.ones(2).to(dev)) == ""


@pytest.mark.parametrize("field", ["tensor_id", "pending", "has_value", "handle", "query_owner"])
def test_the_self_test_sees_a_wrong_native_answer(field, dev, monkeypatch):
    monkeypatch.setattr(reads_check, "CORRUPT", field)
    why = reads_check.run(torch.zeros(1).to(dev))
    assert why, f"a wrong {field} passed the self-test"
    monkeypatch.setattr(reads_check, "CORRUPT", None)
    assert reads_check.run(torch.zeros(1).to(dev)) is None


# -- The selector, in processes of their own ------------------------------------------

_FIRST_READ = """
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate._base import reads, reads_check
assert reads.path() {before}
assert not torch_xla._XLAC._xla_runtime_is_initialized(), "import started the runtime"
{setup}
x = torch.arange(4.0).to(torch_xla.device()) + 1
step, marks = _C.current_step(), _C.marked_count()
assert reads.tensor_id(x) == torch_xla._XLAC._xla_get_tensor_id(x)
assert torch_xla._XLAC._check_tensor_need_materialization([x]) == [True], "the self-test synced x"
assert _C.current_step() == step and _C.marked_count() == marks, "the self-test committed marks"
assert reads.is_pending(x) and _C.lazy_enabled() == (reads.path() == "native reads")
print("PATH:", reads.path())
print("SUMMARY:", [l for l in str(tdx.summary()).splitlines() if "tensor reads" in l][0])
print("METRICS:", tdx.metrics_report().split("Setting: TensorReads\\n  Value: ")[1].splitlines()[0])
"""


def _first_read(setup="", env=None, before='== "not decided yet"'):
    out = run_python(_FIRST_READ.format(setup=setup, before=before), env=env).stdout
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


_USER_MARK = """
import torch_xla.core.xla_model as xm
m = torch.ones(3).to(torch_xla.device()) + 0
torch_xla.sync(); xm.wait_device_ops()
tdx.donate_buffer(m)
"""


@pytest.mark.parametrize("setup, env", [("", {}), (_USER_MARK, {}),
                                        ("", {"XLA_ENABLE_PARAM_ALIASING": "0"})],
                         ids=["plain", "a donation marked", "aliasing off"])
def test_the_first_read_decides_and_leaves_nothing_behind(setup, env):
    out = _first_read(setup=setup, env=env)
    assert out["PATH"] == "native reads"
    assert out["SUMMARY"].endswith("tensor reads: native reads")
    assert out["METRICS"] == "native reads"


def test_the_environment_switch_forces_the_fallback():
    out = _first_read(env={reads.ENV: "0"}, before='== "_XLAC (TORCH_XLA_DONATE_NATIVE_READS=0)"')
    assert out["PATH"] == "_XLAC (TORCH_XLA_DONATE_NATIVE_READS=0)"
    assert "_XLAC (TORCH_XLA_DONATE_NATIVE_READS=0)" in out["SUMMARY"]


def test_a_self_test_mismatch_falls_back_and_says_why():
    out = _first_read(setup='reads_check.CORRUPT = "tensor_id"')
    assert out["PATH"].startswith("_XLAC (tensor_id of a fresh tensor: native ")
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
    assert reads.holders([fake]) == [None]
assert reads.holders([W(torch.ones(3).to(dev))]) == [None]
assert reads.path() == "not decided yet", reads.path()
"""


def test_a_first_read_the_self_test_cannot_use_waits():
    """A fake tensor or a wrapper subclass on the XLA device, first: no verdict yet."""
    assert _first_read(setup=_NOT_TESTABLE_FIRST)["PATH"] == "native reads"


_NO_FUNCTIONALIZATION = """
import torch, torch_xla
import torch_xla.core.xla_model as xm
from torch_xla_donate import _C
from torch_xla_donate._base import reads, xla
X = torch_xla._XLAC
dev = torch_xla.device()
def sync(): torch_xla.sync(); xm.wait_device_ops()
base = torch.arange(8.0).to(dev) + 1; sync()
v = base[2:5]                       # torch_xla's own view: base becomes one too
copy = base.to(dev, copy=True)
pending = base * 2
stale = base[0:2]; base.add_(1)     # a view with an update pending
for t in (base, v, copy, pending, stale):
    n = [reads.tensor_id(t), reads.is_pending(t)]
    assert n == [X._xla_get_tensor_id(t), X._check_tensor_need_materialization([t])[0]], n
sync()
assert reads.holders([base, copy]) == [None, None]  # torch_xla's views hold buffers unseen
print("PATH:", reads.path())
print("FUNCTIONAL:", [_C.lazy_facts(t)[0] for t in (copy,) if _C.lazy_facts(t)])
"""


def test_without_functionalization_reads_agree_or_fall_back():
    out = run_python(_NO_FUNCTIONALIZATION, env={"XLA_DISABLE_FUNCTIONALIZATION": "1"}).stdout
    path = out.split("PATH: ", 1)[1].splitlines()[0]
    assert path == "native reads" or path.startswith("_XLAC (")
    if path == "native reads":
        assert "FUNCTIONAL: [False]" in out  # read bare XLATensorImpls, not wrappers


# The process's first donation, made each way a user makes one: the reads are
# decided outside any commit (marking decides; a commit never runs the
# self-test), and that first step's donations are used.  (A self-test run
# inside a commit once left that step's donations unused: seen in
# test_xla_cpu.py's probe, whose first read came at the barrier.)
_FIRST_DONATION = """
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate._base import reads
dev = torch_xla.device()
p = torch.ones(64, device=dev) * 2; q = torch.ones(64, device=dev) * 3
g = torch.ones(64, device=dev)
torch_xla.sync()
assert not reads.decided()
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
reads.tensor_id(new[0])
print("PATH:", reads.path())
"""


@pytest.mark.parametrize("how", ["donate_buffer", "donate", "donating", "compiled"])
def test_the_first_donation_of_a_process_is_used(how):
    out = run_python(_FIRST_DONATION.format(how=how)).stdout
    got = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert got["DELETED"] == "[True, True]" and got["VALUE"] == "[True, True]", out
    assert got["PATH"] == "native reads"


# -- The hot path (csrc/base/tensor_access.h) ----------------------------------------


@pytest.mark.parametrize("state", sorted(STATES) + ["stale view"])
def test_the_hot_paths_answers_are_torch_xlas_on_both_paths(reads_path, state, dev):
    """TensorId, HasPendingIr and BufferDeleted, which marking, the commit
    and the verdicts ask per tensor, read in place with native reads on and
    ask the bound ``_XLAC`` callables with them off: the same answers."""
    t = _stale_view(dev) if state == "stale view" else STATES[state](dev)[0]
    assert _C.lazy_enabled() == (reads_path == "native")
    got = _C.hot_path_reads(t)
    assert _C.pending_flags([t, torch.ones(2), t]) == [got[1], False, got[1]]
    assert got == (X._xla_get_tensor_id(t), X._check_tensor_need_materialization([t])[0],
                   X._is_placecholder(t))


def test_a_pass_over_many_tensors_answers_as_for_each_alone(reads_path, dev):
    """The commit's passes prefetch, level by level for all their tensors
    at once, what the native reads will read (lazy_reads.h PrefetchLazy),
    stepping over whatever those reads decline.  A list that mixes every
    state with CPU tensors, a wrapper subclass and a stale view gets, tensor
    by tensor, the answers each gets alone: torch_xla's own for XLA tensors."""
    tensors = [STATES[s](dev)[0] for s in sorted(STATES)]
    tensors += [torch.ones(3), Wrapper(torch.ones(3)), _stale_view(dev)]
    alone = [_C.pending_flags([t])[0] for t in tensors]
    assert _C.pending_flags(tensors) == alone
    assert alone[:len(STATES)] == [X._check_tensor_need_materialization([t])[0]
                                   for t in tensors[:len(STATES)]]
