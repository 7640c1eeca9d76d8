"""An event loop's selector that busy-polls while what it waits for is about to come: how the
SQS listener's loop waits (shardq/sqs_api/server.py).

A lone SendMessage wakes the listener's loop twice: for the client's request, and for the
shard's reply to the enqueue it sent. A wake-up from a sleep in ``epoll_wait`` costs what a
lone client's costs (:mod:`shardq.busypoll`): the scheduler's work, an idle virtual CPU woken
by its host, cold caches. So before each wait that may sleep, :meth:`SpinSelector.select`
asks its owner's ``policy()`` which :class:`~shardq.busypoll.BusyPoll` governs this wait (the
listener: the one for a shard's reply while one request is answered alone, the one for the
next request right after an answer; None under load), and while that policy's recent waits
were short it polls without sleeping (``select(0)``, yielding the CPU between polls) for up
to the budget before it sleeps.

Guarantee: only the wait changes, never what is ready or when a callback runs: a wait polls
at most the budget and at most its ``timeout`` (the loop's next timer); a wait of 0 (ready
callbacks) and a wait whose policy is None never poll; and a policy turns itself off while
its waits take longer than the budget (a long poll waiting for a message, a slow disk, a
loaded machine)."""
from __future__ import annotations

import selectors
from collections.abc import Callable

from ..busypoll import BusyPoll
from ..clock import Clock, SystemClock


class SpinSelector(selectors.DefaultSelector):
    """The platform's default selector (epoll on Linux) whose ``select`` busy-polls first
    under the policy ``policy()`` returns for this wait (None: sleep at once); ``clock``
    times the waits (a real one: a spin waits in real time)."""

    def __init__(self, policy: Callable[[], BusyPoll | None], clock: Clock | None = None):
        super().__init__()
        self.policy = policy
        self._monotonic = (clock or SystemClock()).monotonic

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._select(timeout)
        busy = self.policy()
        if busy is None:
            return self._select(timeout)
        start = self._monotonic()
        ready = busy.spin(self._select, (), timeout) if busy.wanted() else []
        if not ready:
            left = None if timeout is None else max(0.0, timeout - (self._monotonic() - start))
            ready = self._select(left)
        busy.note(self._monotonic() - start)
        return ready

    def _select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        return super().select(timeout)
