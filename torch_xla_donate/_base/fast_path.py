"""When marking's native fast path (``C.donate_buffer``, ``C.try_mark``) may run.

The fast path marks in one native call and says "no" to anything unusual;
it must be closed whenever the Python path has something to say for every
mark: donation switched off (a ``DonationDisabledWarning``), an
unprotected CPU process whose first donation owes a ``StaleReadWarning``
(xla_cpu.py), or native reads not decided yet (the first mark decides
them, outside any commit: reads.py), or the hooks out (nothing would
commit the mark).  ``refresh`` recomputes it; the config's listeners, every
barrier and the first warning call it.

This module is the one writer of the native switch
(``C.set_fast_path_enabled``): the hooks say whether they are in through
``hooks_in``, so a ``configure()`` after ``uninstall()`` cannot reopen it.

>>> refresh() is None
True
"""
from . import config, reads, xla, xla_cpu
from .native import C

__all__ = ["refresh", "hooks_in"]

_hooks_in = False


def hooks_in(on: bool) -> None:
    """_hooks/install.py: the hooks are in (``on``) or out; refreshes."""
    global _hooks_in
    _hooks_in = on
    refresh()


def refresh() -> None:
    """Opens the fast path only while the hooks are in, donation is on and
    nothing is owed.  (torch_xla reads ``XLA_ENABLE_PARAM_ALIASING`` when it
    first compiles, so a change before the first step still counts.)"""
    C.set_fast_path_enabled(_hooks_in and config.enabled() and xla.aliasing_enabled()
                            and not xla_cpu.warning_due() and reads.decided())
