"""Every promise in every context: the package's promises, each checked in
each context a user runs a step in.

Promises (one test function each):

* a consumed tensor raises ``DonatedBufferError`` at the use site;
* a tensor never donated, and a donated one no output could take, keep
  their values (the latter with ``UnusedDonationWarning``);
* a refusal is a typed ``ValueError`` naming the holder (a view), and a
  module parameter sharing the donated storage goes down with it, named;
* a buffer another tensor holds is never donated (dropped, named, both
  values kept): a clone read before its first step, a tensor torch_xla's
  ``_replace_xla_tensor`` made share one XLA tensor, a copy only an autograd
  graph holds, a copy made from the donor in the donating step (each way
  torch_xla copies, before and after marking), on both reader paths (the
  ``_XLAC`` path searches in Python and sees no holder only C++ keeps);
* a step's report settles: nothing left in flight, every donation counted
  once;
* values equal those of the same loop without donation, bit for bit.

Contexts (one parameter): grad mode (on, ``torch.no_grad()``,
``torch.inference_mode()``, a ``@torch.no_grad`` function, ``torch.autocast``
to bf16) crossed with the way the step runs (a lazy step and ``sync()``,
``sync(wait=False)``, a ``torch_xla.step()`` block, donation inside and
around a ``torch.compile(backend="openxla")`` call, a second thread).  SPMD
runs the same module in a subprocess with its tensors sharded
(``TDX_MATRIX_SPMD=1``).

CI runs a representative slice: every grad mode with a lazy step, every way
of running with grad on, and the crosses users hit most (an update under
``no_grad`` compiled, in a step block, in a thread, not waited for).  The
long form runs the whole cross product::

    TDX_MATRIX=full PJRT_DEVICE=CPU .venv/bin/python -m pytest -q test/scenarios/test_promise_matrix.py
"""
import os
import threading

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import COPIES, collector_off, run_python

import torch_xla_donate as tdx
from torch_xla_donate import _xla as xla
from torch_xla_donate._poison import is_poisoned

N = 64
SPMD = os.environ.get("TDX_MATRIX_SPMD") == "1"
if SPMD:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    _MESH = xs.Mesh(np.arange(xr.global_runtime_device_count()),
                    (xr.global_runtime_device_count(), 1))


# -- Contexts -------------------------------------------------------------------

def _no_grad_function(fn):
    return torch.no_grad()(fn)()


GRAD_MODES = {
    "grad": lambda fn: fn(),
    "no_grad": lambda fn: _run_in(torch.no_grad(), fn),
    "inference_mode": lambda fn: _run_in(torch.inference_mode(), fn),
    "no_grad_function": _no_grad_function,
    "autocast_bf16": lambda fn: _run_in(torch.autocast("xla", dtype=torch.bfloat16), fn),
}


def _run_in(manager, fn):
    with manager:
        return fn()


def _update(p, g, w):
    """A step's update: a matmul (autocast makes it bf16) and an
    elementwise part, the new state the size of ``p``.  No view: torch_xla
    refuses views of normal tensors under ``inference_mode`` ("Cannot set
    version_counter for inference tensor"), with or without this package."""
    return p - 0.01 * (p @ w) - 0.1 * g


def _lazy(update, args, donate):
    out = (tdx.donating(update, donate_argnums=0) if donate else update)(*args)
    torch_xla.sync()
    return out


def _not_waited(update, args, donate):
    out = (tdx.donating(update, donate_argnums=0) if donate else update)(*args)
    torch_xla.sync(wait=False)
    return out


def _step_block(update, args, donate):
    with torch_xla.step():
        out = (tdx.donating(update, donate_argnums=0) if donate else update)(*args)
    return out


_COMPILED = {}


def _compiled(kind):
    def run(update, args, donate):
        key = (kind, update, donate)
        if key not in _COMPILED:
            if not donate:
                _COMPILED[key] = torch.compile(update, backend="openxla")
            elif kind == "inside":
                _COMPILED[key] = torch.compile(tdx.donating(update, donate_argnums=0),
                                               backend="openxla")
            else:
                _COMPILED[key] = tdx.donating(torch.compile(update, backend="openxla"),
                                              donate_argnums=0)
        out = _COMPILED[key](*args)
        torch_xla.sync()
        return out
    return run


def _in_a_thread(update, args, donate):
    result, errors = [], []

    def body():
        try:
            result.append(_lazy(update, args, donate))
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=120)
    if errors:
        raise errors[0]
    return result[0]


RUNS = {
    "lazy": _lazy,
    "wait_false": _not_waited,
    "step_block": _step_block,
    "compiled_inside": _compiled("inside"),
    "compiled_around": _compiled("around"),
    "thread": _in_a_thread,
}

FULL = os.environ.get("TDX_MATRIX") == "full"
_SLICE = ([(g, "lazy") for g in GRAD_MODES] + [("grad", r) for r in RUNS if r != "lazy"]
          + [("no_grad", "compiled_inside"), ("no_grad", "compiled_around"),
             ("no_grad", "step_block"), ("no_grad", "thread"), ("inference_mode", "wait_false"),
             ("autocast_bf16", "compiled_around")])
if SPMD:  # the subprocess's slice: what sharding could change
    _SLICE = [("grad", "lazy"), ("no_grad", "lazy"), ("grad", "wait_false"), ("grad", "step_block")]
CONTEXTS = [f"{g}/{r}" for g in GRAD_MODES for r in RUNS] if FULL else [f"{g}/{r}" for g, r in _SLICE]


class Context:
    def __init__(self, name):
        self.name = name
        grad, run = name.split("/")
        self._grad, self._run = GRAD_MODES[grad], RUNS[run]
        self.compiled = run.startswith("compiled")

    def step(self, update, args, donate=True):
        """Runs one step of ``update(*args)`` in this context, the first
        argument donated; returns the output."""
        return self._grad(lambda: self._run(update, args, donate))


@pytest.fixture(params=CONTEXTS)
def context(request):
    torch._dynamo.reset()
    _COMPILED.clear()
    yield Context(request.param)
    torch._dynamo.reset()


def _tensor(values, dev):
    t = values.to(dev)
    if SPMD:
        xs.mark_sharding(t, _MESH, (0, None))
    return t


def _state(dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = _tensor(torch.randn(N, N, generator=gen), dev)
    g = _tensor(torch.randn(N, N, generator=gen), dev)
    x = _tensor(torch.randn(N, N, generator=gen) / N, dev)
    torch_xla.sync()
    xm.wait_device_ops()
    return p, g, x


# -- Promises -------------------------------------------------------------------


def test_a_consumed_tensor_raises_at_the_use_site(context, dev):
    p, g, x = _state(dev)
    new = context.step(_update, (p, g, x))
    tdx.settle()
    assert tdx.is_deleted(p)
    with pytest.raises(tdx.DonatedBufferError, match=r"f32\[64,64\].*step \d+ reused"):
        p + 1
    with pytest.raises(tdx.DonatedBufferError):
        p.cpu()
    assert p.shape == (N, N) and "donated XLA tensor" in repr(p)
    assert bool(torch.isfinite(new.cpu()).all())


def _no_output_fits(p, g, x):
    """Reads ``p``, but no output has its size: its donation cannot be used.
    (A compiled graph that does not read a donated argument at all loses the
    donation with the op the compiler removes: README, Limits.)"""
    return g.sum(0) * 2 + x.sum(0) + p.sum()


def test_a_consumed_tensor_the_loop_drops_takes_torch_xlas_tensor_with_it(context, dev):
    # Held through the barrier, then dropped: the poisoned tensor's entry
    # keeps it only weakly, and lets go as it dies (test_dropped_donors.py),
    # so torch_xla's tensor leaves its registry at the ``del``, as a plain
    # tensor's does, whichever execution committed the donation.  A first
    # step warms up: dynamo keeps the arguments of the call that compiled
    # its graph (a plain tensor's too, without this package).
    warm = context.step(_update, _state(dev, seed=1))
    p, g, x = _state(dev)
    with collector_off():
        new = context.step(_update, (p, g, x))
        assert is_poisoned(p)
        before = xla.live_tensor_count()
        del p
        assert xla.live_tensor_count() == before - 1
    tdx.settle()
    assert bool(torch.isfinite(new.cpu()).all()) and bool(torch.isfinite(warm.cpu()).all())


def test_untouched_and_unused_tensors_keep_their_values(context, dev):
    p, g, x = _state(dev)
    p_value, g_value = p.cpu(), g.cpu()
    with pytest.warns(tdx.UnusedDonationWarning, match=r"f32\[64,64\]"):
        out = context.step(_no_output_fits, (p, g, x))  # p donated, nothing can take it
        tdx.settle()
    assert not tdx.is_deleted(p) and not tdx.is_donated(p)
    assert torch.equal(p.cpu(), p_value) and torch.equal(g.cpu(), g_value)
    torch.testing.assert_close(out.cpu(), g_value.sum(0) * 2 + x.cpu().sum(0) + p_value.sum())


def test_refusals_name_the_holder_and_parameters_go_down_named(context, dev):
    p, g, x = _state(dev)
    value = p.cpu()
    # A view held when marking: a ValueError naming it, in any grad mode.
    view = p[0:2]
    with pytest.raises(ValueError, match="shares its buffer with a live view or alias"):
        context._grad(lambda: tdx.donate_buffer(p))
    assert not tdx.is_donated(p)
    del view
    # A view made after marking: the execution that commits the mark drops
    # it (a warning naming the view), runs, and keeps the value.
    context._grad(lambda: tdx.donate_buffer(p))
    view = p[0:2]
    with pytest.warns(tdx.DroppedDonationWarning, match="live view or alias"):
        new = context.step(_update, (p, g, x), donate=False)
        tdx.settle()
    assert not tdx.is_deleted(p) and torch.equal(p.cpu(), value)
    assert torch.equal(view.cpu(), value[0:2]) and new.shape == (N, N)
    assert tdx.last_step_report().in_flight == 0
    del view
    # Parameters of a module sharing the donated storage go down with it.
    model = torch.nn.Linear(N, N, bias=False).to(dev)
    if SPMD:  # sharded like the output, so that it can take the buffer
        xs.mark_sharding(model.weight, _MESH, (0, None))
    torch_xla.sync()
    weight = model.weight.detach()  # the torch.func pattern: shares the storage
    new = context.step(_update, (weight, g, x))
    tdx.settle()
    assert tdx.is_deleted(weight)
    with pytest.raises(tdx.DonatedBufferError, match="parameter 'weight' of Linear"):
        model(x)
    assert new.shape == (N, N)


# Holders of a donor's buffer that are not its views (c10 sees those): each
# makes (donor, check) from a fresh state tensor ``p``; ``check()`` asserts
# the other holder kept its value after the step.


def _clone_read(p, donate_clone):
    """A clone read before its first step keeps its source's buffer for good."""
    value = p.cpu()
    c = p.clone()
    c.cpu()  # executes nothing: the clone's buffer is p's
    donor, other = (c, p) if donate_clone else (p, c)
    return donor, lambda: torch.equal(other.cpu(), value)


def _replaced(p, donate_source):
    """``_replace_xla_tensor(t, s)`` (torch_xla's FSDP) makes t hold s's XLA tensor."""
    s = p * 3
    torch_xla.sync()
    value = s.cpu()
    t = torch.zeros_like(p)
    torch_xla.sync()
    torch_xla._XLAC._replace_xla_tensor(t, s)
    donor, other = (s, t) if donate_source else (t, s)
    return donor, lambda: torch.equal(other.cpu(), value)


def _held_by_autograd(p, _):
    """A copy of p (it shares p's buffer) that only an autograd graph holds."""
    u = p.to(p.device, copy=True)
    torch_xla.sync()
    w = _tensor(torch.ones(N, N), p.device).requires_grad_()
    with torch.enable_grad():
        loss = (u @ w).sum()
    del u
    expected = p.cpu().sum(0, keepdim=True).t().expand(N, N)

    def check():
        loss.backward()  # reads the copy's buffer
        torch.testing.assert_close(w.grad.cpu(), expected)
        return True
    return p, check


def _copied_in_the_step(kind, after_marking):
    """A copy made from p in the donating step, before or after p is marked
    (the step marks it again: no change): its IR value is p's device data,
    and the barrier backs it with p's buffer."""
    def make(p):
        value = p.cpu()
        if after_marking:
            tdx.donate_buffer(p)
        c = COPIES[kind](p)
        return p, lambda: torch.equal(c.cpu(), value)
    return make


def _copied_into_an_older_tensor(p):
    """``x.copy_(p)`` in the donating step into an ``x`` that got its buffer
    at an earlier barrier: x keeps its XLA tensor and id (functionalization
    or not), and its IR value is now p's device data."""
    x = _tensor(torch.zeros(N, N), p.device)
    torch_xla.sync()
    value = p.cpu()
    x.copy_(p)
    return p, lambda: torch.equal(x.cpu(), value)


# Under SPMD a copy into another tensor (copy_, x[...] = t, load_state_dict)
# is an xla::custom_sharding op, computed into a buffer of its own: it holds
# nothing (raw donation keeps its value), so it is no holder there.
_COPY_KINDS = [k for k in COPIES
               if not (SPMD and k in ("copy_", "x[...] = t", "load_state_dict"))]

HOLDERS = {
    "clone read, source donated": lambda p: _clone_read(p, False),
    "clone read, clone donated": lambda p: _clone_read(p, True),
    "_replace_xla_tensor, target donated": lambda p: _replaced(p, False),
    "_replace_xla_tensor, source donated": lambda p: _replaced(p, True),
    "copy held by autograd": lambda p: _held_by_autograd(p, None),
    **{f"{kind} in the step, {when} marking": _copied_in_the_step(kind, when == "after")
       for kind in _COPY_KINDS for when in ("before", "after")},
    **({} if SPMD else {"copy_ into an older tensor": _copied_into_an_older_tensor}),
}
@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.usefixtures("native_reads")
def test_a_buffer_another_tensor_holds_is_never_donated(context, dev, holder):
    p, g, x = _state(dev)
    donor, other_kept = HOLDERS[holder](p)
    value = donor.cpu()
    with pytest.warns(tdx.DroppedDonationWarning, match=r"f32\[64,64\].*(also held|shares)"):
        new = context.step(_update, (donor, g, x))
        tdx.settle()
    assert not tdx.is_deleted(donor) and torch.equal(donor.cpu(), value)
    assert other_kept()
    assert tdx.last_step_report().dropped >= 1
    plain = context.step(_update, (donor, g, x), donate=False)
    assert torch.equal(new.cpu(), plain.cpu())


def test_reports_settle(context, dev):
    p, g, x = _state(dev)
    before = tdx.summary().totals
    context.step(_update, (p, g, x))
    tdx.settle()
    report = tdx.last_step_report()
    after = tdx.summary().totals
    assert report.in_flight == 0 and after.in_flight == 0
    assert after.donated - before.donated == 1
    assert after.reused - before.reused == 1


def _loop(context, dev, donate):
    p, g, x = _state(dev, seed=1)
    values = []
    for _ in range(3):
        p = context.step(_update, (p, g, x), donate=donate)
        values.append(p.cpu())
    return values


def test_values_equal_a_run_without_donation(context, dev):
    plain = _loop(context, dev, donate=False)
    donated = _loop(context, dev, donate=True)
    for a, b in zip(plain, donated):
        assert torch.equal(a, b)


def _every_promise_holds_under_spmd():
    """The module again, in a process with SPMD on and every tensor
    sharded over 4 CPU devices (a slice of the contexts)."""
    proc = run_python(
        f"import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
        f"{os.path.abspath(__file__)!r}]))",
        env={"TDX_MATRIX_SPMD": "1", "CPU_NUM_DEVICES": "4"},
        timeout=600,
    )
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]


if not SPMD:  # the SPMD process itself runs the promises above, not this
    test_every_promise_holds_under_spmd = _every_promise_holds_under_spmd
