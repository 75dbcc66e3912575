"""Everything the plugin asks of torch_xla: its private ``_XLAC`` functions
(one place, so an upgrade that changes one breaks one module), the native
reads of its tensors (``read_*``: csrc/lazy/lazy_reads.h, guarded by
_guards.py; a tensor the reader declines, no plain device data, reads None)
and the walk of its live-tensor registry.
"""
import ctypes
import mmap
import os
import struct
from typing import NamedTuple

import torch
import torch_xla
import torch_xla.runtime

from ._native import C

_XLAC = torch_xla._XLAC

# torch_xla's own functions, taken before the plugin puts its trampolines in
# their place (_hooks.py): what the plugin itself calls.  (The
# benchmarks put a timed wrapper here to time the real barrier.)
REAL = {
    name: getattr(_XLAC, name)
    for name in ("_set_buffer_donation", "_xla_step_marker", "_xla_sync_multi",
                 "_xla_sync_live_tensors", "_xla_wait_device_ops", "_get_graph_hash",
                 "_xla_warm_up_cache")
    if hasattr(_XLAC, name)
}


def real(name: str):
    """torch_xla's own ``_XLAC.<name>``, whatever stands in its place now."""
    return REAL[name]


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def is_xla_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device.type == "xla"


def has_pending_ir(tensors) -> list:
    """For each tensor: does it still hold unexecuted computation?

    True both for a freshly computed tensor and for a materialized one that
    was updated in place since the last step.  One call for the whole list.
    """
    return _XLAC._check_tensor_need_materialization(list(tensors))


def set_donor(t: torch.Tensor, donate: bool) -> bool:
    """Sets torch_xla's buffer-donor flag on the device data behind ``t``.

    Returns False, changing nothing, when ``t`` is not plain device data: it
    has pending IR, or it is a view (its IR is still an ``aten::view``).
    """
    return REAL["_set_buffer_donation"](t, donate)


_carriers = {}


def set_unheld_flags(device, point, count, flag) -> int:
    """Sets torch_xla's donor flag to ``flag`` on ``count`` buffers no tensor
    holds (dead step inputs; donors released before a step that failed),
    through a carrier tensor of ``device``: ``point(carrier, i)`` points
    its handle at the i-th buffer natively (csrc/lazy/lazy_tensor_of.h
    PointCarrier), ``_set_buffer_donation`` takes it, and the carrier gets
    its own handle back.  Returns how many torch_xla accepted."""
    carrier = _carriers.get(str(device))
    if carrier is None:
        # Its own handle may be empty (host data until a barrier reads it):
        # only the one pointed at is read.
        carrier = _carriers[str(device)] = torch.zeros(1).to(device)
    set_donation, accepted = REAL["_set_buffer_donation"], 0
    for i in range(count):
        if point(carrier, i):
            try:
                accepted += set_donation(carrier, flag)
            finally:
                C.restore_carrier(carrier)
    return accepted


def donor_flag(t: torch.Tensor) -> bool:
    """torch_xla's buffer-donor flag on the device data behind ``t``."""
    return _XLAC._get_buffer_donation(t)


def tensor_id(t: torch.Tensor) -> int:
    """torch_xla's unique id of the XLA tensor behind ``t`` (increasing)."""
    return _XLAC._xla_get_tensor_id(t)


def buffer_handles(tensors) -> list:
    """The device-buffer handle behind each tensor: equal handles, one buffer
    (torch_xla backs copies made by ``copy_``, ``load_state_dict``,
    ``t.to(device, copy=True)``, ... with their source's buffer)."""
    return _XLAC._get_tensors_handle(list(tensors))


def live_tensor_count() -> int:
    """How many XLA tensors torch_xla's registry holds alive, all devices
    (torch_xla's own walk of it: the live-tensor registry's self-test)."""
    return len(_XLAC._check_device_tensor_need_materialization(""))


def xlac_library() -> str:
    """The path of torch_xla's native library ``_XLAC.so``."""
    return os.path.realpath(_XLAC.__file__)


def buffer_deleted(t: torch.Tensor) -> bool:
    """True once the buffer behind ``t`` was consumed by a donation.

    Only meaningful for a tensor without pending IR: an in-flight output is a
    placeholder too.
    """
    return _XLAC._is_placecholder(t)


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage: 1 unless views or aliases
    (``t[0:2]``, ``t.detach()``, ``nn.Parameter(t)``) are alive."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def wait_device_ops(device=None) -> None:
    """Blocks until the computations dispatched to ``device`` (a torch device
    of a tensor; None: every local device) have run; only after this is a
    donated input's deletion certain to be visible.

    Why one device: with ``torch_xla.launch`` every local device has its own
    thread, and a step of another device may sit in a collective until its
    thread reaches its next barrier; waiting for it would deadlock.
    """
    wait = _XLAC._xla_wait_device_ops  # through the plugin's trampoline: _verdicts.py listens
    if device is None or local_device_count() == 1:
        wait([])
    else:
        wait(_XLAC._xla_real_devices([str(device)]))


def attach_copies(tensors) -> None:
    """torch_xla's collection of a sync, asked of ``tensors`` without running
    anything: a copy whose IR is its source's device data is backed with that
    buffer now, a clone keeps its pending IR (it gets a buffer of its own at
    the barrier)."""
    REAL["_get_graph_hash"](list(tensors))


def runtime_started() -> bool:
    """True once torch_xla's runtime is up (no XLA computation before it)."""
    started = getattr(_XLAC, "_xla_runtime_is_initialized", None)
    return True if started is None else bool(started())


def spmd() -> bool:
    """True once ``torch_xla.runtime.use_spmd()`` switched SPMD on."""
    return torch_xla.runtime.is_spmd()


def default_device() -> torch.device:
    """The calling thread's XLA device: the one its barriers sync."""
    return torch.device(_XLAC._xla_get_default_device())


_local_device_count = None


def local_device_count() -> int:
    """How many runtime devices this process drives (1 under SPMD, whose
    tensors all live on one virtual device).  Fixed once the runtime is up."""
    global _local_device_count
    if _local_device_count is None:
        _local_device_count = len(_XLAC._xla_get_all_devices())
    return _local_device_count


def aliasing_enabled() -> bool:
    """False when ``XLA_ENABLE_PARAM_ALIASING=0`` turned off all donation."""
    value = os.environ.get("XLA_ENABLE_PARAM_ALIASING")
    if value is None:
        return True
    try:
        return bool(int(value))
    except ValueError:
        return value.strip().lower() not in ("false", "off", "no")


# torch_xla's readers of its counters (what torch_xla.debug.metrics calls).
_METRIC_READERS = ("_xla_counter_names", "_xla_counter_value", "_xla_metrics_report",
                   "_short_xla_metrics_report")


def call_before_metric_reads(hook) -> None:
    """Makes each of torch_xla's counter readers call ``hook()`` first
    (idempotent): the plugin's counters are brought up to date lazily."""
    for name in _METRIC_READERS:
        real = getattr(_XLAC, name, None)
        if real is None or getattr(real, "_tdx_before", None) is hook:
            continue

        def reader(*args, _real=real, **kwargs):
            hook()
            return _real(*args, **kwargs)

        reader._tdx_before = hook
        setattr(_XLAC, name, reader)


def increment_counter(name: str, value: int) -> bool:
    """Adds ``value`` to torch_xla's counter ``name`` (created on first use),
    so that it shows in ``torch_xla.debug.metrics`` reports.  False when this
    torch_xla cannot do it."""
    increment = getattr(_XLAC, "_xla_increment_counter", None)
    if increment is None:
        return False
    increment(name, value)
    return True


# -- Native reads ----------------------------------------------------------

LazyFacts = NamedTuple("LazyFacts", [(name, object) for name in C.LAZY_FACT_FIELDS])
LazyFacts.__doc__ = "Every fact the native reader gives (csrc/lazy/lazy_reads.h)."


class Holders(NamedTuple):
    expected: int
    actual: int
    xla_tensor_refs: int


def read_pending(tensors) -> list:
    """Pending computation per tensor; a tensor the reader declines counts
    as pending (it is no plain device data)."""
    return C.pending_flags(list(tensors))


def read_buffer_key(t):
    """Equal for two tensors exactly when they share one live buffer; 0
    without one (pending, consumed, still computing)."""
    return C.lazy_buffer_key(t)


def read_owner_ids(tensors) -> list:
    """Per tensor, the tensor id its live buffer is filed under (-1: none,
    an upload no graph read), None without a live buffer."""
    return C.lazy_owner_ids(list(tensors))


def read_holders(tensors) -> list:
    """Per tensor with a handle: ``Holders(expected, actual,
    xla_tensor_refs)``; None when unknown (no handle, or functionalization
    off: torch_xla's own views then hold buffers the reader cannot see)."""
    return [None if h is None else Holders(*h) for h in C.lazy_holders(list(tensors))]


def read_excess(tensors):
    """``[(index, extra)]`` of the donors whose buffer has holders beyond
    those the donors sharing it account for; ``[]`` for none; None when any
    tensor's holders are unknown (see ``holders``)."""
    return C.lazy_excess(list(tensors))


def read_facts(t):
    f = C.lazy_facts(t)
    return None if f is None else LazyFacts(*f)


# -- The live-tensor registry ------------------------------------------------

SYMBOL = b"_ZZN9torch_xla16XLAGraphExecutor18DeviceContextArena3GetEvE5arena"

_SHT_SYMTAB = 2
_SYM_SIZE = 24  # Elf64_Sym


def _symbol_value(path: str, name: bytes):
    """The value of ``name`` in the ELF64 symbol table of ``path``, or None.

    The string table is searched for the name, then the symbol table for
    the entry naming that string: two ``find`` calls over the mapped file,
    no Python loop over its (hundreds of thousands of) symbols."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:  # ELF64, little-endian
            return None
        shoff, = struct.unpack_from("<Q", mm, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", mm, 0x3A)
        for i in range(shnum):
            header = shoff + i * shentsize
            if struct.unpack_from("<I", mm, header + 4)[0] != _SHT_SYMTAB:
                continue
            offset, size, link = struct.unpack_from("<QQI", mm, header + 0x18)
            strings = shoff + link * shentsize
            str_offset, str_size = struct.unpack_from("<QQ", mm, strings + 0x18)
            at = mm.find(b"\0" + name + b"\0", str_offset, str_offset + str_size)
            if at < 0:
                return None
            key = struct.pack("<I", at + 1 - str_offset)
            pos = mm.find(key, offset, offset + size)
            while pos >= 0:
                if (pos - offset) % _SYM_SIZE == 0:
                    return struct.unpack_from("<Q", mm, pos + 8)[0]
                pos = mm.find(key, pos + 1, offset + size)
            return None
        return None
    finally:
        mm.close()


def _load_address(path: str):
    """Where ``path`` is mapped in this process (its offset-0 mapping)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    return None


def find_arena():
    """Finds torch_xla's live-tensor registry and hands it to the walk
    (csrc/lazy/live_tensors.h): None, or why not (docs/design.md, "The
    live-tensor registry")."""
    path = xlac_library()
    try:
        value, base = _symbol_value(path, SYMBOL), _load_address(path)
    except (OSError, ValueError, struct.error) as error:
        return f"reading {path} failed: {error!r}"
    if value is None:
        return f"{SYMBOL.decode()} is not in {path}'s symbol table (a stripped build?)"
    if base is None:
        return f"{path} is not mapped in this process"
    arena = ctypes.c_void_p.from_address(base + value).value
    if not arena:
        return "torch_xla has not made its arena yet"
    return C.live_set_arena(arena) or None


def walk_in_use() -> bool:
    """Whether the walk is on (the guards passed: _guards.py)."""
    return C.live_arena() != 0


def same_step_copies(donors, with_handles=False):
    """``{index: ids}`` for the donors with copies: the torch_xla ids of the
    live tensors, other than the donors, that the barrier will back with
    its buffer (a copy made since the last barrier) and, ``with_handles``,
    those holding that buffer itself; ``{index: None}`` where the donor
    cannot be read.  A donor with neither is left out: nothing per donor in
    the common case.  None when the walk is off."""
    donors = list(donors)
    if not donors:
        return {}
    return C.same_step_copies(donors, with_handles) if walk_in_use() else None


def live_tensors():
    """Every live XLA tensor as ``(tensor_id, handle, ir_node,
    ir_is_device_data, device_data_buffer)`` (addresses: compare them), or
    None when the walk is off."""
    return C.live_tensors() if walk_in_use() else None
