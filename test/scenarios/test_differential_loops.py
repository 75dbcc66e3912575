"""Realistic training loops with and without donation, in separate
processes, every step's values compared bit for bit.

On some CPUs torch_xla 2.9's XLA:CPU computed a matmul with a reused
buffer's old contents (tools/repros/xnnpack_stale_read.py), so a donated
loop drifted from the same loop without donation from its first step.  The
package switches XNNPACK off at import on the CPU backend; these loops are
what a user runs, with the package's defaults, and every value must be the
same as without donation:

* an MLP ``h = tanh(h @ w)`` (3 layers), loss ``mean(h ** 2)``, batch 64;
* SGD with momentum and an Adam-style update, written functionally;
* gradients by ``torch.autograd.grad`` and by ``torch.func.grad_and_value``;
* the update lazy, or a ``torch.compile(backend="openxla")`` function;
* donation with ``tdx.donate`` and with ``tdx.donating``.

Each variant runs 5 steps in a process of its own per mode (one process per
mode runs all the variants of the test), and writes every step's loss and
the final state; the donating run must also have donated (buffers reused,
none unused).  Both runs call ``tdx.settle()`` before each barrier
(helpers.settled_sync): without it the plain run itself is not
bit-repeatable (test_repeatability.py).  The final state is compared
element by element (a digest of its bytes).  CI runs width 1024 (where the bug showed at 768 and up), each
mode twice; with XNNPACK on (XLA_FLAGS=--xla_cpu_use_xnnpack=true) every
variant fails on an AVX2 CPU.  The long form repeats more, at other widths::

    TDX_DIFF_REPEATS=5 TDX_DIFF_WIDTHS=768,1024 PJRT_DEVICE=CPU \\
        .venv/bin/python -m pytest -q test/scenarios/test_differential_loops.py
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

TEST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers.py
STEPS = 5
REPEATS = int(os.environ.get("TDX_DIFF_REPEATS", 2))
WIDTHS = os.environ.get("TDX_DIFF_WIDTHS")

# (optimizer, gradients, update, donation); width chosen per variant below.
VARIANTS = [
    ("sgd", "autograd", "lazy", "donate"),
    ("adam", "autograd", "lazy", "donating"),
    ("sgd", "func", "lazy", "donating"),
    ("adam", "func", "lazy", "donate"),
    ("sgd", "autograd", "compiled", "donating"),
    ("adam", "func", "compiled", "donate"),
]


def _width(variant):
    if WIDTHS:
        return [int(w) for w in WIDTHS.split(",")]
    return [1024]


CASES = [v + (w,) for v in VARIANTS for w in _width(v)]

_LOOP = r'''
import hashlib, json, sys, warnings
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla_donate as tdx
from helpers import settled_sync

cases, donate, steps, out_path = json.loads(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
dev = torch_xla.device()
results = {}


def mlp_loss(ws, x):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return (h ** 2).mean()


def grads_of(kind, ws, x):
    if kind == "autograd":
        ws = [w.requires_grad_() for w in ws]
        loss = mlp_loss(ws, x)
        gs = torch.autograd.grad(loss, ws)
        return [g.detach() for g in gs], loss.detach()
    gs, loss = torch.func.grad_and_value(mlp_loss)(ws, x)
    return gs, loss


def sgd(state, gs):
    ws, ms = state["w"], state["m"]
    new_m = [0.9 * m + g for m, g in zip(ms, gs)]
    return {"w": [w - 0.1 * m for w, m in zip(ws, new_m)], "m": new_m}


def adam(state, gs):
    t = state["t"] + 1
    m = [0.9 * m + 0.1 * g for m, g in zip(state["m"], gs)]
    v = [0.999 * v + 0.001 * g * g for v, g in zip(state["v"], gs)]
    w = [w - 0.01 * (mi / (1 - 0.9 ** t)) / ((vi / (1 - 0.999 ** t)).sqrt() + 1e-8)
         for w, mi, vi in zip(state["w"], m, v)]
    return {"w": w, "m": m, "v": v, "t": t}


for opt, grad_kind, how, donation, width in cases:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(width)
    ws = [(torch.randn(width, width, generator=gen) / width ** 0.5).to(dev) for _ in range(3)]
    state = {"w": ws, "m": [torch.zeros(width, width, device=dev) for _ in ws]}
    if opt == "adam":
        state["v"] = [torch.zeros(width, width, device=dev) for _ in ws]
        state["t"] = torch.zeros(1, device=dev)
    xs = [torch.randn(64, width, generator=gen) for _ in range(steps)]
    update = sgd if opt == "sgd" else adam
    if how == "compiled":
        update = torch.compile(update, backend="openxla")
    if donate and donation == "donating":
        update = tdx.donating(update, donate_argnums=0)
    torch_xla.sync(); xm.wait_device_ops()
    before = tdx.summary().totals
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            with torch.no_grad() if grad_kind == "func" else torch.enable_grad():
                gs, loss = grads_of(grad_kind, [w.detach() for w in state["w"]], xs[s].to(dev))
            settled_sync(wait=True)  # else the plain run itself is not bit-repeatable
            losses.append(loss.item())
            if donate and donation == "donate":
                tdx.donate(state)
            with torch.no_grad():
                state = update(state, gs)
            settled_sync(wait=True)
    tdx.settle()
    after = tdx.summary().totals
    key = "/".join(map(str, (opt, grad_kind, how, donation, width)))
    results[key] = {
        "losses": losses,
        "final": [float(w.double().sum().item()) for w in state["w"]],
        "final_bits": [hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
                       for t in state["w"] + state["m"]],
        "reused": after.reused - before.reused,
        "unused": after.unused - before.unused,
        "warnings": [str(w.message)[:200] for w in caught
                     if issubclass(w.category, (tdx.UnusedDonationWarning, tdx.DroppedDonationWarning,
                                                tdx.StaleReadWarning))],
    }
json.dump(results, open(out_path, "w"))
'''


def _run(cases, donate, tmp_path, tag):
    out = tmp_path / f"{tag}.json"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOOP), json.dumps(cases), "1" if donate else "0",
         str(STEPS), str(out)],
        env=dict(os.environ, PJRT_DEVICE="CPU",
                 PYTHONPATH=os.pathsep.join(filter(None, [TEST_DIR, os.environ.get("PYTHONPATH")]))),
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{tag} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both modes, ``REPEATS`` times, each mode's variants in one process of
    its own (the two processes of a round run one after the other)."""
    tmp = tmp_path_factory.mktemp("diff")
    out = []
    for r in range(REPEATS):
        out.append((_run(CASES, False, tmp, f"plain{r}"), _run(CASES, True, tmp, f"donated{r}")))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "/".join(map(str, c)))
def test_donation_changes_no_value_of_a_training_loop(runs, case):
    key = "/".join(map(str, case))
    optimizer_tensors = 3 * (2 if case[0] == "sgd" else 3) + (1 if case[0] == "adam" else 0)
    for plain, donated in runs:
        p, d = plain[key], donated[key]
        assert d["losses"] == p["losses"], "a step's loss differs from the run without donation"
        assert d["final_bits"] == p["final_bits"] and d["final"] == p["final"]
        assert d["reused"] >= (STEPS - 1) * (optimizer_tensors - 1), d  # donation really happened
        assert d["unused"] == 0 and not d["warnings"], d["warnings"]
        assert p["reused"] == 0
