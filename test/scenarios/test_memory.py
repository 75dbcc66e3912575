"""Peak memory: donation must keep one copy of a large state, not two.

Each mode runs in its own process: VmHWM (peak resident memory) never goes
down, so two modes in one process would hide each other.
"""
import pytest
from helpers import run_python

STATE_MIB = 256

_LOOP = """
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla_donate as tdx

def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

dev = torch_xla.device()
n = {mib} * 1024 * 1024 // 4
p = torch.zeros(n, device=dev)
g = torch.full((1,), 0.5, device=dev)
torch_xla.sync(); xm.wait_device_ops()
base = peak_mib()
for _ in range(4):
    if {donate}:
        tdx.donate_buffer(p)
    p = p * 0.9 + g
    torch_xla.sync(); xm.wait_device_ops()
print("growth_mib", peak_mib() - base, "value", p[0].item())
"""


def _growth(donate: bool) -> float:
    out = run_python(_LOOP.format(mib=STATE_MIB, donate=donate)).stdout.split()
    return float(out[out.index("growth_mib") + 1]), float(out[out.index("value") + 1])


def test_donation_keeps_peak_memory_flat():
    plain, plain_value = _growth(donate=False)
    donated, donated_value = _growth(donate=True)
    assert plain > 0.75 * STATE_MIB, f"the plain loop should need a second copy, grew {plain:.0f} MiB"
    assert donated < 0.1 * STATE_MIB, f"the donated loop grew {donated:.0f} MiB"
    assert donated_value == pytest.approx(plain_value)
