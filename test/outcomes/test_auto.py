"""Automatic donation of dead step inputs and the advisor
(_auto.py, csrc/auto/dead_inputs.h).

The tricky case: a dead input has no Python object; only the step's IR
holds its buffer.  Evidence here is the buffer itself: the new values sit
in the old buffers (device pointers), the old buffers are consumed, the
values equal a run without donation.
"""
import contextlib
import re
import subprocess
import sys

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from helpers import buffer_ptr, child_env, materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _auto as auto

N, SHAPE = 4, (64, 64)
INPUTS = [torch.arange(64 * 64, dtype=torch.float32).reshape(SHAPE) / (i + 1) for i in range(N)]

CONTEXTS = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "step block": torch_xla.step,
}


def _update(xs):
    return [x * 0.5 + 1 for x in xs]


def _fresh(dev):
    return list(materialize(*[t.to(dev) for t in INPUTS]))


def _plain_values(dev):
    """The loop's values without any donation."""
    xs = _update(_fresh(dev))
    tdx.settle()
    torch_xla.sync()
    return [x.cpu() for x in xs]


@contextlib.contextmanager
def _auto(on=True):
    auto._donor_sets.clear()  # each test's graphs decide their donor sets afresh
    old = tdx.configure(auto=on)
    try:
        yield
    finally:
        tdx.configure(**old)


def _step(box, context):
    """One step of the functional loop on ``box[0]`` (the caller keeps no
    other reference) in ``context``, ended by a barrier."""
    with context():
        xs = _update(box.pop())
        if context is not torch_xla.step:
            torch_xla.sync()
    xm.wait_device_ops()
    tdx.settle()
    return xs


def _armed():
    t = auto.totals()
    return t["armed"], t["reused"]


@pytest.mark.parametrize("context", list(CONTEXTS.values()), ids=list(CONTEXTS))
def test_every_dead_input_is_reused(dev, context):
    expected = _plain_values(dev)
    xs = _fresh(dev)
    old = {buffer_ptr(x) for x in xs}
    armed, reused = _armed()
    before = tdx.summary().totals
    with _auto():
        box = [xs]
        del xs
        xs = _step(box, context)
    assert _armed() == (armed + N, reused + N)
    assert {buffer_ptr(x) for x in xs} == old  # the new values in the old buffers
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))
    assert "automatic: " in str(tdx.summary())
    # The totals count them as donated and reused, none poisoned (no tensor held them).
    after = tdx.summary().totals
    grew = [getattr(after, f) - getattr(before, f) for f in ("donated", "reused", "auto_reused", "poisoned")]
    assert grew == [N, N, N, 0], grew
    assert after.reused_bytes - before.reused_bytes == N * INPUTS[0].nbytes


@pytest.mark.parametrize("context", list(CONTEXTS.values()), ids=list(CONTEXTS))
def test_a_loop_that_never_waits_reuses_every_dead_input(dev, context):
    """Each step's dead inputs are the outputs of the step before, maybe still running (its
    buffers unwritten, its arguments held): decided after it, never by how far it got."""
    steps, big = 5, [torch.full((1024, 1024), float(i)) for i in range(N)]  # steps that take time
    expected = big
    for _ in range(steps):
        expected = _update(expected)
    xs = list(materialize(*[t.to(dev) for t in big]))
    armed, reused = _armed()
    with _auto():
        for _ in range(steps):
            with context():
                xs = [torch.sin(x) * 0 + x * 0.5 + 1 for x in xs]  # = _update, more work
                if context is not torch_xla.step:
                    torch_xla.sync(wait=False)
        tdx.settle()
    assert _armed() == (armed + steps * N, reused + steps * N)
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))


def _compiles() -> int:
    return (met.metric_data("CompileTime") or [0])[0]


def test_auto_adds_no_compile_to_a_stable_loop(dev):
    """Step 0 reads an input a name still holds; from step 1 on every input is dead.  The
    graph's first execution decides its donor set, so auto compiles as often as the plain
    loop, holding that one input back (and says so)."""

    def run(auto_on, shape):
        xs = list(materialize(*[torch.full(shape, float(i)).to(dev) for i in range(N)]))
        keep = xs[0]  # noqa: F841 - held through step 0, as a module holds its parameters
        compiles = _compiles()
        with _auto(auto_on):
            for _ in range(4):
                xs = _update(xs)
                torch_xla.sync()
                xm.wait_device_ops()
                tdx.settle()
                keep = None
        return _compiles() - compiles, [x.cpu() for x in xs]

    plain_compiles, plain = run(False, (24, 40))
    before = auto.totals()
    auto_compiles, values = run(True, (40, 24))
    after = auto.totals()
    assert (plain_compiles, auto_compiles) == (1, 1)
    assert after["armed"] - before["armed"] == 4 * (N - 1) == after["reused"] - before["reused"]
    assert after["held_back"] - before["held_back"] == 3
    assert all(torch.equal(v.reshape(-1), p.reshape(-1)) for v, p in zip(values, plain))
    assert "held back" in auto.describe_totals()


def test_a_failing_search_skips_the_step_with_a_warning_at_the_users_line(dev, monkeypatch):
    """The step runs undonated and right; the warning names the sync, not the package."""

    def broken(**kwargs):
        raise RuntimeError("search broke")

    expected = _plain_values(dev)
    monkeypatch.setattr(auto.C, "find_dead_inputs", broken)
    xs = _fresh(dev)
    armed = _armed()
    with _auto(), pytest.warns(tdx.DroppedDonationWarning, match="search broke") as caught:
        box = [xs]
        del xs
        xs = _step(box, contextlib.nullcontext)
    assert _armed() == armed
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))
    assert caught[0].filename == __file__, caught[0].filename


def test_the_advisor_lists_without_donating(dev):
    xs = _fresh(dev)
    old = {buffer_ptr(x) for x in xs}
    armed = _armed()
    with _auto(), tdx.advise() as advice:  # an open advisor pauses auto
        box = [xs]
        del xs
        xs = _step(box, contextlib.nullcontext)
    assert _armed() == armed
    assert not old & {buffer_ptr(x) for x in xs}
    assert advice.steps == 1 and advice.bytes == N * INPUTS[0].nbytes
    (entry,) = advice.entries
    assert (entry.shape, entry.dtype, entry.count) == (SHAPE, torch.float32, N)
    assert "tdx.donate" in str(advice) and "[64, 64]" in str(advice)


NOTHING_TO_GAIN = {
    "updated in place": lambda xs: [x.mul_(0.5).add_(1) for x in xs],
    "old values kept": lambda xs: xs + _update(xs),
    "0-dim values": lambda xs: [x.sum() * 0.5 for x in xs],
}


@pytest.mark.parametrize("loop", list(NOTHING_TO_GAIN))
def test_the_advisor_on_a_loop_with_nothing_to_gain_is_empty(dev, loop):
    xs = _fresh(dev)
    if loop == "0-dim values":
        xs = list(materialize(*[x.sum() for x in xs]))
    with tdx.advise() as advice:
        for _ in range(2):
            xs = NOTHING_TO_GAIN[loop](xs)
            torch_xla.sync()
    assert advice.steps == 2
    assert advice.entries == [] and advice.bytes == 0
    assert "nothing to donate" in str(advice)


def test_auto_off_donates_nothing(dev):
    xs = _fresh(dev)
    old = {buffer_ptr(x) for x in xs}
    armed = _armed()
    with _auto(False):
        box = [xs]
        del xs
        xs = _step(box, contextlib.nullcontext)
    assert _armed() == armed
    assert not old & {buffer_ptr(x) for x in xs}


def test_a_partial_sync_arms_nothing(dev):
    xs = _fresh(dev)
    old = {buffer_ptr(x) for x in xs}
    armed = _armed()
    with _auto():
        xs = _update(xs)
        xm.unlazy(xs[:2])  # _xla_sync_multi: part of the pending work
        xm.wait_device_ops()
        assert _armed() == armed
        assert not old & {buffer_ptr(x) for x in xs[:2]}
        box = [xs]
        del xs
        xs = _step(box, contextlib.nullcontext)


def test_explicit_marks_and_dead_inputs_share_the_commit(dev):
    expected = _plain_values(dev)
    xs = _fresh(dev)
    old = {buffer_ptr(x) for x in xs}
    armed, reused = _armed()
    with _auto():
        tdx.donate_buffer(xs[0])
        box = [xs]
        del xs
        xs = _step(box, contextlib.nullcontext)
    assert _armed() == (armed + N - 1, reused + N - 1)  # the marked one is no dead input
    assert tdx.last_step_report().reused == 1
    assert {buffer_ptr(x) for x in xs} == old
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))


def test_under_torch_compile_values_are_kept(dev):
    expected = _plain_values(dev)
    f = torch.compile(lambda x: x * 0.5 + 1, backend="openxla")
    xs = _fresh(dev)
    with _auto():
        xs = [f(x) for x in xs]
        torch_xla.sync()
        xm.wait_device_ops()
    assert all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected))


_UNAVAILABLE = """
import warnings
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _guards as guards
guards.CORRUPT = "tensor_id"
dev = torch_xla.device()
try:
    with tdx.advise():
        pass
except tdx.AutoDonationUnavailableError as e:
    print("raised:", e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xs = [torch.ones(8, 8).to(dev) for _ in range(2)]
    torch_xla.sync()
    xs = [x * 2 for x in xs]
    torch_xla.sync()
print("warned:", [str(w.message) for w in caught
                  if issubclass(w.category, tdx.AutoDonationUnavailableWarning)])
print("summary:", tdx.summary().auto == "")
"""


def test_without_native_reads_auto_and_advise_say_so():
    out = run_python(_UNAVAILABLE, env={"TORCH_XLA_DONATE_AUTO": "1"}).stdout
    assert "raised: " in out and "native reads are off: off (tensor_id: native" in out
    assert "warned: ['TORCH_XLA_DONATE_AUTO" in out
    assert "summary: True" in out


_LINES = """
import torch, torch_xla
import torch_xla_donate as tdx
xs = [torch.ones(16, 16).to(torch_xla.device()) for _ in range(3)]
torch_xla.sync()
with tdx.advise() as advice:
    xs = [x * 2 for x in xs]  # LINE
    torch_xla.sync()
print("lines:", [e.line for e in advice.entries])
print("ir debug after:", torch_xla._XLAC._get_ir_debug())
"""


@pytest.mark.parametrize("ir_debug", ["0", "1"])
def test_the_advisor_names_the_line_with_or_without_ir_debug(ir_debug):
    """The block keeps IR frames while open, then leaves torch_xla's setting as it was."""
    out = run_python(_LINES, env={"XLA_IR_DEBUG": ir_debug}).stdout
    line = next(i for i, text in enumerate(_LINES.splitlines(), 1) if "# LINE" in text)
    assert f"lines: ['<string>:{line}']" in out, out
    assert f"ir debug after: {ir_debug == '1'}" in out, out


def test_python_m_advise_prints_the_table_for_a_script(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(_LINES.replace("with tdx.advise() as advice:", "if True:")
                      .replace('print("lines:", [e.line for e in advice.entries])', ""))
    proc = subprocess.run([sys.executable, "-m", "torch_xla_donate", "advise", str(script)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(i for i, text in enumerate(_LINES.splitlines(), 1) if "# LINE" in text)
    assert re.search(rf"3 +\[16, 16\] +float32 +{re.escape(str(script))}:{line}", proc.stderr), \
        proc.stderr


def test_python_m_advise_runs_a_script_as_python_would(tmp_path):
    """The script imports a module beside it, from another directory, and its
    exit status is the command's; the advice is printed either way."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "beside.py").write_text("def double(x):\n    return x * 2\n")
    (tmp_path / "proj" / "run.py").write_text(
        "import sys\nimport torch, torch_xla\nfrom beside import double\n"
        "x = torch.ones(4, 4, device=torch_xla.device())\n"
        "for _ in range(3):\n    x = double(x)\n    torch_xla.sync()\n"
        "assert x.cpu()[0, 0].item() == 8.0\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-m", "torch_xla_donate", "advise", "proj/run.py"],
                          cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "ModuleNotFoundError" not in proc.stderr and "step(s)" in proc.stderr, proc.stderr


def _train(dev, on):
    """Three steps of an MLP with SGD momentum (in-place updates, autograd,
    optimizer state): every value auto leaves alone or donates must match."""
    torch.manual_seed(0)
    # The batch has the first weight's shape: a donated batch would be reused.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = torch.randn(8, 8).to(dev)
    with _auto(on):
        for _ in range(3):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
            tdx.settle()
            torch_xla.sync()
    xm.wait_device_ops()
    tdx.settle()
    state = [p.cpu() for p in model.parameters()]
    state += [opt.state[p]["momentum_buffer"].cpu() for p in model.parameters()]
    return state


def test_a_training_loop_keeps_its_values_with_auto(dev):
    plain = _train(dev, False)
    donated = _train(dev, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, donated))


_IN_PLACE = """
import torch, torch_xla
import torch_xla_donate as tdx
from torch_xla_donate import _auto as auto
xs = [torch.ones(64, 64).to(torch_xla.device()) for _ in range(3)]
torch_xla.sync()
with tdx.advise() as advice:
    for _ in range(2):
        for x in xs:
            x.mul_(0.5).add_(1)
        torch_xla.sync()
print("entries:", len(advice.entries))
tdx.configure(auto=True)
for _ in range(2):
    for x in xs:
        x.mul_(0.5).add_(1)
    torch_xla.sync()
tdx.settle()
t = auto.totals()
print("armed:", t["armed"], "aliased:", t["aliased"] > 0)
print("values:", sorted({round(v, 4) for x in xs for v in x.flatten().tolist()}))
"""


@pytest.mark.parametrize("functionalization", ["on", "off"])
def test_inputs_torch_xla_aliases_itself_are_never_advised(functionalization):
    """An in-place loop has nothing to gain: torch_xla reuses the buffers
    itself.  Functionalization off, the pending tensor is the buffer's own
    and the native search leaves it out (nothing armed); on, the link is in
    torch_xla's Data (not read): auto arms it, which changes nothing, and
    the advisor drops it after the step consumed it unarmed."""
    env = {"XLA_DISABLE_FUNCTIONALIZATION": "1"} if functionalization == "off" else {}
    out = run_python(_IN_PLACE, env=env).stdout
    assert "entries: 0" in out, out
    assert "aliased: True" in out, out
    if functionalization == "off":
        assert "armed: 0 " in out, out
    # 1 -> 1.5 -> 1.75 (advising) -> 1.875 -> 1.9375 (auto)
    assert "values: [1.9375]" in out, out
