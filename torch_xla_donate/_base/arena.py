"""torch_xla's registry of live tensors, walked natively: who will take a
donor's value at the barrier (csrc/lazy/live_tensors.h).

The problem: a copy made from a donor in the donating step itself
(``load_state_dict``, ``copy_``, ``t.to(dev, copy=True)``,
``torch.tensor(t)``, ``x[...] = t``) has the donor's own device-data node as
its IR value; the barrier backs it with the donor's buffer, so donating the
donor destroys it, and no buffer count shows it.  Only torch_xla's registry
of live tensors knows who holds that node.

The registry's walk is torch's (``LazyGraphExecutor::DeviceContextArena``),
but torch_xla's arena is a function-local static of ``_XLAC.so`` that no
symbol exports.  The wheel is not stripped: its symbol table (``.symtab``,
which ``dlsym`` does not read) names the static, and its value plus the
library's load address (``/proc/self/maps``) is where the arena's address is
kept.  Guards, any of which leaves the walk off (``state()`` says why):

* the symbol must be there, and the object it points to must have the
  arena's dynamic type (RTTI, checked natively);
* a self-test at the first use: the walk's count of live tensors equals
  torch_xla's own walk (``_check_device_tensor_need_materialization``), and
  a copy made on purpose from a donor is found;
* native reads must be on (``_base/reads.py``; ``TORCH_XLA_DONATE_NATIVE_READS=0``
  turns both off): the donors are read through the same guarded reader.

With the walk off, the screen (_outcomes/sharing.py) searches every
barrier's donors in Python instead.

>>> SYMBOL.startswith(b"_ZZN9torch_xla16XLAGraphExecutor18DeviceContextArena3Get")
True
"""
import ctypes
import mmap
import struct
import threading

from . import reads, xla
from .native import C

__all__ = ["SYMBOL", "state", "in_use", "decide_on", "same_step_copies", "live_tensors"]

SYMBOL = b"_ZZN9torch_xla16XLAGraphExecutor18DeviceContextArena3GetEvE5arena"

_SHT_SYMTAB = 2
_SYM_SIZE = 24  # Elf64_Sym

_lock = threading.Lock()
_state = {"why_off": None, "decided": False}


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


def _find_arena():
    """(arena address, None) or (0, why not)."""
    path = xla.xlac_library()
    try:
        value, base = _symbol_value(path, SYMBOL), _load_address(path)
    except (OSError, ValueError, struct.error) as error:
        return 0, f"reading {path} failed: {error!r}"
    if value is None:
        return 0, f"{SYMBOL.decode()} is not in {path}'s symbol table (a stripped build?)"
    if base is None:
        return 0, f"{path} is not mapped in this process"
    arena = ctypes.c_void_p.from_address(base + value).value
    if not arena:
        return 0, "torch_xla has not made its arena yet"
    why = C.live_set_arena(arena)
    return (arena, None) if not why else (0, why)


def _self_test(donors):
    """None when the walk agrees with torch_xla, else why not."""
    for _ in range(3):  # another thread may make or drop tensors meanwhile
        if C.live_count() == xla.live_tensor_count():
            break
    else:
        return (f"the walk counts {C.live_count()} live tensors, torch_xla "
                f"{xla.live_tensor_count()}")
    for t in donors:
        facts = reads.facts(t)
        if facts is None or not facts.has_handle:
            continue
        copy = t.to(t.device, copy=True)  # dies before the barrier: no trace in the step
        found = C.same_step_copies([t]).get(0)
        if found is None or reads.tensor_id(copy) not in found:
            return "a copy made on purpose from a donor was not found"
        return None
    return "no donor to test on"


def _decide(donors) -> None:
    """Finds the arena and runs the self-test, once per process (a test with
    no donor to copy waits for a later call)."""
    with _lock:
        if _state["decided"]:
            return
        if not C.lazy_enabled():
            return  # off while native reads are (state() says so); decided with them on
        arena, why = _find_arena()
        if arena:
            try:
                why = _self_test(donors)
            except Exception as error:  # any surprise: the walk stays off
                why = f"self-test raised {error!r}"
            if why == "no donor to test on":
                C.live_set_arena(0)
                return
        if why is not None:
            C.live_set_arena(0)
        _state["why_off"], _state["decided"] = why, True


def state() -> str:
    """``"in use"``, ``"off (<why>)"`` or ``"not decided yet"`` (before the
    first barrier with donors)."""
    if not C.lazy_enabled() and reads.path() != "not decided yet":
        return f"off (native reads are off: {reads.path()})"
    if not _state["decided"]:
        return "not decided yet"
    return "in use" if _state["why_off"] is None else f"off ({_state['why_off']})"


def in_use() -> bool:
    return _state["decided"] and _state["why_off"] is None and C.lazy_enabled()


def decide_on(tensors) -> bool:
    """Finds the arena and runs the self-test with ``tensors`` (XLA tensors
    with a buffer: one is copied on purpose) if not done yet; True when the
    walk is in use."""
    if not _state["decided"]:
        _decide(list(tensors))
    return in_use()


def same_step_copies(donors):
    """``{index: ids}`` for the donors with copies: the torch_xla ids of the
    live tensors, other than the donors, that the barrier will back with
    its buffer (a copy made since the last barrier); ``{index: None}``
    where the donor cannot be read.  A donor with neither is left out:
    nothing per donor in the common case.  None when the walk is off."""
    donors = list(donors)
    if not donors:
        return {}
    return C.same_step_copies(donors) if decide_on(donors) else None


def live_tensors():
    """Every live XLA tensor as ``(tensor_id, handle, ir_node,
    ir_is_device_data, device_data_buffer)`` (addresses: compare them), or
    None when the walk is off."""
    return C.live_tensors() if in_use() else None
