"""_C.lazy_excess (csrc/hooks/commit.cpp ``ExcessHolders``): which donors have
more buffer holders than the donors sharing their buffer account for,
judged natively with no Python object per donor, kept in step with the
Python reference below on the states test_lazy_reads.py builds."""
import pytest
from test_lazy_reads import _clean, _read_into_op, _replaced

from torch_xla_donate import _C
from torch_xla_donate import _xla as reads


def _reference_excess(tensors):
    """``reads.excess`` in Python, from ``holders`` and ``buffer_key``: the
    reference the native one is kept in step with."""
    counts = reads.read_holders(tensors)
    if any(c is None for c in counts):
        return None
    if all(c.actual <= c.expected and c.xla_tensor_refs <= 1 for c in counts):
        return []
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(reads.read_buffer_key(t) or -i - 1, []).append(i)
    over = []
    for members in groups.values():
        allowed = sum(counts[i].expected for i in members)
        refs = max(counts[i].xla_tensor_refs for i in members)
        extra = max(counts[members[0]].actual - allowed, refs - len(members))
        over += [(i, extra) for i in members if extra > 0]
    return over


def _cloned_read(dev):
    t = _clean(dev)
    c = t.clone()
    c.cpu()  # shares t's buffer for good
    return [t, _clean(dev)], c


def _cloned_both(dev):
    (t, u), c = _cloned_read(dev)
    return [t, c, u], None  # donated together: the clone is no extra holder


def _replaced_pair(dev):
    p, s = _replaced(dev)
    return [_clean(dev), p], s


def _replaced_both(dev):
    p, s = _replaced(dev)
    return [p, s], None


EXCESS = {
    "clean": lambda dev: ([_clean(dev), _read_into_op(dev)], None),
    "clone read before its step": _cloned_read,
    "clone donated with its source": _cloned_both,
    "replaced": _replaced_pair,
    "replaced, both donated": _replaced_both,
    "a pending donor": lambda dev: ([_clean(dev), _clean(dev) * 2], None),
}


@pytest.mark.parametrize("case", sorted(EXCESS))
@pytest.mark.usefixtures("native_reads")
def test_excess_is_the_python_reference(case, dev):
    tensors, keep = EXCESS[case](dev)
    native = _C.lazy_excess(tensors)
    assert native == _reference_excess(tensors), case
    if case.startswith(("clone read", "replaced")) and "both" not in case:
        assert native, "the extra holder was not seen"
    del keep
