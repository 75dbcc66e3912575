"""Every ``_XLAC`` call the plugin makes, in one place so that an upgrade that
changes one breaks one module; the native reads that give a Python type; the
address of torch_xla's live-tensor registry (docs/design.md, "Reading torch_xla")."""
import ctypes
import functools
import mmap
import os
import struct
from typing import NamedTuple

import torch
import torch_xla
import torch_xla.runtime

from ._native import C

_XLAC = torch_xla._XLAC

# torch_xla's own functions, taken before _hooks.py's trampolines replace them (benchmarks time them here).
REAL = {name: getattr(_XLAC, name) for name in (
    "_set_buffer_donation", "_xla_step_marker", "_xla_sync_multi", "_xla_sync_live_tensors",
    "_xla_wait_device_ops", "_get_graph_hash", "_xla_warm_up_cache") if hasattr(_XLAC, name)}
_carriers = {}  # device: the carrier tensor of set_unheld_flags


def real(name: str):
    return REAL[name]


def is_xla_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device.type == "xla"


def has_pending_ir(tensors) -> list:
    """Per tensor: unexecuted computation, fresh or an in-place update since the last step."""
    return _XLAC._check_tensor_need_materialization(list(tensors))


def set_donor(t: torch.Tensor, donate: bool) -> bool:
    """Sets torch_xla's donor flag on ``t``'s buffer; False (nothing set) for no plain device data."""
    return REAL["_set_buffer_donation"](t, donate)


def set_unheld_flags(device, point, count, flag) -> int:
    """Sets the donor flag on ``count`` buffers no tensor holds, through a carrier
    ``point(carrier, i)`` aims at each (docs/design.md, "A carrier tensor"); how many took it."""
    carrier = _carriers.get(str(device))
    if carrier is None:
        # Its own handle may be empty (host data until a barrier): only the one pointed at is read.
        carrier = _carriers[str(device)] = torch.zeros(1).to(device)
    set_donation, accepted = REAL["_set_buffer_donation"], 0
    for i in range(count):
        if point(carrier, i):
            try:
                accepted += set_donation(carrier, flag)
            finally:
                C.restore_carrier(carrier)
    return accepted


def tensor_id(t: torch.Tensor) -> int:
    return _XLAC._xla_get_tensor_id(t)


def buffer_handles(tensors) -> list:
    """The device-buffer handle behind each tensor: equal handles, one buffer."""
    return _XLAC._get_tensors_handle(list(tensors))


def live_tensor_count() -> int:
    """The live XLA tensors of every device, by torch_xla's own walk of its registry."""
    return len(_XLAC._check_device_tensor_need_materialization(""))


def buffer_deleted(t: torch.Tensor) -> bool:
    """True once a donation consumed ``t``'s buffer (without pending IR: an output in flight is too)."""
    return _XLAC._is_placecholder(t)


def wait_device_ops(device=None) -> None:
    """Blocks until ``device``'s work (None: every local device's) has run, deletions visible."""
    wait = _XLAC._xla_wait_device_ops  # through the plugin's trampoline: _verdicts.py listens
    if device is None or local_device_count() == 1:
        wait([])
    else:
        # One device: under torch_xla.launch another's step may wait in a collective (deadlock).
        wait(_XLAC._xla_real_devices([str(device)]))


def attach_copies(tensors) -> None:
    """torch_xla's collection of a sync, running nothing: a copy gets its source's
    buffer now, a clone keeps its pending IR (docs/design.md, "Clones among those copies")."""
    REAL["_get_graph_hash"](list(tensors))


def runtime_started() -> bool:
    started = getattr(_XLAC, "_xla_runtime_is_initialized", None)
    # Without the query (no supported release lacks it) assume the worst.
    return True if started is None else bool(started())


def spmd() -> bool:
    return torch_xla.runtime.is_spmd()


def default_device() -> torch.device:
    """The calling thread's XLA device: the one its barriers sync."""
    return torch.device(_XLAC._xla_get_default_device())


def set_ir_debug(on: bool) -> bool:
    """Whether new IR nodes keep the Python frames that made them (torch's
    ``FLAGS_torch_lazy_ir_debug``, ``XLA_IR_DEBUG``); returns the old setting."""
    old = bool(_XLAC._get_ir_debug())
    _XLAC._set_ir_debug(bool(on))
    return old


@functools.cache
def local_device_count() -> int:
    """Runtime devices this process drives (1 under SPMD); fixed once the runtime is up."""
    return len(_XLAC._xla_get_all_devices())


def aliasing_enabled() -> bool:
    value = os.environ.get("XLA_ENABLE_PARAM_ALIASING", "1").strip().lower()
    try:
        return bool(int(value))
    except ValueError:
        return value not in ("false", "off", "no")


def call_before_metric_reads(hook) -> None:
    """Makes torch_xla's counter readers (torch_xla.debug.metrics) call ``hook()`` first (idempotent)."""
    for name in ("_xla_counter_names", "_xla_counter_value", "_xla_metrics_report",
                 "_short_xla_metrics_report"):
        reader = getattr(_XLAC, name, None)
        if reader is None or getattr(reader, "_tdx_before", None) is hook:
            continue

        def before(*args, _real=reader, **kwargs):
            hook()
            return _real(*args, **kwargs)

        before._tdx_before = hook
        setattr(_XLAC, name, before)


def increment_counter(name: str, value: int) -> bool:
    increment = getattr(_XLAC, "_xla_increment_counter", None)
    if increment is not None:
        increment(name, value)
    return increment is not None


LazyFacts = NamedTuple("LazyFacts", [(name, object) for name in C.LAZY_FACT_FIELDS])


class Holders(NamedTuple):
    expected: int
    actual: int
    xla_tensor_refs: int


def read_facts(t):
    f = C.lazy_facts(t)
    return None if f is None else LazyFacts(*f)


def read_holders(tensors) -> list:
    """Per tensor ``Holders`` of its buffer; None when unknown (no handle, or functionalization
    off: torch_xla's own views then hold buffers unseen)."""
    return [None if h is None else Holders(*h) for h in C.lazy_holders(list(tensors))]


def read_buffer_key(t):
    return C.lazy_buffer_key(t)


# -- The live-tensor registry ------------------------------------------------

SYMBOL = b"_ZZN9torch_xla16XLAGraphExecutor18DeviceContextArena3GetEvE5arena"


def _symbol_value(path: str, name: bytes):
    """``name``'s value in the ELF64 symbol table of ``path``, or None: no Python loop over symbols."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:  # ELF64, little-endian
            return None
        shoff, = struct.unpack_from("<Q", mm, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", mm, 0x3A)
        for i in range(shnum):
            header = shoff + i * shentsize
            if struct.unpack_from("<I", mm, header + 4)[0] != 2:  # SHT_SYMTAB
                continue
            offset, size, link = struct.unpack_from("<QQI", mm, header + 0x18)
            str_offset, str_size = struct.unpack_from("<QQ", mm, shoff + link * shentsize + 0x18)
            at = mm.find(b"\0" + name + b"\0", str_offset, str_offset + str_size)
            if at < 0:
                return None
            key = struct.pack("<I", at + 1 - str_offset)
            pos = mm.find(key, offset, offset + size)
            while pos >= 0:
                if (pos - offset) % 24 == 0:  # sizeof(Elf64_Sym)
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
    """Finds torch_xla's live-tensor registry and hands it to the walk: None, or why not."""
    path = os.path.realpath(_XLAC.__file__)
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
    return C.live_arena() != 0
