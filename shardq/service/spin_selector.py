"""An event loop's selector that busy-polls while a reply is about to come: how the SQS
listener's loop waits for a shard's reply to a lone request (shardq/sqs_api/server.py).

A lone SendMessage wakes the listener's loop twice: for the client's request, and for the
shard's reply to the enqueue it sent. The second wake-up, from a sleep in ``epoll_wait``,
costs what a lone client's costs (:mod:`shardq.busypoll`): the scheduler's work, an idle
virtual CPU woken by its host, cold caches. So while ``wanted()`` says a reply is worth
polling for (the listener: exactly one request being answered), and the policy's recent
waits of that kind were short, :meth:`SpinSelector.select` polls without sleeping
(``select(0)``, yielding the CPU between polls) for up to the budget before it sleeps.

Guarantee: only the wait changes, never what is ready or when a callback runs: a wait with
nothing due sooner (``timeout``) polls at most the budget and at most ``timeout``; a loop
with ready callbacks (``timeout`` 0) or with several requests under way (load, where a
spin would only take CPU from the shards and the clients on the same machine) never polls;
and the policy turns itself off while the waits take longer than the budget (a long poll
waiting for a message, a slow disk, a loaded machine)."""
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
