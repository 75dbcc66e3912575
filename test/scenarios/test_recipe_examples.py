"""The examples the README's recipes point to and no other test runs: SPMD
(always) and torchopt (where torchopt is installed; it is not a dependency)."""
import pathlib
import re
import subprocess
import sys

from helpers import child_env

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _run(name, *args) -> str:
    env = child_env()
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_spmd_example_donates_every_shard_every_step():
    out = _run("spmd_sharded_state.py", "--devices", "4", "--steps", "3")
    assert "devices: 4; sharding: {devices=[4,1]0,1,2,3}" in out
    assert "the old state is poisoned: DonatedBufferError" in out
    assert re.search(r"3 step\(s\) donated 12 buffer\(s\)", out), out
    assert re.search(r"reused \(poisoned\)\s+12\b", out), out


def test_torchopt_example_learns_and_donates_params_and_moments():
    out = _run("torchopt_adam.py", "--steps", "6", "--width", "64")
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0], out
    # w, b and Adam's two moments of each: 6 tensors a step, all reused.
    assert re.search(r"6 step\(s\) donated 36 buffer\(s\)", out), out
    assert re.search(r"reused \(poisoned\)\s+36\b", out), out
