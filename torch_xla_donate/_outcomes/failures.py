"""Failed steps.

A step that raises at its barrier (compile error, or the out-of-memory of an
earlier asynchronous step that torch_xla reports at the next barrier)
abandons its own donations: STEP_FAILED, value kept.

A step dispatched with ``sync(wait=False)`` can fail later, while running.
torch_xla then reports the error once, at the next barrier or wait for the
device, whoever comes first: our barrier, our own wait when a verdict is
settled (a use of the tensor, ``is_deleted``, ``settle``), or the
user's ``xm.wait_device_ops()``, which the plugin routes through ``wait_*``
here.  A donated input of a failed step is not deleted, which alone would
read "unused"; so every failure seen marks the steps committed so far as
failed, and their open verdicts whose buffer survived settle STEP_FAILED,
without an unused warning (or UnusedDonationError in strict mode).  An
unused donation of an earlier step still open at that moment is reported as
failed too: a failure cannot be attributed to one step, and saying nothing
is the safe error.  A failure that surfaces elsewhere (``loss.item()`` on an
output of the failed step) is invisible to us: those donations read
"unused".

``with torch_xla.step():`` (and ``torch_xla.compile``) syncs on the way out
even when its body raised, running whatever part of the step was traced.
The donations are abandoned there (executions.py knows the block raised):
the outputs that would take the buffers are lost with the exception, and the
old values must not be lost with them.
"""
from .._base.native import C
from . import devices

__all__ = ["note_failure", "in_failed_step", "wait_before", "wait_after"]

_failed_through = 0  # every step up to this one may have failed


def note_failure() -> None:
    global _failed_through
    _failed_through = max(_failed_through, C.current_step())


def any_failed() -> bool:
    return _failed_through > 0


def in_failed_step(record) -> bool:
    return record.step <= _failed_through


# torch_xla's ``_xla_wait_device_ops``, listening (a Trampoline's before and
# after, see executions.py): for failed steps, and for steps known to be
# dispatched (every step so far, once a wait for every device returns).

def wait_before(*args, **kwargs):
    devices_ = kwargs.get("devices", args[0] if args else None)
    return (C.current_step(), not devices_)


def wait_after(token, result, error):
    step, every_device = token
    if error is not None:
        note_failure()
    elif every_device:
        devices.dispatched(None, step)
    return result
