"""``AsyncQueue.consume``: the loop that yields leases, holding at most ``concurrency`` that
are not yet settled (acked, nacked, buried or expired) through its client. A lease counts
until its current deadline: one extended through the client (``extend``, a heartbeat)
counts until the deadline the extend set, and while an extend is out it counts on, since
its reply may move the deadline."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..clock import SystemClock
from ..types import Lease

if TYPE_CHECKING:
    from .aio import AsyncQueue

_now = SystemClock.now


def settled(consumers: list[Consumer], leases: list[Lease]) -> None:
    """``leases`` were acked, nacked or buried through the client of ``consumers``: the
    loops holding them hold them no more."""
    for c in consumers:
        for lease in leases:
            c.settled(lease)


def extending(consumers: list[Consumer], lease: Lease) -> Callable[[float | None], None] | None:
    """An extend of ``lease`` is sent through the client of ``consumers``: the loops holding
    it count it on until the returned function is told the deadline the extend set (None:
    it failed, and the deadline stands); None when no loop holds it."""
    try:
        ref = (lease.job_id, lease.token)
        holding = [c for c in consumers if c.extending_one(ref)]
    except (AttributeError, TypeError):  # no lease (the call refuses it), or an unhashable part
        return None
    if not holding:
        return None

    def extended(deadline: float | None) -> None:
        for c in holding:
            c.extended(ref, deadline)
    return extended


class Consumer:
    """State of one ``consume()`` loop."""

    def __init__(self, q: AsyncQueue, queue: str, concurrency: int, wait: float, visibility: float | None):
        self.q, self.queue, self.concurrency = q, queue, concurrency
        self.wait, self.visibility = wait, visibility
        self.held: dict[tuple[Any, ...], float] = {}   # (job_id, token) -> its current deadline
        self.extending: dict[tuple[Any, ...], int] = {}  # (job_id, token) -> its extends still out
        self.buffer: deque[Lease] = deque()
        self.freed = asyncio.Event()

    def unhanded(self) -> list[Lease]:
        """Take the leases fetched and not yet handed out (to release them unstarted)."""
        left, self.buffer = list(self.buffer), deque()
        return left

    def settled(self, lease: Lease) -> None:
        if self.held.pop((lease.job_id, lease.token), None) is not None:
            self.freed.set()

    def extending_one(self, ref: tuple[Any, ...]) -> bool:
        """An extend of the lease ``ref`` is sent: True if this loop holds it (then it counts
        until :meth:`extended`, even past its deadline)."""
        if ref not in self.held:
            return False
        self.extending[ref] = self.extending.get(ref, 0) + 1
        return True

    def extended(self, ref: tuple[Any, ...], deadline: float | None) -> None:
        """The extend of ``ref`` ended: it moved the lease's deadline to ``deadline`` (None:
        it failed, and the deadline stands; a lease lost meanwhile is past it)."""
        left = self.extending.pop(ref) - 1
        if left:
            self.extending[ref] = left
        if deadline is not None and ref in self.held:  # (not settled meanwhile)
            self.held[ref] = deadline
        self.freed.set()  # a wait for room looks again: its soonest deadline moved

    def _expire(self) -> float | None:
        """Forget the leases past their deadline, but one being extended (its reply tells);
        the soonest deadline of the others (None: none)."""
        now = _now()  # lease deadlines are wall-clock seconds
        extending = self.extending
        soonest = None
        for ref, deadline in list(self.held.items()):
            if ref in extending:
                continue
            if deadline <= now:
                del self.held[ref]
            elif soonest is None or deadline < soonest:
                soonest = deadline
        return soonest

    async def run(self) -> AsyncIterator[Lease]:
        q = self.q
        q._consumers.append(self)
        try:
            while True:
                if not self.buffer:
                    soonest = self._expire()
                    room = self.concurrency - len(self.held)
                    if room <= 0:
                        self.freed.clear()
                        timeout = None if soonest is None else max(0.0, soonest - _now())
                        try:  # (not wait_for: in 3.11 it loses a cancel that comes as the wait ends)
                            async with asyncio.timeout(timeout):
                                await self.freed.wait()
                        except TimeoutError:
                            pass
                        continue
                    leases = await q.dequeue_many(self.queue, max_jobs=room, wait=self.wait,
                                                  visibility=self.visibility)
                    for lease in leases:
                        self.held[(lease.job_id, lease.token)] = lease.deadline
                    self.buffer.extend(leases)
                    continue
                yield self.buffer.popleft()
        finally:
            q._consumers.remove(self)
            q._release(self.unhanded())
