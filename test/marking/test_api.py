"""donate_buffer / undonate / is_donated / is_deleted: marking and bad input."""
import sys
import warnings

import pytest
import torch
import torch_xla
from helpers import buffer_ptr, materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _C


def test_installed_into_torch_xla():
    assert torch_xla._XLAC.donate_buffer is tdx.donate_buffer


def test_mark_is_visible_until_the_step(dev):
    t = materialize(torch.ones(4, device=dev))
    assert not tdx.is_donated(t)
    tdx.donate_buffer(t)
    assert tdx.is_donated(t) and not tdx.is_deleted(t)
    u = t * 2
    torch_xla.sync()
    assert not tdx.is_donated(t) and tdx.is_deleted(t)
    assert u.cpu().tolist() == [2.0] * 4


def _donate_here(t):
    tdx.donate_buffer(t)
    return sys._getframe().f_lineno - 1


@pytest.fixture(params=["one native call", "refused first"])
def marking_path(request, monkeypatch):
    """donate_buffer marks in its one native call, or (a commit on another
    thread, a class met for the first time...) after Python resolved what
    the native call refused: both blame the caller's line."""
    if request.param == "refused first":
        monkeypatch.setattr(_C, "try_mark", _refusing_once(_C.try_mark))
    return request.param


def _refusing_once(try_mark):
    """``C.try_mark`` that refuses the call from ``donate_buffer`` itself
    (its one argument) as a commit on another thread would."""
    def refusing(tensor, *args):
        return int(_C.Refusal.COMMITTING) if not args else try_mark(tensor, *args)
    return refusing


def test_records_name_the_line_of_each_donate_buffer_call(dev, marking_path):
    # File and line are cached per call site: one line in a loop, two lines
    # of one function and another function must each keep their own.
    ts = materialize(*[torch.full((2,), float(i), device=dev) for i in range(5)])
    loop_line = sys._getframe().f_lineno + 2
    for t in ts[:2]:
        tdx.donate_buffer(t)
    tdx.donate_buffer(ts[2])
    next_line = sys._getframe().f_lineno - 1
    helper_line = _donate_here(ts[3])
    torch_xla._XLAC.donate_buffer(ts[4])
    alias_line = sys._getframe().f_lineno - 1
    records = [_C.unmark(t) for t in ts]
    for t in ts:
        torch_xla._XLAC._set_buffer_donation(t, False)
    assert [r.line for r in records] == [loop_line, loop_line, next_line, helper_line, alias_line]
    assert {r.file for r in records} == {__file__}


def test_marking_twice_counts_once(dev):
    t, g = materialize(torch.ones(8, device=dev), torch.ones(8, device=dev))
    tdx.donate_buffer(t)
    torch_xla._XLAC.donate_buffer(t)
    assert _C.marked_count() == 1
    t2 = t + g
    torch_xla.sync(wait=True)
    stats = _C.step_stats()
    assert stats["donated"] == 1 and stats["reused"] == 1


def test_undonate_cancels_the_mark(dev):
    t, g = materialize(torch.full((16,), 3.0, device=dev), torch.ones(16, device=dev))
    ptr = buffer_ptr(t)
    tdx.donate_buffer(t)
    assert tdx.undonate(t) is True
    assert tdx.undonate(t) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = t + g
        torch_xla.sync(wait=True)
    assert buffer_ptr(out) != ptr
    assert t.cpu().tolist() == [3.0] * 16


def test_undonate_after_the_step_is_too_late(dev):
    t = materialize(torch.ones(4, device=dev))
    tdx.donate_buffer(t)
    u = t + 1
    torch_xla.sync()
    with pytest.raises(tdx.DonatedBufferError):
        tdx.undonate(t)


def _assert_intact_and_unmarked(t, expected):
    assert not tdx.is_donated(t)
    assert t.cpu().tolist() == expected


@pytest.mark.parametrize("bad", [None, 3.0, [1.0], "t"])
def test_not_a_tensor_is_a_type_error(bad):
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        tdx.donate_buffer(bad)


def test_cpu_tensor_is_a_value_error():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="XLA device.*torch_xla.device"):
        tdx.donate_buffer(t)
    assert not tdx.is_donated(t) and t.tolist() == [1.0] * 3


def test_pending_computation_says_to_mark_step_first(dev):
    t = torch.ones(3, device=dev) * 2
    with pytest.raises(ValueError, match=r"pending computation.*xm.mark_step\(\)"):
        tdx.donate_buffer(t)
    _assert_intact_and_unmarked(t, [2.0] * 3)


def test_donated_tensor_is_a_donated_buffer_error(dev):
    t = materialize(torch.ones(3, device=dev))
    tdx.donate_buffer(t)
    u = t + 1
    torch_xla.sync()
    with pytest.raises(tdx.DonatedBufferError):
        tdx.donate_buffer(t)


def test_live_view_refuses_the_donation(dev):
    t = materialize(torch.arange(6.0, device=dev))
    v = t[0:2]
    with pytest.raises(ValueError, match=r"shares its buffer.*t\[0:2\]"):
        tdx.donate_buffer(t)
    _assert_intact_and_unmarked(t, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert v.cpu().tolist() == [0.0, 1.0]


def test_live_detach_alias_refuses_the_donation(dev):
    t = materialize(torch.ones(4, device=dev))
    alias = t.detach()
    with pytest.raises(ValueError, match="detach"):
        tdx.donate_buffer(t)
    assert alias.cpu().tolist() == [1.0] * 4


def test_a_view_itself_cannot_be_donated(dev):
    base = materialize(torch.arange(8.0, device=dev))
    v = base.reshape(2, 4)
    del base
    torch_xla.sync()
    with pytest.raises(ValueError, match="view"):
        tdx.donate_buffer(v)
    _assert_intact_and_unmarked(v, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]])


def test_param_aliasing_off_poisons_nothing_and_warns_once_per_line():
    proc = run_python(
        """
        import warnings
        import torch, torch_xla
        import torch_xla_donate as tdx
        dev = torch_xla.device()
        a = torch.ones(64, device=dev); b = torch.ones(64, device=dev)
        torch_xla.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # once per line
            tdx.donate_buffer(a); tdx.donate_buffer(b)
            a2 = a + 1; b2 = b + 1
            torch_xla.sync(wait=True)
            print("values", a.sum().item(), b.sum().item(), a2.sum().item())
        kinds = [type(w.message).__name__ for w in caught]
        print("warnings", kinds.count("DonationDisabledWarning"), len(kinds))
        print("poisoned", tdx.is_deleted(a), tdx.is_deleted(b))
        """,
        env={"XLA_ENABLE_PARAM_ALIASING": "0"},
    )
    assert "values 64.0 64.0 128.0" in proc.stdout
    assert "warnings 1 1" in proc.stdout
    assert "poisoned False False" in proc.stdout
