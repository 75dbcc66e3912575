"""The one lock of the plugin's critical sections, which the native fast
path of marking can see.

Marking's fast path (``C.donate_buffer``, ``C.try_mark``) marks without
taking this lock (it cannot be interrupted by another Python thread), but
must not mark while another thread is inside a commit: it declines while the
lock has holders, and the Python path then takes the lock.

>>> with lock:
...     C.lock_holders() > 0
True
"""
import threading

from .native import C

__all__ = ["lock"]


class _HookLock:
    """A re-entrant lock that counts its holders in ``_C``."""

    def __init__(self):
        self._lock = threading.RLock()

    def acquire(self):
        self._lock.acquire()
        C.note_lock(True)

    def release(self):
        C.note_lock(False)
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info):
        self.release()


lock = _HookLock()
