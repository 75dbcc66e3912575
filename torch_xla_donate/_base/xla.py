"""The one place that talks to torch_xla's private ``_XLAC`` functions.

Every question the plugin asks the lazy-tensor executor goes through here, so
a torch_xla upgrade that renames or changes one of them breaks one module.
"""
import os

import torch
import torch_xla
import torch_xla.runtime

from .native import C

_XLAC = torch_xla._XLAC

# torch_xla's own functions, taken before the plugin puts its trampolines in
# their place (_hooks/executions.py): what the plugin itself calls.  (The
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
    Only commit.py arms flags, inside an execution it commits.
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
    wait = _XLAC._xla_wait_device_ops  # through the plugin's trampoline: failures.py listens
    if device is None or local_device_count() == 1:
        wait([])
    else:
        wait(_XLAC._xla_real_devices([str(device)]))


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


# What the native commit calls of torch_xla's and torch's: the package's
# install step hands them over with the other layers' (``C.bind``,
# _hooks/install.py).
NATIVE_HOOKS = dict(tensor_type=torch.Tensor)
