"""Which executions commit marks, and torch_xla's donor flag armed only inside
them: nothing else can take a marked buffer, and nothing is left armed."""
import os
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import buffer_ptr, materialize, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _hooks as step_hook

_flag = torch_xla._XLAC._get_buffer_donation


def _state(dev, n=64, value=None):
    t = torch.randn(n, n, device=dev) if value is None else torch.full((n, n), value, device=dev)
    return materialize(t)


def _unlazy_other(dev, x):
    y = torch.ones(5, device=dev) + 1
    xm.unlazy([y])  # an execution that commits nothing


def _compiled_call_donating_another(dev, x):
    y = torch.full((7,), 2.0).to(dev)  # device data at once: no barrier
    tdx.donate_buffer(y)
    return torch.compile(lambda t: t * 3, backend="openxla")(y)


# What clears the flag an unused donation's buffer kept from its barrier,
# and whether the verdict (and its warning) comes with it.
CLEARED_BY = {
    "the next barrier": (lambda dev, x: torch_xla.sync(wait=False), True),
    "an execution that commits nothing": (_unlazy_other, False),
    "a use of the tensor": (lambda dev, x: x + 0, True),
    "a compiled call": (_compiled_call_donating_another, True),
    "settle()": (lambda dev, x: tdx.settle(), True),
}


@pytest.mark.parametrize("cleared_by", list(CLEARED_BY))
def test_marking_arms_nothing_and_what_the_barrier_armed_cannot_fire_later(dev, cleared_by):
    p, g = _state(dev), _state(dev)
    tdx.donate_buffer(p)
    assert not _flag(p), "marking alone must not arm torch_xla's flag"
    new = p + g
    x = _state(dev, n=3)  # an unused donation: its buffer survives the step
    expected = x.cpu()
    tdx.donate_buffer(x)
    torch_xla.sync(wait=False)
    # Held by the loop, x is poisoned and its entry keeps the buffer: no graph
    # can read it before its verdict, whose flag is cleared by the verdict or
    # by any execution before it builds its graph, whichever comes first.
    clear, settles = CLEARED_BY[cleared_by]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clear(dev, x)
    assert not _flag(x)
    unused = [w for w in caught if issubclass(w.category, tdx.UnusedDonationWarning)]
    assert len(unused) == settles
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        tdx.settle()
    assert tdx.is_deleted(p) and not tdx.is_deleted(x) and not _flag(x)
    assert torch.equal(x.cpu(), expected)


def test_unlazy_leaves_marks_untouched_for_the_next_barrier(dev):
    # xm.unlazy runs part of the pending work; another pending tensor may
    # still read the marked one, so its mark waits for the step barrier.
    t0 = _state(dev)
    expected = t0.cpu()
    tdx.donate_buffer(t0)
    t1 = t0 + 1
    later = t0 * 2  # still pending after unlazy: it reads t0
    xm.unlazy([t1])
    xm.wait_device_ops()
    assert not torch_xla._XLAC._is_placecholder(t0), "unlazy must not consume a marked buffer"
    assert tdx.is_donated(t0) and not tdx.is_deleted(t0)
    assert torch.equal(t1.cpu(), expected + 1)
    step = _C.current_step()
    torch_xla.sync(wait=True)
    assert tdx.is_deleted(t0) and torch.equal(later.cpu(), expected * 2)
    assert tdx.last_step_report().step == step + 1


def test_sync_multi_syncing_device_data_takes_no_marked_buffer(dev):
    t0 = _state(dev)
    tdx.donate_buffer(t0)
    t1 = t0 * 3
    torch_xla._XLAC._xla_sync_multi([t1], devices=[], wait=True, sync_xla_data=True)
    assert not torch_xla._XLAC._is_placecholder(t0) and tdx.is_donated(t0)
    assert tdx.undonate(t0)


@pytest.mark.parametrize("update", ["copy_", "add_", "setitem"])
def test_updated_in_place_after_marking_keeps_its_value_and_the_source_its_buffer(dev, update):
    t, other = _state(dev), _state(dev)
    other_value = other.cpu()
    tdx.donate_buffer(t)
    if update == "copy_":
        t.copy_(other)
        expected = other_value
    elif update == "add_":
        expected = t.cpu() + 1
        t.add_(1)
    else:
        t[...] = other
        expected = other_value
    with torch_xla.step():  # its flush runs t's update first: no flag may follow it
        out = other * 2
    xm.wait_device_ops()
    assert torch.equal(t.cpu(), expected) and not tdx.is_deleted(t)
    assert not torch_xla._XLAC._is_placecholder(other), "the copy source lost its buffer"
    assert torch.equal(other.cpu(), other_value) and torch.equal(out.cpu(), other_value * 2)
    assert tdx.last_step_report().updated_in_place == 1


def test_swap_tensors_after_marking_donates_the_buffer_the_tensor_holds_then(dev):
    t, s = _state(dev, value=1.0), _state(dev, value=2.0)
    s_ptr = buffer_ptr(s)
    tdx.donate_buffer(t)
    torch.utils.swap_tensors(t, s)  # t now holds s's old buffer, and s t's
    new = t + 1
    torch_xla.sync(wait=True)
    assert buffer_ptr(new) == s_ptr and tdx.is_deleted(t)
    assert not tdx.is_deleted(s) and s.sum().item() == 64 * 64  # the unmarked one survives


@pytest.mark.parametrize("use", ["vmap", "jit.trace", "plain op"])
def test_an_async_unused_donation_cannot_fire_in_a_later_step(dev, use):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1  # x is no input: unused, known only once the step ran
    torch_xla.sync(wait=False)
    ptr = buffer_ptr(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        if use == "vmap":
            later = torch.func.vmap(lambda v: v + 1)(x)
        elif use == "jit.trace":
            later = torch.jit.trace(lambda v: v + 1, (x,))(x)
        else:
            later = x + 1  # same size as x: it would take x's buffer if armed
        torch_xla.sync(wait=True)
    assert buffer_ptr(later) != ptr and buffer_ptr(x) == ptr
    assert x.cpu().tolist() == [0.0, 1.0, 2.0] and later.cpu().tolist() == [1.0, 2.0, 3.0]


def test_uninstall_cancels_every_mark_and_install_brings_the_hooks_back(dev):
    t = _state(dev)
    tdx.donate_buffer(t)
    step_hook.uninstall()
    try:
        assert not step_hook.installed() and not tdx.is_donated(t) and not _flag(t)
        new = t + 1
        torch_xla.sync(wait=True)  # torch_xla's own barrier: nothing armed, nothing taken
        assert not torch_xla._XLAC._is_placecholder(t)
    finally:
        step_hook.install()
    assert step_hook.installed() and isinstance(torch_xla._XLAC._xla_step_marker, _C.Trampoline)


def test_a_configure_after_uninstall_keeps_the_fast_path_closed(dev):
    """One module writes the native marking state (_config.py refresh): a
    ``configure()`` after ``uninstall()`` (its listener refreshes the state)
    cannot let marking on while the hooks are out."""
    t = _state(dev)
    step_hook.uninstall()
    try:
        previous = tdx.configure(enabled=True)
        assert _C.try_mark(t, _C.Via.DONATE_BUFFER, ("here.py", 1)) == _C.Refusal.OFF
        assert not tdx.is_donated(t)
        tdx.configure(**previous)
    finally:
        step_hook.install()
    assert _C.try_mark(t, _C.Via.DONATE_BUFFER, ("here.py", 1)) == 0  # on again
    assert tdx.undonate(t)


def test_a_donating_call_that_raises_leaves_nothing_marked(dev):
    @tdx.donating(donate_argnums=0)
    def update(p):
        raise FloatingPointError("diverged")

    p = _state(dev)
    mine = _state(dev)
    tdx.donate_buffer(mine)  # marked by the user before: not the call's to cancel
    with pytest.raises(FloatingPointError):
        update(p)
    assert not tdx.is_donated(p) and not _flag(p) and tdx.is_donated(mine)
    assert tdx.undonate(mine)
    torch_xla.sync(wait=True)
    assert not tdx.is_deleted(p) and p.sum().item() is not None


def test_a_mark_refused_midway_arms_nothing(dev):
    # Dynamic shapes: sizes the fast path cannot read send the mark down the
    # checked path, which may raise; it never set a flag before.
    t = _state(dev)
    with pytest.raises(TypeError):
        tdx.donate_buffer([t])
    assert not _flag(t) and not tdx.is_donated(t)


def test_the_step_block_flush_commits_nothing_and_its_end_commits(dev):
    p, g = _state(dev), _state(dev)
    ptr = buffer_ptr(p)
    tdx.donate_buffer(p)
    pending = g * 3  # flushed on entry, without p's mark
    before = _C.current_step()
    with torch_xla.step():
        new = p - g
    assert tdx.is_deleted(p) and buffer_ptr(new) == ptr
    # The flush committed nothing, so it is no step of the ledger: the block's
    # end is the one step since.
    assert tdx.last_step_report().step == _C.current_step() == before + 1
    assert tdx.last_step_report().reused == 1


def test_compile_as_a_decorator_keeps_torch_xlas_names(dev):
    def toy_program(t):
        return t * 2

    compiled = torch_xla.compile(toy_program)
    assert compiled.__name__ == "toy_program" and compiled.__wrapped__ is not None
    t = _state(dev, n=4, value=1.0)
    assert compiled(t).sum().item() == 32


def test_warnings_point_at_the_users_line_past_torchs_frames(dev):
    x, y = materialize(torch.arange(3.0, device=dev), torch.ones(3, device=dev))
    tdx.donate_buffer(x)
    z = y + 1
    torch_xla.sync(wait=False)
    with pytest.warns(tdx.UnusedDonationWarning) as caught:
        torch.func.vmap(lambda v: v * 2)(x)  # the dispatcher settles it, deep in torch
    assert os.path.basename(caught[0].filename) == "test_executions.py"


_DEBUG_SCRIPT = r"""
import sys
if sys.argv[1] == "plugin":
    import torch_xla_donate as tdx
import torch, torch_xla
dev = torch_xla.device()
p = torch.randn(16, 16, device=dev); g = torch.randn(16, 16, device=dev)
torch_xla.sync()
for i in range(2):
    p = p * 0.9 + g
    torch_xla.sync()
print(p.sum().item())
with torch_xla.step():
    q = p + 1
compiled = torch_xla.compile(lambda t: t * 3)
compiled(q)
f = torch.compile(lambda x: x * 2, backend="openxla")
f(q)
"""


def _analysis(text):
    """(causes, innermost frames, whole frame lists of non-dynamo compiles)."""
    blocks = re.split(r"={80}\n", text)
    causes, innermost, frames = [], [], []
    for block in blocks:
        lines = [line.split(": ", 1)[1] for line in block.splitlines() if "Analysis: " in line]
        if "Compilation Cause" not in lines and "Execution Cause" not in lines:
            continue
        causes.append(lines[1].strip())
        stack = lines[lines.index("Python Frame Triggered Execution: ") + 1:]
        stack = [s.strip() for s in stack if s.strip() and not s.startswith("-")]
        innermost.append(stack[0])
        if "dynamo" not in lines[1]:
            frames.append(stack)
    return causes, innermost, frames


def test_torch_xla_debug_analysis_is_the_same_with_the_plugin(tmp_path):
    script = tmp_path / "debugged.py"
    script.write_text(_DEBUG_SCRIPT)
    out = {}
    for mode in ("plain", "plugin"):
        proc = run_python(f"import runpy, sys; sys.argv = ['x', '{mode}']; "
                          f"runpy.run_path({str(script)!r}, run_name='__main__')",
                          env={"PT_XLA_DEBUG_LEVEL": "2"})
        out[mode] = _analysis(proc.stderr)
    causes, innermost, frames = out["plugin"]
    assert causes == out["plain"][0] and len(causes) >= 8
    assert innermost == out["plain"][1]
    assert not any("torch_xla_donate" in f for f in innermost)
    # Barriers and step blocks: the very same frames torch_xla lists.
    assert frames == out["plain"][2]
