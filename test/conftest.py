"""Shared fixtures: every test runs on torch_xla's CPU PJRT backend."""
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest
import torch_xla

import torch_xla_donate as tdx
from torch_xla_donate import _C


@pytest.fixture(scope="session", autouse=True)
def xla_runtime():
    """torch_xla's runtime up before any test runs: autograd sizes its device
    queues at the first backward of the process, and a first backward on the
    CPU (a doctest's) before the XLA runtime exists leaves XLA's devices out
    ("device_ready_queues_ ... INTERNAL ASSERT FAILED" at every XLA
    backward).  A fixture, not an import-time call: a test module may switch
    SPMD on when it is imported, which must come first."""
    torch_xla.device()


@pytest.fixture
def dev():
    return torch_xla.device()


# torch's words when a tensor's Python object outlives its TensorImpl: code
# that took the object from somewhere other than torch (the garbage
# collector, a weak reference) and kept it (issue: a donated torch.func loop
# printed it).  Printed by C++ to file descriptor 2, so captured per test.
ZOMBIE_TENSOR = "Deallocating Tensor that still has live PyObject references"


@pytest.fixture(autouse=True)
def no_zombie_tensors(capfd):
    """No test may make torch warn that a tensor's Python object outlived
    its TensorImpl (the output stays in the test's report)."""
    yield
    out, err = capfd.readouterr()
    sys.stdout.write(out)
    sys.stderr.write(err)
    assert ZOMBIE_TENSOR not in err, "a tensor's Python object outlived its TensorImpl"


@pytest.fixture(autouse=True)
def clean_ledger():
    """Each test leaves no marks and no open verdicts behind."""
    yield
    tdx.settle()
    for t in _C.marked_tensors():
        tdx.undonate(t)


# -- Tests that run in a process of their own ----------------------------------
#
# torch_xla 2.9 (XLA:CPU) corrupts the heap of its process when a step whose
# graph has donated buffers fails to compile: with torch_xla's own
# ``_set_buffer_donation``, without this plugin
# (tools/repros/compile_error_with_donation.py).  The corruption shows up
# later, as a crash of whatever test runs next (XLA:CPU's fusion emitters,
# which the import switches off only with auto on: _xla_cpu.py).  Tests that provoke
# such a failure carry ``@pytest.mark.own_process``: they run in a fresh
# interpreter, and pass only if it passes them.

_CHILD = "TDX_OWN_PROCESS_CHILD"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "own_process: run this test in a fresh Python process (see conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(_CHILD):
        return None
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath,
        env=dict(os.environ, **{_CHILD: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or "1 passed" not in proc.stdout:
        pytest.fail(
            f"{pyfuncitem.nodeid} failed in its own process (exit {proc.returncode}):\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    return True


# -- Native reads (_xla.py) -------------------------------------


@pytest.fixture
def fast_path_open(dev):
    """Marking in one native call, as after a process's first donation:
    that one decides the guards and gives the process's one
    ``StaleReadWarning`` where it is owed (_xla_cpu.py), so a test run
    alone sees what it sees after others."""
    import warnings

    import torch
    import torch_xla

    import torch_xla_donate as tdx
    from torch_xla_donate._native import C

    probe = torch.ones(2, device=dev) + 0
    torch_xla.sync()
    if C.try_mark(probe):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdx.donate_buffer(probe)
    C.unmark(probe)
    assert C.try_mark(probe) == 0, "marking still refuses after a first donation"
    C.unmark(probe)


@pytest.fixture
def native_reads(dev):
    """Native reads decided and the walk of live tensors in use, as after a
    process's first donation (docs/design.md, "Reading torch_xla")."""
    import torch
    import torch_xla

    from torch_xla_donate import _guards as guards

    sample = torch.ones(2, device=dev) + 0
    torch_xla.sync()
    guards.decide(sample)
    for name in ("reads", "walk", "poisoning"):
        if guards.state(name) not in ("native reads", "in use", "native dispatch key"):
            pytest.fail(f"the {name} guard failed in this process: {guards.state(name)}")
