"""The listener's routers: a request borrows one of its own for as long as it runs.

One :class:`~shardq.client.router.Router` shared by every request thread shares each
shard's connection too: concurrent requests queue behind one another's sends and reads, and
a reply read by another thread (a leader, or the connection's reader thread) reaches its
caller through a lock release, a thread switch per call. A caller alone on its connection
sends and reads its reply itself, with no hand-off (``ShardClient.call_solo``), as each
thread of a client with its own ``shardq.connect`` does. So each request takes a router from
a free list and gives it back when it has answered: the routers in use are as many as the
requests running at once, the most recently returned is taken first (its connections are
up), and past ``SQS_API_ROUTERS_MAX`` a request shares the one router the listener's
background work uses (long polls hold theirs for up to 20 s; the cap bounds the connections
one process holds to ``(SQS_API_ROUTERS_MAX + 1) x shards``).

Their calls do not busy-poll (``busy_poll_us = 0``): a listener's many threads share the
CPUs with the shards, and a thread spinning for its reply takes a CPU from the shard that
is to send it. They connect as clients, not as ``service`` (a shard holds 16 of those, fewer
than the routers here), so a shard still polls for their next request after answering them.
A :class:`Routers` is used where a router is: attributes not its own are those of the router
the calling thread has borrowed, or of the shared one."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import limits


class Routers:
    """Routers made by ``make()`` (lazily, at most ``most`` beside the shared one)."""

    def __init__(self, make: Callable[[], Any], most: int = limits.SQS_API_ROUTERS_MAX):
        self._make, self._most = make, most
        self.shared = make()
        self._free: list[Any] = []
        self._made: list[Any] = []
        self._lock = threading.Lock()
        self._mine = threading.local()
        self._closed = False

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[Any]:
        """A router for this thread's calls until the block ends (the shared one once
        ``most`` are out). Nested on one thread: the outer one's."""
        if getattr(self._mine, "router", None) is not None:
            yield self._mine.router
            return
        with self._lock:
            router = self._free.pop() if self._free else None
            grow = router is None and len(self._made) < self._most and not self._closed
            if grow:
                self._made.append(None)  # the place taken before the router is made, outside the lock
        if grow:
            try:
                router = self._make()
            except BaseException:
                with self._lock:
                    self._made.remove(None)
                raise
            with self._lock:
                self._made[self._made.index(None)] = router
        if router is None:  # every router out: share
            yield self.shared
            return
        self._mine.router = router
        try:
            yield router
        finally:
            self._mine.router = None
            with self._lock:
                if self._closed:
                    router.close()
                else:
                    self._free.append(router)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (copy, pickle: not a router's)
            raise AttributeError(name)
        return getattr(getattr(self._mine, "router", None) or self.shared, name)

    @property
    def made(self) -> int:
        """Routers made beside the shared one."""
        with self._lock:
            return sum(r is not None for r in self._made)

    def close(self) -> None:
        """Close the shared router and every router not borrowed now (those are closed as
        they come back)."""
        with self._lock:
            self._closed = True
            idle, self._free = self._free, []
        for r in idle:
            r.close()
        self.shared.close()
