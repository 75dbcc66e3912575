"""torch.compile(backend="openxla"): a marked input of a compiled call is
donated by that call's graph.

    step = torch.compile(update, backend="openxla")
    for batch in loader:
        tdx.donate(params)                 # or tdx.donating(step, donate_argnums=0)
        params = step(params, batch)       # the compiled graph reuses the buffers
        torch_xla.sync()

torch_xla's dynamo bridge bakes the donor set into the XLA executable when
it extracts the graph (its first call), from the donor flags set at that
moment, and every later call runs that executable as it is.  So here each
compiled graph keeps one executable per *donation pattern* (which of its
arguments are donated):

* a call commits the marks of its own arguments but those it only marks
  (the other marks wait for their own execution) through the stages a step
  barrier's commit goes through (commit.py): ``commit.begin_and_decide``
  takes and checks them and refuses them if switched off,
  ``commit.finish`` poisons the donors after the call and leaves their
  verdicts in flight (verdicts.py), and a call that raises ends in
  ``commit.fail`` (STEP_FAILED, values kept);
* its ``arm`` stage is its own (``_arming``): the first call with a
  pattern extracts the graph from a pristine copy of the FX graph with
  those arguments' flags armed around the bridge's hash and warm-up, and
  disarmed right after (so nothing else can take them); later calls with
  the pattern run its executable, with no flag set.  A call without marks
  runs the plain executable: nothing unmarked is ever donated;
* ``torch.ops.xla.dynamo_set_buffer_donor_(t, True)`` in the compiled
  function (torch_xla's own way; also what ``donate_buffer``, ``donate`` and
  ``donating`` emit when dynamo traces them, so they cause no graph break)
  donates its argument on every call of the graph: such a donation is
  marked at the call, poisoned and reported like any other.  An argument
  the graph only donates and never reads (``tdx.donate(opt)`` before
  torch.optim's graph break) is marked at the call for the next execution
  that takes it, as eager ``donate`` marks (``_take_marks_only``);
* the bridge's own syncs (before tracing, for pending inputs) commit
  nothing (_hooks.py);
* an argument whose gradient autograd will need (``requires_grad``) is not
  donated by a compiled forward graph: its mark waits for the next step
  barrier, after backward;
* switched off (``configure(enabled=False)``, ``XLA_ENABLE_PARAM_ALIASING=0``),
  a call donates nothing, not even its graph's own ops (they mark nothing,
  as eager marking; an executable without them is extracted), and warns
  ``DonationDisabledWarning`` once; a mark made before switching off is
  refused by ``commit.begin_and_decide`` at the call (DISABLED): the switch is read
  at each call, not baked in when dynamo traced.

A graph break splits a compiled function into several graphs.  A marked
tensor is donated by the first graph that takes it; a later graph reading it
raises ``DonatedBufferError``.  Mark after the break, or inside the compiled
function next to the last use.
"""
import contextlib
import copy
import threading

from . import _commit as commit
from . import _config as config
from . import _poison as poison
from . import _verdicts as verdicts
from . import _xla as xla
from . import _xla_cpu as xla_cpu
from ._marking import is_donor_op
from ._messages import Notices, user_site
from ._native import C, lock

__all__ = ["install", "uninstall", "installed", "TRAMPOLINES"]

_BRIDGES = ("torch_xla.core.dynamo_bridge", "torch_xla._dynamo.dynamo_bridge")

_local = threading.local()
# On a thread inside a compiled call:
#   arming: the tensors whose flags an extraction arms (its donation pattern)
#   static: the tensors graph ops donated during this extraction
#   withheld: TensorImpls of graph-op donors the commit refused (not armed)
#   static_on: whether this extraction arms graph-op donors (not while switched off)
#   armed:  what is armed right now (between the bridge's hash and warm-up)


# -- The compiled graph ---------------------------------------------------------

class _CompiledGraph:
    """Stands in for what ``extract_compiled_graph`` returns: one executable
    per donation pattern of this graph."""

    def __init__(self, model, extract):
        # Argument indices the graph's own ops only mark (see _take_marks_only).
        self._carried = _take_marks_only(model)
        self._pristine = copy.deepcopy(model)  # extraction rewrites its model
        self._model = model
        self._extract = extract
        # (argument indices armed, graph-op donors withheld, on) -> compiled callable
        self._variants = {}
        self._static = None  # argument indices the graph's own ops donate

    def __call__(self, *args):
        """One call, through the commit's stages (commit.py): begin and
        decide (``_begin_and_decide``), arm (``_arming``), then finish or
        fail."""
        poison.refuse_consumed(args)
        on = config.on()
        # The marks the call takes: its arguments' but those autograd will
        # need and those the graph only marks (each waits for the execution
        # that reads it).  Switched off, the commit refuses them.
        candidates = [i for i, a in enumerate(args) if xla.is_xla_tensor(a) and C.is_marked(a)
                      and not a.requires_grad and i not in self._carried]
        if self._static is None:  # the first call: learn the graph's own donors
            self._variant(frozenset(candidates if on else ()), args, on)
        # Switched off, the graph's own ops mark nothing, as eager marking.
        if (self._static or self._carried) and not on:
            config.warn_if_off()
        if on and self._carried:
            _carry([args[i] for i in self._carried])
        notices = Notices()
        donors = self._begin_and_decide(args, candidates, notices, on)
        donated = {id(t) for t, _ in donors}
        pattern = frozenset(i for i, a in enumerate(args) if id(a) in donated) - self._static
        # The graph's own donations the commit refused (a buffer another
        # tensor holds): extracted without them, as eager would run.
        withheld = frozenset(i for i in self._static if id(args[i]) not in donated)
        try:
            fn = (self._variants.get((pattern, withheld, on))
                  or self._variant(pattern, args, on, withheld))
            with _arming([args[i] for i in pattern]):
                result = fn(*args)
        except BaseException:
            with lock:
                commit.fail(donors)
            notices.deliver(quietly=True)
            raise
        if donors:
            with lock:
                commit.finish(donors[0][0].device, donors, notices, certain=False)
        notices.deliver()
        return result

    def _begin_and_decide(self, args, candidates, notices, on):
        """``commit.begin_and_decide`` for the marks of the call's
        arguments ``candidates`` and, if ``on``, the graph's own donations
        (marked here, at the call); returns the donor entries.  Never raises
        from the plugin's own checks (see commit.barrier_before)."""
        static = [args[i] for i in self._static if on and xla.is_xla_tensor(args[i])]
        with lock:
            if static:
                xla_cpu.warn_if_unprotected()
                where = user_site()
                for t in static:
                    if not C.is_marked(t):
                        _mark_graph_op(t, where)
            tensors = [args[i] for i in candidates] + [t for t in static
                                                       if all(t is not args[i] for i in candidates)]
            if not tensors:
                return []
            return commit.begin_and_decide(tensors, notices)[1]

    def _variant(self, pattern, args, on, withheld=frozenset()):
        """Extracts the graph with the flags of ``pattern``'s arguments armed
        (and, if ``on``, those its own ops donate, but for the arguments
        ``withheld``); returns the compiled callable."""
        model = self._model if not self._variants else copy.deepcopy(self._pristine)
        self._model = None
        _local.static, _local.static_on = [], on
        _local.withheld = {poison.inner(args[i])._cdata for i in withheld}
        try:
            with _arming([args[i] for i in pattern]), _capturing_graph_ops():
                fn = self._extract(model, args)
            static = _local.static
        finally:
            _local.static, _local.static_on, _local.withheld = None, True, None
        if self._static is None:
            # A graph op sees the tensor torch_xla computes with (the one a
            # functional argument wraps): match arguments by TensorImpl.
            impls = {t._cdata for t in static}
            self._static = frozenset(i for i, a in enumerate(args) if xla.is_xla_tensor(a)
                                     and poison.inner(a)._cdata in impls)
        self._variants[(pattern - self._static, withheld, on)] = fn
        return fn


def _take_marks_only(model) -> frozenset:
    """Removes from ``model`` (an FX graph) the donor ops of the arguments it
    only marks (each of their uses is a donor op whose result nothing
    reads); returns those arguments' indices.

    The tricky case: ``tdx.donate(opt); opt.step()`` in one compiled
    function.  torch.optim breaks the graph before ``step()``, so the graph
    that marks the state has no op that reads it; committed there, no
    output could take it (and torch_xla's bridge cannot extract a graph of
    donor ops alone).  Such a mark is what ``donate`` makes in eager: it
    waits for the next execution that takes the tensor (the step's graph,
    or the step barrier); ``__call__`` makes it (``_carry``).  The donor
    ops reach this graph because _marking.py registers them as side
    effects.
    """
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    carried = frozenset(
        i for i, node in enumerate(placeholders)
        if node.users and all(is_donor_op(user) and not user.users
                              for user in node.users)
    )
    if carried:
        for i in carried:
            for user in list(placeholders[i].users):
                model.graph.erase_node(user)
        model.recompile()
    return carried


def _carry(tensors) -> None:
    """Marks ``tensors`` (what a graph only marks) for the next execution
    that takes them, as ``donate`` would before the call."""
    tensors = [t for t in tensors if xla.is_xla_tensor(t)]
    if not tensors:
        return
    where = user_site()
    with lock:
        for t in tensors:
            if not C.is_marked(t):
                # With its version, as eager marks: an in-place update before
                # the execution that takes it makes it an output, no donor.
                _mark_graph_op(t, where, with_version=True)


def _mark_graph_op(t, where, with_version=False) -> None:
    poison.check_poisonable(t)  # its twin class, for the poisoning after the call
    C.mark_graph_op(t, where, with_version)


class _arming:
    """A compiled call's arm stage (a step barrier's is ``commit.arm``):
    ``with _arming(tensors):`` the calling thread is in a compiled call
    whose extractions donate ``tensors``.  Their flags are set only while
    the bridge builds an executable (``_hash_before`` to ``_warm_after``),
    as an executable keeps the donor set it was built with; a call that
    runs a cached executable sets none.  The thread's barriers commit
    nothing meanwhile."""

    def __init__(self, tensors):
        self._tensors = tensors

    def __enter__(self):
        self._saved = getattr(_local, "arming", None)
        _local.arming = self._tensors
        self._context = commit.context(commit.COMPILED_CALL).__enter__()

    def __exit__(self, *exc_info):
        self._context.__exit__(*exc_info)
        _local.arming = self._saved
        _disarm()  # an extraction that failed between hash and warm-up


# -- Arming around the bridge's hash and warm-up ----------------------------------
#
# Inside ``with alias_with_buffer_donor_config():`` the bridge calls
# ``_get_graph_hash`` and then ``_xla_warm_up_cache``: the executable gets the
# donor set of the flags set in between.  The lock is held from one to the
# other, so no other execution runs while the flags are armed.

def _hash_before(*args, **kwargs):
    arming = getattr(_local, "arming", None)
    if arming is None or getattr(_local, "armed", None) is not None:
        return C.PASS
    lock.acquire()
    try:
        verdicts.disarm_in_flight(xla.default_device())  # before arming this call's
    except BaseException:
        lock.release()
        raise
    withheld = getattr(_local, "withheld", None) or ()
    static = getattr(_local, "static", None) if getattr(_local, "static_on", True) else None
    tensors = list(arming) + [t for t in static or () if t._cdata not in withheld]
    _local.armed = [t for t in tensors if xla.set_donor(t, True)]
    return None


def _hash_after(token, result, error):
    if error is not None:
        _disarm()
    return result


def _warm_before(*args, **kwargs):
    return C.PASS if getattr(_local, "armed", None) is None else None


def _warm_after(token, result, error):
    _disarm()
    return result


def _disarm() -> None:
    armed = getattr(_local, "armed", None)
    if armed is None:
        return
    _local.armed = None
    try:
        for t in armed:
            xla.set_donor(t, False)
    finally:
        lock.release()


def _set_buffer_donation(t, should_donate):
    """torch_xla's ``_set_buffer_donation``, except for a graph op's call
    during an extraction on this thread: that is the graph's own donation,
    armed with the others around the warm-up."""
    static = getattr(_local, "static", None)
    if static is not None and should_donate:
        static.append(t)
        return True
    return xla.set_donor(t, should_donate)


_capture_lock = threading.Lock()
_capture_depth = 0


@contextlib.contextmanager
def _capturing_graph_ops():
    """``_XLAC._set_buffer_donation`` is ours while an extraction runs (the
    graph op looks it up at each call); torch_xla's own the rest of the time,
    so that code calling it directly pays nothing for the plugin."""
    global _capture_depth
    with _capture_lock:
        if _capture_depth == 0:
            xla._XLAC._set_buffer_donation = _set_buffer_donation
        _capture_depth += 1
    try:
        yield
    finally:
        with _capture_lock:
            _capture_depth -= 1
            if _capture_depth == 0:
                xla._XLAC._set_buffer_donation = xla.real("_set_buffer_donation")


TRAMPOLINES = (
    ("_get_graph_hash", _hash_before, _hash_after),
    ("_xla_warm_up_cache", _warm_before, _warm_after),
)


# -- Installing -------------------------------------------------------------------

_patched = []  # (module, name, original)


def _extract_compiled_graph(model, args):
    return _CompiledGraph(model, _original_extract)


_original_extract = None


def install() -> None:
    global _original_extract
    if _patched:
        return
    import importlib

    for name in _BRIDGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "extract_compiled_graph", None)
        if original is None or original is _extract_compiled_graph:
            continue
        _original_extract = _original_extract or original
        module.extract_compiled_graph = _extract_compiled_graph
        _patched.append((module, "extract_compiled_graph", original))


def uninstall() -> None:
    global _original_extract
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)
    _original_extract = None


def installed() -> bool:
    return bool(_patched)
