"""Every entry point that takes a tree walks it the same way (walk.py):
``donate``, ``donating`` (by position and by name), and both of them while
dynamo traces them, over every kind of leaf.  Each marks exactly the
tensors the kind promises, or refuses it with the same error."""
import collections
import dataclasses

import pytest
import torch
import torch._dynamo
import torch.utils._pytree as pytree
import torch_xla
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C

N = 8

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Registered:
    a: torch.Tensor
    b: torch.Tensor


pytree.register_dataclass(Registered)


@dataclasses.dataclass
class Unregistered:
    a: torch.Tensor


class Opaque:
    def __init__(self, a):
        self.a = a


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(N, N)
        self.register_buffer("scale", torch.ones(N))


def _fresh(dev, n=2):
    out = materialize(*[torch.randn(N, N, device=dev) for _ in range(n)])
    return [out] if n == 1 else list(out)


def _optimizer(dev, kind):
    model = torch.nn.Linear(N, N).to(dev)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.ones(2, N, device=dev)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    materialize(model.weight)
    keys = ("momentum_buffer",) if kind == "sgd" else ("exp_avg", "exp_avg_sq")
    return opt, [s[k] for s in opt.state.values() for k in keys]


# kind -> dev -> (tree, the tensors donated, or the error type refusing it)
def _kinds():
    def tensor(dev):
        t, = _fresh(dev, 1)
        return t, [t]

    def nest(dev):
        a, b = _fresh(dev)
        return {"w": [a, (b, None, 3, "s")]}, [a, b]

    def namedtuple(dev):
        a, b = _fresh(dev)
        return Pair(a, b), [a, b]

    def registered_dataclass(dev):
        a, b = _fresh(dev)
        return [Registered(a, b)], [a, b]

    def zero_dim_skipped(dev):
        a, = _fresh(dev, 1)
        s = materialize(torch.ones((), device=dev) * 3)
        return [a, s], [a]

    def module(dev):
        m = WithBuffer().to(dev)
        materialize(m.fc.weight)
        return [m], [m.fc.weight, m.fc.bias, m.scale]

    def sgd(dev):
        return _optimizer(dev, "sgd")

    def adam(dev):  # its CPU step counters are skipped
        return _optimizer(dev, "adam")

    def unregistered_dataclass(dev):
        a, = _fresh(dev, 1)
        return {"cfg": Unregistered(a)}, TypeError

    def opaque_root(dev):
        a, = _fresh(dev, 1)
        return Opaque(a), TypeError

    def cpu_tensor(dev):
        a, = _fresh(dev, 1)
        return [a, torch.ones(N)], ValueError

    def cpu_scalar(dev):
        a, = _fresh(dev, 1)
        return [a, torch.tensor(1.0)], ValueError

    def view(dev):
        a, b = _fresh(dev)
        return [a, b[0]], ValueError

    return {f.__name__: f for f in (tensor, nest, namedtuple, registered_dataclass,
                                    zero_dim_skipped, module, sgd, adam,
                                    unregistered_dataclass, opaque_root, cpu_tensor,
                                    cpu_scalar, view)}


KINDS = _kinds()


def _noop(tree):
    return None


def _donate_inside(tree):
    tdx.donate(tree)


ENTRY_POINTS = {
    "donate": lambda tree: tdx.donate(tree),
    "donating argnums": lambda tree: tdx.donating(_noop, donate_argnums=0)(tree),
    "donating argnames": lambda tree: tdx.donating(_noop, donate_argnames="tree")(tree=tree),
    "compiled donate": lambda tree: torch.compile(_donate_inside, backend="openxla")(tree),
    "compiled donating": lambda tree: torch.compile(
        tdx.donating(_noop, donate_argnums=0), backend="openxla")(tree),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _reference_error(kind, dev):
    tree, _ = KINDS[kind](dev)
    with pytest.raises(Exception) as caught:
        tdx.donate(tree)
    return caught.value


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_entry_point_walks_a_tree_the_same_way(dev, kind, entry):
    refused = isinstance(KINDS[kind](dev)[1], type)
    reference = _reference_error(kind, dev) if refused else None
    tree, expected = KINDS[kind](dev)
    others = _fresh(dev, 1)  # a mark made before: kept whatever the call does
    tdx.donate_buffer(others[0])
    marked_before = _C.marked_count()
    if refused:  # refused, as ``donate`` refuses it
        assert isinstance(reference, expected), reference
        with pytest.raises(expected) as caught:
            ENTRY_POINTS[entry](tree)
        message, want = str(caught.value), str(reference)
        assert message.startswith(want.split(" is a ")[0].split(", so")[0]), (message, want)
        assert _C.marked_count() == marked_before  # all or nothing
    else:
        ENTRY_POINTS[entry](tree)
        assert [tdx.is_donated(t) for t in expected] == [True] * len(expected)
        assert _C.marked_count() == marked_before + len(expected)  # and nothing else
        tdx.undonate(tree)
    assert tdx.undonate(others[0])
    torch_xla.sync()


@pytest.mark.parametrize("where", ["nested", "in an optimizer's state"])
def test_a_dataclass_is_refused_with_its_path_and_the_fix(dev, where):
    """The cheap walk (no paths, the common case's) refuses it too, and the
    message names the path as the path-building walk would."""
    a, = _fresh(dev, 1)
    if where == "nested":
        tree, path = {"cfg": Unregistered(a)}, "tree['cfg']"
    else:
        tree, _ = _optimizer(dev, "sgd")
        first = next(iter(tree.state.values()))
        first["extra"] = Unregistered(a)
        path = "optimizer.state[0]['extra']"
    for call in (tdx.donate, tdx.undonate):
        with pytest.raises(TypeError) as caught:
            call(tree)
        name = call.__name__
        assert str(caught.value).startswith(f"{name}: {path} is a Unregistered"), caught.value
        assert "register_dataclass" in str(caught.value)
    assert not tdx.is_donated(a) and _C.marked_count() == 0
