"""Optimizer loops: functional updates with donate(), torch.optim, MpDeviceLoader.

* A functional optimizer (params and Adam state as plain tensors, replaced by
  new tensors each step) donated with ``donate`` does not need a second copy
  of its state at the step's peak, and computes the same values.
* ``torch.optim`` + ``xm.optimizer_step`` and ``MpDeviceLoader`` loops (in-place
  updates, which torch_xla aliases by itself) give the same results with the
  plugin imported as without it.
* A functional loop driven by ``MpDeviceLoader``: the loader's barrier
  commits the marks, and the values equal those of the loop without donation.

Checkpoints of marked models: test_checkpoints.py; ``donate(model)`` with a
constant buffer and ``donate(optimizer)``: test_donate_model_and_optimizer.py.
"""
import warnings

import torch
import torch_xla.distributed.parallel_loader as pl
from helpers import materialize, run_python, settle_autograd, settled_sync

import torch_xla_donate as tdx

# -- peak memory of a functional Adam loop ------------------------------------

PARAM_MIB = (64, 32)  # two parameters; Adam keeps p, m and v for each
STATE_MIB = 3 * sum(PARAM_MIB)

_FUNCTIONAL_ADAM = """
import sys
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla_donate as tdx

def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

dev = torch_xla.device()
sizes = [mib * 1024 * 1024 // 4 for mib in {param_mib}]
gen = torch.Generator().manual_seed(0)
targets = [torch.randn(n, generator=gen).to(dev) for n in sizes]
params = [torch.zeros(n, device=dev) for n in sizes]
state = {{"step": torch.zeros((), device=dev),
          "m": [torch.zeros(n, device=dev) for n in sizes],
          "v": [torch.zeros(n, device=dev) for n in sizes]}}
torch_xla.sync(); xm.wait_device_ops()
base = peak_mib()
deleted = 0
for _ in range(4):
    # Loss 0.5 * |p - target|^2, its gradient written out.
    grads = [p - t for p, t in zip(params, targets)]
    old = (params, state)
    if {donate}:
        tdx.donate(old)
    step = state["step"] + 1
    m = [0.9 * m + 0.1 * g for m, g in zip(state["m"], grads)]
    v = [0.999 * v + 0.001 * g * g for v, g in zip(state["v"], grads)]
    params = [p - 0.05 * (mi / (1 - 0.9 ** step)) / ((vi / (1 - 0.999 ** step)).sqrt() + 1e-8)
              for p, mi, vi in zip(params, m, v)]
    state = {{"step": step, "m": m, "v": v}}
    del grads, m, v, step
    torch_xla.sync(); xm.wait_device_ops()
    deleted += sum(tdx.is_deleted(t) for t in old[0] + old[1]["m"] + old[1]["v"])
    del old
print("growth_mib", peak_mib() - base, "deleted", deleted)
torch.save({{"params": [p.cpu() for p in params], "m": [t.cpu() for t in state["m"]],
            "v": [t.cpu() for t in state["v"]], "step": state["step"].cpu()}}, {out!r})
"""


def _adam_run(tmp_path, donate: bool):
    out = tmp_path / f"adam_{donate}.pt"
    code = _FUNCTIONAL_ADAM.format(param_mib=PARAM_MIB, donate=donate, out=str(out))
    words = run_python(code).stdout.split()
    growth = float(words[words.index("growth_mib") + 1])
    deleted = int(words[words.index("deleted") + 1])
    return growth, deleted, torch.load(out)


def test_functional_adam_keeps_one_copy_of_its_state(tmp_path):
    plain, plain_deleted, plain_state = _adam_run(tmp_path, donate=False)
    donated, donated_deleted, donated_state = _adam_run(tmp_path, donate=True)
    # Without donation the step's outputs need a second copy of the state.
    assert plain > 0.9 * STATE_MIB, f"plain loop grew {plain:.0f} MiB"
    # With it the new state lives in the old buffers.  Not quite flat: XLA
    # pairs donated buffers with outputs by size in parameter order, not by
    # data flow, and copies an input it would otherwise overwrite too early
    # (measured: +116 MiB here against +315 MiB without donation; a loop
    # whose outputs are created in the order of their inputs can stay flat:
    # +11 MiB measured for SGD with momentum).
    assert donated < 0.6 * STATE_MIB, f"donated loop grew {donated:.0f} MiB"
    assert plain - donated > 0.4 * STATE_MIB
    assert plain_deleted == 0 and donated_deleted == 4 * 3 * len(PARAM_MIB)
    # The XLA CPU backend is not bitwise reproducible run to run: tight,
    # not exact, tolerance.
    for key in ("params", "m", "v"):
        for a, b in zip(plain_state[key], donated_state[key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert plain_state["step"].item() == donated_state["step"].item() == 4


# -- torch.optim and MpDeviceLoader, with and without the plugin ---------------

_TORCH_OPTIM = """
import warnings
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
if {plugin}:
    import torch_xla_donate as tdx
    for w in (tdx.UnusedDonationWarning, tdx.DroppedDonationWarning):
        warnings.simplefilter("error", w)
    donated_before = tdx._C.totals()["donated"]

dev = torch_xla.device()
gen = torch.Generator().manual_seed(0)
x = torch.randn(96, 12, generator=gen)
y = torch.randint(0, 3, (96,), generator=gen)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(),
                                torch.nn.Linear(24, 3)).to(dev)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)

def train_step(model, opt, xb, yb):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    xm.optimizer_step(opt)

# A plain loop with a barrier per step and a checkpoint in the middle.
model, opt = model_and_optimizer(0)
for i, (xb, yb) in enumerate(loader):
    train_step(model, opt, xb.to(dev), yb.to(dev))
    torch_xla.sync()
    if i == 2:
        xm.save(model.state_dict(), {ckpt!r})
        saved = torch.load({ckpt!r})
        for k, v in model.state_dict().items():
            assert torch.equal(saved[k], v.cpu()), k
results = {{"plain": {{k: v.cpu() for k, v in model.state_dict().items()}}}}

# The same with MpDeviceLoader, whose iterator issues the barriers.
model, opt = model_and_optimizer(0)
for epoch in range(2):
    for xb, yb in pl.MpDeviceLoader(loader, dev):
        train_step(model, opt, xb, yb)
results["loader"] = {{k: v.cpu() for k, v in model.state_dict().items()}}
if {plugin}:
    # Nothing was marked behind the user's back.
    assert tdx._C.totals()["donated"] == donated_before
torch.save(results, {out!r})
"""


def test_torch_optim_and_mp_device_loader_unchanged_by_the_plugin(tmp_path):
    """The same script in a fresh process without the plugin, and here, where
    the plugin is imported and its step hook installed."""
    results = {}
    for plugin in (False, True):
        out = tmp_path / f"optim_{plugin}.pt"
        code = _TORCH_OPTIM.format(plugin=plugin, out=str(out),
                                   ckpt=str(tmp_path / f"ckpt_{plugin}.pt"))
        if plugin:
            assert tdx._hooks.installed()
            with warnings.catch_warnings():
                exec(compile(code, "<torch.optim loop>", "exec"), {})
        else:
            run_python(code)
        results[plugin] = torch.load(out)
    for loop in ("plain", "loader"):
        without, with_plugin = results[False][loop], results[True][loop]
        assert without.keys() == with_plugin.keys()
        for k in without:
            torch.testing.assert_close(with_plugin[k], without[k], rtol=1e-5, atol=1e-6)
    # The loops trained: the parameters moved away from the same start.
    assert not torch.allclose(results[True]["plain"]["0.weight"],
                              results[True]["loader"]["0.weight"])


def test_donating_a_model_before_an_in_place_optimizer_step_is_harmless(dev):
    """torch.optim updates in place: the marked parameters are outputs of the
    step, not donors; they keep their new values and nothing is poisoned."""
    results = []
    for donate in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        materialize(model.weight)
        for _ in range(3):
            if donate:
                assert tdx.donate(model) == 2
            opt.zero_grad()
            model(torch.ones(5, 8, device=dev)).square().sum().backward()
            opt.step()
            settled_sync()  # bit-repeatable, with or without donation
            if donate:
                stats = tdx._C.step_stats()
                assert stats["updated_in_place"] == 2 and stats["reused"] == 0
        results.append([p.cpu() for p in model.parameters()])
        assert not any(tdx.is_deleted(p) for p in model.parameters())
    for a, b in zip(*results):
        assert torch.equal(a, b)


# -- a functional loop driven by MpDeviceLoader ---------------------------------


def _functional_sgd_over_loader(dev, donate: bool):
    """SGD with momentum written functionally; the loader's iterator is the
    only barrier, so it commits the marks made in the previous iteration."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 10, generator=gen), torch.randn(64, 2, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    params = {"w": (torch.randn(10, 2, generator=gen) * 0.1).to(dev), "b": torch.zeros(2).to(dev)}
    momenta = {k: torch.zeros_like(v) for k, v in params.items()}
    materialize(params["w"])
    previous, consumed = None, []
    for xb, yb in pl.MpDeviceLoader(loader, dev):
        if previous is not None:  # the barrier of this iteration settled it
            consumed.append(all(tdx.is_deleted(t) for t in previous))
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = ((xb @ leaves["w"] + leaves["b"] - yb) ** 2).mean()
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        del leaves, loss
        previous = list(params.values()) + list(momenta.values())
        if donate:
            tdx.donate((params, momenta))
        momenta = {k: 0.9 * momenta[k] + grads[k] for k in params}
        params = {k: params[k] - 0.05 * momenta[k] for k in params}
        settle_autograd()  # before the loader's barrier: bit-repeatable runs
    consumed.append(all(tdx.is_deleted(t) for t in previous))
    return {k: v.cpu() for k, v in params.items()}, consumed


def test_functional_loop_over_mp_device_loader(dev):
    plain, plain_consumed = _functional_sgd_over_loader(dev, donate=False)
    donated, donated_consumed = _functional_sgd_over_loader(dev, donate=True)
    assert plain_consumed == [False] * 4
    assert donated_consumed == [True] * 4
    for k in plain:
        assert torch.equal(donated[k], plain[k]), k
