"""The worker core: what every runner (threads, processes, asyncio) keeps and decides.

No I/O and no clock of its own (the runner's :class:`~shardq.clock.Clock` is injected):
:class:`WorkerCore` holds the jobs in hand (leased, waiting for a runner, running,
settling), the counters, the backoff after ShardUnavailable, the outbox of settlements
that met an outage, the heartbeat due times, the reports made before acks and the shutdown
grace period. Its whole loop, :meth:`WorkerCore.run`, is a generator that yields effects and
is sent their outcomes:

* :class:`Wait` (until a run finishes, stop() is asked, or ``seconds`` pass; answered with
  the runs that finished, ``(job, result)``), :class:`Start` (run this job's handler);
* the queue calls :class:`ReadConfig`, :class:`Dequeue`, :class:`Extend`,
  :class:`SettleMany` (acks and reports, many at once), :class:`Send` (a nack, a bury, or
  the release of a job in hand at shutdown), each answered with the call's return value or
  the exception it raised. Every call effect names its client call once (``call(q)``): the
  same line serves the blocking client and the asyncio one, whose call returns the awaitable.

The runners only execute effects: :func:`drive` (threads and processes: a runner thread or
a process pool runs each job; ``ctx.extend`` is a request to the loop) and the asyncio
runner's ``await`` loop of the same shape (asyncio tasks run the jobs). Both run
:meth:`~.handling.Runs.run` for each job, with :meth:`WorkerCore.start` and
:meth:`WorkerCore.may_commit` as its checks before the run and before the commit.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .. import limits
from ..clock import Clock
from ..errors import InvalidJob, LeaseLost, ShardqError, ShardUnavailable
from ..types import JobId, Lease, Token
from .handling import EXPIRED, SKIPPED, Report, Result
from .options import WorkerOptions
from .policy import (ACK, BURY_NOW, NOTHING, Burst, Counter, Outbox, Policy, Progress, Settle, UnavailableBackoff,
                     burst_for)

if TYPE_CHECKING:  # prometheus_client is imported only by a worker that serves metrics
    from .metrics import WorkerMetrics

log = logging.getLogger("shardq.worker")
R = TypeVar("R")


@dataclasses.dataclass
class WorkerStats:
    leased: int = 0       # leases received
    succeeded: int = 0    # handler ran (and committed), acked
    duplicates: int = 0   # already processed: handler skipped, acked
    failed: int = 0       # handler raised: nacked with backoff, or dead-lettered (last delivery, Fail)
    lost: int = 0         # lease lost: rolled back and not acked, or acked late and fenced; the redelivery wins
    expired: int = 0      # deadline passed before it started: not run
    released: int = 0     # not started, handed back (stop, or waited too long for a runner)
    abandoned: int = 0    # still running when the grace period ended: lease released
    unavailable: int = 0  # ShardUnavailable answers seen

    @property
    def processed(self) -> int:
        return self.succeeded + self.duplicates + self.failed + self.lost + self.expired


class JobState(enum.StrEnum):
    """A job in a runner's hands::

        PENDING (leased, waiting for a runner) -> QUEUED (given to an idle runner) -> RUNNING
          -> COMMITTING (the idempotency transaction passed its lease check) -> FINISHED
          -> acked / nacked / dropped (lease lost); ABANDONED: released at shutdown (not
          started, or still running when the grace period ended).

    Heartbeats extend the lease of every job not yet FINISHED or ABANDONED."""

    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    COMMITTING = "committing"
    FINISHED = "finished"
    ABANDONED = "abandoned"


_BEATING = frozenset((JobState.PENDING, JobState.QUEUED, JobState.RUNNING, JobState.COMMITTING))


class Held:
    """One delivery in a runner's hands. ``lease``, ``state`` and ``lost`` are read by the
    threads that run handlers: they change under the core's lock."""

    __slots__ = ("lease", "state", "lost", "extend_at", "lease_s", "reports", "started_at")

    def __init__(self, lease: Lease, extend_at: float, state: JobState = JobState.PENDING):
        self.lease, self.state, self.lost, self.extend_at = lease, state, False, extend_at
        self.started_at = 0.0  # the clock's monotonic time its handler started (RUNNING)
        self.lease_s: float | None = None  # set by ctx.extend: heartbeats renew by this
        self.reports: list[Report] = []    # ctx.report calls not yet landed: made before the ack

    @property
    def ref(self) -> tuple[JobId, Token]:  # one delivery; a job can be redelivered to us
        return self.lease.job_id, self.lease.token


# ---------------------------------------------------------------------------- effects
class Wait(NamedTuple):
    """Wait until a run finishes, stop() is asked, or ``seconds`` pass (0: only look);
    answered with the runs that finished meanwhile, ``[(job, result)]``."""

    seconds: float


class Start(NamedTuple):
    """Run ``job``'s handler (a runner thread, a pool process, an asyncio task); its
    ``(job, result)`` comes back in a :class:`Wait` answer."""

    job: Held


class ReadConfig(NamedTuple):
    """The queue's config (its lease length and delivery limit)."""

    queue: str

    def call(self, q: Any) -> Any:
        return q.queue_config(self.queue)


class Dequeue(NamedTuple):
    """Lease up to ``max_jobs`` jobs, waiting up to ``wait`` seconds for the first."""

    queue: str
    max_jobs: int
    wait: float

    def call(self, q: Any) -> Any:
        return q.dequeue_many(self.queue, max_jobs=self.max_jobs, wait=self.wait, visibility=None)


class Extend(NamedTuple):
    """Extend ``lease`` (of ``job``) by ``seconds``; answered with the new lease."""

    job: Held
    lease: Lease
    seconds: float

    def call(self, q: Any) -> Any:
        return q.extend(self.lease, self.seconds)


class SettleMany(NamedTuple):
    """Ack ``acks`` and make ``reports`` (``ctx.report``, before those jobs' acks) in one
    pipelined round: answered per ack (and per report) with None or the error."""

    acks: list[Lease]
    reports: list[tuple[Lease, Report]]

    def call(self, q: Any) -> Any:
        return q.settle_many(self.acks, self.reports) if self.reports else q.ack_many(self.acks)


class Send(NamedTuple):
    """A nack or a bury (``settle``) of ``lease``; or, for a settle of NOTHING, a nack with
    no delay that hands a job in hand back at shutdown (``delivered`` False: its handler
    never started)."""

    lease: Lease
    settle: Settle
    delivered: bool = True

    def call(self, q: Any) -> Any:
        if self.settle.op == BURY_NOW:
            return q.bury(self.lease, self.settle.error)
        if not self.delivered:
            return q.nack(self.lease, delay=0.0, delivered=False)
        return q.nack(self.lease, delay=self.settle.delay_s, error=self.settle.error)


Effect = Wait | Start | ReadConfig | Dequeue | Extend | SettleMany | Send
#: A core operation: yields effects, is sent each one's answer (a call's value or the
#: exception it raised), returns R.
Steps = Generator[Any, Any, R]


def _error(answer: Any) -> BaseException | None:
    """A settlement's answer as the error it is (None: it landed). An exception that is not
    the queue's (a bug) is raised, as the call itself would have."""
    if not isinstance(answer, BaseException):
        return None
    if not isinstance(answer, ShardqError):
        raise answer
    return answer


class WorkerCore:
    """What a worker holds and decides, whatever runs its handlers (see the module
    docstring). ``lock`` guards what handler threads read (a job's lease, state and lost
    flag); a runner whose handlers share its thread passes ``contextlib.nullcontext()``."""

    def __init__(self, options: WorkerOptions, clock: Clock, *, lock: AbstractContextManager[Any],
                 rng: random.Random | None = None, can_bury: bool = True, metrics: WorkerMetrics | None = None):
        """The policy, the progress lines and the burst come from ``options`` (every runner's
        the same way); ``can_bury``: the queue client can dead-letter a job at once."""
        self.clock, self.lock, self.options, self.metrics = clock, lock, options, metrics
        if metrics is not None:  # (read at each scrape: every runner's jobs in hand)
            metrics.count_in_flight(lambda: len(self.jobs))
        self.policy = Policy(backoff_base_s=options.backoff_base_s, backoff_cap_s=options.backoff_cap_s,
                             rng=rng or random.Random(), can_bury=can_bury)
        self.progress = Progress(options.log_every, options.log_every_s, clock.monotonic(), options.queue)
        self.burst = burst_for(options.burst, options.queue)
        self.heartbeat_fraction, self.grace_s = float(options.heartbeat_fraction), float(options.grace_s)
        self.stop_at: float | None = None  # clock.monotonic() when stop() was first asked
        self.stats = WorkerStats()
        self.let_go = 0  # jobs that left the worker's hands (settled or given up), ever
        self._let_go_seen = 0
        self.reset()

    def reset(self) -> None:
        """A new run: nothing in hand."""
        self.backoff = UnavailableBackoff()
        self.outbox: Outbox[Held] = Outbox()
        self.jobs: dict[tuple[JobId, Token], Held] = {}
        self.pending: deque[Held] = deque()      # leased, waiting for a runner
        self.confirmed: list[tuple[Held, Settle]] = []  # reports landed: acked in the next round
        self.idle = self.options.concurrency  # runners free
        self.run_leased = 0
        self.grace_at: float | None = None

    # ------------------------------------------------------------------ the loop
    def run(self, max_jobs: int | None = None, until_idle: bool = False) -> Steps[str]:
        """The worker's loop, from nothing in hand: read the queue's config, then lease,
        start, heartbeat and settle until stopped (and the grace period is over),
        ``max_jobs`` leases are settled, or the burst (the options' ``burst``, else this
        queue alone with ``until_idle``) says the queues are drained. Returns why it ended,
        which the last progress line says."""
        self.reset()
        queue = self.options.queue
        burst = self.burst if self.burst is not None else Burst([queue]) if until_idle else None
        yield from self.configure()
        last_fill: int | None = None
        while True:
            yield from self.settle(self._finished((yield Wait(self.wait_s(last_fill)))))
            yield from self.heartbeat(self.clock.now())
            yield from self.dispatch()
            self.progress.tick(self.stats, len(self.jobs), self.clock.monotonic())
            last_fill = None
            if self.stop_at is not None:
                if (yield from self.shutdown_step()):
                    return self.ended("stopped")
            elif max_jobs is not None and self.run_leased >= max_jobs and not self.jobs:
                return self.ended(f"{max_jobs} jobs done")
            elif burst is not None and burst.done:
                if not self.jobs:
                    return self.ended("queues drained (burst)")
            else:
                held = len(self.jobs)
                token = self.burst_token(burst, queue) if burst is not None else 0
                last_fill = yield from self.fill(max_jobs)
                if burst is not None:
                    if last_fill is None:
                        burst.busy(queue)
                    elif burst.answered(queue, token, held, last_fill) and not self.jobs:
                        return self.ended("queues drained (burst)")
            yield from self.dispatch()

    def ended(self, why: str) -> str:
        """The loop returns ``why`` (it ended): the last progress line says it."""
        self.progress.final(self.stats, why, self.clock.monotonic())
        return why

    def configure(self) -> Steps[None]:
        """Read the queue's config (waiting out outages, until stopped) into the policy."""
        cfg: dict[str, Any] = {}
        while self.stop_at is None:
            answer = yield ReadConfig(self.options.queue)
            if not isinstance(answer, BaseException):
                cfg = answer
                break
            if not isinstance(answer, ShardUnavailable):
                raise answer
            yield Wait(self.unavailable("queue_config", answer))
        self.backoff.reset()
        self.policy.configure(cfg)

    def wait_s(self, last_fill: int | None) -> float:
        """How long the loop may wait for a run to finish before its next turn."""
        if self.confirmed:
            return 0.0  # acks of reported jobs to send: the next round goes at once
        if self.backoff.s:
            return self.backoff.s  # a result or stop() still wakes the loop early
        if self.idle == self.options.concurrency and not self.jobs:
            return 0.0  # nothing in flight: the dequeue long-polls instead
        if last_fill and self.idle > 0:
            return 0.0  # the queue had jobs and a runner is free: keep pulling
        return self.options.poll_s

    def fill(self, max_jobs: int | None) -> Steps[int | None]:
        """Lease up to the free capacity (``concurrency + prefetch``): how many came, None
        if it did not ask (or met an outage)."""
        # A job whose reports landed and whose ack goes in the next round holds no slot.
        cap = self.options.concurrency + (self.options.prefetch or 0) - len(self.jobs) + len(self.confirmed)
        if max_jobs is not None:
            cap = min(cap, max_jobs - self.run_leased)
        cap = min(cap, limits.BATCH_JOBS_MAX)
        if cap <= 0:
            return None
        wait = self.options.idle_wait_s if not self.jobs else 0.0
        answer = yield Dequeue(self.options.queue, cap, wait)
        if isinstance(answer, BaseException):
            if not isinstance(answer, ShardUnavailable):
                raise answer
            self.unavailable("dequeue", answer)
            return None
        self.pending.extend(self.leased(answer, self.clock.now()))
        self.run_leased += len(answer)
        return len(answer)

    def dispatch(self) -> Steps[None]:
        """Start pending jobs on idle runners; one whose lease ended meanwhile is not run."""
        now = self.clock.now()
        while self.pending and self.idle > 0:
            job = self.pending.popleft()
            if job.state != JobState.PENDING:
                continue  # released at shutdown
            if now >= job.lease.deadline:
                self.finished(job, (EXPIRED, None, None))
                continue
            job.state = JobState.QUEUED
            self.idle -= 1
            yield Start(job)

    def _finished(self, results: list[tuple[Held, Result]]) -> list[tuple[Held, Result]]:
        self.idle += len(results)
        return [(job, result) for job, result in results if result[0] != SKIPPED]

    # ------------------------------------------------------------------ a runner's checks
    def start(self, job: Held) -> Result | None:
        """A runner is about to run ``job``: None (it runs: RUNNING), or the result instead
        (SKIPPED: released meanwhile; EXPIRED: its lease ended before it started, celery#7918)."""
        with self.lock:
            if job.state != JobState.QUEUED:
                return SKIPPED, None, None
            if self.clock.now() >= job.lease.deadline:
                return EXPIRED, None, None
            job.state = JobState.RUNNING
        if self.metrics is not None:  # (the handler's time: read only where it is reported)
            job.started_at = self.clock.monotonic()
        return None

    def may_commit(self, job: Held) -> bool:
        """The lease check right before the commit (the runner's thread): local knowledge
        only, so the client is used by the loop alone (:meth:`.policy.Policy.may_commit`)."""
        with self.lock:
            if job.lost or job.state != JobState.RUNNING:
                return False
            if not self.policy.may_commit(False, job.lease.deadline, self.clock.now()):
                job.lost = True
                return False
            job.state = JobState.COMMITTING
            return True

    # ------------------------------------------------------------------ counting
    def count(self, counter: Counter, lease: Lease | None = None) -> None:
        """One job finished, counting under ``counter``: stats, metrics, a progress line if due."""
        setattr(self.stats, counter.value, getattr(self.stats, counter.value) + 1)
        if self.metrics is not None and lease is not None:
            self.metrics.finished(lease, counter.value)
        self.progress.counted(self.stats, len(self.jobs), self.clock.monotonic())

    def unavailable(self, what: str, exc: BaseException | None) -> float:
        """Count and log a ShardUnavailable answer; how long to wait before the next try."""
        self.stats.unavailable += 1
        wait = self.backoff.failed()
        log.warning("%s: shard unavailable (%s); retrying in %.1fs", what, exc, wait)
        return wait

    def leased(self, leases: list[Lease], now: float) -> list[Held]:
        """A dequeue answered ``leases`` (an answer: the backoff resets): each becomes a
        job in hand, its first heartbeat due at ``heartbeat_fraction`` of the lease."""
        self.backoff.reset()
        self.stats.leased += len(leases)
        jobs = [Held(lease, self.extend_at(lease, now)) for lease in leases]
        for job in jobs:
            self.jobs[job.ref] = job
        return jobs

    def forget(self, job: Held) -> None:
        """The job is settled (or given up): it leaves the worker's hands."""
        if self.jobs.pop(job.ref, None) is not None:
            self.let_go += 1

    def burst_token(self, burst: Burst, queue: str) -> int:
        """``burst.asking()`` before a dequeue of ``queue``. A job that left this worker's
        hands since its last dequeue may have sent another queue work after that queue's
        worker found it empty: the group's "found nothing" answers so far are stale
        (``burst.busy``), even when this worker's loop never turned while it held the job."""
        if self.let_go != self._let_go_seen:
            self._let_go_seen = self.let_go
            burst.busy(queue)
        return burst.asking()

    def _finish(self, job: Held, counter: Counter, keep: bool = False) -> None:
        if not keep:
            self.forget(job)
        self.count(counter, job.lease)

    # ------------------------------------------------------------------ settling
    def settle(self, results: list[tuple[Held, Result]]) -> Steps[None]:
        """Settle finished runs as the policy says, after retrying the outbox: nacks and
        buries one call each; acks in one round with the reports of the jobs just finished
        (:meth:`settle_round`)."""
        decided = (self.outbox_due() if self.outbox else []) + [
            (job, self.finished(job, result)) for job, result in results]
        acks = [(job, settle) for job, settle in decided if settle.op == ACK]
        for job, settle in decided:
            if settle.op not in (ACK, NOTHING):
                yield from self.send(job, settle)
        if acks or self.confirmed:
            yield from self.settle_round(acks)

    def send(self, job: Held, settle: Settle) -> Steps[None]:
        """A nack or a bury, first try or retry."""
        self.answered(job, settle, _error((yield Send(job.lease, settle))))

    def settle_round(self, acks: list[tuple[Held, Settle]]) -> Steps[None]:
        """Ack the jobs of ``acks`` with no report, and those whose reports landed in the
        round before (``confirmed``); make the reports (``ctx.report``) of the others, all
        in one pipelined call. A job is acked only after its reports landed, so a job whose
        reports land now waits for the next round (the loop turns again at once). A report
        that met an unavailable shard waits in the outbox with what has not landed; one
        refused settles its job as :meth:`reported` says. One round: one outage counted."""
        reporting = [(job, settle) for job, settle in acks if job.reports]
        ready = self.confirmed + [(job, settle) for job, settle in acks if not job.reports]
        self.confirmed = []
        effect = SettleMany([job.lease for job, _ in ready],
                            [(job.lease, r) for job, _ in reporting for r in job.reports])
        answer = yield effect
        failed = _error(answer)
        if failed is not None:  # the whole call
            acked: list[BaseException | None] = [failed] * len(ready)
            answers: list[BaseException | None] = [failed] * len(effect.reports)
        else:
            acked, answers = answer if effect.reports else (answer, [])
        outage: BaseException | None = None
        for (job, settle), exc in zip(ready, acked):
            if isinstance(exc, ShardUnavailable):
                outage = exc
            self.answered(job, settle, exc, counted=True)
        at = 0
        for job, settle in reporting:
            mine = answers[at:at + len(job.reports)]
            at += len(job.reports)
            decided, unavailable = self.reported(job, settle, mine)
            if decided is None:  # an outage: the job waits in the outbox with what did not land
                outage = outage or unavailable
                self.outbox.put(job, settle, job.lease)
            elif decided is not settle:  # refused: not acked
                if decided.op != NOTHING:
                    yield from self.send(job, decided)
            else:
                self.confirmed.append((job, settle))
        if outage is not None:
            self.unavailable("ack" if not effect.reports else "settle", outage)

    def finished(self, job: Held, result: Result) -> Settle:
        """A run ended with ``result``: what to send (:meth:`.policy.Policy.settle`). A nack
        or bury counts at once and keeps the job in hand until it lands; NOTHING (the lease
        is lost or expired) lets it go; an ack counts when it lands (:meth:`answered`)."""
        with self.lock:
            started, job.state = job.state, JobState.FINISHED
            lost = job.lost
        if self.metrics is not None and started in (JobState.RUNNING, JobState.COMMITTING):
            self.metrics.handled(job.lease, self.clock.monotonic() - job.started_at)
        settle = self.policy.settle(*result, job.lease, lost=lost)
        if settle.counted_at_once:
            self._finish(job, settle.counter, keep=settle.op != NOTHING)
        return settle

    def answered(self, job: Held, settle: Settle, exc: BaseException | None, *, counted: bool = False) -> bool:
        """The queue answered ``settle`` with ``exc`` (None: it landed). True: it met an
        unavailable shard and waits in the outbox (the outage is counted unless
        ``counted``: a round of many settlements counts one); else the job is settled."""
        answer = self.policy.answer(settle, job.lease, exc)
        if answer.retry:
            if not counted:
                self.unavailable(settle.op, exc)
            self.outbox.put(job, settle, job.lease)
            return True
        if answer.counter is not None:
            self._finish(job, answer.counter)
        else:
            self.forget(job)
        return False

    def reported(self, job: Held, settle: Settle,
                 answers: list[BaseException | None]) -> tuple[Settle | None, BaseException | None]:
        """The answers to ``job.reports`` (``ctx.report``, made before the ack ``settle``):
        ``(settle, None)`` if all landed; ``(None, outage)`` if one met an unavailable shard
        (``job.reports`` keeps what did not land; the job waits in the outbox); else the
        refusal the policy sends instead (:meth:`.policy.Policy.reported`), counted here:
        sent unless it is NOTHING."""
        outage: BaseException | None = None
        for exc in answers:
            if exc is None:
                continue
            decided = self.policy.reported(settle, job.lease, exc)
            if decided is None:
                outage = outage or exc
            elif decided is not settle:
                job.reports.clear()
                self._finish(job, decided.counter, keep=decided.op != NOTHING)
                return decided, None
        if outage is None:
            job.reports.clear()
            return settle, None
        job.reports[:] = [r for r, exc in zip(job.reports, answers) if exc is not None]
        return None, outage

    def outbox_due(self) -> list[tuple[Held, Settle]]:
        """Empty the outbox: what to send again; what waited past its lease's deadline is
        given up (an ack counts as lost; the queue redelivers the job)."""
        retry, given_up = self.outbox.take(self.clock.now())
        for job, counter in given_up:
            if counter is not None:
                self._finish(job, counter)
            else:
                self.forget(job)
        return retry

    # ------------------------------------------------------------------ shutdown
    def stopping(self) -> None:
        """stop() was asked (any thread): the grace period counts from the first ask."""
        if self.stop_at is None:
            self.stop_at = self.clock.monotonic()

    def grace_end(self, now: float) -> float:
        """When running jobs stop being waited for (monotonic, the worker's clock):
        ``grace_s`` after the first stop(), or after ``now`` if none was asked."""
        return (self.stop_at if self.stop_at is not None else now) + self.grace_s

    def shutdown_step(self) -> Steps[bool]:
        """One loop turn while stopping: at the first, release the jobs not started; True
        (the loop returns) once nothing is in hand, or the grace period is over: then the
        jobs still running are released (ABANDONED, their leases lost) and what waits in
        the outbox is left to expire."""
        now = self.clock.monotonic()
        if self.grace_at is None:
            self.grace_at = self.grace_end(now)
            log.info("stopping: %d running, releasing %d not started; grace %.1fs",
                     self.options.concurrency - self.idle, len(self.pending), self.grace_s)
            while self.pending:
                yield from self.release(self.pending.popleft(), Counter.RELEASED)
        if not self.jobs:
            return True
        if now < self.grace_at:
            return False
        running = [job for job in list(self.jobs.values()) if job.state in (JobState.QUEUED, JobState.RUNNING)]
        for job in running:
            yield from self.release(job, Counter.ABANDONED)
        log.warning("grace period over: released the leases of %d running job(s); %d left to "
                    "expire", len(running), len(self.jobs))
        return True

    def abandon_all(self) -> Steps[None]:
        """The worker was cancelled from outside (its asyncio task, not stop()): a stop whose
        grace period is over at once. The jobs not started are released (not a delivery),
        the running ones abandoned (their leases released), what waits in the outbox is
        left to expire."""
        self.stopping()
        self.grace_at = self.clock.monotonic()
        while self.pending:
            yield from self.release(self.pending.popleft(), Counter.RELEASED)
        yield from self.shutdown_step()

    def release(self, job: Held, counter: Counter) -> Steps[None]:
        """Hand a job in hand back now (a nack with no delay; an error only means its lease
        expires by itself). A job whose handler never started is not counted as a delivery."""
        with self.lock:
            started = job.state != JobState.PENDING
            job.state, job.lost = JobState.ABANDONED, True
        answer = yield Send(job.lease, Settle(NOTHING, counter), delivered=started)
        if isinstance(answer, BaseException):
            log.info("job %s: release failed (%s); its lease will expire", job.lease.job_id, answer)
        self.jobs.pop(job.ref, None)
        setattr(self.stats, counter.value, getattr(self.stats, counter.value) + 1)

    # ------------------------------------------------------------------ leases
    def extend_at(self, lease: Lease, now: float) -> float:
        """When the heartbeat next extends ``lease``: ``heartbeat_fraction`` of what is left."""
        return now + self.heartbeat_fraction * (lease.deadline - now)

    def heartbeat(self, now: float) -> Steps[None]:
        """One heartbeat tick: extend, one at a time, every lease whose time has come. A
        lease lost is marked (its job is not acked, its transaction rolls back). At the
        first ShardUnavailable the tick ends (the next one retries, beginning with the
        same lease); an extend that answers resets the backoff."""
        for job in list(self.jobs.values()):
            if now < job.extend_at:
                continue
            with self.lock:
                if job.lost or job.state not in _BEATING:
                    continue
                lease = job.lease
            answer = yield Extend(job, lease, job.lease_s or self.policy.visibility_s)
            if isinstance(answer, LeaseLost):
                with self.lock:
                    job.lost = True
                log.warning("job %s attempt %d: lease lost while running (%s); with an idempotency "
                            "store its effects roll back and it is not acked, else it is acked late", job.lease.job_id,
                            job.lease.attempt, answer)
                continue
            if isinstance(answer, ShardUnavailable):
                self.unavailable("extend", answer)
                return
            if isinstance(answer, BaseException):
                raise answer
            self.backoff.reset()
            with self.lock:
                job.lease = answer
            job.extend_at = self.extend_at(answer, now)

    def extend(self, job: Held, seconds: float) -> Steps[float]:
        """``ctx.extend(seconds)``: extend now; later heartbeats renew by ``seconds``.
        Returns the new deadline; raises InvalidJob (seconds out of range), LeaseLost (the
        job is marked lost) or what the call raised (the handler decides)."""
        seconds = float(seconds)
        if not 0 < seconds <= limits.VISIBILITY_TIMEOUT_S_MAX:
            raise InvalidJob(f"ctx.extend: seconds must be in (0, {limits.VISIBILITY_TIMEOUT_S_MAX}]")
        with self.lock:
            if job.lost:
                raise LeaseLost(f"job {job.lease.job_id}: the lease was lost")
            lease = job.lease
        answer = yield Extend(job, lease, seconds)
        if isinstance(answer, LeaseLost):
            with self.lock:
                job.lost = True
            raise answer
        if isinstance(answer, BaseException):
            raise answer
        now = self.clock.now()
        with self.lock:
            job.lease, job.lease_s = answer, seconds
        job.extend_at = self.extend_at(answer, now)
        return float(answer.deadline)


def drive(steps: Steps[R], perform: Callable[[Any], Any]) -> R:
    """Run a core operation with blocking calls (the thread and process runners):
    ``perform(effect)`` executes each effect. A call's exception is its answer: the core
    decides what it means."""
    answer: Any = None
    try:
        while True:
            effect = steps.send(answer)
            try:
                answer = perform(effect)
            except Exception as exc:  # noqa: BLE001 - the core decides what an error means
                if isinstance(effect, (Wait, Start)):
                    raise
                answer = exc
    except StopIteration as stop:
        result: R = stop.value
        return result


async def adrive(steps: Steps[R], perform: Callable[[Any], Awaitable[Any]]) -> R:
    """:func:`drive` for the asyncio runner: ``perform(effect)`` is awaited."""
    answer: Any = None
    try:
        while True:
            effect = steps.send(answer)
            try:
                answer = await perform(effect)
            except Exception as exc:  # noqa: BLE001 - the core decides what an error means
                if isinstance(effect, (Wait, Start)):
                    raise
                answer = exc
    except StopIteration as stop:
        result: R = stop.value
        return result
