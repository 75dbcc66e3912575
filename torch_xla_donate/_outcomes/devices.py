"""Several devices in one process.

``torch_xla.launch`` (``xmp.spawn``) on CPU or GPU runs one thread per local
device in one process, and each thread's barrier syncs only the tensors of
its own device.  So a barrier commits only the marks on its device (the
others wait for their own thread's barrier), and is certain only about the
open verdicts of its device.  No code here waits for a device while holding
the hook lock: the step of another device may sit in a collective
(all_reduce) until that device's thread has passed its own barrier, which
takes the lock.

Under SPMD every tensor lives on one virtual device: one device here.
"""
import torch

from .._base import xla
from .._base.native import C

__all__ = ["barrier_device", "split_by_device", "marks_on", "dispatched", "dispatched_through"]


def barrier_device(device: str):
    """The device a barrier called with ``device`` ("" : the thread's) syncs."""
    return torch.device(device) if device else xla.default_device()


def split_by_device(entries, device):
    """(entries whose tensor is on ``device``, the others)."""
    if xla.local_device_count() == 1:
        return entries, []
    mine = [e for e in entries if e[0].device == device]
    return mine, [e for e in entries if e[0].device != device]


def marks_on(device):
    """The tensors whose marks a barrier of ``device`` takes: None for all
    (one device), else those on ``device``."""
    if xla.local_device_count() == 1:
        return None
    return [t for t in C.marked_tensors() if t.device == device]


# The newest step known to be dispatched, per device (None: every device).
# A verdict of such a step is certain without waiting: its buffers no longer
# change between "held for a donation" and "deleted".
_dispatched_steps = {}


def dispatched(device, step) -> None:
    """Every step of ``device`` (None: of every device) up to ``step`` has
    been dispatched."""
    if step > _dispatched_steps.get(device, 0):
        _dispatched_steps[device] = step


def dispatched_through(device) -> int:
    return max(_dispatched_steps.get(device, 0), _dispatched_steps.get(None, 0))
