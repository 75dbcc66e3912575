"""Helpers shared by the tests (fixtures live in conftest.py)."""
import os
import subprocess
import sys
import textwrap

import torch_xla
import torch_xla.core.xla_model as xm


def materialize(*tensors):
    """Runs pending work so the tensors are plain device data, and waits for it."""
    torch_xla.sync()
    xm.wait_device_ops()
    return tensors[0] if len(tensors) == 1 else tensors


def buffer_ptr(t) -> int:
    """The device address of ``t``'s buffer, after all work has run."""
    xm.wait_device_ops()
    return torch_xla._XLAC._unsafe_buffer_pointer(t)


def run_python(code: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter: for process-global settings
    (environment switches, SPMD, peak memory).  Fails the test if it fails."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc
