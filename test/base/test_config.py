"""Strict mode and the off switch (config.py), set by ``configure`` or by
environment variable (read at import, so those run in a fresh interpreter).

Strict mode turns "this donation was not usable" from a warning into
``UnusedDonationError``, raised where the warning would be given: by the
barrier that found out (after its own step ran), or by the first use of the
tensor when the verdict was still open.  Either way the tensor keeps its
value, is unmarked and not poisoned, the ledger is settled, and the next
step works.  Dropped donations (a view appeared after marking) stay warnings.

The off switch makes ``donate_buffer`` check its argument and do nothing
else, with one ``DonationDisabledWarning`` per process; marks made before
switching off are ignored by the next barrier (verdict DISABLED).
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import buffer_ptr, materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _config as config


@pytest.fixture
def strict():
    previous = tdx.configure(strict=True)
    yield
    tdx.configure(**previous)


@pytest.fixture
def disabled():
    previous = tdx.configure(enabled=False)
    yield
    tdx.configure(**previous)


def _assert_kept(t, expected):
    """Not poisoned, not marked, no armed donor flag, value intact."""
    assert type(t) is torch.Tensor
    assert not tdx.is_deleted(t) and not tdx.is_donated(t)
    assert not torch_xla._XLAC._get_buffer_donation(t)
    assert t.cpu().tolist() == expected


def _assert_next_step_consumes(t):
    ptr = buffer_ptr(t)
    tdx.donate_buffer(t)
    new = t * 2
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t) and buffer_ptr(new) == ptr


# -- configure() -------------------------------------------------------------


def test_configure_returns_the_previous_values_and_restores_them():
    before = tdx.configure()
    assert before == {name: _C.switches()[name] for name in ("strict", "enabled", "auto")}
    flipped = {name: not value for name, value in before.items()}
    previous = tdx.configure(**flipped)
    assert previous == before
    assert tdx.configure() == flipped
    tdx.configure(**previous)
    assert tdx.configure() == before


@pytest.mark.parametrize("bad", [1, 0, "yes", None.__class__, [True]])
@pytest.mark.parametrize("name", ["strict", "enabled", "auto"])
def test_configure_refuses_anything_but_a_bool(name, bad):
    before = tdx.configure()
    with pytest.raises(TypeError, match=f"configure\\({name}=...\\) expects True or False"):
        tdx.configure(**{name: bad})
    assert tdx.configure() == before


@pytest.mark.parametrize("value", [True, False, "yes"])
def test_check_sharing_is_retired_accepted_and_ignored(value):
    """Ownership is always checked (sharing.py): the old switch changes nothing."""
    before = tdx.configure()
    with pytest.warns(DeprecationWarning, match="check_sharing=...\\) is retired and ignored"):
        previous = tdx.configure(check_sharing=value)
    assert previous == before == tdx.configure() and "check_sharing" not in previous


def test_configure_takes_keywords_only():
    with pytest.raises(TypeError):
        tdx.configure(True)


# -- strict mode -------------------------------------------------------------


def test_strict_unused_donation_raises_at_a_waiting_barrier(dev, strict):
    lonely, other = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(lonely)
    out = other * 2  # `lonely` is no input of this step
    with pytest.raises(tdx.UnusedDonationError,
                       match=r"not usable at step \d+: f32\[3\] \(donated at .*test_config\.py"):
        torch_xla.sync(wait=True)
    assert out.cpu().tolist() == [2.0] * 3  # the step itself ran
    _assert_kept(lonely, [0.0, 1.0, 2.0])
    stats = _C.step_stats()
    assert (stats["unused"], stats["reused"], stats["in_flight"]) == (1, 0, 0)
    assert _C.marked_count() == 0
    _assert_next_step_consumes(lonely)


def test_strict_names_only_the_unused_and_consumes_the_rest(dev, strict):
    used, unused = materialize(torch.ones(4, device=dev), torch.zeros(5, dtype=torch.int32, device=dev))
    ptr = buffer_ptr(used)
    tdx.donate_buffer(used)
    tdx.donate_buffer(unused)
    new = used + 1
    with pytest.raises(tdx.UnusedDonationError) as info:
        torch_xla.sync(wait=True)
    assert "s32[5]" in str(info.value) and "f32[4]" not in str(info.value)
    assert tdx.is_deleted(used) and buffer_ptr(new) == ptr
    with pytest.raises(tdx.DonatedBufferError):
        used.sum()
    _assert_kept(unused, [0] * 5)
    stats = _C.step_stats()
    assert (stats["donated"], stats["reused"], stats["unused"], stats["in_flight"]) == (2, 1, 1, 0)


def test_strict_open_verdict_raises_at_the_first_use_then_the_tensor_works(dev, strict):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)  # the verdict stays open: no error yet
    with pytest.raises(tdx.UnusedDonationError, match=r"f32\[3\]"):
        x.cpu()
    _assert_kept(x, [0.0, 1.0, 2.0])
    assert z.cpu().tolist() == [2.0] * 3
    assert _C.step_stats()["in_flight"] == 0


def test_strict_open_verdict_raises_at_the_next_barrier_after_its_step_ran(dev, strict):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    xm.mark_step()  # wait=False
    w = z * 10
    with pytest.raises(tdx.UnusedDonationError, match=r"f32\[3\]"):
        torch_xla.sync()
    assert w.cpu().tolist() == [20.0] * 3  # the barrier's own step ran
    _assert_kept(x, [0.0, 1.0, 2.0])
    _assert_next_step_consumes(x)


def test_strict_open_verdict_raises_at_settle(dev, strict):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)
    with pytest.raises(tdx.UnusedDonationError):
        tdx.settle()
    _assert_kept(x, [0.0, 1.0, 2.0])
    tdx.settle()  # nothing left open: no second error


def test_strict_does_not_touch_a_consumed_donation(dev, strict):
    p = materialize(torch.ones(8, device=dev))
    tdx.donate_buffer(p)
    new = p * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_xla.sync(wait=True)
    assert tdx.is_deleted(p) and new.cpu().tolist() == [3.0] * 8


def test_strict_keeps_dropped_donations_a_warning(dev, strict):
    t = materialize(torch.arange(4.0, device=dev))
    tdx.donate_buffer(t)
    head = t[0:2]
    doubled = t * 2
    with pytest.warns(tdx.DroppedDonationWarning):
        torch_xla.sync(wait=True)
    assert head.cpu().tolist() == [0.0, 1.0] and doubled.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
    _assert_kept(t, [0.0, 1.0, 2.0, 3.0])


def test_strict_switched_off_again_warns(dev, strict):
    tdx.configure(strict=False)
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    with pytest.warns(tdx.UnusedDonationWarning):
        torch_xla.sync(wait=True)
    _assert_kept(x, [0.0, 1.0, 2.0])


# -- the off switch -----------------------------------------------------------


@pytest.mark.parametrize("action, per_line", [("default", 1), ("always", 3)])
def test_disabled_donates_nothing_and_warns_through_the_filters(dev, disabled, action, per_line):
    """Each marking line warns; Python's filters decide how often (once per
    line by default, every time under "always")."""
    ps = [materialize(torch.full((64,), float(i), device=dev)) for i in range(3)]
    ptrs = [buffer_ptr(p) for p in ps]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for p in ps:
            tdx.donate_buffer(p)
            torch_xla._XLAC.donate_buffer(p)  # the alias installed into torch_xla
    said = [w for w in caught if issubclass(w.category, tdx.DonationDisabledWarning)]
    assert len(said) == 2 * per_line and len({w.lineno for w in said}) == 2
    assert all("TORCH_XLA_DONATE_DISABLE=1" in str(w.message) for w in said)
    assert all(w.filename == __file__ for w in said)
    assert _C.marked_count() == 0 and not any(tdx.is_donated(p) for p in ps)
    news = [p + 1 for p in ps]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_xla.sync(wait=True)
    for i, (p, new) in enumerate(zip(ps, news)):
        _assert_kept(p, [float(i)] * 64)
        assert buffer_ptr(new) != ptrs[i] and new.cpu().tolist() == [i + 1.0] * 64


def test_disabled_still_checks_its_argument(dev, disabled):
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        tdx.donate_buffer([1.0])
    with pytest.raises(ValueError, match="XLA device"):
        tdx.donate_buffer(torch.ones(2))
    with pytest.raises(ValueError, match="pending computation"):
        tdx.donate_buffer(torch.ones(2, device=dev) * 2)


def test_marks_made_before_switching_off_are_ignored(dev):
    p = materialize(torch.arange(16.0, device=dev))
    ptr = buffer_ptr(p)
    tdx.donate_buffer(p)
    previous = tdx.configure(enabled=False)
    try:
        new = p + 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch_xla.sync(wait=True)
        _assert_kept(p, [float(i) for i in range(16)])
        assert buffer_ptr(new) != ptr
        stats = _C.step_stats()
        assert (stats["donated"], stats["reused"], stats["failed"], stats["in_flight"]) == (1, 0, 1, 0)
    finally:
        tdx.configure(**previous)
    _assert_next_step_consumes(p)


def test_switching_back_on_donates_again(dev, disabled):
    p = materialize(torch.ones(8, device=dev))
    with pytest.warns(tdx.DonationDisabledWarning):
        tdx.donate_buffer(p)
    assert not tdx.is_donated(p)
    tdx.configure(enabled=True)
    _assert_next_step_consumes(p)


# -- environment variables (read at import: a fresh interpreter each) ---------

_ENV_PROBE = """
import warnings
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _C
dev = torch_xla.device()
print("config", tdx.configure())

# An unusable donation: warning, error, or nothing at all.
x, y = torch.arange(3.0, device=dev), torch.ones(3, device=dev)
torch_xla.sync()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        tdx.donate_buffer(x)
        z = y + 1
        torch_xla.sync(wait=True)
        outcome = "no error"
    except tdx.UnusedDonationError:
        outcome = "UnusedDonationError"
kinds = sorted(type(w.message).__name__ for w in caught)
print("unusable:", outcome, kinds, "x", x.cpu().tolist(), "marked", _C.marked_count())
print("why:", [str(w.message) for w in caught if "Disabled" in type(w.message).__name__])

# A usable donation, twice, with the disabled warning counted.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        p = torch.ones(4, device=dev)
        torch_xla.sync()
        tdx.donate_buffer(p)
        new = p + 1
        torch_xla.sync(wait=True)
kinds = sorted(type(w.message).__name__ for w in caught)
print("usable:", "consumed" if tdx.is_deleted(p) else "kept", kinds, "new", new.cpu().tolist())
"""


ENV_CASES = {
    "strict": {"TORCH_XLA_DONATE_STRICT": "1", "TORCH_XLA_DONATE_DISABLE": "0"},
    "disable": {"TORCH_XLA_DONATE_DISABLE": "true", "TORCH_XLA_DONATE_STRICT": "yes"},
    "zero": {"TORCH_XLA_DONATE_STRICT": "0", "TORCH_XLA_DONATE_DISABLE": "0"},
    "check sharing": {"TORCH_XLA_DONATE_CHECK_SHARING": "on",
                      "PYTHONWARNINGS": "always::DeprecationWarning"},
}


@pytest.fixture(scope="module")
def probes():
    """Runs the probe under each environment, all at once (each interpreter
    spends most of its time importing torch_xla)."""
    procs = {name: subprocess.Popen([sys.executable, "-c", _ENV_PROBE], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env=dict(os.environ, PJRT_DEVICE="CPU", **env))
             for name, env in ENV_CASES.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out}\n{err}"
        results[name] = {line.split(":")[0].split()[0]: line for line in out.splitlines()}
        results[name]["stderr"] = err
    return results


def test_env_strict_turns_the_warning_into_an_error(probes):
    lines = probes["strict"]
    assert "{'strict': True, 'enabled': True, 'auto': False}" in lines["config"]
    assert "unusable: UnusedDonationError [] x [0.0, 1.0, 2.0] marked 0" in lines["unusable"]
    assert "usable: consumed [] new [2.0, 2.0, 2.0, 2.0]" in lines["usable"]


def test_env_disable_switches_donation_off_and_warns_each_call_under_always(probes):
    lines = probes["disable"]
    assert "{'strict': True, 'enabled': False, 'auto': False}" in lines["config"]
    # Disabled wins: nothing is marked, so nothing can be unusable either.
    assert "unusable: no error ['DonationDisabledWarning'] x [0.0, 1.0, 2.0] marked 0" in lines["unusable"]
    assert ("usable: kept ['DonationDisabledWarning', 'DonationDisabledWarning'] new "
            "[2.0, 2.0, 2.0, 2.0]") in lines["usable"]


def test_env_zero_leaves_the_defaults(probes):
    lines = probes["zero"]
    assert "{'strict': False, 'enabled': True, 'auto': False}" in lines["config"]
    # "why" names the guard that failed, if one switched donation off.
    assert "unusable: no error ['UnusedDonationWarning'] x [0.0, 1.0, 2.0] marked 0" in \
        lines["unusable"], lines["why"]
    assert "usable: consumed [] new [2.0, 2.0, 2.0, 2.0]" in lines["usable"]


def test_env_check_sharing_is_retired_and_warned(probes):
    lines = probes["check sharing"]
    assert "{'strict': False, 'enabled': True, 'auto': False}" in lines["config"]
    assert "TORCH_XLA_DONATE_CHECK_SHARING is retired and ignored" in lines["stderr"]
    assert "usable: consumed [] new [2.0, 2.0, 2.0, 2.0]" in lines["usable"]


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                      ("0", False), ("", False), ("off", False), ("no", False),
                                      ("false", False), ("2", False)])
def test_env_flag_spellings(monkeypatch, value, on):
    monkeypatch.setenv("TORCH_XLA_DONATE_STRICT", value)
    assert config._env_flag("TORCH_XLA_DONATE_STRICT") is on
