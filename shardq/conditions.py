"""A condition variable that counts its waiters."""
from __future__ import annotations

import threading


class CountedCondition(threading.Condition):
    """A :class:`threading.Condition` whose ``waiters`` says how many threads are in
    :meth:`wait`. ``notify_all`` is Python code that checks the lock's owner even when
    nobody waits; a hot path that signals on every call checks ``waiters`` first and skips
    it. ``waiters`` changes only with the lock held (``wait`` holds it on entry and again
    on return), so a thread that holds the lock and reads 0 knows nobody can miss the
    signal."""

    def __init__(self, lock: threading.Lock | threading.RLock) -> None:
        super().__init__(lock)
        self.waiters = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiters += 1
        try:
            return super().wait(timeout)
        finally:
            self.waiters -= 1
