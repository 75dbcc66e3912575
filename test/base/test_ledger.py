"""The native ledger (torch_xla_donate._C), independent of torch_xla.

The ledger keys marks by object identity, so plain Python objects stand in
for tensors here.
"""
import pytest

from torch_xla_donate import _C

V = _C.Verdict


class Obj:
    pass


@pytest.fixture(autouse=True)
def empty_ledger():
    _C.reset()
    yield
    _C.reset()


def mark(obj, shape=(2, 3), dtype="f32", nbytes=24, line=7):
    return _C.mark(obj, "train.py", line, shape, dtype, nbytes)


def test_mark_records_where_what_and_size():
    r = mark(Obj(), shape=(4, 4), nbytes=64, line=12)
    assert (r.file, r.line, r.where) == ("train.py", 12, "train.py:12")
    assert (r.shape, r.dtype, r.nbytes) == ((4, 4), "f32", 64)
    assert r.shape_string == "f32[4,4]"
    assert r.verdict == V.MARKED and r.step == -1


def test_marking_twice_counts_once():
    a = Obj()
    assert mark(a) is not None
    assert mark(a) is None
    assert _C.marked_count() == 1
    step, tensors, records = _C.begin_step()
    assert tensors == [a] and len(records) == 1


def test_begin_step_commits_in_marking_order_and_empties_marks():
    objs = [Obj() for _ in range(5)]
    recs = [mark(o) for o in objs]
    before = _C.current_step()
    step, tensors, records = _C.begin_step()
    assert step == before + 1
    assert tensors == objs
    assert [r.id for r in records] == [r.id for r in recs]
    assert all(r.step == step and r.verdict == V.IN_FLIGHT for r in records)
    assert _C.marked_count() == 0 and not _C.is_marked(objs[0])


def test_unmark_cancels_and_keeps_order_of_the_rest():
    objs = [Obj() for _ in range(4)]
    for o in objs:
        mark(o)
    r = _C.unmark(objs[1])
    assert r.verdict == V.CANCELLED
    assert _C.unmark(objs[1]) is None
    assert _C.marked_tensors() == [objs[0], objs[2], objs[3]]
    _, tensors, _ = _C.begin_step()
    assert tensors == [objs[0], objs[2], objs[3]]


def test_settle_counts_each_verdict_once():
    a, b, c = Obj(), Obj(), Obj()
    mark(a, nbytes=100)
    mark(b, nbytes=10, shape=(5,), dtype="bf16")
    mark(c, nbytes=1)
    step, _, (ra, rb, rc) = _C.begin_step()
    _C.settle(ra, V.REUSED)
    _C.settle(ra, V.UNUSED)  # a second verdict is ignored
    _C.settle(rb, V.UNUSED)
    stats = _C.step_stats(step)
    assert stats["donated"] == 3 and stats["donated_bytes"] == 111
    assert stats["reused"] == 1 and stats["reused_bytes"] == 100
    assert stats["unused"] == 1 and stats["unused_shapes"] == ["bf16[5]"]
    assert stats["in_flight"] == 1
    _C.settle(rc, V.UPDATED_IN_PLACE)
    assert _C.step_stats(step)["in_flight"] == 0
    assert ra.verdict == V.REUSED and rb.verdict == V.UNUSED


def test_settle_rejects_a_verdict_that_is_not_final():
    mark(Obj())
    _, _, (r,) = _C.begin_step()
    with pytest.raises(ValueError, match="final verdict"):
        _C.settle(r, V.IN_FLIGHT)


def test_history_is_bounded_but_totals_keep_counting():
    keep = []
    for _ in range(_C.HISTORY_STEPS + 10):
        o = Obj()
        keep.append(o)
        mark(o, nbytes=4)
        _, _, (r,) = _C.begin_step()
        _C.settle(r, V.REUSED)
    first = _C.current_step() - (_C.HISTORY_STEPS + 10) + 1
    assert _C.step_stats(first) is None
    assert _C.step_stats(-1)["reused"] == 1
    assert _C.totals()["reused"] == _C.HISTORY_STEPS + 10


def test_ledger_releases_tensors_once_committed():
    import sys
    a = Obj()
    mark(a)
    held = sys.getrefcount(a)
    _, tensors, _ = _C.begin_step()
    del tensors
    assert sys.getrefcount(a) == held - 1


def test_the_index_agrees_with_a_dict_through_marks_unmarks_and_steps():
    # The ledger's index (tensor -> slot, beside tombstoned slots): unmarking,
    # compaction and clearing at a barrier must never lose a mark or invent
    # one.  A seeded random walk, checked against a Python dict.
    import random

    rng = random.Random(8711)
    objs = [Obj() for _ in range(600)]
    marked = {}  # id -> obj, in marking order
    for _ in range(6):
        for _ in range(3000):
            o = rng.choice(objs)
            if rng.random() < 0.6:
                record = mark(o)
                assert (record is None) == (id(o) in marked)
                marked.setdefault(id(o), o)
            else:
                assert (_C.unmark(o) is not None) == (id(o) in marked)
                marked.pop(id(o), None)
            if rng.random() < 0.01:
                probe = rng.choice(objs)
                assert _C.is_marked(probe) == (id(probe) in marked)
        assert [id(t) for t in _C.marked_tensors()] == list(marked)
        _, tensors, _ = _C.begin_step()
        assert [id(t) for t in tensors] == list(marked)
        marked.clear()
        assert not any(_C.is_marked(o) for o in objs)


@pytest.mark.parametrize("ndim", [0, 1, 6, 7, 9])
def test_a_record_keeps_its_shape_inline_or_not(ndim):
    """Shapes of up to six dimensions are kept inside the record, longer
    ones on the heap (csrc/base/dims.h): either way the record reads back
    the shape it was given, also once records are recycled."""
    shape = tuple(range(2, 2 + ndim))
    r = mark(Obj(), shape=shape)
    assert r.shape == shape
    assert r.shape_string == "f32[" + ",".join(map(str, shape)) + "]"


def test_recycled_records_never_overwrite_one_still_held():
    """Records are recycled (csrc/base/block_pool.h): the memory of records
    nobody holds any more goes to the next ones marked.  A record still held
    (a report, a poisoned tensor's tag) keeps what it said, however many
    records are made and dropped around it, from several threads."""
    import threading

    kept = [mark(Obj(), shape=(i + 1,), line=i) for i in range(50)]

    def churn(first):
        for i in range(first, first + 2000):
            o = Obj()
            r = mark(o, shape=(i % 7 + 1, 3), line=i)
            assert (r.line, r.shape) == (i, (i % 7 + 1, 3))
            _C.unmark(o)

    threads = [threading.Thread(target=churn, args=(k * 10_000,)) for k in range(3)]
    for t in threads:
        t.start()
    churn(100_000)
    for t in threads:
        t.join()
    assert [(r.line, r.shape, r.verdict) for r in kept] == [
        (i, (i + 1,), V.MARKED) for i in range(50)]
