"""Thread safety: marks, queries and barriers from many threads at once.

The ledger keeps its state behind one mutex, and ``donate_buffer`` /
``undonate`` make the two things a mark is made of (torch_xla's donor flag
and the ledger entry) under the step hook's lock, or in one native call that
no other thread can interrupt and that declines while the lock is held, so a
barrier in another thread sees either both or neither.  Without that, a barrier between the two
could donate a buffer the ledger does not know about (nothing poisoned, the
tensor silently dead), or undonate could report a cancellation while the
step consumed the buffer.  Each stress test runs a bounded number of
iterations and checks, at the end, the ground truth of every tensor: its
buffer is deleted if and only if it is poisoned, and a tensor is marked in
the ledger if and only if torch_xla's donor flag is set.

torch_xla itself does not promise that one device's lazy tensors can be
built and synced from several threads at once (we saw "Check failed:
data()->tensor_data" doing so), so the tests serialize their torch_xla work
(building ops, barriers) under ``XLA_OPS``; the plugin's calls
(``donate_buffer``, ``undonate``, queries) stay outside it, racing the
barriers.
"""
import random
import sys
import threading
import time
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from helpers import materialize

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _native as lock_module
from torch_xla_donate import _poison as poison

XLA_OPS = threading.Lock()  # see the module doc
THREADS = 16
PER_THREAD = 24
TIMEOUT = 60


@pytest.fixture(autouse=True)
def fast_thread_switches():
    """Switch threads every microsecond instead of every 5 ms: races that
    need a switch at one precise bytecode show up in a short run."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def _run_threads(targets):
    """Starts all targets together, joins them, re-raises the first error."""
    errors = []
    start = threading.Barrier(len(targets))

    def wrap(fn):
        def run():
            try:
                start.wait()
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a thread hung: deadlock?"
    if errors:
        raise errors[0]


def _flag(t) -> bool:
    return torch_xla._XLAC._get_buffer_donation(t)


def _assert_consistent(tensors):
    """Ground truth of every tensor against the plugin's view of it."""
    tdx.settle()
    xm.wait_device_ops()
    marked = {id(t) for t in _C.marked_tensors()}
    assert _C.marked_count() == len(marked)
    for t in tensors:
        deleted = torch_xla._XLAC._is_placecholder(t)
        assert deleted == poison.is_poisoned(t), "poisoned iff the buffer is gone"
        assert tdx.is_deleted(t) == deleted
        if not deleted:
            assert tdx.is_donated(t) == (id(t) in marked)
            assert not _flag(t), "torch_xla's donor flag is armed only inside a commit"


def test_native_fast_path_declines_while_the_hook_lock_is_held(dev):
    t = materialize(torch.ones(4, device=dev))
    assert _C.lock.depth == 0
    with lock_module.lock:
        assert _C.lock.depth == 1
        assert _C.try_mark(t) == _C.Refusal.COMMITTING and not tdx.is_donated(t)
        tdx.donate_buffer(t)  # the Python path, re-entering the lock
        assert tdx.is_donated(t)
    assert _C.lock.depth == 0
    assert tdx.undonate(t) and not _flag(t)


def test_a_mark_waits_for_another_thread_holding_the_hook_lock(dev):
    # As if that thread were inside a barrier: the mark must come after it.
    t = materialize(torch.ones(4, device=dev))
    marked = threading.Event()

    def mark():
        tdx.donate_buffer(t)
        marked.set()

    with lock_module.lock:
        other = threading.Thread(target=mark)
        other.start()
        assert not marked.wait(0.3), "marked while another thread held the lock"
        assert not tdx.is_donated(t) and not _flag(t)
    other.join(TIMEOUT)
    assert marked.is_set() and tdx.is_donated(t) and not _flag(t)
    assert tdx.undonate(t)


def test_marks_from_many_threads_before_one_step(dev):
    groups = [[materialize(torch.full((32,), float(g * 100 + i), device=dev))
               for i in range(PER_THREAD)] for g in range(THREADS)]
    shared = [materialize(torch.full((32,), -1.0, device=dev)) for _ in range(8)]

    def marker(group):
        def run():
            for t in group + shared:  # every thread also marks the shared ones
                tdx.donate_buffer(t)
                assert tdx.is_donated(t)
        return run

    _run_threads([marker(g) for g in groups])
    everyone = [t for g in groups for t in g] + shared
    assert _C.marked_count() == len(everyone)  # marking twice counts once
    assert all(tdx.is_donated(t) and not _flag(t) for t in everyone)
    outs = [t * 2 for t in everyone]
    torch_xla.sync(wait=True)
    stats = _C.step_stats()
    assert stats["donated"] == stats["reused"] == len(everyone)
    assert all(tdx.is_deleted(t) for t in everyone)
    for g in range(len(groups)):
        for i in range(PER_THREAD):
            assert outs[g * PER_THREAD + i].cpu()[0].item() == 2 * (g * 100 + i)
    _assert_consistent(everyone)


def test_queries_while_other_threads_mark_and_undonate(dev):
    tensors = [materialize(torch.full((16,), float(i), device=dev)) for i in range(64)]
    stop = threading.Event()
    cancelled = []

    def marker(seed):
        def run():
            rng = random.Random(seed)
            # Until the cancellers met marks: under load a thread may make
            # all its marks within one switch interval of the GIL.
            deadline = time.monotonic() + 60
            while len(cancelled) < 50 and time.monotonic() < deadline:
                for _ in range(100):
                    tdx.donate_buffer(rng.choice(tensors))
                time.sleep(0)  # lets the other threads in
            stop.set()
        return run

    def canceller(seed):
        def run():
            rng = random.Random(seed)
            while not stop.is_set():
                t = rng.choice(tensors)
                if tdx.undonate(t):
                    cancelled.append(t)
        return run

    def querier(seed):
        def run():
            rng = random.Random(seed)
            while not stop.is_set():
                t = rng.choice(tensors)
                assert tdx.is_donated(t) in (True, False)
                assert tdx.is_deleted(t) is False  # no barrier runs: nothing consumed
                _C.marked_count()
                _C.marked_tensors()
        return run

    _run_threads([marker(1), marker(2), canceller(3), canceller(4), querier(5), querier(6)])
    assert cancelled, "the cancellers never met a mark: the test tested nothing"
    _assert_consistent(tensors)
    # Then one step: exactly the tensors still marked are consumed.
    still_marked = [t for t in tensors if tdx.is_donated(t)]
    outs = [t + 1 for t in tensors]
    torch_xla.sync(wait=True)
    for i, (t, out) in enumerate(zip(tensors, outs)):
        assert tdx.is_deleted(t) == any(t is m for m in still_marked)
        assert out.cpu()[0].item() == i + 1
    _assert_consistent(tensors)


def _race_marks_against_barriers(dev, n, undo):
    """One thread marks (and maybe undonates) tensors, each with a pending
    consumer, while another thread runs barriers as fast as it can."""
    srcs = [materialize(torch.full((64,), float(i), device=dev)) for i in range(n)]
    outs = [None] * n
    undone = [False] * n
    stop = threading.Event()

    def marker():
        try:
            for i, s in enumerate(srcs):
                with XLA_OPS:
                    outs[i] = s * 2  # s is an input of whichever step runs next
                tdx.donate_buffer(s)
                if undo:
                    try:
                        undone[i] = tdx.undonate(s)
                    except tdx.DonatedBufferError:
                        pass  # a barrier came first and consumed it: too late
        finally:
            stop.set()

    def stepper():
        while not stop.is_set():
            with XLA_OPS:
                torch_xla.sync()
            # Right after a barrier, a source whose buffer is gone must be
            # poisoned already: it was donated through the ledger.
            for s in srcs:
                if torch_xla._XLAC._is_placecholder(s):
                    assert poison.is_poisoned(s), "buffer donated behind the ledger's back"
        torch_xla.sync()

    _run_threads([marker, stepper])
    _assert_consistent(srcs)
    for i, s in enumerate(srcs):
        if undone[i]:
            assert not tdx.is_deleted(s), "undonate() said cancelled, yet the step took the buffer"
            assert s.cpu()[0].item() == float(i)
        assert outs[i].cpu()[0].item() == 2.0 * i
    return undone


# A barrier that runs between ``s * 2`` and ``donate_buffer(s)`` takes the
# consumer with it; the next step no longer reads ``s``, so that mark ends
# unused (value kept, with a warning): one of the outcomes the race allows.
_UNUSED_IS_AN_OUTCOME = pytest.mark.filterwarnings(
    "ignore::torch_xla_donate.UnusedDonationWarning")


@_UNUSED_IS_AN_OUTCOME
def test_barriers_racing_marks(dev):
    _race_marks_against_barriers(dev, n=150, undo=False)


@_UNUSED_IS_AN_OUTCOME
def test_barriers_racing_undonate(dev, monkeypatch):
    # Widen the window between dropping the ledger entry and clearing the
    # donor flag, where a barrier used to donate a cancelled tensor.
    real_unmark = _C.unmark

    def slow_unmark(t):
        record = real_unmark(t)
        time.sleep(0.001)
        return record

    monkeypatch.setattr(_C, "unmark", slow_unmark)
    undone = _race_marks_against_barriers(dev, n=60, undo=True)
    assert any(undone)


def test_many_threads_each_running_their_own_donating_loop(dev):
    """Threads that each own a state and step it: all barriers share one
    device, so any thread's barrier may commit another thread's mark; every
    state must still end right, and every old state be poisoned."""
    states = [materialize(torch.zeros(32, device=dev)) for _ in range(4)]
    olds = [[] for _ in states]
    values = [[] for _ in states]  # what each old state held
    results = [None] * len(states)

    def loop(k):
        def run():
            state = states[k]
            for n in range(25):
                olds[k].append(state)
                values[k].append(float(n * (k + 1)))
                tdx.donate_buffer(state)
                with XLA_OPS:
                    state = state + (k + 1)
                with XLA_OPS:
                    torch_xla.sync()
            results[k] = state
        return run

    with warnings.catch_warnings():
        # Another thread's barrier may commit a mark before its owner built
        # the update that uses it: that donation is unused, and says so.
        warnings.simplefilter("ignore", tdx.UnusedDonationWarning)
        _run_threads([loop(k) for k in range(len(states))])
        torch_xla.sync(wait=True)
        for k, state in enumerate(results):
            assert state.cpu().tolist() == [25.0 * (k + 1)] * 32
        everything = [t for old in olds for t in old]
        _assert_consistent(everything)
    # Which donations another thread's barrier made unusable depends on the
    # scheduling (under load, half of them): each one kept its value, and
    # every thread still had donations consumed.
    for k, old in enumerate(olds):
        kept = [(t, v) for t, v in zip(old, values[k]) if not tdx.is_deleted(t)]
        assert len(kept) < len(old), f"thread {k}: not one donation consumed"
        for t, v in kept:
            assert t.cpu().tolist() == [v] * 32


def test_queries_racing_asynchronous_barriers(dev):
    """``is_deleted``/``is_donated`` from many threads while another thread
    runs a donating loop with ``sync(wait=False)``: the queries settle open
    verdicts themselves (``is_deleted`` may wait for the device), racing the
    barriers that settle the same verdicts.  Every donation here is usable,
    so each must end consumed exactly once; a query may never see a tensor
    deleted and later alive, nor deleted while its buffer is there."""
    steps, queriers = 200, 8
    state = materialize(torch.zeros(32, device=dev))
    inc = materialize(torch.ones(32, device=dev))
    olds = []
    stop = threading.Event()
    queries = [0] * queriers
    totals_before = _C.totals()

    def loop():
        nonlocal state
        try:
            for _ in range(steps):
                tdx.donate_buffer(state)
                with XLA_OPS:
                    old, state = state, state + inc
                    torch_xla.sync(wait=False)
                olds.append(old)
        finally:
            stop.set()

    def querier(k):
        def run():
            rng = random.Random(k)
            deleted_seen = set()
            while not stop.is_set() or len(deleted_seen) < len(olds):
                if not olds:
                    continue
                i = rng.randrange(len(olds))
                t = olds[i]
                deleted = tdx.is_deleted(t)
                queries[k] += 1
                assert not tdx.is_donated(t), "a committed donation still reads as marked"
                if i in deleted_seen:
                    assert deleted, "deleted, then alive again"
                if deleted:
                    deleted_seen.add(i)
                    assert torch_xla._XLAC._is_placecholder(t), "poisoned, yet the buffer is there"
                    with pytest.raises(tdx.DonatedBufferError):
                        t + 1  # raises before reaching torch_xla
                if stop.is_set() and not deleted:
                    # The loop is over: every open verdict is settled by the
                    # query itself, and every donation was usable.
                    raise AssertionError(f"donation {i} not consumed after the loop")
        return run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_threads([loop] + [querier(k) for k in range(queriers)])
        torch_xla.sync(wait=True)
    assert not [w for w in caught if issubclass(w.category, (tdx.UnusedDonationWarning,
                                                               tdx.DroppedDonationWarning))]
    assert min(queries) > 0
    assert len(olds) == steps
    _assert_consistent(olds)
    assert all(tdx.is_deleted(t) for t in olds)
    assert state.cpu().tolist() == [float(steps)] * 32
    totals = _C.totals()
    delta = {k: totals[k] - totals_before[k] for k in ("donated", "reused", "unused", "failed")}
    assert delta == {"donated": steps, "reused": steps, "unused": 0, "failed": 0}
