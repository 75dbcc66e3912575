"""SPMD: sharded tensors can be donated, are poisoned after the step, and the
compiled HLO aliases each shard.  Sharded tensors have no single buffer
pointer, so the evidence is the HLO's ``input_output_alias`` and the deletion
of the donated data.

SPMD is process-global: every check runs in one subprocess (they are slow to
start) and the tests read its report.
"""
import glob
import json
import os

import pytest
from helpers import run_python

_CODE = r"""
import json, warnings
import numpy as np
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
xr.use_spmd()
import torch_xla_donate as tdx
from torch_xla_donate import _xla

dev = torch_xla.device()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
gen = torch.Generator().manual_seed(0)
out = {"devices": n}

def sharded(shape, spec):
    t = torch.randn(*shape, generator=gen).to(dev)
    if spec is not None:
        xs.mark_sharding(t, mesh, spec)
    return t

def settle():
    torch_xla.sync()
    xm.wait_device_ops()

def unused_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]

def raises_donated(t):
    try:
        t.sum()
    except tdx.DonatedBufferError:
        return True
    return False

# Every core path on sharded data.
p = sharded((64, 48), ("data", None))
g = sharded((64, 48), ("data", None))
settle()
out["spec"] = torch_xla._XLAC._get_xla_sharding_spec(p)
out["in_flight"] = _xla.has_pending_ir([p, g])
out["use_count"] = torch._C._storage_Use_Count(p.untyped_storage()._cdata)
out["deleted_before"] = _xla.buffer_deleted(p)
try:
    torch_xla._XLAC._unsafe_buffer_pointer(p)
    out["pointer"] = "available"
except RuntimeError:
    out["pointer"] = "raises"

# A row-sharded functional update (shards f32[16,48]), wait=True.
expected = (p.cpu() * 0.9 + g.cpu())
old = p
tdx.donate_buffer(p)
out["flag_set_by_marking"] = torch_xla._XLAC._get_buffer_donation(p)
p = p * 0.9 + g
settle()
out["row"] = {
    "deleted": tdx.is_deleted(old),
    "buffer_deleted": _xla.buffer_deleted(old),
    "poisoned_use_raises": raises_donated(old),
    "value_ok": torch.allclose(p.cpu(), expected),
    "spec_kept": torch_xla._XLAC._get_xla_sharding_spec(p) == out["spec"],
}

# The same without donation (shards f32[16,40]): the HLO reference.
q = sharded((64, 40), ("data", None))
settle()
old_q = q
q = q * 0.9 + 1
settle()
out["reference_deleted"] = tdx.is_deleted(old_q) or _xla.buffer_deleted(old_q)

# Step after step with sync(wait=False): settled by the next barrier.
r = sharded((64, 24), ("data", None))
settle()
olds = []
for _ in range(3):
    olds.append(r)
    tdx.donate_buffer(r)
    r = r + 1
    torch_xla.sync(wait=False)
out["async_deleted"] = [tdx.is_deleted(t) for t in olds]

# Replicated sharding.
a, b = sharded((32, 8), (None, None)), sharded((32, 8), (None, None))
settle()
old = a
tdx.donate_buffer(a)
a = a - b
settle()
out["replicated_deleted"] = tdx.is_deleted(old)

# XLA pairs donors with outputs by shard byte size, whatever the sharding:
# rows f32[16,16] can back the column shards f32[64,4] of another output.
c = sharded((64, 16), ("data", None))
d = sharded((64, 16), (None, "data"))
settle()
expected = d.cpu() * 2 + c.cpu().sum()
old = c
tdx.donate_buffer(c)
e = d * 2 + c.sum()
xs.mark_sharding(e, mesh, (None, "data"))
settle()
out["cross_sharding"] = {"deleted": tdx.is_deleted(old), "value_ok": torch.allclose(e.cpu(), expected)}

# No output with the donor's shard size (f32[16,16] vs f32[64,5]): unused,
# the tensor keeps its value and is usable.
c = sharded((64, 16), ("data", None))
d = sharded((64, 20), (None, "data"))
settle()
before = c.cpu()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(c)
    e = d * 2 + c.sum()
    xs.mark_sharding(e, mesh, (None, "data"))
    settle()
    out["unused"] = {
        "deleted": tdx.is_deleted(c),
        "value_kept": torch.equal(c.cpu(), before),
        "unused": unused_warnings(caught),
    }

# mark_sharding after donate_buffer replaces the device data behind the
# tensor: the mark must follow it.
u = torch.randn(64, 56, generator=gen).to(dev)
v = torch.randn(64, 56, generator=gen).to(dev)
settle()
expected = u.cpu() + v.cpu()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(u)
    xs.mark_sharding(u, mesh, ("data", None))
    old = u
    u = u + v
    settle()
    out["resharded"] = {
        "deleted": tdx.is_deleted(old),
        "value_ok": torch.allclose(u.cpu(), expected),
        "unused": unused_warnings(caught),
    }

# scan with a sharded carry.
from torch_xla.experimental.scan import scan
carry = sharded((64, 32), ("data", None))
seq = torch.randn(3, 64, 32, generator=gen).to(dev)
xs.mark_sharding(seq, mesh, (None, "data", None))
settle()
expected = carry.cpu()
for x in seq.cpu():
    expected = expected * 0.5 + x
old = carry
tdx.donate_buffer(carry)
carry, _ = scan(lambda c, x: (c * 0.5 + x, c.sum()), carry, seq)
settle()
out["scan"] = {"deleted": tdx.is_deleted(old), "value_ok": torch.allclose(carry.cpu(), expected)}

# gradient_accumulation with a sharded carried tensor.
from torch_xla.experimental.gradient_accumulation import gradient_accumulation as _ga
from torch_xla_donate._native import call_gradient_accumulation
gradient_accumulation = lambda *a: call_gradient_accumulation(_ga, *a)
torch.manual_seed(0)
model = torch.nn.Linear(16, 4).to(dev)
data = torch.randn(2, 8, 16, generator=gen).to(dev)
acc = sharded((64, 72), ("data", None))
settle()
def step(x, acc):
    loss = model(x).pow(2).mean()
    return loss, acc + loss
old = acc
tdx.donate_buffer(acc)
loss, acc = gradient_accumulation(step, (data,), model, acc)
settle()
out["grad_acc"] = {"deleted": tdx.is_deleted(old), "loss": loss.item()}
tdx.donate_buffer(model.weight)
try:
    gradient_accumulation(step, (data,), model, acc)
    out["grad_acc"]["param_refused"] = False
except tdx.ParameterDonationError:
    out["grad_acc"]["param_refused"] = tdx.undonate(model.weight)

print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def spmd(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo")
    proc = run_python(
        _CODE,
        env={"CPU_NUM_DEVICES": "4", "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"},
    )
    line = next(out for out in proc.stdout.splitlines() if out.startswith("RESULT "))
    headers = []
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        with open(path) as f:
            headers.append(f.readline())
    return json.loads(line[len("RESULT "):]), headers


def test_core_paths_work_on_sharded_data(spmd):
    out, _ = spmd
    assert out["devices"] == 4 and out["spec"] == "{devices=[4,1]0,1,2,3}"
    assert out["in_flight"] == [False, False]
    assert out["use_count"] == 1
    assert out["deleted_before"] is False
    assert out["flag_set_by_marking"] is False  # armed only inside the step
    # No single pointer: deletion and the HLO are the evidence.
    assert out["pointer"] == "raises"


def test_sharded_tensor_is_donated_and_poisoned(spmd):
    out, _ = spmd
    assert out["row"] == {
        "deleted": True,
        "buffer_deleted": True,
        "poisoned_use_raises": True,
        "value_ok": True,
        "spec_kept": True,
    }
    assert out["reference_deleted"] is False


def _header(headers, shard_shape):
    """The compiled step whose parameters include ``shard_shape``."""
    found = [h for h in headers if "SyncTensorsGraph" in h and shard_shape in h.split("->")[0]]
    assert len(found) == 1, (shard_shape, found)
    return found[0]


def test_compiled_hlo_aliases_the_donated_shards(spmd):
    _, headers = spmd
    donated = _header(headers, "f32[16,48]")
    assert "input_output_alias={ {0}: (" in donated and "num_partitions=4" in donated
    # The output that takes the buffer is a shard of the same shape.
    assert "->(f32[16,48]" in donated
    reference = _header(headers, "f32[16,40]")
    assert "input_output_alias" not in reference


def test_async_steps_settle_sharded_donations(spmd):
    out, _ = spmd
    assert out["async_deleted"] == [True, True, True]


def test_replicated_tensor_is_donated(spmd):
    out, _ = spmd
    assert out["replicated_deleted"] is True


def test_donor_and_output_may_be_sharded_differently(spmd):
    out, _ = spmd
    assert out["cross_sharding"] == {"deleted": True, "value_ok": True}


def test_donation_without_an_output_of_its_shard_size_is_unused_and_kept(spmd):
    out, _ = spmd
    m = out["unused"]
    assert m["deleted"] is False and m["value_kept"] is True
    assert len(m["unused"]) == 1 and "f32[64,16]" in m["unused"][0]


def test_mark_sharding_after_donate_buffer_donates_the_new_shards(spmd):
    out, _ = spmd
    assert out["resharded"] == {"deleted": True, "value_ok": True, "unused": []}


def test_scan_and_gradient_accumulation_with_sharded_state(spmd):
    out, _ = spmd
    assert out["scan"] == {"deleted": True, "value_ok": True}
    ga = out["grad_acc"]
    assert ga["deleted"] is True and ga["loss"] > 0 and ga["param_refused"] is True


_WITH_AUTO = r"""
import warnings
import numpy as np
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
xr.use_spmd()
import torch_xla_donate as tdx
from torch_xla_donate import _guards
dev = torch_xla.device()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    up = torch.ones(64, 48).to(dev)  # host data until the next sync under SPMD
    try:
        tdx.donate_buffer(up)
        print("unsynced upload: marked")
    except ValueError as e:
        print("unsynced upload:", "sync first" if "torch_xla.sync()) first" in str(e) else str(e))
    p = torch.ones(64, 48).to(dev)
    xs.mark_sharding(p, mesh, ("data", None))
    torch_xla.sync(); xm.wait_device_ops()  # AUTO LINE: the first barrier
    tdx.donate_buffer(p)
    q = p * 2 + 1
    torch_xla.sync(); xm.wait_device_ops()
print("reads:", _guards.state("reads"), "donated:", tdx.is_deleted(p), "q:", q.cpu()[0, 0].item())
print("warned:", [(w.category.__name__, w.lineno) for w in caught])
"""


def test_auto_on_leaves_explicit_donation_working_and_says_why_it_does_nothing():
    """Auto cannot run under SPMD: it says so once, at the user's sync, and never decides the
    reads on a sample of its own (an upload holds host data there, which the reads decline:
    that switched donation off for the process).  An unsynced upload marked first gets the
    "sync first" error, and leaves donation on."""
    out = run_python(_WITH_AUTO, env={"CPU_NUM_DEVICES": "4", "TORCH_XLA_DONATE_AUTO": "1"}).stdout
    line = next(i for i, text in enumerate(_WITH_AUTO.splitlines(), 1) if "# AUTO LINE" in text)
    assert "unsynced upload: sync first" in out, out
    assert "reads: native reads donated: True q: 3.0" in out, out
    assert f"warned: [('AutoDonationUnavailableWarning', {line})]" in out, out
