"""The compatibility layer, on whatever release runs the suite: the path it
picks for each feature, the import gate, and the outcomes it must report
truthfully (a value torch_xla lost is never called kept)."""
import doctest
import inspect

import pytest
import torch
import torch_xla
from helpers import materialize, run_python
from torch_xla.experimental import gradient_accumulation as ga

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _commit as commit
from torch_xla_donate import _native as _compat


def _release():
    return _compat.release(torch_xla.__version__)


def test_this_release_is_supported_and_the_version_is_visible():
    assert _release() in _compat.SUPPORTED
    assert tdx.__version__ and "__version__" in tdx.__all__
    assert _compat.release(torch.__version__) == _release()


@pytest.mark.parametrize("torch_version, xla_version, message", [
    ("2.6.0", "2.6.0", r"needs torch_xla 2\.7, 2\.8 or 2\.9.*2\.6 and older ignore"),
    ("2.5.1+cu124", "2.5.1", r"needs torch_xla 2\.7, 2\.8 or 2\.9"),
    ("2.10.0", "2.10.0", r"needs torch_xla 2\.7, 2\.8 or 2\.9; this is torch_xla 2\.10\.0"),
    ("2.9.0", "2.8.1", r"built for torch 2\.8, but torch 2\.9\.0 is installed"),
    ("2.7.0", "2.9.0", r"pip install 'torch==2\.9\.\*'"),
])
def test_the_import_gate_names_what_to_install(torch_version, xla_version, message):
    with pytest.raises(ImportError, match=message):
        _compat.check_versions(torch_version, xla_version)


def test_importing_with_a_mismatched_torch_fails_with_that_message():
    proc = run_python(
        "import torch, torch_xla\n"
        "torch.__version__ = '2.1.0'\n"
        "try:\n"
        "    import torch_xla_donate\n"
        "except ImportError as e:\n"
        "    print('REFUSED', e)\n")
    assert "REFUSED torch_xla" in proc.stdout and "matching torch" in proc.stdout


def test_gradient_accumulation_is_called_in_this_releases_form(dev):
    params = inspect.signature(ga.gradient_accumulation).parameters.values()
    assert any(p.kind == p.VAR_POSITIONAL for p in params) == (_release() >= (2, 8))
    model = torch.nn.Linear(4, 1).to(dev)
    data = materialize(torch.ones(2, 3, 4, device=dev))
    acc = materialize(torch.zeros(3, device=dev))
    loss, acc = _compat.call_gradient_accumulation(
        ga.gradient_accumulation, lambda x, a: (model(x).sum(), a + 1), (data,), model, acc)
    torch_xla.sync()
    assert acc.cpu().tolist() == [2.0, 2.0, 2.0]


def test_a_consumed_carried_tensor_is_refused_before_torch_xla_sees_it(dev):
    model = torch.nn.Linear(4, 1).to(dev)
    data = materialize(torch.ones(2, 3, 4, device=dev))
    acc = materialize(torch.zeros(3, device=dev))
    tdx.donate_buffer(acc)
    new = acc + 1
    torch_xla.sync()
    calls = []

    def train_step(x, a):
        calls.append(x)
        return model(x).sum(), a + 1

    with pytest.raises(tdx.DonatedBufferError):
        _compat.call_gradient_accumulation(ga.gradient_accumulation, train_step, (data,), model,
                                           acc)
    assert calls == [], "torch_xla traced the loop with the consumed tensor"


def test_a_value_a_failed_step_lost_is_reported_lost_never_kept(dev, monkeypatch):
    # torch_xla 2.7 loses donated inputs when a step fails to compile.  Here
    # the real barrier runs (consuming the donation) and then fails, as that
    # release does: the plugin must observe the loss, not assume the value kept.
    real = torch_xla._XLAC._xla_step_marker.real

    def runs_then_fails(*args, **kwargs):
        real(*args, **kwargs)
        torch_xla._XLAC._xla_wait_device_ops([])
        raise RuntimeError("compile failed (simulated)")

    t = materialize(torch.randn(8, 8, device=dev))
    tdx.donate_buffer(t)
    out = t * 2  # an output of t's size: the donation is consumed
    monkeypatch.setattr(torch_xla._XLAC, "_xla_step_marker",
                        _C.Trampoline(runs_then_fails, commit.barrier_hook, commit.barrier_after))
    with pytest.raises(RuntimeError, match="simulated"):
        torch_xla.sync()
    monkeypatch.undo()
    report = tdx.last_step_report()
    assert (report.lost, report.failed) == (1, 0) and "values gone" in str(report)
    assert tdx.is_deleted(t)
    with pytest.raises(tdx.DonatedBufferError, match="failed, and torch_xla lost"):
        t.sum()


def test_a_copy_made_since_the_barrier_has_no_buffer_of_its_own(dev):
    """A copy shares its source's buffer until the next barrier: marking
    refuses it, its source it does not; after the barrier both own one."""
    source = materialize(torch.arange(6.0, device=dev) * 2)
    copy = torch.empty(6, device=dev)
    copy.copy_(source)  # shares the source's buffer until the next barrier
    with pytest.raises(ValueError, match="copy"):
        tdx.donate_buffer(copy)
    tdx.donate_buffer(source)
    assert tdx.undonate(source)
    torch_xla.sync()
    tdx.donate_buffer(copy)
    assert tdx.undonate(copy)
    assert torch.equal(copy.cpu(), source.cpu())


def test_the_compat_docstrings_hold():
    failures, _ = doctest.testmod(_compat, optionflags=doctest.ELLIPSIS)
    assert failures == 0
