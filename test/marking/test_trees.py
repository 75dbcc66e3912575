"""donate(tree): every tensor leaf of a pytree, module or optimizer, all or nothing."""
import collections
import gc
import sys

import pytest
import torch
import torch_xla
from helpers import materialize

import torch_xla_donate as tdx
import torch_xla_donate._config
import torch_xla_donate._trees
from torch_xla_donate import _C
from torch_xla_donate import _verdicts as unused


def _lineno() -> int:
    return sys._getframe(1).f_lineno


def _assert_consumed(t):
    """Evidence, not flags: the buffer is gone and any use raises."""
    assert tdx.is_deleted(t)
    with pytest.raises(tdx.DonatedBufferError):
        t.cpu()


def test_nested_containers_donate_every_tensor_and_skip_the_rest(dev):
    Pair = collections.namedtuple("Pair", "a b")
    w, b, m = (torch.full((8, 8), 2.0, device=dev), torch.ones(8, device=dev),
               torch.zeros(8, 8, device=dev))
    c = torch.full((3,), 5.0, device=dev)
    materialize(w)
    tree = {"layer1": [w, b, 3, None], "opt": Pair(m, "momentum"), "extra": (c,)}
    assert tdx.donate(tree) == 4
    assert all(tdx.is_donated(t) for t in (w, b, m, c))
    new_w, new_b, new_m, new_c = w * 3, b + 1, m + w, c - 1
    materialize(new_w)
    for t in (w, b, m, c):
        _assert_consumed(t)
    # The outputs are right although their inputs' buffers were reused.
    torch.testing.assert_close(new_w.cpu(), torch.full((8, 8), 6.0))
    torch.testing.assert_close(new_b.cpu(), torch.full((8,), 2.0))
    torch.testing.assert_close(new_m.cpu(), torch.full((8, 8), 2.0))
    torch.testing.assert_close(new_c.cpu(), torch.full((3,), 4.0))
    assert tree["layer1"][2:] == [3, None] and tree["opt"].b == "momentum"


def test_cpu_leaf_names_its_path_and_marks_nothing(dev):
    w, b = torch.ones(4, 4, device=dev), torch.ones(4, device=dev)
    materialize(w)
    params = {"layer0": [w], "layer1": [torch.ones(4, 4), b]}
    with pytest.raises(ValueError) as info:
        tdx.donate(params)
    message = str(info.value)
    assert "tree['layer1'][0]" in message
    assert "XLA device" in message and "no tensor of this call was marked" in message
    assert not tdx.is_donated(w) and not tdx.is_donated(b)
    # Nothing was lost: the same tensors still work and can be donated.
    assert w.sum().item() == 16
    assert tdx.donate(params["layer0"]) == 1


def test_failure_keeps_marks_made_before_the_call(dev):
    a, b = torch.ones(4, device=dev), torch.ones(2, device=dev)
    materialize(a)
    tdx.donate_buffer(a)
    pending = b + 1  # not materialized: cannot be donated yet
    with pytest.raises(ValueError, match=r"tree\[2\].*pending computation"):
        tdx.donate([a, b, pending])
    assert tdx.is_donated(a), "a mark made before the failing call must survive"
    assert not tdx.is_donated(b)


def test_poisoned_leaf_names_its_path(dev):
    x = torch.ones(16, device=dev)
    materialize(x)
    tdx.donate(x)
    y = x * 2
    materialize(y)
    with pytest.raises(tdx.DonatedBufferError, match=r"tree\['state'\]\['x'\]"):
        tdx.donate({"state": {"x": x, "y": y}})
    assert not tdx.is_donated(y)


def test_duplicates_count_once(dev):
    t = torch.ones(32, device=dev)
    materialize(t)
    assert tdx.donate([t, (t, {"again": t})]) == 1
    out = t + 1
    materialize(out)
    _assert_consumed(t)
    torch.testing.assert_close(out.cpu(), torch.full((32,), 2.0))


def test_messages_blame_the_callers_line(dev):
    x = torch.ones(8, device=dev)
    materialize(x)
    line = _lineno() + 1
    tdx.donate({"x": x})
    y = x + 1
    materialize(y)
    with pytest.raises(tdx.DonatedBufferError, match=rf"{__file__}:{line}\b"):
        x.sum()


def test_opaque_root_is_a_type_error_and_scalars_are_skipped(dev):
    class State:  # not registered with torch.utils._pytree
        def __init__(self, t):
            self.t = t

    t = torch.ones(2, device=dev)
    materialize(t)
    with pytest.raises(TypeError, match=r"State.*register_pytree_node"):
        tdx.donate(State(t))
    assert not tdx.is_donated(t)
    assert tdx.donate(None) == 0 and tdx.donate([1, "a", None]) == 0


def test_switched_off_donates_nothing_and_warns_at_the_callers_line(dev, monkeypatch):
    t = torch.ones(4, device=dev)
    materialize(t)
    previous = tdx.configure(enabled=False)
    try:
        with pytest.warns(tdx.DonationDisabledWarning) as caught:
            assert tdx.donate([t]) == 0
        with pytest.raises(ValueError, match=r"tree\[0\]"):  # still checked
            tdx.donate([torch.ones(1)])
    finally:
        tdx.configure(**previous)
    assert not tdx.is_donated(t)
    assert [w.filename for w in caught] == [__file__]


# -- nn.Module ---------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def test_module_parameters_and_buffers_are_donated_in_place(dev):
    net = _Net().to(dev)
    materialize(net.fc1.weight)
    names = [n for n, _ in net.named_parameters()] + ["scale"]
    old = dict(net.named_parameters()) | {"scale": net.scale}
    expected = {n: t.cpu() * 0.5 for n, t in old.items()}
    assert tdx.donate(net) == len(names) == 5
    new = {n: t * 0.5 for n, t in old.items()}  # a functional update
    materialize(*new.values())
    for t in old.values():
        _assert_consumed(t)
    # The module holds the poisoned tensors: calling it says why it fails.
    with pytest.raises(tdx.DonatedBufferError, match="was donated"):
        net(torch.ones(1, 6, device=dev))
    for n in names:
        torch.testing.assert_close(new[n].cpu(), expected[n])
    # Installing the new tensors makes the module usable again.
    for n, t in new.items():
        module_name, _, leaf = n.rpartition(".")
        owner = net.get_submodule(module_name)
        if leaf == "scale":
            owner.scale = t
        else:
            setattr(owner, leaf, torch.nn.Parameter(t))
    del new, t
    assert net(torch.ones(1, 6, device=dev)).shape == (1, 6)


def test_module_errors_name_the_attribute_path(dev):
    net = _Net().to(dev)
    net.fc2.register_buffer("host_only", torch.zeros(3))  # stayed on the CPU
    materialize(net.fc1.weight)
    with pytest.raises(ValueError, match=r"module\.fc2\.host_only"):
        tdx.donate(net)
    assert not any(tdx.is_donated(p) for p in net.parameters())
    with pytest.raises(ValueError, match=r"tree\['model'\]\.fc2\.host_only"):
        tdx.donate({"model": net})


def test_module_buffers_are_named_while_they_live(dev):
    """donate(module) remembers which tensors are its buffers, so that an
    unused warning can name them (module.scale); a refused call
    remembers nothing, and a buffer that dies is forgotten."""
    net = _Net().to(dev)
    materialize(net.fc1.weight)
    scale = net.scale
    net.fc2.register_buffer("host_only", torch.zeros(3))
    with pytest.raises(ValueError):
        tdx.donate(net)
    assert unused._buffer_path(scale) is None
    del net.fc2.host_only
    assert tdx.donate(net) > 0
    assert unused._buffer_path(scale) == "module.scale"
    assert unused._buffer_path(net.fc1.weight) is None  # a parameter
    key = id(scale)
    tdx.undonate(net)
    del net, scale
    gc.collect()
    assert key not in unused._buffers


def test_tied_weights_are_donated_once(dev):
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}
    ).to(dev)
    # Tie after .to(): moving to XLA makes a new Parameter per module.
    model.head.weight = model.emb.weight
    materialize(model.emb.weight)
    assert tdx.donate(model) == 1
    assert tdx.donate([model.emb, model.head]) == 1


# -- torch.optim ---------------------------------------------------------------


def _adam_with_state(dev):
    model = torch.nn.Linear(5, 3).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 5, device=dev)).sum().backward()
    opt.step()
    materialize(model.weight)
    return model, opt


def test_optimizer_state_is_donated_and_host_counters_skipped(dev):
    model, opt = _adam_with_state(dev)
    states = [s for s in opt.state.values()]
    moments = [s[k] for s in states for k in ("exp_avg", "exp_avg_sq")]
    assert all(s["step"].device.type == "cpu" for s in states)
    skipped = tdx.summary().skipped_on_cpu
    assert tdx.donate(opt) == 4
    # Left out, not silently: the summary counts the two CPU step counters.
    assert tdx.summary().skipped_on_cpu == skipped + 2
    assert "skipped (on CPU)" in str(tdx.summary())
    # A functional Adam-like update of the moments, written into the state.
    for s in states:
        s["exp_avg"] = s["exp_avg"] * 0.9
        s["exp_avg_sq"] = s["exp_avg_sq"] * 0.999
    materialize(states[0]["exp_avg"])
    for t in moments:
        _assert_consumed(t)
    assert all(not tdx.is_deleted(s["exp_avg"]) for s in states)
    assert all(s["step"].item() == 1 for s in states)


def test_optimizer_errors_name_the_state_entry(dev):
    model, opt = _adam_with_state(dev)
    opt.state[model.bias]["trace"] = torch.zeros(3)  # a host tensor, not a counter
    skipped = tdx.summary().skipped_on_cpu
    with pytest.raises(ValueError, match=r"optimizer\.state\[1\]\['trace'\]"):
        tdx.donate(opt)
    assert not any(tdx.is_donated(s["exp_avg"]) for s in opt.state.values())
    assert tdx.summary().skipped_on_cpu == skipped  # a refused call counts nothing


def test_module_and_optimizer_together(dev):
    model, opt = _adam_with_state(dev)
    assert tdx.donate({"model": model, "opt": opt}) == 2 + 4


def test_native_batch_marks_all_or_nothing(dev):
    """``_C.try_mark_all``, donate()'s one native call: when one tensor is
    refused it marks none, says which and why, and leaves no torch_xla
    donor flag behind."""
    via = _C.Via.DONATE
    ok = [materialize(torch.full((4,), float(i), device=dev)) for i in range(3)]
    tdx.donate_buffer(ok[0])  # the guards decided (a first mark)
    tdx.undonate(ok[0])
    pending = materialize(torch.zeros(4, device=dev))
    pending.add_(1)
    assert _C.try_mark_all(ok + [pending], via, ("here.py", 1)) == (_C.Refusal.PENDING, 3)
    assert not any(tdx.is_donated(t) for t in ok + [pending])
    assert not any(torch_xla._XLAC._get_buffer_donation(t) for t in ok)
    assert _C.try_mark_all([ok[0], torch.zeros(4)], via, ("here.py", 1)) == (_C.Refusal.NOT_XLA, 1)
    assert not tdx.is_donated(ok[0])
    # All donatable (a scalar among them is skipped): all marked, blamed on `where`.
    scalar = materialize(torch.tensor(1.0, device=dev))
    assert _C.try_mark_all(ok + [scalar], via, ("here.py", 7)) == (0, 3)
    assert all(tdx.is_donated(t) for t in ok) and not tdx.is_donated(scalar)
    new = [t + 1 for t in ok]
    torch_xla.sync()
    assert all(tdx.is_deleted(t) for t in ok)
    with pytest.raises(tdx.DonatedBufferError, match="here.py:7"):
        ok[1] + 1
    assert scalar.item() == 1.0 and [t.cpu()[0].item() for t in new] == [1.0, 2.0, 3.0]
