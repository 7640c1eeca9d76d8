"""The consumer policy: what a worker does with a delivery once it has run, decided once.

No I/O, no clock, no threads: each call takes what it needs (an outcome, a lease, ``now``)
and says what to send; the only side effect is a log line on logger ``shardq.worker``. The
thread and process runners (:class:`~shardq.consumer.worker.Worker`) and the asyncio runner
(:class:`~shardq.consumer.aioworker.AsyncWorker`) are drivers over it: they make the queue
calls, wait, and report the answers back. Written once, the rules cannot drift apart
between drivers, and drift shows in failure handling first (docs/guarantees.md).

* :meth:`Policy.settle`: an outcome becomes an ack (DONE, DUPLICATE), a nack with the
  handler's delay (RETRY) or with full-jitter backoff (FAILED; no delay on the queue's last
  delivery, which dead-letters it), a bury (BURY; a nack with no delay on a queue that
  cannot bury), or nothing (the lease was lost or expired: the queue redelivers the job);
* :meth:`Policy.may_commit`: the lease check before a commit, with the commit margin;
* :meth:`Policy.reported`: a finished job's reports (``ctx.report``: an arrival at a
  barrier, a kept result) go before its ack; what their answers mean for that ack;
* :meth:`Policy.answer` and :class:`Outbox`: an ack, nack or bury that met
  ``ShardUnavailable`` is kept and retried, after each :class:`UnavailableBackoff` wait,
  until it lands or its lease's deadline passes;
* :meth:`Policy.failure`: an exception around the handler (the idempotency store at BEGIN,
  the claim, COMMIT or ROLLBACK; a lock timeout; a lost connection) is a failed attempt
  with its error text, retried with backoff like a handler's failure, never a job left to
  expire silently.
"""
from __future__ import annotations

import logging
import random
from typing import Any, NamedTuple

from .. import limits
from ..errors import JobGone, LeaseLost, ShardUnavailable
from ..types import Lease
from .handling import (BURY, DONE, EXPIRED, FAILED, LOST, RETRY, Context, Result, backoff_delay,
                       error_text, failure_result)

log = logging.getLogger("shardq.worker")

COMMIT_MARGIN_S = 1.0            # commit only with this much lease left (at most 10% of it)
UNAVAILABLE_BACKOFF_S_MIN = 0.1  # after ShardUnavailable, wait this long, doubling ...
UNAVAILABLE_BACKOFF_S_MAX = 5.0  # ... up to this

# What to tell the queue about one delivery.
ACK, NACK, BURY_NOW, NOTHING = "ack", "nack", "bury", "nothing"


class Settle(NamedTuple):
    """One delivery's settlement. ``counter`` is the ``WorkerStats`` field it counts under:
    an ack counts when it lands (and as ``lost`` if it never does); anything else counts
    at once, when it is decided."""

    op: str                   # ACK, NACK, BURY_NOW or NOTHING
    counter: str
    delay_s: float = 0.0      # NACK: when the job is visible again
    error: str | None = None  # NACK, BURY_NOW: the job's error text

    @property
    def counted_at_once(self) -> bool:
        return self.op != ACK


class Answer(NamedTuple):
    """What the queue's answer to a settlement means: ``retry`` later (the shard was
    unavailable: keep it in the outbox), else settled, counting ``counter`` now if set."""

    retry: bool
    counter: str | None = None


class Policy:
    """The rules of one worker. ``configure`` with the queue's config before use."""

    def __init__(self, *, backoff_base_s: float, backoff_cap_s: float, rng: random.Random,
                 can_bury: bool = True):
        self.backoff_base_s, self.backoff_cap_s = float(backoff_base_s), float(backoff_cap_s)
        self.rng = rng
        self.can_bury = can_bury
        self.visibility_s = limits.VISIBILITY_TIMEOUT_S_DEFAULT
        self.max_deliveries = limits.MAX_DELIVERIES_DEFAULT

    def configure(self, queue_config: dict) -> None:
        """Take the queue's lease length and delivery limit (the queue's defaults if absent)."""
        self.visibility_s = float(queue_config.get("visibility_timeout", limits.VISIBILITY_TIMEOUT_S_DEFAULT))
        self.max_deliveries = int(queue_config.get("max_deliveries", limits.MAX_DELIVERIES_DEFAULT))

    # ------------------------------------------------------------------ before the commit
    def may_commit(self, lost: bool, deadline: float, now: float) -> bool:
        """The lease check right before a commit: no heartbeat saw the lease lost, and more
        than the commit margin, ``min(1 s, 10% of the lease)``, is left. Local knowledge
        only: the queue expires a lease at its stored deadline and never earlier."""
        return not lost and now < deadline - min(COMMIT_MARGIN_S, 0.1 * self.visibility_s)

    def failure(self, exc: BaseException, lease: Lease, ctx: Context | None = None) -> Result:
        """The outcome of an attempt that raised ``exc``: the handler's error, or the
        store's around it. A store error (down at BEGIN, at the claim, at COMMIT or at
        ROLLBACK) is FAILED with ``"Type: message"``, so the job is nacked with backoff and
        its dead letter says why; the transaction was rolled back (or never committed)."""
        return failure_result(exc, lease, ctx, max_deliveries=self.max_deliveries)

    # ------------------------------------------------------------------ after the run
    def settle(self, outcome: str, error: str | None, delay: float | None, lease: Lease, *,
               lost: bool) -> Settle:
        """What to send for one run's ``(outcome, error, delay)``. ``lost``: a heartbeat
        saw the lease lost (or the commit margin passed): nothing is sent, the queue
        redelivers the job and the redelivery decides."""
        if outcome == EXPIRED:
            log.warning("job %s attempt %d: lease expired before it started; not running it",
                        lease.job_id, lease.attempt)
            return Settle(NOTHING, "expired")
        if outcome in (FAILED, RETRY, BURY):
            if lost:
                return Settle(NOTHING, "failed")
            if outcome == BURY:
                if self.can_bury:
                    return Settle(BURY_NOW, "failed", 0.0, error)
                log.warning("job %s: this queue cannot dead-letter early; retrying it until "
                            "max_deliveries instead", lease.job_id)
                return Settle(NACK, "failed", 0.0, error)
            if outcome == RETRY and delay is not None:
                return Settle(NACK, "failed", max(0.0, min(float(delay), limits.DELAY_S_MAX)), error)
            if lease.attempt >= self.max_deliveries:
                log.warning("job %s failed its last delivery (%d of %d); the queue dead-letters it",
                            lease.job_id, lease.attempt, self.max_deliveries)
                return Settle(NACK, "failed", 0.0, error)
            return Settle(NACK, "failed", backoff_delay(lease.attempt, self.backoff_base_s,
                                                        self.backoff_cap_s, self.rng), error)
        if outcome == LOST or lost:
            log.warning("job %s attempt %d: lease lost; not acking (%s)", lease.job_id,
                        lease.attempt, "rolled back" if outcome == LOST else outcome)
            return Settle(NOTHING, "lost")
        return Settle(ACK, "succeeded" if outcome == DONE else "duplicates")

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
            return Settle(NOTHING, "lost")
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
            log.warning("job %s: ack failed (%s); the queue will redeliver it", lease.job_id, error_text(exc))
            return Answer(False, "lost")
        if isinstance(exc, LeaseLost):
            log.info("job %s: %s after the lease was lost", lease.job_id, settle.op)
        else:
            log.warning("job %s: %s failed (%s); its lease will expire", lease.job_id, settle.op,
                        error_text(exc))
        return Answer(False)


class Outbox:
    """Settlements that met an unavailable shard, each with the lease it settles. The
    driver retries them after each backoff wait; :meth:`take` gives up those whose lease
    has ended (the queue redelivers the job)."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, Settle, Lease]] = []

    def put(self, job: Any, settle: Settle, lease: Lease) -> None:
        self._items.append((job, settle, lease))

    def __len__(self) -> int:
        return len(self._items)

    def take(self, now: float) -> tuple[list[tuple[Any, Settle]], list[tuple[Any, str | None]]]:
        """Empty the outbox: ``(to retry, given up)``; a given-up job comes with the counter
        it now counts under (``lost`` for an ack; a nack or bury was counted already)."""
        items, self._items = self._items, []
        retry: list[tuple[Any, Settle]] = []
        given_up: list[tuple[Any, str | None]] = []
        for job, settle, lease in items:
            if now < lease.deadline:
                retry.append((job, settle))
            else:
                log.warning("job %s: gave up %s after the lease ended", lease.job_id, settle.op)
                given_up.append((job, "lost" if settle.op == ACK else None))
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
