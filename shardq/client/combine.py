"""Flat combining of single calls (the threaded router's): threads whose single enqueue or
ack meets its shard's first lane taken hand their item to one leader, which sends every item
waiting as one request and hands each caller its own outcome.

A crowd of threads on one router then costs the shard one request per round, not one per
thread (the batch path: a fifth of the shard's Python a job), and the kernel one connection's
reads. A round carries what queued while the last was out, so it grows with the load, as a
group commit does; a thread alone never waits for one.

The guarantee is each caller's: it gets its item's outcome (a value or the error raised),
exactly as if it had made its own call. What a round means on the wire (one request, its
session, the re-send after a break, a refusal of the whole split item by item) is the
``send`` function's (:class:`~.router.Router`). A leader serves one round and hands the lead
to the first thread still waiting, so no caller serves others for long; :data:`LEADERS` rounds
may be out at once.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .. import limits
from ..errors import OutcomeUnknown, ShardUnavailable
from .channel import MERGE_BYTES_MAX  # a round's body bytes, as a merged request's (the asyncio client's)

LEADERS = 2  # rounds of one kind out at once to one shard: the second overlaps the first's fsync


class _Slot:
    """One caller's item and, once its round ends, its outcome. ``lock`` is held until then
    (or until the caller is made leader): the cheapest sleep and wake-up CPython has."""

    __slots__ = ("item", "size", "lock", "outcome", "lead")

    def __init__(self, item: Any, size: int) -> None:
        self.item, self.size = item, size
        self.lock = threading.Lock()
        self.lock.acquire()
        self.outcome: Any = None
        self.lead = False


class Combiner:
    """Combines the single calls of one kind to one shard. ``send(items)``: one request
    carrying ``items``, returning one outcome each (a value, or an exception in its place);
    an exception it raises is every item's. ``leaders``: rounds out at once."""

    def __init__(self, send: Callable[[list[Any]], list[Any]], leaders: int = LEADERS) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._waiting: list[_Slot] = []
        self._leaders, self._leaders_max = 0, leaders
        self.rounds = 0  # rounds sent (tests, probes)

    def call(self, item: Any, size: int = 0, timeout: float | None = None) -> Any:
        """``item``'s outcome: its value, or its error raised. ``size``: its body bytes.
        ``timeout``: how long it may wait for a round to take it; past that, still unsent, it
        leaves with ShardUnavailable (once taken, its round's own deadlines end it)."""
        slot = _Slot(item, size)
        with self._lock:
            if self._leaders < self._leaders_max:
                self._leaders += 1
                slot.lead = True
            else:
                self._waiting.append(slot)
        if not slot.lead:
            if not self._wait(slot, timeout):
                raise ShardUnavailable(f"no round took this call within {timeout:.1f} s; it was not sent")
            if not slot.lead:
                return _result(slot.outcome)
        self._round(slot)
        return _result(slot.outcome)

    def _wait(self, slot: _Slot, timeout: float | None) -> bool:
        """Sleep until the slot's round ends or the lead is handed to it: False when
        ``timeout`` passed first with its item unsent (it leaves the queue)."""
        try:
            if slot.lock.acquire(timeout=-1 if timeout is None else timeout):
                return True
            with self._lock:
                if not slot.lead and slot in self._waiting:
                    self._waiting.remove(slot)
                    return False
            slot.lock.acquire()  # taken into a round meanwhile, or given the lead: it comes
            return True
        except BaseException:  # (KeyboardInterrupt): leave without stranding the others
            with self._lock:
                if not slot.lead and slot in self._waiting:
                    self._waiting.remove(slot)  # not sent: nothing to undo
                    raise
            if slot.lead:
                self._round(slot)  # the lead came meanwhile: serve it, then leave
            raise

    def _round(self, lead: _Slot) -> None:
        """Send the leader's item and the first waiting ones as one request; hand the lead
        on, then the outcomes."""
        with self._lock:
            batch = _take(lead, self._waiting)
            self._waiting = self._waiting[len(batch) - 1:]
        outcomes: list[Any] | None = None
        try:
            outcomes = self._send([s.item for s in batch])
        except Exception as e:  # noqa: BLE001 - every item's, raised in each caller
            outcomes = [e] * len(batch)
        finally:
            if outcomes is None:  # the leader was interrupted mid-round
                outcomes = [OutcomeUnknown("the call was interrupted; it may have been applied")] * len(batch)
            self.rounds += 1
            with self._lock:
                nxt = self._waiting.pop(0) if self._waiting else None
                if nxt is None:
                    self._leaders -= 1
                else:
                    nxt.lead = True
            if nxt is not None:  # first: its round's send overlaps the wake-ups below
                nxt.lock.release()
            for s, outcome in zip(batch, outcomes):
                s.outcome = outcome
                if s is not lead:
                    s.lock.release()


def _take(lead: _Slot, waiting: list[_Slot]) -> list[_Slot]:
    """The leader's slot and the first waiting ones that fit one request with it."""
    size = lead.size
    for i, s in enumerate(waiting):
        size += s.size
        if i + 1 >= limits.BATCH_JOBS_MAX or size > MERGE_BYTES_MAX:
            return [lead, *waiting[:i]]
    return [lead, *waiting]


def _result(outcome: Any) -> Any:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
