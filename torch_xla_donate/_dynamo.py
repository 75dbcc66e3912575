"""torch.compile(backend="openxla"): a marked argument of a compiled call is donated by that call's
graph, through the commit's stages (docs/design.md, "The step's life").  torch_xla's bridge bakes
the donor flags set at extraction into the executable, so each graph keeps one executable per
donation pattern (which of its arguments are donated); a call without marks runs the plain one."""

import contextlib
import copy
import importlib
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

__all__ = ["install", "uninstall", "TRAMPOLINES"]

_BRIDGES = ("torch_xla.core.dynamo_bridge", "torch_xla._dynamo.dynamo_bridge")


class _Local(threading.local):  # what a thread inside a compiled call is doing
    arming = None  # the tensors whose flags an extraction arms (its donation pattern)
    static = None  # the tensors graph ops donated during this extraction
    withheld = None  # TensorImpls of graph-op donors the commit refused (not armed)
    static_on = True  # whether this extraction arms graph-op donors (not while switched off)
    armed = None  # what is armed right now (between the bridge's hash and warm-up)


_local = _Local()


class _CompiledGraph:
    """What ``extract_compiled_graph`` returns: one executable per donation pattern."""

    def __init__(self, model, extract):
        self._carried = _take_marks_only(model)  # argument indices the graph's own ops only mark
        self._pristine = copy.deepcopy(model)  # extraction rewrites its model
        self._model = model
        self._extract = extract
        self._variants = {}  # (argument indices armed, graph-op donors withheld, on) -> callable
        self._static = None  # argument indices the graph's own ops donate

    def __call__(self, *args):
        poison.refuse_consumed(args)
        on = config.on()
        # The marks the call takes: its arguments' but those autograd will need (they wait for
        # the barrier after backward) and those the graph only marks.  Switched off, the commit
        # refuses them (DISABLED): the switch is read per call, not baked in when dynamo traced.
        candidates = [
            i
            for i, a in enumerate(args)
            if xla.is_xla_tensor(a) and C.is_marked(a) and not a.requires_grad and i not in self._carried
        ]
        if self._static is None:  # the first call: learn the graph's own donors
            self._variant(frozenset(candidates if on else ()), args, on)
        # Switched off, the graph's own ops mark nothing, as eager marking.
        if (self._static or self._carried) and not on:
            config.warn_if_off()
        notices = Notices()
        static = [args[i] for i in self._static if on and xla.is_xla_tensor(args[i])]
        carried = [args[i] for i in self._carried if on and xla.is_xla_tensor(args[i])]
        with lock:
            # What the graph only marks, with its version as eager marks: an in-place update
            # before the execution that takes it makes it an output, no donor.
            if carried:
                _mark_graph_ops(carried, with_version=True)
            if static:  # the graph's own donations, marked at the call
                xla_cpu.warn_if_unprotected()
                _mark_graph_ops(static)
            tensors = [args[i] for i in candidates]
            tensors += [t for t in static if all(t is not args[i] for i in candidates)]
            donors = commit.begin_and_decide(tensors, notices)[1] if tensors else []
        donated = {id(t) for t, _ in donors}
        pattern = frozenset(i for i, a in enumerate(args) if id(a) in donated) - self._static
        # The graph's own donations the commit refused (a buffer another tensor holds):
        # extracted without them, as eager would run.
        withheld = frozenset(i for i in self._static if id(args[i]) not in donated)
        try:
            fn = self._variants.get((pattern, withheld, on)) or self._variant(pattern, args, on, withheld)
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

    def _variant(self, pattern, args, on, withheld=frozenset()):
        """Extracts the graph with ``pattern``'s flags armed (and, if ``on``, its own ops'
        donors but ``withheld``); returns the compiled callable."""
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
            # A graph op sees the tensor torch_xla computes with (the one a functional
            # argument wraps): match arguments by TensorImpl.
            impls = {t._cdata for t in static}
            self._static = frozenset(
                i for i, a in enumerate(args) if xla.is_xla_tensor(a) and poison.inner(a)._cdata in impls
            )
        self._variants[(pattern - self._static, withheld, on)] = fn
        return fn


def _take_marks_only(model) -> frozenset:
    """Removes from the FX graph ``model`` the donor ops of the arguments it only marks (no op
    reads them: ``tdx.donate(opt)`` before torch.optim's graph break); returns their indices.
    The bridge cannot extract donor ops alone, and no output could take such a buffer."""
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    carried = frozenset(
        i
        for i, node in enumerate(placeholders)
        if node.users and all(is_donor_op(user) and not user.users for user in node.users)
    )
    for i in carried:
        for user in list(placeholders[i].users):
            model.graph.erase_node(user)
    if carried:
        model.recompile()
    return carried


def _mark_graph_ops(tensors, with_version=False) -> None:
    """Marks those of ``tensors`` not marked yet, as their graph ops would (lock held)."""
    where = user_site()
    for t in tensors:
        if not C.is_marked(t):
            poison.check_poisonable(t)  # its twin class, for the poisoning after the call
            C.mark_graph_op(t, where, with_version)


class _arming:
    """``with _arming(tensors):`` this thread's extractions donate ``tensors``, armed only from
    ``_hash_before`` to ``_warm_after``; its barriers commit nothing."""

    def __init__(self, tensors):
        self._tensors = tensors

    def __enter__(self):
        self._saved = _local.arming
        _local.arming = self._tensors
        self._context = commit.context(commit.COMPILED_CALL).__enter__()

    def __exit__(self, *exc_info):
        self._context.__exit__(*exc_info)
        _local.arming = self._saved
        _disarm()  # an extraction that failed between hash and warm-up


# -- Arming around the bridge's hash and warm-up.  Inside ``alias_with_buffer_donor_config()``
# the bridge calls ``_get_graph_hash`` and then ``_xla_warm_up_cache``: the executable gets the
# donor set of the flags set in between.  The lock is held from one to the other, so no other
# execution runs while the flags are armed.


def _hash_before(*args, **kwargs):
    arming = _local.arming
    if arming is None or _local.armed is not None:
        return C.PASS
    lock.acquire()
    try:
        verdicts.disarm_in_flight(xla.default_device())  # before arming this call's
    except BaseException:
        lock.release()
        raise
    withheld = _local.withheld or ()
    static = _local.static if _local.static_on else None
    tensors = list(arming) + [t for t in static or () if t._cdata not in withheld]
    _local.armed = [t for t in tensors if xla.set_donor(t, True)]
    return None


def _hash_after(token, result, error):
    if error is not None:
        _disarm()
    return result


def _warm_before(*args, **kwargs):
    return C.PASS if _local.armed is None else None


def _warm_after(token, result, error):
    _disarm()
    return result


def _disarm() -> None:
    armed = _local.armed
    if armed is None:
        return
    _local.armed = None
    try:
        for t in armed:
            xla.set_donor(t, False)
    finally:
        lock.release()


def _set_buffer_donation(t, should_donate):
    """torch_xla's ``_set_buffer_donation``, but a graph op's call during an extraction on this
    thread is recorded, to be armed with the others around the warm-up."""
    static = _local.static
    if static is not None and should_donate:
        static.append(t)
        return True
    return xla.set_donor(t, should_donate)


_capture_lock = threading.Lock()
_capture_depth = 0


@contextlib.contextmanager
def _capturing_graph_ops():
    """``_XLAC._set_buffer_donation`` is ours only while an extraction runs (the graph op looks
    it up per call), so that code calling it directly pays nothing for the plugin."""
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

_patched = []  # (bridge module, its extract_compiled_graph)
_original_extract = None


def _extract_compiled_graph(model, args):
    return _CompiledGraph(model, _original_extract)


def install() -> None:
    global _original_extract
    if _patched:
        return
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
        _patched.append((module, original))


def uninstall() -> None:
    global _original_extract
    while _patched:
        module, original = _patched.pop()
        module.extract_compiled_graph = original
    _original_extract = None
