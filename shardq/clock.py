"""Time, injected. ``time.time()`` and ``time.monotonic()`` are read here; the shard and
the log read no other clock (their state takes ``now``, their loops a :class:`Clock`), and
``tests/project/test_time_reads.py`` lists the modules elsewhere that still do, a list that
only shrinks.

Deadlines (lease expiry, delays, dedup windows) are wall-clock seconds since the epoch,
because they are written to the log and must mean the same thing after a restart.
Waiting and timeouts inside one process use the monotonic clock.
"""
from __future__ import annotations

import time


class Clock:
    """Interface: ``now()`` wall seconds (float), ``monotonic()`` seconds (float)."""

    def now(self) -> float:
        raise NotImplementedError

    def monotonic(self) -> float:
        raise NotImplementedError


class SystemClock(Clock):
    """The real clocks."""

    now = staticmethod(time.time)
    monotonic = staticmethod(time.monotonic)


class FakeClock(Clock):
    """A clock tests move by hand; both readings advance together."""

    def __init__(self, start: float = 1_000_000.0):
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def monotonic(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        self._t += seconds
        return self._t

    def set(self, t: float) -> None:
        self._t = float(t)
