"""Ownership: who else holds a marked tensor's buffer decides its donation,
the same way at marking and at the commit, never depending on timing."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from helpers import buffer_ptr, child_env, materialize, settled_sync
from torch.func import functional_call, grad_and_value

import torch_xla_donate as tdx


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(dev):
    g = torch.Generator().manual_seed(0)
    return materialize(torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev))


def _base(t):
    return t._base if t._base is not None else t


def _tutorial_run(dev, steps, donate):
    """The torch.func tutorial's training loop (functional_call + grad on
    parameters detached from the module), with our donation call added."""
    torch.manual_seed(0)
    model = _MLP().to(dev)
    x, y = _data(dev)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(params, x, y):
        return F.mse_loss(functional_call(model, params, (x,)), y)

    first = dict(params)
    for step in range(steps):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        old = {buffer_ptr(p) for p in params.values()}
        if donate:
            tdx.donate(params)
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        settled_sync()  # bit-repeatable, with or without donation
        if donate and step > 0:
            # XLA pairs donated buffers with outputs by byte size: the new
            # parameters or the gradients (alive too; a weight's gradient is
            # a transposed view whose base is the output) took every old
            # buffer.  (Not at step 0: XLA:CPU does not hand buffers uploaded
            # from the host, as .to(device) made the module's, to outputs.)
            outputs = {buffer_ptr(_base(t)) for t in list(params.values()) + list(grads.values())}
            assert old <= outputs, step
    return model, first, {k: v.cpu() for k, v in params.items()}


def test_the_torch_func_tutorial_pattern_donates_every_step(dev):
    _, _, plain = _tutorial_run(dev, 4, donate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dropped or unused donation at any step
        model, first, donated = _tutorial_run(dev, 4, donate=True)
    for k in plain:
        assert torch.equal(donated[k], plain[k]), k
    # The module's own parameters shared their storage with the first
    # detached tensors: they went down with that donation, and say so.
    assert all(tdx.is_deleted(t) for t in first.values())
    with pytest.raises(tdx.DonatedBufferError, match=r"parameter 'fc1\.weight' of _MLP"):
        model(torch.ones(2, 16, device=dev))
    assert isinstance(model.fc1.weight, torch.nn.Parameter)


def test_a_leaf_a_finished_graph_still_accumulates_into_goes_down_with_it(dev):
    w = materialize(torch.randn(32, 32, device=dev)).requires_grad_()
    loss = (w * w).sum()
    loss.backward()  # finished; loss keeps its AccumulateGrad, which holds the old w
    w = w.detach()
    ptr = buffer_ptr(w)
    tdx.donate_buffer(w)  # shares its storage with the old leaf: taken down with it
    new = w * 0.5
    torch_xla.sync()
    old_leaf = loss.grad_fn.next_functions[0][0].next_functions[0][0].variable
    # The new value or the old leaf's gradient (same size) took the buffer.
    assert tdx.is_deleted(w) and ptr in (buffer_ptr(new), buffer_ptr(old_leaf.grad))
    with pytest.raises(tdx.DonatedBufferError, match="leaf a finished autograd graph"):
        old_leaf.detach() + 1


def test_a_companion_of_an_unused_donation_is_given_back_with_it(dev):
    """The same companion, when no output takes the buffer: the settled
    verdict lifts its poison too, before anything looks at it."""
    w = materialize(torch.randn(32, 32, device=dev)).requires_grad_()
    loss = (w * w).sum()
    loss.backward()
    torch_xla.sync()  # the gradient too: no output of w's size in the next step
    w = w.detach()
    value = w.cpu()
    tdx.donate_buffer(w)
    total = w.sum()  # no output of w's size: the donation goes unused
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[32,32\]"):
        torch_xla.sync()
        tdx.settle()
    old_leaf = loss.grad_fn.next_functions[0][0].next_functions[0][0].variable
    assert type(old_leaf) is torch.Tensor, "the companion is still poisoned"
    assert torch.equal(old_leaf.detach().cpu(), value) and torch.equal(w.cpu(), value)
    assert torch.allclose(total.cpu(), value.sum())


def test_a_grad_slot_is_named_and_taking_the_grad_out_of_it_donates(dev):
    model = torch.nn.Linear(16, 16).to(dev)
    materialize(model.weight)
    model(torch.ones(4, 16, device=dev)).sum().backward()
    torch_xla.sync()
    with pytest.raises(ValueError, match=r"\.grad of the parameter 'weight' of Linear.*p\.grad = None"):
        tdx.donate_buffer(model.weight.grad)
    g = model.weight.grad
    model.weight.grad = None
    ptr = buffer_ptr(g)
    tdx.donate_buffer(g)
    new = g * 2
    torch_xla.sync()
    assert tdx.is_deleted(g) and buffer_ptr(new) == ptr


def test_a_user_held_view_is_still_refused_and_named(dev):
    t = materialize(torch.arange(6.0, device=dev))
    v = t[0:2]
    with pytest.raises(ValueError, match="shares its buffer with a live view or alias"):
        tdx.donate_buffer(t)
    assert v.cpu().tolist() == [0.0, 1.0] and not tdx.is_donated(t)


@pytest.mark.parametrize("graph", ["no graph", "a forward pass", "a kept p.cpu()"])
def test_a_named_parameter_alias_is_refused_with_or_without_a_graph(dev, graph):
    """``p = nn.Parameter(x)`` kept by the user shares x's buffer: one rule,
    whatever autograd graph hangs on p."""
    x = materialize(torch.randn(4, 4, device=dev))
    p = torch.nn.Parameter(x)
    value = x.cpu()
    kept = {"no graph": None, "a forward pass": lambda: (p * 2).sum(),
            "a kept p.cpu()": lambda: p.cpu()}[graph]
    kept = kept() if kept else None
    with pytest.raises(ValueError, match="shares its buffer with a live view or alias"):
        tdx.donate_buffer(x)
    torch_xla.sync()
    assert not tdx.is_deleted(p) and torch.equal(p.detach().cpu(), value)
    assert not tdx.is_donated(x)


@pytest.mark.parametrize("copy", ["clone", "copy_", "to(copy=True)", "torch.tensor"])
def test_a_copy_that_has_no_buffer_of_its_own_yet_is_refused(dev, copy):
    src = materialize(torch.arange(4.0, device=dev))
    if copy == "clone":
        c = src.clone()
    elif copy == "copy_":
        c = torch.empty_like(src).copy_(src)
    elif copy == "to(copy=True)":
        c = src.to(dev, copy=True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            c = torch.tensor(src)
    with pytest.raises(ValueError, match="no buffer of its own yet.*torch_xla.sync"):
        tdx.donate_buffer(c)
    torch_xla.sync()
    tdx.donate_buffer(c)  # after a step it has
    assert tdx.undonate(c) and src.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_fresh_upload_owns_its_buffer(dev):
    t = torch.randn(64, 64).to(dev)  # uploaded from the host, never through a step
    ptr = buffer_ptr(t)
    tdx.donate_buffer(t)
    new = t + 1
    torch_xla.sync()
    assert tdx.is_deleted(t) and buffer_ptr(new) == ptr


def test_saved_tensors_hooks_keeping_the_tensor_get_the_donated_error(dev):
    kept = []

    def pack(t):
        kept.append(t)
        return t

    w = materialize(torch.randn(8, 8, device=dev)).requires_grad_()
    x = materialize(torch.randn(8, 8, device=dev))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (x * w).sum()  # saves x through the hook: a Python reference only
    tdx.donate_buffer(x)
    new = x + 1
    torch_xla.sync()
    assert tdx.is_deleted(x)
    with pytest.raises(tdx.DonatedBufferError):
        loss.backward()  # backward reads x: our error, not a deleted buffer


# -- Deterministic under load ---------------------------------------------------------

_STRESS = r"""
import os, sys, warnings
import torch, torch_xla
import torch_xla_donate as tdx
from torch.func import grad, grad_and_value

warnings.simplefilter("error")  # a dropped or unused donation fails the run
steps = int(sys.argv[1])
dev = torch_xla.device()
torch.manual_seed(0)

def mlp(params, x):
    h = x
    for w in params[:-1]:
        h = torch.tanh(h @ w)
    return h @ params[-1]

x = torch.randn(32, 64, device=dev)
y = torch.randn(32, 8, device=dev)
params = [torch.randn(64, 64, device=dev) * 0.1 for _ in range(3)] + [torch.randn(64, 8, device=dev) * 0.1]
torch_xla.sync()
loss = lambda ps, x, y: ((mlp(ps, x) - y) ** 2).mean()
refused = 0

def donate_and_update(params, grads):
    global refused
    try:
        tdx.donate(params)
    except ValueError:
        refused += 1
    params = [p - 0.05 * g for p, g in zip(params, grads)]
    torch_xla.sync()
    return params

for step in range(steps):  # the issue's loop: grad, sync, donate, update
    grads = grad(loss)(params, x, y)
    torch_xla.sync()
    params = donate_and_update(params, grads)
for step in range(steps):  # grad_and_value, donating right after it returns
    grads, value = grad_and_value(loss)(params, x, y)
    params = donate_and_update(params, grads)
tdx.settle()
t = tdx.summary().totals
print("STRESS", refused, t.dropped, t.unused, t.reused, t.donated)
"""


def test_torch_func_loops_under_load_never_refuse_or_drop(tmp_path):
    steps = int(os.environ.get("TDX_OWNERSHIP_STEPS", "150"))
    script = tmp_path / "stress.py"
    script.write_text(_STRESS)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        env = child_env()
        proc = subprocess.run([sys.executable, str(script), str(steps)], env=env,
                              capture_output=True, text=True, timeout=1800)
    finally:
        for p in busy:
            p.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(out for out in proc.stdout.splitlines() if out.startswith("STRESS"))
    refused, dropped, unused, reused, donated = map(int, line.split()[1:])
    assert (refused, dropped, unused) == (0, 0, 0), line
    assert reused == donated == 2 * steps * 4


def test_a_tensor_only_autograd_holds_is_not_kept_by_the_scan(dev):
    """The garbage collector hands out the Python object of a tensor whose
    last Python name is gone while a graph holds it; the scan of holders
    leaves it to C++, so the graph going away in the middle of a scan (as
    autograd's worker thread may do at any moment) frees it cleanly: torch
    would otherwise warn that a tensor's Python object outlived it (the
    suite-wide ``no_zombie_tensors`` fixture fails the test then)."""
    import gc

    from torch_xla_donate import _holders as ownership

    w = torch.randn(4, 4, device=dev, requires_grad=True)
    b = torch.nn.Parameter(torch.randn(4, 4, device=dev))
    held_only_by_the_graph = id(b)
    loss = (w * b).sum()  # saves b
    del b
    with ownership.scanning():
        scanned = ownership.scan().tensors
        assert all(id(o) != held_only_by_the_graph for o in scanned)
        assert any(o is w for o in scanned)
        del loss
        gc.collect()


def test_the_autograd_wait_leaves_nothing_for_the_next_graph(dev):
    """Autograd's worker thread still holds the probe's own graph a moment
    after the wait returns: a lazy tensor in it alive at the next barrier
    became an extra output of the user's graph (a recompile under load).
    The probe creates none: no new tensor with pending IR, however soon one
    looks."""
    import re

    from torch_xla_donate import _holders as ownership

    def pending_ids():
        """Live tensors whose IR is a computation (a tensor whose IR is only
        its own device data is no graph output)."""
        report = torch_xla._XLAC._xla_tensors_report(0, str(dev))
        entries = re.findall(r"Tensor: id=(\d+).*?IR \{(.*?)\n\}", report, flags=re.S)
        return {i for i, ir in entries if re.search(r"= \S+ (?!xla::device_data)", ir)}

    torch_xla.sync()
    before = pending_ids()
    for _ in range(5):
        ownership.settle_autograd(dev)
        assert pending_ids() <= before
