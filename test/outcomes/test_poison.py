"""Poisoning: every operator on a donated tensor raises at its call site,
whoever calls it; metadata stays readable."""
import pickle
import weakref

import pytest
import torch
import torch_xla
from helpers import collector_off, materialize

from torch_xla_donate import _C
from torch_xla_donate import _guards as guards
from torch_xla_donate import _poison as poison
from torch_xla_donate.errors import DonatedBufferError


@pytest.fixture
def consumed_record():
    """A ledger record whose verdict is 'consumed', as after a real step."""
    holder = torch.empty(0)
    _C.mark(holder, "train.py", 42, (2, 3), "f32", 24)
    _, _, (record,) = _C.begin_step()
    _C.settle(record, _C.Verdict.REUSED)
    return record


@pytest.fixture
def donated(consumed_record, dev):
    """A poisoned tensor, refused by the plugin's dispatch key (donated_key.h)."""
    t = materialize(torch.ones(2, 3, device=dev))
    assert guards.decide(t) and guards.state("poisoning") == "native dispatch key", guards.state("poisoning")
    poison.poison(t, consumed_record)
    return t


@torch.jit.script
def _scripted(x):
    return x * 2


def _traced():
    return torch.jit.trace(lambda x: x * 2, (torch.ones(2, 3),))


USES = {
    "arithmetic": lambda t: t + 1,
    "reduction": lambda t: t.sum(),
    "indexing": lambda t: t[0],
    "in-place": lambda t: t.add_(1),
    "to cpu": lambda t: t.cpu(),
    "item": lambda t: t.sum().item(),
    "torch.stack of a list": lambda t: torch.stack([torch.ones(2, 3), t]),
    "functional": lambda t: torch.nn.functional.relu(t),
    "matmul": lambda t: torch.ones(3, 2) @ t,
    "aten op": lambda t: torch.ops.aten.mul.Tensor(t, 2),
    "numpy": lambda t: t.cpu().numpy(),
    "clone": lambda t: t.clone(),
    "pickle": lambda t: pickle.dumps(t),
    "comparison": lambda t: t == 1,
    "tolist": lambda t: t.tolist(),
    "torch.func.vmap": lambda t: torch.func.vmap(lambda x: x * 2)(t),
    "torch.func.grad": lambda t: torch.func.grad(lambda x: (x * x).sum())(t),
    "torch.jit.trace": lambda t: torch.jit.trace(lambda x: x * 2, (t,)),
    "a scripted function": lambda t: _scripted(t),
    "_make_subclass, then a use": lambda t: torch.Tensor._make_subclass(torch.Tensor, t) + 1,
    "another tensor's set_(t), then a use": lambda t: torch.empty(0, device=t.device).set_(t) + 1,
    "nn.Parameter(t), then a use": lambda t: torch.nn.Parameter(t) * 2,
    "t.data": lambda t: t.data + 1,
    "detach": lambda t: t.detach(),
    "a partial write": lambda t: t.__setitem__(0, 1.0),
    "copy_ from itself": lambda t: t.copy_(t),
    "copy_ into another tensor": lambda t: torch.empty(2, 3, device=t.device).copy_(t),
    "autograd backward": lambda t: (t.requires_grad_() * 2).sum().backward(),
}


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_every_use_raises(donated, use):
    with pytest.raises(DonatedBufferError, match=r"f32\[2,3\].*train\.py:42"):
        use(donated)


def test_metadata_stays_readable(donated):
    assert donated.shape == (2, 3) and donated.dtype == torch.float32
    assert donated.device.type == "xla" and donated.dim() == 2 and donated.numel() == 6
    assert donated.size(1) == 3 and len(donated) == 2 and donated.stride() == (3, 1)
    assert isinstance(donated, torch.Tensor) and not donated.requires_grad
    hash(donated)


def test_a_new_value_lifts_the_poison(donated, dev):
    # ``t.set_(s)`` and ``t.data = s`` give the tensor another buffer: it is
    # a live tensor again, not a donated one.
    donated.set_(torch.full((2, 3), 7.0, device=dev))
    assert poison.donation_record(donated) is None
    assert (donated + 1).sum().item() == 48 and "donated" not in repr(donated)
    assert not poison.is_poisoned(donated)


@pytest.mark.parametrize("source", ["same shape", "broadcast", "other dtype", "from the host"])
def test_copy_into_a_consumed_tensor_refills_it(donated, dev, source):
    """``copy_`` writes every element and reads none: the tensor takes the
    source's value and is live again (``load_state_dict`` does this, and
    torch.compile's write-back of an input the graph mutated)."""
    src = {"same shape": lambda: torch.full((2, 3), 5.0, device=dev),
           "broadcast": lambda: torch.full((3,), 5.0, device=dev),
           "other dtype": lambda: torch.full((2, 3), 5, dtype=torch.int32, device=dev),
           "from the host": lambda: torch.full((2, 3), 5.0)}[source]()
    donated.copy_(src)
    assert donated.dtype == torch.float32 and poison.donation_record(donated) is None
    assert "donated" not in repr(donated) and not poison.is_poisoned(donated)
    torch_xla.sync()
    assert torch.equal(donated.cpu(), torch.full((2, 3), 5.0))


def test_copy_from_a_consumed_tensor_still_raises_and_refills_nothing(donated, dev):
    target = materialize(torch.ones(2, 3, device=dev))
    with pytest.raises(DonatedBufferError):
        target.copy_(donated)
    assert torch.equal(target.cpu(), torch.ones(2, 3)) and poison.is_poisoned(donated)


def test_dot_data_assignment_lifts_the_poison(consumed_record, dev):
    t = materialize(torch.ones(2, 3, device=dev))
    poison.poison(t, consumed_record)
    t.data = torch.zeros(2, 3, device=dev)
    assert poison.donation_record(t) is None and t.sum().item() == 0


def test_repr_says_plainly_that_it_was_donated(donated, consumed_record):
    text = repr(donated)
    assert "donated" in text and "f32[2,3]" in text and "train.py:42" in text
    assert str(donated) == text
    assert f"step {consumed_record.step}" in text


def test_message_names_step_place_and_fix(donated, consumed_record):
    with pytest.raises(DonatedBufferError) as info:
        donated.sum()
    msg = str(info.value)
    assert f"step {consumed_record.step}" in msg
    assert "24 bytes" in msg and "undonate" in msg


def test_parameter_stays_a_parameter_and_module_use_raises(consumed_record, dev):
    lin = torch.nn.Linear(3, 2).to(dev)
    materialize(lin.weight)
    poison.poison(lin.weight, consumed_record)
    assert isinstance(lin.weight, torch.nn.Parameter)
    with pytest.raises(DonatedBufferError):
        lin(torch.ones(1, 3, device=dev))
    with pytest.raises(DonatedBufferError):
        lin.state_dict()


def test_weakref_and_views_do_not_stop_poisoning(consumed_record, dev):
    t = materialize(torch.ones(2, 3, device=dev))
    ref = weakref.ref(t)
    poison.poison(t, consumed_record)
    with pytest.raises(DonatedBufferError):
        ref().sum()


def test_unpoison_restores_the_original_class(consumed_record, dev):
    p = torch.nn.Parameter(materialize(torch.ones(2, device=dev)))
    poison.poison(p, consumed_record)
    poison.unpoison(p)
    assert type(p) is torch.nn.Parameter and not poison.is_poisoned(p)
    assert type(poison.inner(p)) is torch.Tensor and not _C.has_donated_key(poison.inner(p))
    assert p.sum().item() == 2


def test_the_record_rides_on_the_tensor_and_leaves_with_unpoison(consumed_record, dev):
    t = materialize(torch.ones(2, device=dev))
    assert poison.donation_record(t) is None
    poison.poison(t, consumed_record)
    assert poison.donation_record(t).id == consumed_record.id
    poison.unpoison(t)
    assert poison.donation_record(t) is None and t.sum().item() == 2


def test_shallow_copies_of_a_tagged_tensor_carry_no_record(consumed_record):
    # torch copies a TensorImpl's metadata into detach()/.data copies; a copy
    # is no donated tensor.  (Tagged, not poisoned, so detach() may run.)
    t = torch.ones(2)
    _C.tag_record(t, consumed_record)
    assert _C.tagged_record(t).id == consumed_record.id
    assert _C.tagged_record(t.detach()) is None
    assert _C.tagged_record(t.data) is None
    _C.untag_record(t)
    assert _C.tagged_record(t) is None


def test_only_a_tensor_can_carry_a_record(consumed_record):
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        _C.tag_record([1.0, 2.0], consumed_record)
    assert _C.tagged_record([1.0, 2.0]) is None
    _C.untag_record([1.0, 2.0])  # nothing to remove: no error


def test_poisoning_allocates_little_the_garbage_collector_counts(consumed_record, dev):
    # A __dict__ per poisoned tensor (our first design) doubled a training
    # loop's young-generation collections; gc.get_count()[0] counts them.
    # What remains here is the Python object of the tensor torch_xla sees,
    # which ``poison.poison``'s check of a functional alias reads: one per
    # poisoned tensor (a commit makes none: test_release.py).
    import gc

    ts = [torch.ones(2, device=dev) for _ in range(200)]
    materialize(ts[0])
    with collector_off():
        before = gc.get_count()[0]
        for t in ts:
            poison.poison(t, consumed_record)
        grown = gc.get_count()[0] - before
    assert grown <= 200 + 20, grown
    assert all(poison.donation_record(t).id == consumed_record.id for t in ts)


def test_load_state_dict_refills_a_module_whose_parameters_were_consumed(dev):
    """Restoring a checkpoint into a module after its parameters were donated
    (``load_state_dict`` copies into each parameter) makes it usable again."""
    import torch_xla_donate as tdx

    model = torch.nn.Linear(4, 4).to(dev)
    checkpoint = {k: v.cpu() for k, v in model.state_dict().items()}
    materialize(model.weight)
    tdx.donate_buffer(model.weight)
    new = model.weight * 2
    torch_xla.sync()
    assert tdx.is_deleted(model.weight)
    with pytest.raises(DonatedBufferError):
        model(torch.ones(1, 4, device=dev))
    model.load_state_dict(checkpoint)
    assert not tdx.is_deleted(model.weight) and type(model.weight) is torch.nn.Parameter
    torch.testing.assert_close(model.weight.detach().cpu(), checkpoint["weight"])
    assert model(torch.ones(1, 4, device=dev)).shape == (1, 4)
