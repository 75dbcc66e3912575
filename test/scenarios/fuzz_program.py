"""The random programs of test_fuzz.py: what a program may draw (shapes,
dtypes, ops, donations) and how it runs twice in lockstep, on a reference
set of tensors and on a donating one, checking the invariants listed in
test_fuzz.py after every barrier.  ``tools/fuzz_replay.py`` replays a
recorded trace through ``Program``.
"""
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from hypothesis import strategies as st

import torch_xla_donate as tdx
from torch_xla_donate import _C
from torch_xla_donate import _poison as poison

SHAPES = [(4,), (8,), (16,), (2, 4), (4, 2), (2, 8), (4, 4)]
# A wide input now and then: matmuls at the widths where XLA:CPU once read a
# reused buffer's old contents (tools/repros/xnnpack_stale_read.py), after a
# donation or an in-place update gave the buffer to a new value.
WIDE = (1024, 1024)
INPUT_SHAPES = SHAPES + [WIDE]
DTYPES = [torch.float32, torch.bfloat16, torch.int32]
MAX_STEPS = 4
MAX_OPS = 7
MAX_LIVE = 12
BYTE = st.integers(0, 255)

BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum}
SCALAR = {"*3": lambda t: t * 3, "+2": lambda t: t + 2, "-1": lambda t: 1 - t}
UNARY_ANY = {"neg": torch.neg, "abs": torch.abs}
UNARY_FLOAT = {"relu": torch.relu, "tanh": torch.tanh, "exp": torch.exp}
REDUCE = {"sum": torch.sum, "amax": torch.amax}
INPLACE = {
    "add_": lambda t: t.add_(1),
    "mul_": lambda t: t.mul_(2),
    "neg_": lambda t: t.neg_(),
    "setitem": lambda t: t.__setitem__(0, 5),
}

# Totals over the whole run, printed at the end.
STATS = dict.fromkeys(
    ["examples", "steps", "ops", "reads", "donations", "refused", "consumed",
     "unused", "updated_in_place", "dropped", "deferred", "wide_matmuls"], 0)


@dataclass(eq=False)
class Entry:
    """One tensor of the program: its reference twin and its donating twin."""
    ref: torch.Tensor
    don: torch.Tensor
    host: torch.Tensor  # the same ops on CPU torch: only to tell, on a mismatch, which twin is off
    quarantined: bool = False  # verdict deferred to the next barrier: no use
    defer: bool = False  # if donated: judge the verdict after the next barrier
    marked_version: int = -1  # if donated: its version counter when marked


def _pending(t) -> bool:
    return torch_xla._XLAC._check_tensor_need_materialization([t])[0]


def _shares_buffer(t) -> bool:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 1


def _buffer_deleted(t) -> bool:
    return torch_xla._XLAC._is_placecholder(t)


def _assert_same(e, what):
    a, b = e.ref.cpu(), e.don.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(
        b, a, rtol=0, atol=0, equal_nan=True,
        msg=lambda m: f"{what}: {m}\nreference {a}\ndonating  {b}\nCPU torch {e.host}")


def _named_in(caught, category):
    """How many donations the warnings of ``category`` named (one warning may
    list several, and counts those of one shape and place: "2 x f32[4]
    (donated at f.py:3), s32[2,4] (donated at ...)")."""
    items = re.findall(r"(?:(\d+) x )?[\w]+\[[\d,]*\] \(donated at ",
                       " ".join(str(w.message) for w in caught if issubclass(w.category, category)))
    return sum(int(n) if n else 1 for n in items)


class Program:
    """Draws and runs one random program on both tensor sets in lockstep."""

    def __init__(self, data, dev):
        self.data, self.dev = data, dev
        self.env = []
        self.marked = {}      # id(entry) -> entry, donated in the current step
        self.deferred = []    # (entry, expectation) judged after the next barrier
        self.step_no = 0
        self.counts = dict.fromkeys(["consumed", "unused", "updated_in_place", "dropped"], 0)
        self.log = []  # what ran, for the failure message (see the test)
        self.draws = []  # every value drawn, for TDX_FUZZ_TRACE

    def draw(self, strategy, label):
        value = self.data.draw(strategy, label=label)
        self.draws.append(value)
        return value

    # -- building blocks ----------------------------------------------------

    def new_tensor(self, shape, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        if dtype.is_floating_point:
            scale = 3 if shape != WIDE else 1 / 32  # a wide matmul's sums stay small
            cpu = (torch.randn(shape, generator=gen) * scale).to(dtype)
        else:
            cpu = torch.randint(-9, 10, shape, generator=gen, dtype=dtype)
        self.env.append(Entry(cpu.to(self.dev), cpu.to(self.dev), cpu.clone()))
        self.log.append(f"input {tuple(shape)} {dtype} seed={seed}")

    def usable(self, pred=lambda e: True):
        return [e for e in self.env if not e.quarantined and pred(e)]

    @staticmethod
    def pick(candidates, index):
        return candidates[index % len(candidates)] if candidates else None

    def produce(self, fn, *entries):
        ref = fn(*[e.ref for e in entries])
        don = fn(*[e.don for e in entries])
        host = fn(*[e.host for e in entries])
        if any(don is e.don for e in entries):
            return  # t.to(t.dtype) returns t itself: nothing new
        if len(self.env) < MAX_LIVE:
            self.env.append(Entry(ref, don, host))

    # -- ops ---------------------------------------------------------------
    #
    # Every op draws the same values (an operand, a second operand, a choice
    # of function, a choice of dim/shape/dtype, whether its donation's
    # verdict is deferred) and maps them onto what is valid in the current
    # program by modulo.  So the sequence of draws never depends on what XLA
    # did (which donations were consumed): hypothesis requires that.

    def op(self):
        kind = self.draw(st.sampled_from(
            ["binary", "scalar", "unary", "reduce", "matmul", "cast", "view",
             "inplace", "donate", "update", "update", "read", "drop"]), "op")
        args = [self.draw(BYTE, name) for name in ("a", "b", "fn", "choice")]
        args.append(self.draw(st.booleans(), "defer verdict"))
        STATS["ops"] += 1
        self.log.append(f"{kind}{tuple(args)} on {len(self.env)} live")
        getattr(self, "op_" + kind)(*args)

    def op_binary(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(), a)
        if a is not None:
            b = self.pick(self.usable(lambda e: e.ref.shape == a.ref.shape and e.ref.dtype == a.ref.dtype), b)
            self.produce(BINARY[self.pick(sorted(BINARY), fn)], a, b)

    def op_scalar(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(), a)
        if a is not None:
            self.produce(SCALAR[self.pick(sorted(SCALAR), fn)], a)

    def op_unary(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(), a)
        if a is not None:
            table = dict(UNARY_ANY, **(UNARY_FLOAT if a.ref.dtype.is_floating_point else {}))
            self.produce(table[self.pick(sorted(table), fn)], a)

    def op_reduce(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(lambda e: e.ref.dim() > 0), a)
        if a is not None:
            dim = choice % a.ref.dim()
            reduce = REDUCE[self.pick(sorted(REDUCE), fn)]
            self.produce(lambda t: reduce(t, dim), a)

    def op_matmul(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(lambda e: e.ref.dim() == 2 and e.ref.dtype.is_floating_point), a)
        if a is not None:
            b = self.pick(self.usable(lambda e: e.ref.dim() == 2 and e.ref.dtype == a.ref.dtype
                                      and e.ref.shape[0] == a.ref.shape[1]), b)
            if b is not None:
                self.produce(torch.matmul, a, b)
                STATS["wide_matmuls"] += a.ref.shape == WIDE

    def op_cast(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(), a)
        if a is not None:
            dtype = self.pick(DTYPES, choice)
            self.produce(lambda t: t.to(dtype), a)

    def op_view(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(lambda e: e.ref.dim() > 0), a)
        if a is None:
            return
        shape = a.ref.shape
        kind = self.pick(["reshape", "slice"] + (["transpose", "flatten"] if len(shape) == 2 else []), fn)
        if kind == "reshape":
            targets = [s for s in SHAPES if torch.Size(s).numel() == shape.numel()]
            target = self.pick(targets or [(shape.numel(),)], choice)
            view = lambda t: t.reshape(target)
        elif kind == "slice":
            view = lambda t: t[1:]
        elif kind == "transpose":
            view = lambda t: t.t()
        else:
            view = lambda t: t.reshape(-1)  # t.view(-1) fails on a CPU twin that is not contiguous
        self.produce(view, a)

    def op_inplace(self, a, b, fn, choice, defer):
        a = self.pick(self.usable(), a)
        if a is not None:
            update = INPLACE[self.pick(sorted(n for n in INPLACE if a.ref.dim() > 0 or n != "setitem"), fn)]
            update(a.ref)
            update(a.don)
            update(a.host)

    def op_update(self, a, b, fn, choice, defer):
        """The functional update donation exists for: donate x, then compute
        its replacement from it (an output of x's size and dtype)."""
        e = self.pick(self.usable(), a)
        if e is not None:
            self.donate(e, defer)
            self.produce(SCALAR[self.pick(sorted(SCALAR), fn)], e)

    def op_donate(self, a, b, fn, choice, defer):
        e = self.pick(self.usable(), a)
        if e is not None:
            self.donate(e, defer)

    def donate(self, e, defer):
        t = e.don
        donatable = t.dim() > 0 and not t._is_view() and not _shares_buffer(t) and not _pending(t)
        if donatable:
            tdx.donate_buffer(t)
            assert tdx.is_donated(t)
            if id(e) not in self.marked:
                self.marked[id(e)] = e
                e.defer = defer
                e.marked_version = t._version
                STATS["donations"] += 1
        else:
            with pytest.raises(ValueError):
                tdx.donate_buffer(t)
            assert tdx.is_donated(t) == (id(e) in self.marked)
            STATS["refused"] += 1

    def op_read(self, a, b, fn, choice, defer):
        e = self.pick(self.usable(), a)
        if e is not None:
            _assert_same(e, "read in the middle of a step")
            STATS["reads"] += 1

    def op_drop(self, a, b, fn, choice, defer):
        e = self.pick(self.usable(), a)
        if e is not None:
            self.env.remove(e)

    # -- barriers and checks ---------------------------------------------------

    def barrier(self):
        """Ends the step: the reference first (no donation), then the real
        barrier.  Returns the expectations for this step's donations."""
        expectations = []
        for e in self.marked.values():
            # Updated in place after marking: still pending, or (torch_xla
            # 2.7 runs a pending tensor's graph when it is read) run already.
            if _pending(e.don) or e.don._version != e.marked_version:
                expectations.append((e, "updated_in_place"))
            elif _shares_buffer(e.don):
                expectations.append((e, "dropped"))
            else:
                expectations.append((e, "consumed_or_unused"))
        self.marked = {}
        kind = self.draw(st.sampled_from(["sync", "sync_wait", "mark_step", "sync_nowait"]), "barrier")
        marked = [self.env.index(e) if e in self.env else "dropped" for e, _ in expectations]
        self.log.append(f"barrier {kind}, marked {marked}")
        if kind == "sync":
            torch_xla.sync()
        elif kind == "sync_wait":
            torch_xla.sync(wait=True)
        elif kind == "mark_step":
            xm.mark_step()
        else:
            torch_xla.sync(wait=False)
        self.step_no = _C.current_step()
        STATS["steps"] += 1
        return expectations

    def judge(self, expectations):
        """Checks the verdicts of one batch of donations."""
        consumed = unused = 0
        verdicts = [tdx.is_deleted(e.don) for e, _ in expectations]  # settles open ones
        # Ground truth next; an output still being computed reads as a
        # placeholder too (a tensor updated in place since), so wait first.
        xm.wait_device_ops()
        for (e, expected), deleted in zip(expectations, verdicts):
            d = e.don
            assert deleted == _buffer_deleted(d), "poisoned iff XLA deleted the buffer"
            assert not tdx.is_donated(d)
            if deleted:
                assert expected == "consumed_or_unused", f"{expected} donation was consumed"
                with pytest.raises(tdx.DonatedBufferError):
                    d.cpu()
                with pytest.raises(tdx.DonatedBufferError):
                    d + 1
                if e in self.env:  # the program may have dropped it after marking
                    self.env.remove(e)
                consumed += 1
            else:
                assert not poison.is_poisoned(d)
                e.quarantined = False
                if expected == "consumed_or_unused":
                    unused += 1
                else:
                    self.counts[expected] += 1
        self.counts["consumed"] += consumed
        self.counts["unused"] += unused

    def check_all_values(self):
        for e in self.env:
            if not e.quarantined:
                assert not poison.is_poisoned(e.don)
                _assert_same(e, f"after the barrier, entry {self.env.index(e)}")

    def run(self):
        n_inputs = self.draw(st.integers(2, 5), "inputs")
        for _ in range(n_inputs):
            self.new_tensor(self.draw(st.sampled_from(INPUT_SHAPES), "shape"),
                            self.draw(st.sampled_from(DTYPES), "dtype"),
                            self.draw(st.integers(0, 2**16), "seed"))
        torch_xla.sync()
        # Every unused donation is named: steps() shows every warning.
        caught = self.steps()
        assert _C.marked_count() == 0
        assert _named_in(caught, tdx.UnusedDonationWarning) == self.counts["unused"]
        assert _named_in(caught, tdx.DroppedDonationWarning) == self.counts["dropped"]
        for key, value in self.counts.items():
            STATS[key] += value

    def steps(self):
        """Runs the program's steps; returns the warnings they gave."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(self.draw(st.integers(1, MAX_STEPS), "steps")):
                for _ in range(self.draw(st.integers(1, MAX_OPS), "ops")):
                    self.op()
                expectations = self.barrier()
                # The previous step's deferred verdicts: this barrier settled them.
                self.judge(self.deferred)
                now = [item for item in expectations if not item[0].defer]
                self.deferred = [item for item in expectations if item[0].defer]
                self.judge(now)
                for e, _ in self.deferred:
                    e.quarantined = True
                STATS["deferred"] += len(self.deferred)
                if not self.deferred:
                    self.check_ledger(expectations)
                self.check_all_values()
            self.judge(self.deferred)
            self.check_all_values()
        return caught

    def check_ledger(self, expectations):
        """The ledger's account of the step matches what the program saw."""
        if not expectations:
            return
        stats = _C.step_stats(self.step_no)
        assert stats["donated"] == len(expectations) and stats["in_flight"] == 0
        expected = {k: sum(1 for _, x in expectations if x == k) for k in ("updated_in_place", "dropped")}
        assert stats["updated_in_place"] == expected["updated_in_place"]
        assert stats["donated"] == (stats["reused"] + stats["unused"] + stats["updated_in_place"]
                                    + stats["dropped"]), stats
        assert stats["dropped"] == expected["dropped"]
