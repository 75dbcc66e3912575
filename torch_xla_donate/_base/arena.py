"""torch_xla's registry of live tensors, walked natively (csrc/lazy/live_tensors.h):
who will take a donor's value at the barrier, and the dead step inputs.

The registry is torch's ``DeviceContextArena``; its address is a
function-local static of ``_XLAC.so``, found here in the library's symbol
table (why, and its guards: docs/design.md, "Reading torch_xla"; guards.py
runs them).

>>> SYMBOL.startswith(b"_ZZN9torch_xla16XLAGraphExecutor18DeviceContextArena3Get")
True
"""
import ctypes
import mmap
import struct

from . import xla
from .native import C

__all__ = ["SYMBOL", "find", "in_use", "same_step_copies", "live_tensors"]

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


def find():
    """Finds torch_xla's arena and hands it to the walk: None, or why not."""
    path = xla.xlac_library()
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


def in_use() -> bool:
    """Whether the walk is on (the guards passed: guards.py)."""
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
    return C.same_step_copies(donors, with_handles) if in_use() else None


def live_tensors():
    """Every live XLA tensor as ``(tensor_id, handle, ir_node,
    ir_is_device_data, device_data_buffer)`` (addresses: compare them), or
    None when the walk is off."""
    return C.live_tensors() if in_use() else None
