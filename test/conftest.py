"""Shared fixtures: every test runs on torch_xla's CPU PJRT backend."""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest
import torch_xla

import torch_xla_donate as tdx
from torch_xla_donate import _C, step_hook


@pytest.fixture
def dev():
    return torch_xla.device()


@pytest.fixture(autouse=True)
def clean_ledger():
    """Each test leaves no marks and no open verdicts behind."""
    yield
    step_hook.settle_in_flight()
    for t in _C.marked_tensors():
        tdx.undonate(t)
