"""The consumer policy: what a worker does with a delivery once it has run, decided once.

No I/O, no clock, no threads: each call takes what it needs (an outcome, a lease, ``now``)
and says what to send; the only side effect is a log line on logger ``shardq.worker``. The
worker core (:mod:`shardq.consumer.core`) asks it, whichever runner executes the core's
effects (threads, processes, asyncio). Written once, the rules cannot drift apart between
runners, and drift shows in failure handling first (docs/guarantees.md).

* :meth:`Policy.settle`: an outcome becomes an ack (DONE, DUPLICATE), a nack with the
  handler's delay (RETRY) or with full-jitter backoff (FAILED; no delay on the queue's last
  delivery, which dead-letters it), a bury (BURY; a nack with no delay on a queue that
  cannot bury), or nothing (a failure or a rollback after the lease was lost, or a lease
  expired before its run: the queue redelivers the job); a run whose effect is done is
  acked even after its lease was seen lost (a late ack: it deletes the job unless it was
  leased again);
* :meth:`Policy.may_commit`: the lease check before a commit, with the commit margin;
* :meth:`Policy.reported`: a finished job's reports (``ctx.report``: an arrival at a
  barrier, a kept result) go before its ack; what their answers mean for that ack;
* :meth:`Policy.answer` and :class:`Outbox`: an ack, nack or bury that met
  ``ShardUnavailable`` is kept and retried, after each :class:`UnavailableBackoff` wait,
  until it lands or its lease's deadline passes;
* an exception around the handler (the idempotency store at BEGIN, the claim, COMMIT or
  ROLLBACK; a lock timeout; a lost connection) is a failed attempt with its error text
  (:func:`~.handling.failed`), retried with backoff like a handler's failure (:meth:`Policy.settle`),
  never a job left to expire silently;
* :class:`Progress`: the progress lines (every N jobs, every N seconds, a last one);
* :class:`Burst`: ``--burst``, when a worker's queues are drained and it may return.
"""
from __future__ import annotations

import enum
import logging
import math
import random
import threading
from typing import Any, Generic, NamedTuple, TypeVar

from .. import limits
from ..limits import LOG_EVERY_S_MAX
from ..errors import Cancelled, InvalidConfig, JobGone, LeaseLost, ShardUnavailable
from ..types import Lease
from .handling import BURY, DONE, EXPIRED, FAILED, LOST, RETRY, Outcome, backoff_delay, cut_text, error_text

log = logging.getLogger("shardq.worker")
J = TypeVar("J")  # what an Outbox keeps with each settlement: the runner's job

COMMIT_MARGIN_S = 1.0            # commit only with this much lease left (at most 10% of it)
UNAVAILABLE_BACKOFF_S_MIN = 0.1  # after ShardUnavailable, wait this long, doubling ...
UNAVAILABLE_BACKOFF_S_MAX = 5.0  # ... up to this



class SettleKind(enum.StrEnum):
    """What to tell the queue about one delivery (a str: it logs as its value)."""

    ACK = "ack"
    NACK = "nack"
    BURY_NOW = "bury"
    NOTHING = "nothing"


ACK, NACK, BURY_NOW, NOTHING = SettleKind.ACK, SettleKind.NACK, SettleKind.BURY_NOW, SettleKind.NOTHING


class Counter(enum.StrEnum):
    """A ``WorkerStats`` counter; its value is the field's name."""

    LEASED = "leased"
    SUCCEEDED = "succeeded"
    DUPLICATES = "duplicates"
    FAILED = "failed"
    LOST = "lost"
    EXPIRED = "expired"
    RELEASED = "released"
    ABANDONED = "abandoned"
    UNAVAILABLE = "unavailable"


class Settle(NamedTuple):
    """One delivery's settlement. ``counter`` is the ``WorkerStats`` field it counts under:
    an ack counts when it lands (and as ``lost`` if it never does); anything else counts
    at once, when it is decided."""

    op: SettleKind
    counter: Counter
    delay_s: float = 0.0      # NACK: when the job is visible again
    error: str | None = None  # NACK, BURY_NOW: the job's error text

    @property
    def counted_at_once(self) -> bool:
        return self.op != ACK


class Answer(NamedTuple):
    """What the queue's answer to a settlement means: ``retry`` later (the shard was
    unavailable: keep it in the outbox), else settled, counting ``counter`` now if set."""

    retry: bool
    counter: Counter | None = None


class Policy:
    """The rules of one worker. ``configure`` with the queue's config before use."""

    def __init__(self, *, backoff_base_s: float, backoff_cap_s: float, rng: random.Random,
                 can_bury: bool = True):
        self.backoff_base_s, self.backoff_cap_s = float(backoff_base_s), float(backoff_cap_s)
        self.rng = rng
        self.can_bury = can_bury
        self.visibility_s = limits.VISIBILITY_TIMEOUT_S_DEFAULT
        self.max_deliveries = limits.MAX_DELIVERIES_DEFAULT

    def configure(self, queue_config: dict[str, Any]) -> None:
        """Take the queue's lease length and delivery limit (the queue's defaults if absent)."""
        self.visibility_s = float(queue_config.get("visibility_timeout", limits.VISIBILITY_TIMEOUT_S_DEFAULT))
        self.max_deliveries = int(queue_config.get("max_deliveries", limits.MAX_DELIVERIES_DEFAULT))

    # ------------------------------------------------------------------ before the commit
    def may_commit(self, lost: bool, deadline: float, now: float) -> bool:
        """The lease check right before a commit: no heartbeat saw the lease lost, and more
        than the commit margin, ``min(1 s, 10% of the lease)``, is left. Local knowledge
        only: the queue expires a lease at its stored deadline and never earlier."""
        return not lost and now < deadline - min(COMMIT_MARGIN_S, 0.1 * self.visibility_s)

    # ------------------------------------------------------------------ after the run
    def settle(self, outcome: Outcome, error: str | None, delay: float | None, lease: Lease, *,
               lost: bool) -> Settle:
        """What to send for one run's ``(outcome, error, delay)``. ``lost``: a heartbeat
        saw the lease lost (or the commit margin passed): a failure sends nothing, the
        queue redelivers the job and the redelivery decides; a run whose effect is done
        (DONE, DUPLICATE) is acked all the same, a late ack, which deletes the job while
        nobody leased it again (docs/guarantees.md) and else gets LeaseLost."""
        if outcome == EXPIRED:
            log.warning("job %s attempt %d: lease expired before it started; not running it",
                        lease.job_id, lease.attempt)
            return Settle(NOTHING, Counter.EXPIRED)
        if outcome in (FAILED, RETRY, BURY):
            if lost:
                return Settle(NOTHING, Counter.FAILED)
            if outcome == BURY:
                if self.can_bury:
                    return Settle(BURY_NOW, Counter.FAILED, 0.0, error)
                log.warning("job %s: this queue cannot dead-letter early; retrying it until "
                            "max_deliveries instead", lease.job_id)
                return Settle(NACK, Counter.FAILED, 0.0, error)
            if outcome == RETRY and delay is not None:
                seconds = _seconds(delay)
                if seconds is not None:
                    return Settle(NACK, Counter.FAILED, max(0.0, min(seconds, limits.DELAY_S_MAX)), error)
                # Retry() refuses such a delay; one set on it afterwards (or by a subclass) is
                # no reason to end the worker: this run failed, as with any error of the task's
                shown = repr(delay) if len(repr(delay)) <= 60 else repr(delay)[:57] + "..."
                log.warning("job %s attempt %d: Retry's delay_s %s is not a number of seconds: "
                            "retried as a failure instead", lease.job_id, lease.attempt, shown)
                first, nl, rest = (error or "retry requested").partition("\n")
                error = cut_text(f"{first} (Retry's delay_s {shown} is not a number of seconds: "
                                 f"retried as a failure){nl}{rest}")
            if lease.attempt >= self.max_deliveries:
                log.warning("job %s failed its last delivery (%d of %d); the queue dead-letters it",
                            lease.job_id, lease.attempt, self.max_deliveries)
                return Settle(NACK, Counter.FAILED, 0.0, error)
            return Settle(NACK, Counter.FAILED, backoff_delay(lease.attempt, self.backoff_base_s,
                                                        self.backoff_cap_s, self.rng), error)
        if outcome == LOST:
            log.warning("job %s attempt %d: lease lost; not acking (rolled back)", lease.job_id, lease.attempt)
            return Settle(NOTHING, Counter.LOST)
        if lost:  # its effect is done: a late ack deletes the job unless it was leased again
            log.warning("job %s attempt %d: its lease ended while it ran; acking late (nothing changes "
                        "if it was leased again)", lease.job_id, lease.attempt)
        return Settle(ACK, Counter.SUCCEEDED if outcome == DONE else Counter.DUPLICATES)

    def reported(self, settle: Settle, lease: Lease, exc: BaseException | None) -> Settle | None:
        """What the answer to one of a finished job's reports (``ctx.report``: an arrival
        at a barrier, a kept result; made before the job's ack ``settle``) means: None,
        retry it (ShardUnavailable: the job waits in the outbox, its ack unsent, until the
        report lands or the lease ends); else what to send for the job instead of ``settle``.

        ``exc`` None: it landed (an arrival answered ``"repeated"`` had landed before), so
        ``settle`` stands. LeaseLost or JobGone: the lease is gone (a result is fenced like
        an ack); nothing is sent, the queue redelivers the job, and its redelivery reports
        again (skipped as a duplicate with an idempotency store). Any other error (the
        barrier refused the arrival, the callback's queue is full): a failed attempt, nacked
        with backoff like a handler's failure, so its dead letter says why."""
        if exc is None:
            return settle
        if isinstance(exc, ShardUnavailable):
            return None
        if isinstance(exc, (LeaseLost, JobGone)):
            log.warning("job %s attempt %d: lease lost before its report landed (%s); not acking",
                        lease.job_id, lease.attempt, error_text(exc))
            return Settle(NOTHING, Counter.LOST)
        log.warning("job %s attempt %d: its report was refused after its effect committed: %s",
                    lease.job_id, lease.attempt, error_text(exc))
        return self.settle(FAILED, error_text(exc), None, lease, lost=False)

    def answer(self, settle: Settle, lease: Lease, exc: BaseException | None) -> Answer:
        """The queue answered ``settle`` with ``exc`` (None: it landed).

        ShardUnavailable (OutcomeUnknown included) -> retry later: a retry of a call that
        did land gets LeaseLost or JobGone, which settle it. JobGone to an ack: an earlier
        try landed. LeaseLost (or any other error): the lease is gone; an ack counts as
        ``lost`` and the queue redelivers the job (with a store, the redelivery is skipped
        and acked)."""
        if exc is None:
            return Answer(False, settle.counter if settle.op == ACK else None)
        if isinstance(exc, ShardUnavailable):
            return Answer(True)
        if settle.op == ACK:
            if isinstance(exc, JobGone):
                return Answer(False, settle.counter)
            if isinstance(exc, Cancelled):  # (the ack deleted it: never delivered again)
                log.info("job %s: cancelled while it ran; removed, not redelivered", lease.job_id)
            else:
                log.warning("job %s: ack failed (%s); the queue will redeliver it", lease.job_id, error_text(exc))
            return Answer(False, Counter.LOST)
        if isinstance(exc, LeaseLost):
            log.info("job %s: %s after the lease was lost", lease.job_id, settle.op)
        else:
            log.warning("job %s: %s failed (%s); its lease will expire", lease.job_id, settle.op,
                        error_text(exc))
        return Answer(False)


def _seconds(delay: Any) -> float | None:
    """A Retry's ``delay_s`` as seconds (a negative one or one past a year is clamped by the
    caller), or None if it is no number: not a bool, not a str, not NaN."""
    if isinstance(delay, (bool, str, bytes)):
        return None
    try:
        seconds = float(delay)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isnan(seconds) else seconds


class Outbox(Generic[J]):
    """Settlements that met an unavailable shard, each with the lease it settles. The
    driver retries them after each backoff wait; :meth:`take` gives up those whose lease
    has ended (the queue redelivers the job)."""

    def __init__(self) -> None:
        self._items: list[tuple[J, Settle, Lease]] = []

    def put(self, job: J, settle: Settle, lease: Lease) -> None:
        self._items.append((job, settle, lease))

    def __len__(self) -> int:
        return len(self._items)

    def take(self, now: float) -> tuple[list[tuple[J, Settle]], list[tuple[J, Counter | None]]]:
        """Empty the outbox: ``(to retry, given up)``; a given-up job comes with the counter
        it now counts under (``lost`` for an ack; a nack or bury was counted already)."""
        items, self._items = self._items, []
        retry: list[tuple[J, Settle]] = []
        given_up: list[tuple[J, Counter | None]] = []
        for job, settle, lease in items:
            if now < lease.deadline:
                retry.append((job, settle))
            else:
                log.warning("job %s: gave up %s after the lease ended", lease.job_id, settle.op)
                given_up.append((job, Counter.LOST if settle.op == ACK else None))
        return retry, given_up


class UnavailableBackoff:
    """How long a driver waits after ShardUnavailable before its next try at the queue:
    ``UNAVAILABLE_BACKOFF_S_MIN`` doubling to ``UNAVAILABLE_BACKOFF_S_MAX``; an answer
    from the queue resets it. ``s`` is 0.0 while nothing failed."""

    def __init__(self) -> None:
        self.s = 0.0

    def failed(self) -> float:
        self.s = min(UNAVAILABLE_BACKOFF_S_MAX, max(UNAVAILABLE_BACKOFF_S_MIN, self.s * 2))
        return self.s

    def reset(self) -> None:
        self.s = 0.0

    @property
    def retry_s(self) -> float:
        """How long to wait before retrying what met the outage (the outbox): the current
        backoff, at least the minimum even if another call has answered meanwhile."""
        return max(self.s, UNAVAILABLE_BACKOFF_S_MIN)




class Progress:
    """When a worker logs its progress, and what the line says: every ``every_jobs``
    finished jobs, and every ``every_s`` seconds in which at least one job finished (an
    idle worker stays quiet); :meth:`final` sums up a run when the worker returns.

    Both limits are checked here, once for every driver: ``every_jobs`` an int >= 1,
    ``every_s`` a number in (0, LOG_EVERY_S_MAX]; anything else is :class:`InvalidConfig`."""

    def __init__(self, every_jobs: int, every_s: float, now: float, name: str = ""):
        check_progress(every_jobs, every_s)
        self.every_jobs, self.every_s, self.name = every_jobs, float(every_s), name
        self.n, self.t0, self.start = 0, now, now

    def counted(self, stats: Any, in_flight: int, now: float) -> None:
        """One more job finished; log a line if one is due."""
        self.n += 1
        if self.n >= self.every_jobs:
            self._line(stats, in_flight, now)

    def tick(self, stats: Any, in_flight: int, now: float) -> None:
        """Called by the driver's loop now and then: log a line if ``every_s`` passed
        since the last one and a job finished meanwhile."""
        if self.n and now - self.t0 >= self.every_s:
            self._line(stats, in_flight, now)

    def final(self, stats: Any, why: str, now: float) -> None:
        """The run is over (``why``: stopped, or the queues are empty)."""
        elapsed = now - self.start
        handed_back = "".join(f"; {n} {what}" for n, what in (
            (stats.released, "released (not started)"),
            (stats.abandoned, "abandoned (running when the grace period ended)")) if n)
        log.info("%s%s after %.1fs: %s%s", self._prefix(), why, elapsed, _totals(stats), handed_back)

    def _line(self, stats: Any, in_flight: int, now: float) -> None:
        elapsed = now - self.t0
        log.info("%s%d jobs in %.1fs (%.1f/s); total %s; in flight %d", self._prefix(), self.n, elapsed,
                 self.n / elapsed if elapsed > 0 else 0.0, _totals(stats), in_flight)
        self.n, self.t0 = 0, now

    def _prefix(self) -> str:
        return f"queue {self.name}: " if self.name else ""


def check_progress(every_jobs: object, every_s: object) -> None:
    """The progress limits (:class:`Progress`): InvalidConfig unless ``every_jobs`` is an
    int >= 1 and ``every_s`` a number in (0, LOG_EVERY_S_MAX]."""
    if isinstance(every_jobs, bool) or not isinstance(every_jobs, int) or every_jobs < 1:
        raise InvalidConfig(f"log_every must be an int >= 1, not {every_jobs!r}")
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) \
            or not 0 < every_s <= LOG_EVERY_S_MAX:
        raise InvalidConfig(f"log_every_s must be a number of seconds in (0, {LOG_EVERY_S_MAX:g}], "
                            f"not {every_s!r}")


def _totals(stats: Any) -> str:
    return (f"{stats.succeeded} ok, {stats.duplicates} duplicate, {stats.failed} failed, "
            f"{stats.lost} lost, {stats.expired} expired")


class Burst:
    """``--burst``: when the workers of one process are done, shared by every driver.

    A worker is done when its queues are *drained*: for every queue, a dequeue asked while
    that queue's worker held no job (none running, none unsettled: every ack, nack, bury
    and report answered, its outbox empty) found no job to lease, and no worker of the
    group has held or leased a job since that dequeue was asked. The last clause covers a
    job of one queue that sends a job to another: its worker is busy until the job is
    settled, which makes every earlier "found nothing" stale, so each queue is asked again.

    "No job to lease" is what a dequeue sees: jobs delayed and not yet due (a ``delay``,
    a retry's backoff), jobs waiting behind their key's head, jobs held back by a limit or
    a paused queue do not count, as RQ's burst mode ignores scheduled jobs; they run at
    the next start. Jobs other workers hold do not count either.

    Once done, it stays done: each worker returns as soon as it holds no job, leasing no
    more. One object serves every worker of a process (a lock guards it: the drivers run
    in threads of their own)."""

    def __init__(self, queues: Any):
        self._lock = threading.Lock()
        self._epoch = 0
        self._empty: dict[str, int | None] = {q: None for q in queues}
        if not self._empty:
            raise InvalidConfig("burst: no queue to drain")
        self._done = False

    def asking(self) -> int:
        """Call right before a dequeue: the token to pass to :meth:`answered`."""
        with self._lock:
            return self._epoch

    def answered(self, queue: str, token: int, held: int, found: int) -> bool:
        """A dequeue of ``queue`` asked with ``token`` while its worker held ``held``
        jobs found ``found``. Returns whether the group is done."""
        with self._lock:
            if held or found:
                self._epoch += 1
                self._empty[queue] = None
            else:
                self._empty[queue] = token
            if not self._done and all(e == self._epoch for e in self._empty.values()):
                self._done = True
                log.info("burst: %s drained; exiting once every job is settled",
                         ", ".join(sorted(self._empty)))
            return self._done

    def busy(self, queue: str) -> None:
        """``queue``'s worker holds a job and asked nothing this turn."""
        with self._lock:
            self._epoch += 1
            self._empty[queue] = None

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done


def burst_for(burst: Any, queue: str) -> Burst | None:
    """A driver's ``burst`` argument: False/None (work until stopped), True (this queue
    alone), or a :class:`Burst` shared with other workers."""
    if burst is None or burst is False:
        return None
    if burst is True:
        return Burst([queue])
    if isinstance(burst, Burst):
        return burst
    raise InvalidConfig(f"burst must be a bool or a Burst, not {type(burst).__name__}")
