"""How a caller alone on its connection waits for a reply that is about to come.

Sleeping in ``poll`` until a reply arrives costs a short call more than the wait itself:
the wake-up (the scheduler's work and, on a virtual machine, the host waking an idle
virtual CPU) and caches gone cold by the time the caller runs again. Measured on 2-CPU
VMs, a lone caller's enqueue took 0.7 times as long, and a lease and its ack 0.6 times,
when it polled its socket without sleeping (docs/performance.md, "Busy-polling for the
reply"). So a lone call on the router's lane (:meth:`~shardq.client.connection.Lane.call`)
polls without sleeping, yielding the CPU between polls, for up to a budget before it
sleeps, as the kernel's ``busy_read`` does for sockets of network cards.

A shard's loop does the same before it sleeps for its next request
(``service.busy_poll_us``): a lone client's next request comes a round trip after the
last reply, and the shard that wakes for it pays what the caller did. So it polls only
after an iteration that sent a reply to a connection of role "client" (a "service" one,
serve's own, does not poll, and its next request comes late: shardq/shard/process.py). The
SQS listener connects as such a part of serve (role "service", while ``[sqs_api] processes``
is at most 8; more processes connect as clients: shardq/sqs_api/server.py), so a shard does
not poll after answering it; the listener's event loop polls instead, the same way, for a
lone request's reply from a shard and for a lone client's next request
(:mod:`shardq.service.spin_selector`).

Guarantee: a wait spends at most ``budget_us`` microseconds of CPU polling (the shard's loop,
through :meth:`BusyPoll.spin_if_wanted`, one look more before the budget's clock starts), and none while
recent waits (a moving average) took longer than the budget, so a slow disk, a loaded
machine or a client that pauses between calls turns it off by itself, and it comes back
on when they stop; a process allowed only one CPU never polls (the other side could not
run while it did). Only the wait is changed: what is sent, and when a reply or a request
counts as received, are not.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sized
from typing import TypeVar

from .clock import Clock, SystemClock
from .errors import InvalidConfig

T = TypeVar("T")  # what a spin's poll reports

#: The default budget: about one fdatasync of a small record on the VMs measured, so that an
#: enqueue's reply usually comes within it.
BUSY_POLL_US_DEFAULT = 300
#: The largest budget accepted: beyond this a caller spends more CPU than most waits take.
BUSY_POLL_US_MAX = 10_000
#: Weight of the newest call in the moving averages: about the last 8 calls count.
_NEWEST = 0.125
#: Above this share of calls finding the connection in use, nobody polls without sleeping.
_SHARED_MAX = 0.25


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class BusyPoll:
    """The busy-poll policy of one connection (used by one caller at a time: the one on
    the lane), or of one shard's loop. ``clock``: its monotonic
    reading times the spin; a real one (the default), since a spin waits in real time."""

    __slots__ = ("budget_s", "_average_s", "_shared", "_clock")

    def __init__(self, budget_us: int = BUSY_POLL_US_DEFAULT, clock: Clock | None = None):
        if type(budget_us) is not int or not 0 <= budget_us <= BUSY_POLL_US_MAX:
            raise InvalidConfig(f"busy_poll_us must be an int from 0 (off) to {BUSY_POLL_US_MAX}, "
                                f"got {budget_us!r}")
        self.budget_s = budget_us / 1e6 if usable_cpus() > 1 else 0.0
        self._average_s = 0.0
        self._shared = 0.0  # moving share of recent calls that found the connection in use
        self._clock = clock or SystemClock()

    def wanted(self) -> bool:
        """Poll without sleeping for this call: on, recent replies came within the budget,
        and recent callers mostly found the connection to themselves (many threads on one
        connection wait for one another's replies anyway, and a polling thread would take
        the interpreter's lock from the ones with work to do)."""
        return 0.0 < self.budget_s and self._average_s <= self.budget_s and self._shared <= _SHARED_MAX

    def note(self, took_s: float) -> None:
        """The wait polled for took ``took_s`` seconds (a lone call's reply after its request
        was written; a shard's next request after its last iteration). A wait longer than
        twice the budget counts as twice the budget: long enough to turn polling off once
        most waits are, not so long that one idle minute keeps it off for the next burst."""
        self._average_s += (min(took_s, 2 * self.budget_s) - self._average_s) * _NEWEST
        if self._shared:  # (a shard's loop never shares: 0.0 for good)
            self._shared -= self._shared * _NEWEST

    def note_shared(self) -> None:
        """A call found the connection in use by another thread (it takes the general path).
        Several threads may note at once: a lost update only nudges a heuristic."""
        self._shared += (1.0 - self._shared) * _NEWEST

    def spin_if_wanted(self, poll: Callable[[int], list[T]], limit_s: float | None = None) -> list[T]:
        """:meth:`spin` with no ``others`` if :meth:`wanted`, else [] at once: one call for a
        loop that asks on every iteration (the shard's). Its first ``poll(0)`` comes before
        the spin's clock starts, so a wait that finds something ready reads no clock; after
        a miss it yields the CPU, as between any two looks, and the spin keeps to the budget."""
        budget = self.budget_s
        # wanted()'s test written out: the shard's loop asks on every iteration (one call less)
        if 0.0 < budget and self._average_s <= budget and self._shared <= _SHARED_MAX:
            ready = poll(0)
            if ready:
                return ready
            os.sched_yield()  # (not two polls back to back: the spin's first comes next)
            return self.spin(poll, (), limit_s)
        return []

    def spin(self, poll: Callable[[int], list[T]], others: Sized = (),
             limit_s: float | None = None) -> list[T]:
        """Call ``poll(0)`` (a ``select.poll`` or ``epoll`` object's, or a selector's ``select``) until it reports
        something ready, and return what it reported; or return [] once the budget (or
        ``limit_s``, if shorter) is spent or ``others`` (a connection's pending requests of
        other threads) is no longer empty: the caller is no longer alone, and sleeps as the
        general path's callers do. Between calls it yields the CPU, so that any other
        runnable thread or process goes first."""
        clock = self._clock.monotonic
        end = clock() + (self.budget_s if limit_s is None else min(self.budget_s, limit_s))
        while True:
            ready = poll(0)
            if ready:
                return ready
            if others or clock() >= end:
                return []
            os.sched_yield()
