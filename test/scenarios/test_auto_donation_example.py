"""examples/auto_donation.py: plain, annotated and automatic donation of
one functional loop give the same values; both donating modes need one
copy of the state less at peak than the plain one; the advisor lists the
whole state."""
import pathlib
import re
import subprocess
import sys

import pytest
from helpers import child_env

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "auto_donation.py"
MIB, TENSORS = 64, 4


@pytest.fixture(scope="module")
def output() -> str:
    env = child_env()
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--mib", str(MIB), "--tensors",
                           str(TENSORS), "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _mode(out, mode):
    m = re.search(rf"^{mode}: peak growth (\d+) MiB, step ([0-9.]+) ms, checksum (\S+)$", out, re.M)
    assert m, out
    return float(m.group(1)), m.group(3)


def test_every_mode_computes_the_same_values(output):
    assert len({_mode(output, m)[1] for m in ("plain", "annotated", "auto")}) == 1


@pytest.mark.parametrize("mode", ["annotated", "auto"])
def test_donating_modes_keep_one_copy_of_the_state(output, mode):
    plain, _ = _mode(output, "plain")
    growth, _ = _mode(output, mode)
    # Each mode's growth has the same fixed part (compiling, XLA's pools):
    # donation saves (at least most of) one copy of the state.
    assert plain - growth > 0.75 * MIB, output


def test_auto_reuses_every_state_buffer_and_the_advisor_lists_them(output):
    assert f"reused {3 * TENSORS} (" in output
    assert re.search(rf"^  {MIB}\.0 MiB +{TENSORS} +\[", output, re.M), output
