"""A functional training loop of a small MLP, with and without donation."""
import json
import os

import torch
import torch_xla
import torch_xla.debug.metrics as met
from helpers import buffer_ptr, run_python

import torch_xla_donate as tdx

STEPS = 20


def _mlp_params(dev):
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (32,), (4, 32), (4,)]
    params = [(torch.randn(s, generator=gen) * 0.1).to(dev) for s in shapes]
    data = torch.randn(64, 16, generator=gen).to(dev)
    target = torch.randint(0, 4, (64,), generator=gen).to(dev)
    torch_xla.sync()
    return params, data, target


def _grads(params, x, y):
    """Cross-entropy gradients of the MLP, written out by hand.

    Not ``torch.autograd.grad``: on an XLA device autograd runs on a worker
    thread that drops its intermediate tensors a moment after returning, so
    whether they are still alive (and become extra graph outputs) at the
    barrier depends on timing.  Plain torch_xla then compiles a second graph
    at a random step, which would make compile counts meaningless here.
    """
    w1, b1, w2, b2 = params
    z = x @ w1.T + b1
    h = torch.relu(z)
    logits = h @ w2.T + b2
    onehot = torch.nn.functional.one_hot(y, logits.shape[1]).to(logits.dtype)
    dlogits = (torch.softmax(logits, dim=1) - onehot) / x.shape[0]
    dz = (dlogits @ w2) * (z > 0).to(z.dtype)
    return [dz.T @ x, dz.sum(0), dlogits.T @ h, dlogits.sum(0)]


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _train(dev, donate: bool):
    """Plain SGD with momentum, written functionally: new tensors each step."""
    params, x, y = _mlp_params(dev)
    momenta = [torch.zeros_like(p) for p in params]
    torch_xla.sync()
    compiles, reused = [], []
    for _ in range(STEPS):
        grads = _grads(params, x, y)
        state = params + momenta
        before = {buffer_ptr(t) for t in state}
        if donate:
            for t in state:
                tdx.donate_buffer(t)
        momenta = [0.9 * m + g for m, g in zip(momenta, grads)]
        params = [p - 0.05 * m for p, m in zip(params, momenta)]
        del grads
        torch_xla.sync()
        compiles.append(_compiles())
        reused.append({buffer_ptr(t) for t in params + momenta} == before)
        # With donation every old buffer was consumed by the step; without
        # it, none.
        assert [tdx.is_deleted(t) for t in state] == [donate] * 8
        del state
    return [p.cpu() for p in params], compiles, reused


def _run_both_modes():
    """Both modes in one fresh process: compile counts are process-global,
    so graphs left by other tests must not be counted."""
    code = f"""
        import json, sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        import torch, torch_xla
        import test_training_loop as t
        dev = torch_xla.device()
        out = {{}}
        for donate in (False, True):
            params, compiles, reused = t._train(dev, donate)
            out[str(donate)] = [[p.tolist() for p in params], compiles, reused]
        print("RESULT" + json.dumps(out))
    """
    stdout = run_python(code).stdout
    result = json.loads(stdout[stdout.index("RESULT") + len("RESULT"):])
    plain, donated = result["False"], result["True"]
    return plain, donated


def test_same_parameters_and_no_extra_compiles():
    plain, donated = _run_both_modes()
    (plain_params, plain_compiles, plain_reused) = plain
    (donated_params, donated_compiles, donated_reused) = donated
    plain_params = [torch.tensor(p) for p in plain_params]
    donated_params = [torch.tensor(p) for p in donated_params]
    # Not bitwise: two plain runs on XLA's CPU backend already differ by an
    # ulp (its reductions are not reproducible run to run).
    for a, b in zip(plain_params, donated_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Steady state: the first step compiles the step graph, no later step
    # compiles anything, in either mode.
    assert plain_compiles[-1] == plain_compiles[0]
    assert donated_compiles[-1] == donated_compiles[0]
    # Evidence of reuse: the new state lives exactly in the buffers of the
    # state it replaced, in every step; never without donation.
    assert not any(plain_reused)
    assert all(donated_reused), donated_reused
