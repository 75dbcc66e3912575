"""Finding who holds a buffer: one walk over the objects the garbage
collector tracks (live tensors, the modules holding them, the leaves
autograd graphs accumulate into).

The walk costs about 50 ms in a process with torch_xla loaded, so it runs
only when a use count says there is a holder, once per call: within
``scanning()``, ``scan()`` reuses one walk.

The tricky case: the Python objects of tensors only C++ keeps alive are
left out (csrc/outcomes/ownership.cpp): they count as C++ holders, and kept
in a list they would outlive their TensorImpls.
"""
import contextlib
import threading

import torch

from .._base.dtypes import shape_string
from .._base.native import C

__all__ = ["scan", "scanning", "storage_of"]


class _Scan:
    """One walk over the objects the garbage collector tracks: live tensors,
    the modules holding them, and the leaves autograd graphs accumulate into."""

    def __init__(self):
        # Not the Python objects of tensors only C++ keeps alive (see
        # live_objects in csrc/module.cpp): no Python code holds those, and
        # ours must not outlive their TensorImpls.
        self.tensors, modules = C.live_objects((torch.Tensor, torch.nn.Module))
        self._names = {}
        for m in modules:
            for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
                for name, p in named:
                    label = f"{kind} '{name}' of {type(m).__name__}"
                    # The root-most module gives the longest, most telling name.
                    if len(label) > len(self._names.get(id(p), "")):
                        self._names[id(p)] = label
        self._leaves = None

    def sharing(self, address, t):
        seen = {id(t)}
        for o in self.tensors + self._accumulated_leaves():
            if id(o) not in seen and storage_of(o) == address:
                seen.add(id(o))
                yield o

    def module_name(self, t):
        return self._names.get(id(t))

    def accumulated(self, t) -> bool:
        return any(t is leaf for leaf in self._accumulated_leaves())

    def _accumulated_leaves(self) -> list:
        """The variables of the AccumulateGrad nodes of every graph a live
        tensor roots."""
        if self._leaves is None:
            leaves, seen = [], set()
            todo = [f for f in (_attribute(t, "grad_fn") for t in self.tensors) if f is not None]
            kept = []  # node wrappers are made on access: keep them, or ids repeat
            while todo:
                node = todo.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                kept.append(node)
                variable = getattr(node, "variable", None)
                if isinstance(variable, torch.Tensor):
                    leaves.append(variable)
                todo.extend(n for n, _ in node.next_functions)
            self._leaves = leaves
        return self._leaves

    def grad_slot_of(self, t):
        for o in self.tensors:
            if o is not t and _attribute(o, "is_leaf") and _attribute(o, "grad") is t:
                name = self._names.get(id(o))
                return f"the {name}" if name else f"a tensor {shape_string(o)}"
        return None


def _attribute(t, name):
    """``t.<name>``, or None where torch refuses (an undefined tensor)."""
    try:
        return getattr(t, name)
    except RuntimeError:
        return None


def storage_of(t) -> int:
    """The address of ``t``'s StorageImpl; 0 for none (or a tensor torch
    cannot describe, as found among the garbage collector's objects)."""
    try:
        return C.storage_address(t)
    except (RuntimeError, TypeError):
        return 0


_local = threading.local()


@contextlib.contextmanager
def scanning():
    """Within it, ``scan()`` walks the objects once and reuses the result."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _local.scan = None


def scan() -> _Scan:
    cached = getattr(_local, "scan", None)
    if cached is None:
        cached = _Scan()
        if getattr(_local, "depth", 0):
            _local.scan = cached
    return cached
