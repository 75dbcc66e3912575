"""A KV cache kept as transformers' ``StaticCache`` keeps it, in plain torch:
4-D [batch, heads, positions, head_dim] tensors written in place with
``index_copy_(2, pos, k)`` at a position held on the device, then read by
the attention of the same step.

torch_xla aliases a tensor updated in place to itself, so donating the cache
has nothing to add: each cache tensor must be reported "updated in place",
stay readable and in its first buffer, and hold what it holds without
donation.  What costs memory is how the attention reads the updated cache
(README, "Decoding with a KV cache"): ``einsum`` over the 4-D cache lets
XLA:CPU read it where it is (no temporary near the cache's size), which is
the form the README recommends; ``torch.matmul`` (HF's eager attention) makes
copies, which is only printed here, not promised.
tools/repros/hf_static_cache_decode.py runs the real thing with transformers.

Each run is a process of its own: the XLA dump flag is process-global.
"""
import json

import pytest
from helpers import run_python

B, H, P, D = 4, 8, 1024, 64  # each cache tensor 8 MiB
CACHE_MIB = 2 * B * H * P * D * 4 / 2**20

_STEP = """
import glob, json, os, re, tempfile
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla_donate as tdx

READ, DONATE = {read!r}, {donate}
B, H, P, D = {B}, {H}, {P}, {D}
dev = torch_xla.device()
torch.manual_seed(0)
keys, values = torch.zeros(B, H, P, D).to(dev), torch.zeros(B, H, P, D).to(dev)
x = torch.randn(B, H, 1, D).to(dev)
pos = torch.tensor([0], device=dev)
torch_xla.sync(); xm.wait_device_ops()
pointer = torch_xla._XLAC._unsafe_buffer_pointer
first = [pointer(keys), pointer(values)]
for step in range(3):
    if DONATE:
        tdx.donate([keys, values])
    keys.index_copy_(2, pos, x * 2)  # StaticLayer.update
    values.index_copy_(2, pos, x * 3)
    q = x * D ** -0.5
    if READ == "matmul":  # HF's eager attention
        x = torch.matmul(q, keys.transpose(2, 3)).softmax(-1) @ values
    else:
        x = torch.einsum("bhtk,bhkd->bhtd", torch.einsum("bhtd,bhkd->bhtk", q, keys).softmax(-1),
                         values)
    pos = pos + 1
    torch_xla.sync(); xm.wait_device_ops()
temp = 0.0
for path in glob.glob(os.path.join(os.environ["DUMP"], "*memory-usage-report.txt")):
    for match in re.finditer(r"size ([\\d.]+)(B|KiB|MiB|GiB), preallocated-temp", open(path).read()):
        temp = max(temp, float(match[1]) * {{"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 1024}}[match[2]])
report = tdx.last_step_report()
print("RESULT", json.dumps({{
    "in_first_buffers": [pointer(keys), pointer(values)] == first,
    "updated_in_place": report.updated_in_place if report else None,
    "reused": report.reused if report else None,
    "out": x.flatten()[:64].cpu().tolist(),
    "keys": keys[:, :, :4].flatten()[::7].cpu().tolist(),
    "values": values[:, :, :4].flatten()[::7].cpu().tolist(),
    "temp_mib": temp,
}}))
"""


def _run(read, donate, tmp_path):
    dump = tmp_path / f"{read}-{donate}"
    code = _STEP.format(read=read, donate=donate, B=B, H=H, P=P, D=D)
    out = run_python(code, env={"DUMP": str(dump), "TF_CPP_MIN_LOG_LEVEL": "2",
                                "XLA_FLAGS": f"--xla_dump_to={dump} --xla_cpu_use_xnnpack=false"})
    return json.loads(out.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static_cache")
    return {(read, donate): _run(read, donate, tmp)
            for read in ("matmul", "einsum") for donate in (False, True)}


@pytest.mark.parametrize("read", ["matmul", "einsum"])
def test_donated_static_cache_is_updated_in_place_and_keeps_its_values(runs, read):
    plain, donated = runs[(read, False)], runs[(read, True)]
    assert donated["updated_in_place"] == 2 and donated["reused"] == 0, donated
    assert plain["in_first_buffers"] and donated["in_first_buffers"]
    for key in ("out", "keys", "values"):
        assert donated[key] == plain[key], key


def test_einsum_reads_the_updated_cache_where_it_is(runs):
    matmul, einsum = runs[("matmul", True)], runs[("einsum", True)]
    print(f"XLA temporaries: matmul {matmul['temp_mib']:.1f} MiB, einsum "
          f"{einsum['temp_mib']:.1f} MiB (cache {CACHE_MIB:.0f} MiB)")
    assert einsum["temp_mib"] < 0.1 * CACHE_MIB, einsum["temp_mib"]
    for key in ("out", "keys", "values"):
        assert einsum[key] == pytest.approx(matmul[key], rel=1e-5, abs=1e-6), key
