"""An in-memory stand-in for the router API the worker consumes, for worker unit tests.

Same rules as the shard state machine, in a few lines: leases carry a token and a deadline
read from a (fake) clock; ack/nack/extend with a stale token or after the deadline raise
``LeaseLost``, but for a late ack: an ack with the token of the job's lease that ran out (or
a nack of no delay ended) deletes it while nobody leased it since, as a shard's does
(docs/guarantees.md); an expired lease makes its job ready again; a job delivered
``max_deliveries`` times is dead-lettered when its lease ends (nack or expiry) or when it
would be leased again; per key, only the oldest live job can be leased (FIFO, one lease
per key). Thread-safe. Every call is recorded in ``calls`` for assertions.

``enqueue(job_id=...)`` may reuse a job id: the fake then delivers that id twice, which is
how a test stands in for "redelivered after it was processed" (a crash between the commit
and the ack) without a crash.

:class:`BuryingQueue` adds ``bury`` as a shard has it; :class:`PlainQueue` takes away what
SQS lacks; :class:`AsyncFacade` is the asyncio
client's API over one FakeQueue, for the asyncio runner. Which declared contracts
(shardq/client/contracts.py) each one offers, and so which path a worker takes on it, is
in the table of tests/client/test_contracts.py.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from shardq.errors import InvalidJob, JobGone, LeaseLost, ShardUnavailable
from shardq.types import DeadLetter, Lease

READY, LEASED, ACKED, DEAD = "ready", "leased", "acked", "dead"


@dataclass
class FakeJob:
    uid: int
    job_id: int
    key: str | None
    body: bytes
    queue: str
    state: str = READY
    ready_at: float = 0.0
    attempts: int = 0
    token: int = 0
    deadline: float = 0.0
    lapsed: int = 0    # the token of the lease that ran out (or a nack of no delay ended): a late ack's
    error: str | None = None
    history: list = field(default_factory=list)


class FakeQueue:
    service_id: str | None = None  # no service: an idempotency store is not bound

    def __init__(self, clock, visibility_timeout: float = 30.0, max_deliveries: int = 5):
        self.clock = clock
        self.visibility_timeout = visibility_timeout
        self.max_deliveries = max_deliveries
        self.jobs: dict[int, FakeJob] = {}     # uid -> job, in enqueue order
        self.dead: list[DeadLetter] = []
        self.calls: list[tuple] = []
        self.unavailable: dict[str, int] = {}  # op name -> how many next calls raise ShardUnavailable
        self.deliver_expired = 0               # the next N leases come with a deadline already passed
        self.closed = False
        self.max_leased = 0                    # most leases live at one time
        self.refuse_reports: str | None = None  # set: every report is refused with this text
        self.reported: list[tuple] = []        # (job_id, Report) of each report that landed
        self.progressed: list[tuple] = []      # (job_id, fraction, note) of each ctx.progress
        self._next_id = 1
        self._next_token = 1
        self._cond = threading.Condition()

    # ------------------------------------------------------------------ producer side
    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default",
                delay: float = 0.0, job_id: int | None = None) -> int:
        with self._cond:
            uid = self._next_id
            self._next_id += 1
            jid = uid if job_id is None else job_id
            self.jobs[uid] = FakeJob(uid, jid, key, body, queue, ready_at=self.clock.now() + delay)
            self._cond.notify_all()
            return jid

    # ------------------------------------------------------------------ router API
    def queue_config(self, queue: str) -> dict:
        self._maybe_fail("queue_config")
        return {"visibility_timeout": self.visibility_timeout,
                "max_deliveries": self.max_deliveries}

    def dequeue_many(self, queue: str, max_jobs: int = 1, wait: float = 1.0,
                     visibility: float | None = None) -> list[Lease]:
        self._maybe_fail("dequeue_many")
        with self._cond:
            out = self._lease(queue, max_jobs, visibility)
            if not out and wait > 0:
                # Real waiting is short: a test moves the fake clock, which notifies no one.
                self._cond.wait(min(wait, 0.01))
                out = self._lease(queue, max_jobs, visibility)
            self.calls.append(("dequeue", [lease.job_id for lease in out]))
            live = sum(1 for j in self.jobs.values() if j.state == LEASED)
            self.max_leased = max(self.max_leased, live)
            return out

    # ------------------------------------------------------------------ reports (ctx.report)
    def settle_many(self, acks, reports) -> tuple[list, list]:
        """Acks, then reports (``(lease, Report)``), each answered None or its error: a
        report meets ``unavailable["report"]`` like any op, and ``refuse_reports`` (an
        error text) refuses it; a ``put_result`` needs the lease. Landed reports are in
        ``reported`` as ``(job_id, Report)``."""
        acked: list = []
        for lease in acks:
            try:
                self.ack(lease)
                acked.append(None)
            except (ShardUnavailable, LeaseLost, JobGone) as exc:
                acked.append(exc)
        return acked, [self._report(lease, report) for lease, report in reports]

    def _report(self, lease: Lease, report) -> BaseException | None:
        try:
            self._maybe_fail("report")
        except ShardUnavailable as exc:
            return exc
        with self._cond:
            if self.refuse_reports is not None:
                self.calls.append(("refused", report.op, lease.job_id))
                return InvalidJob(self.refuse_reports)
            if report.op == "put_result":
                try:
                    self._current(lease)
                except (LeaseLost, JobGone) as exc:
                    return exc
            self.calls.append(("report", report.op, lease.job_id))
            self.reported.append((lease.job_id, report))
        return None

    def arrive(self, *args) -> str:  # the one-call path (a worker that does not collect reports)
        raise AssertionError("the worker collects reports: it never calls arrive itself")

    def put_result(self, *args) -> None:
        raise AssertionError("the worker collects reports: it never calls put_result itself")

    def progress(self, lease: Lease, fraction: float | None, note: str | None) -> None:
        with self._cond:
            self.progressed.append((lease.job_id, fraction, note))

    def barrier_values(self, shard: int, barrier: str) -> list[bytes]:
        raise AssertionError("no workflow here: no step reads a barrier's values")

    def dequeue(self, queue: str, wait: float = 1.0) -> Lease | None:
        out = self.dequeue_many(queue, max_jobs=1, wait=wait)
        return out[0] if out else None

    def ack(self, lease: Lease) -> None:
        self._maybe_fail("ack")
        with self._cond:
            job = self._lapsed(lease) or self._current(lease)
            job.state = ACKED
            job.history.append(("ack", lease.token))
            self.calls.append(("ack", lease.job_id, lease.token))
            self._cond.notify_all()

    def ack_many(self, leases: list[Lease]) -> list[Exception | None]:
        self._maybe_fail("ack_many")
        out: list[Exception | None] = []
        for lease in leases:
            try:
                self.ack(lease)
                out.append(None)
            except (LeaseLost, ShardUnavailable) as exc:
                out.append(exc)
        return out

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
             delivered: bool = True) -> None:
        self._maybe_fail("nack")
        with self._cond:
            job = self._current(lease)
            if not delivered:
                job.attempts -= 1
            self.calls.append(("nack", lease.job_id, delay, error))
            if error is not None:
                job.error = error
            job.history.append(("nack", lease.token, delay, error))
            self._end_lease(job, self.clock.now() + delay, lapsed=lease.token if delay <= 0 else 0)
            self._cond.notify_all()

    def extend(self, lease: Lease, seconds: float) -> Lease:
        self._maybe_fail("extend")
        with self._cond:
            try:
                job = self._current(lease)
            except LeaseLost:
                self.calls.append(("extend", lease.job_id, seconds, False))
                raise
            job.deadline = self.clock.now() + seconds
            self.calls.append(("extend", lease.job_id, seconds, True))
            return lease._replace(deadline=job.deadline)

    def close(self) -> None:
        self.closed = True

    # ------------------------------------------------------------------ test helpers
    def job(self, job_id: int) -> FakeJob:
        """The newest job with this id."""
        with self._cond:
            self._advance()
            return [j for j in self.jobs.values() if j.job_id == job_id][-1]

    def state(self, job_id: int) -> str:
        return self.job(job_id).state

    def ops(self, name: str) -> list[tuple]:
        with self._cond:
            return [c for c in self.calls if c[0] == name]

    # ------------------------------------------------------------------ internals
    def _maybe_fail(self, op: str) -> None:
        with self._cond:
            n = self.unavailable.get(op, 0)
            if n:
                self.unavailable[op] = n - 1
                self.calls.append(("unavailable", op))
                raise ShardUnavailable(f"fake shard down ({op})")

    def _advance(self) -> None:
        now = self.clock.now()
        for job in self.jobs.values():
            if job.state == LEASED and job.deadline <= now:
                job.history.append(("expired", job.token))
                self._end_lease(job, now, lapsed=job.token)

    def _end_lease(self, job: FakeJob, ready_at: float, lapsed: int = 0) -> None:
        job.token = 0
        if job.attempts >= self.max_deliveries:
            self._kill(job)
        else:
            job.state, job.ready_at, job.lapsed = READY, ready_at, lapsed

    def _lapsed(self, lease: Lease) -> FakeJob | None:
        """The job a late ack of ``lease`` deletes: ready again, leased by nobody since."""
        self._advance()
        return next((j for j in self.jobs.values() if j.job_id == lease.job_id and j.state == READY
                     and j.lapsed and j.lapsed == lease.token), None)

    def _kill(self, job: FakeJob) -> None:
        job.state = DEAD
        self.dead.append(DeadLetter(job.job_id, job.key, job.body, job.queue, job.attempts,
                                    job.error))

    def _lease(self, queue: str, max_jobs: int, visibility: float | None) -> list[Lease]:
        self._advance()
        now = self.clock.now()
        vis = self.visibility_timeout if visibility is None else visibility
        heads: dict[str, int] = {}  # key -> its oldest live job
        for job in self.jobs.values():
            if job.key is not None and job.state in (READY, LEASED) and job.key not in heads:
                heads[job.key] = job.uid
        out: list[Lease] = []
        for job in self.jobs.values():
            if len(out) >= max_jobs:
                break
            if job.queue != queue or job.state != READY or job.ready_at > now:
                continue
            if job.key is not None and heads[job.key] != job.uid:
                continue
            if job.attempts >= self.max_deliveries:
                self._kill(job)
                continue
            job.state = LEASED
            job.attempts += 1
            job.token, job.lapsed = self._next_token, 0
            self._next_token += 1
            job.deadline = now + vis
            if self.deliver_expired:
                self.deliver_expired -= 1
                job.deadline = now - 1.0
            job.history.append(("lease", job.token))
            out.append(Lease(job.job_id, job.key, job.body, job.queue, job.attempts, job.token,
                             job.deadline))
        return out

    def _current(self, lease: Lease) -> FakeJob:
        self._advance()
        same = [j for j in self.jobs.values() if j.job_id == lease.job_id]
        job = next((j for j in same if j.state == LEASED and j.token == lease.token), None)
        if job is None:
            if all(j.state == ACKED for j in same):
                raise JobGone(f"job {lease.job_id} is gone")
            raise LeaseLost(f"job {lease.job_id}: lease {lease.token} is no longer current")
        if job.deadline <= self.clock.now():
            raise LeaseLost(f"job {lease.job_id}: lease {lease.token} expired")
        return job


class BuryingQueue(FakeQueue):
    """FakeQueue plus ``bury`` (dead-letter now, with the error), as a shard has it."""

    def bury(self, lease, error=None) -> None:
        self._maybe_fail("bury")
        with self._cond:
            job = self._current(lease)
            self.calls.append(("bury", lease.job_id, error))
            job.error = error
            job.token = 0
            self._kill(job)
            self._cond.notify_all()


class PlainQueue(BuryingQueue):
    """BuryingQueue with the Queue protocol's calls only, as SQS has them: no calls about a
    job (results, progress, barriers) and no ``settle_many`` (a method set to None is
    absent to ``isinstance`` against a protocol)."""

    settle_many = arrive = put_result = progress = barrier_values = None


class AsyncFacade:
    """The asyncio client's API over a FakeQueue: the same jobs, the same failures."""

    service_id = None

    def __init__(self, q: FakeQueue):
        self.q = q

    async def queue_config(self, queue: str) -> dict:
        return self.q.queue_config(queue)

    async def dequeue_many(self, queue: str, max_jobs: int = 100, wait: float = 0.0,
                           visibility: float | None = None):
        end = time.monotonic() + wait
        while True:  # never blocks the loop; a cancelled wait leaves no lease behind
            out = self.q.dequeue_many(queue, max_jobs=max_jobs, wait=0, visibility=visibility)
            if out or time.monotonic() >= end:
                return out
            await asyncio.sleep(0.002)  # the fake's poll interval (its clock notifies no one)

    async def ack(self, lease) -> None:
        self.q.ack(lease)

    async def nack(self, lease, delay: float = 0.0, error: str | None = None, *,
                   delivered: bool = True) -> None:
        self.q.nack(lease, delay=delay, error=error, delivered=delivered)

    async def bury(self, lease, error: str | None = None) -> None:
        self.q.bury(lease, error)

    async def extend(self, lease, seconds: float):
        return self.q.extend(lease, seconds)

    async def ack_many(self, leases):
        return self.q.ack_many(leases)

    async def settle_many(self, acks, reports):
        return self.q.settle_many(acks, reports)

    async def report_many(self, reports):
        return self.q.settle_many([], reports)[1]

    async def close(self) -> None:
        pass  # the test owns the FakeQueue


class AsyncTask:
    """A handler the asyncio runner takes as an async task with no task registry: a
    subclass writes ``run_async``; a thread never runs it."""

    is_async = True

    def __call__(self, ctx):
        raise AssertionError("an async task: never run in a thread")

    def task_of(self, body):
        return self

    def resolve(self, ctx):
        return self, [], {}
