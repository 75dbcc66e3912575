"""Several devices in one process: ``torch_xla.launch`` on CPU runs one
thread per device (``CPU_NUM_DEVICES``), and every thread's barrier syncs its
own device only.  Each barrier must commit only its device's marks and judge
only its device's verdicts; otherwise one thread's barrier takes the other
threads' marks, finds their buffers alive and calls them unused.

Collectives (``xm.all_reduce``) between these threads are not supported by
torch_xla on CPU: they hang in XLA's rendezvous with or without this package
(pytorch/xla#5005, #9089), so the replicas here train independently.

The device count is process-global: everything runs in one subprocess.
"""
import json
import subprocess
import sys

import pytest
from helpers import child_env

STEPS = 6

_CODE = r"""
import json, os, warnings
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

STEPS = {steps}

def replica(index):
    warnings.simplefilter("error")  # any donation warning fails the replica
    import torch_xla_donate as tdx
    dev = torch_xla.device()
    rank = xr.global_ordinal()
    p = torch.full((128, 128), float(rank)).to(dev)
    g = torch.ones(128, 128).to(dev)
    torch_xla.sync()
    xm.wait_device_ops()
    first = torch_xla._XLAC._unsafe_buffer_pointer(p)
    olds, ptrs = [], []
    for step in range(STEPS):
        olds.append(p)
        tdx.donate_buffer(p)
        p = p - 0.5 * g
        torch_xla.sync()  # wait=False: the next barrier settles the verdict
        xm.wait_device_ops(torch_xla._XLAC._xla_real_devices([str(dev)]))  # for the pointer
        ptrs.append(torch_xla._XLAC._unsafe_buffer_pointer(p))
    deleted = [tdx.is_deleted(t) for t in olds]
    try:
        olds[0].sum()
        poisoned = False
    except tdx.DonatedBufferError:
        poisoned = True
    line = "REPLICA " + json.dumps({"rank": rank, "device": str(dev), "deleted": deleted,
          "same_ptr": [q == first for q in ptrs], "poisoned": poisoned,
          "value": p[0, 0].item()}) + "\n"
    os.write(1, line.encode())  # one write: the replicas' threads never interleave lines

if __name__ == "__main__":
    torch_xla.launch(replica, args=())

    # One thread, two devices: torch_xla.sync() syncs the default device
    # only; the mark on xla:1 must wait for xla:1's own barrier.
    import torch_xla_donate as tdx
    a = torch.zeros(64, 64).to("xla:0")
    b = torch.zeros(64, 64).to("xla:1")
    torch_xla.sync()
    torch_xla._XLAC._xla_step_marker("xla:1", [], wait=True)
    xm.wait_device_ops()
    old_a, old_b = a, b
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdx.donate_buffer(a)
        tdx.donate_buffer(b)
        a = a + 1
        b = b + 2
        torch_xla.sync()
        xm.wait_device_ops()
        first = {"a_deleted": tdx.is_deleted(old_a), "b_still_marked": tdx.is_donated(old_b)}
        torch_xla._XLAC._xla_step_marker("xla:1", [], wait=True)
        xm.wait_device_ops()
        second = {"b_deleted": tdx.is_deleted(old_b), "b_value": b[0, 0].item()}
    print("SINGLE " + json.dumps({**first, **second, "warnings": [str(w.message) for w in caught]}))
""".replace("{steps}", str(STEPS))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # torch_xla.launch pickles the replica function by its module: it must
    # live in a script file run as __main__, not in ``python -c``.
    script = tmp_path_factory.mktemp("launch") / "launch_replicas.py"
    script.write_text(_CODE)
    env = child_env(CPU_NUM_DEVICES="2")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    replicas = [json.loads(x[len("REPLICA "):]) for x in lines if x.startswith("REPLICA ")]
    single = [json.loads(x[len("SINGLE "):]) for x in lines if x.startswith("SINGLE ")]
    return sorted(replicas, key=lambda r: r["rank"]), single


def test_each_launched_replica_reuses_its_buffer_every_step(report):
    replicas, _ = report
    assert [r["device"] for r in replicas] == ["xla:0", "xla:1"]
    for r in replicas:
        assert r["deleted"] == [True] * STEPS
        assert r["same_ptr"] == [True] * STEPS
        assert r["poisoned"] is True
        assert r["value"] == r["rank"] - 0.5 * STEPS


def test_a_barrier_leaves_the_marks_of_other_devices_for_their_own_barrier(report):
    _, single = report
    assert single == [
        {"a_deleted": True, "b_still_marked": True, "b_deleted": True, "b_value": 2.0, "warnings": []}
    ]
