"""The worker core: what every runner (threads, processes, asyncio) keeps and decides.

No I/O and no clock of its own (the runner's :class:`~shardq.clock.Clock` is injected):
:class:`WorkerCore` holds the jobs in hand, the counters, the backoff after
ShardUnavailable, the outbox of settlements that met an outage, the heartbeat due times and
the shutdown grace period, and is told what happened: ``leased``, ``finished`` (a run's
result), ``answered`` (the queue's answer to a settlement), ``reported`` (to a job's
reports, made before its ack), ``outbox_due``, ``stopping``. An operation that needs the
queue while it decides (a heartbeat tick, ``ctx.extend``) is a generator that yields an
:class:`Extend` effect and is sent its answer; the threaded runner executes it with
:func:`drive`, the asyncio runner with an ``await`` loop of the same shape.

What the runners still do themselves: waiting (threads and a results queue; tasks on an
event loop), the dequeue call and its long poll, the batching of acks and reports
(``settle_many`` for threads; the asyncio client merges per loop turn), releasing leases
at shutdown, and running handlers (threads, a process pool, asyncio tasks).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from .. import limits
from ..clock import Clock
from ..errors import InvalidJob, LeaseLost, ShardUnavailable
from ..types import JobId, Lease, Token
from .handling import Report, Result
from .policy import NOTHING, Burst, Counter, Outbox, Policy, Progress, Settle, UnavailableBackoff

if TYPE_CHECKING:  # prometheus_client is imported only by a worker that serves metrics
    from .metrics import WorkerMetrics

log = logging.getLogger("shardq.worker")
R = TypeVar("R")
H = TypeVar("H", bound="Held")


@dataclasses.dataclass
class WorkerStats:
    leased: int = 0       # leases received
    succeeded: int = 0    # handler ran (and committed), acked
    duplicates: int = 0   # already processed: handler skipped, acked
    failed: int = 0       # handler raised: nacked with backoff
    lost: int = 0         # lease lost: not acked, the redelivery wins
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
          -> acked / nacked / dropped (lease lost); ABANDONED: still running when the grace
          period ended (its lease released).

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
    threads that run handlers: they change under the core's lock. A runner subclasses it
    for what only it needs (the asyncio task, a parked flag)."""

    __slots__ = ("lease", "state", "lost", "extend_at", "lease_s", "reports")

    def __init__(self, lease: Lease, extend_at: float, state: JobState = JobState.PENDING):
        self.lease, self.state, self.lost, self.extend_at = lease, state, False, extend_at
        self.lease_s: float | None = None  # set by ctx.extend: heartbeats renew by this
        self.reports: list[Report] = []    # ctx.report calls not yet landed: made before the ack

    @property
    def ref(self) -> tuple[JobId, Token]:  # one delivery; a job can be redelivered to us
        return self.lease.job_id, self.lease.token


class Extend(NamedTuple):
    """Effect: extend ``lease`` (of ``job``) by ``seconds``; send back the new lease, or the
    exception the call raised."""

    job: Held
    lease: Lease
    seconds: float


#: What a runner sends back for an :class:`Extend`: the new lease, or the call's exception.
ExtendAnswer = Lease | BaseException
Steps = Generator[Extend, ExtendAnswer, R]


class WorkerCore(Generic[H]):
    """What a worker holds and decides, whatever runs its handlers: the jobs in hand, the
    counters and progress lines, the backoff after ShardUnavailable, and the heartbeat
    (when each lease is due, what an answer means). No I/O: an operation that needs the
    queue is a generator that yields an effect (:class:`Extend`) and is sent its answer;
    each runner executes it with its own few lines (:func:`drive`, or an ``await`` loop).

    ``lock`` guards what handler threads read (a job's lease, state and lost flag);
    a runner whose handlers share its thread passes ``contextlib.nullcontext()``."""

    def __init__(self, policy: Policy, progress: Progress, clock: Clock, *, heartbeat_fraction: float,
                 lock: AbstractContextManager[Any], grace_s: float = 30.0,
                 metrics: WorkerMetrics | None = None):
        self.policy, self.progress, self.clock, self.lock = policy, progress, clock, lock
        self.heartbeat_fraction, self.grace_s = heartbeat_fraction, grace_s
        self.stop_at: float | None = None  # clock.monotonic() when stop() was first asked
        self.metrics = metrics
        self.stats = WorkerStats()
        self.backoff = UnavailableBackoff()
        self.outbox: Outbox[H] = Outbox()
        self.jobs: dict[tuple[JobId, Token], H] = {}
        self.let_go = 0  # jobs that left the worker's hands (settled or given up), ever
        self._let_go_seen = 0

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

    def leased(self, leases: list[Lease], now: float, make: Callable[[Lease, float], H]) -> list[H]:
        """A dequeue answered ``leases`` (an answer: the backoff resets): each becomes a
        job in hand, ``make(lease, extend_at)``, its first heartbeat due at
        ``heartbeat_fraction`` of the lease."""
        self.backoff.reset()
        self.stats.leased += len(leases)
        jobs = [make(lease, self.extend_at(lease, now)) for lease in leases]
        for job in jobs:
            self.jobs[job.ref] = job
        return jobs

    def forget(self, job: H) -> None:
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

    def _finish(self, job: H, counter: Counter, keep: bool = False) -> None:
        if not keep:
            self.forget(job)
        self.count(counter, job.lease)

    # ------------------------------------------------------------------ settling
    def finished(self, job: H, result: Result) -> Settle:
        """A run ended with ``result``: what to send (:meth:`.policy.Policy.settle`). A nack
        or bury counts at once and keeps the job in hand until it lands; NOTHING (the lease
        is lost or expired) lets it go; an ack counts when it lands (:meth:`answered`)."""
        with self.lock:
            job.state = JobState.FINISHED
            lost = job.lost
        settle = self.policy.settle(*result, job.lease, lost=lost)
        if settle.counted_at_once:
            self._finish(job, settle.counter, keep=settle.op != NOTHING)
        return settle

    def answered(self, job: H, settle: Settle, exc: BaseException | None, *, counted: bool = False) -> bool:
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

    def reported(self, job: H, settle: Settle,
                 answers: list[BaseException | None]) -> tuple[Settle | None, BaseException | None]:
        """The answers to ``job.reports`` (``ctx.report``, made before the ack ``settle``):
        ``(settle, None)`` if all landed; ``(None, outage)`` if one met an unavailable shard
        (``job.reports`` keeps what did not land; the runner parks the job in the outbox);
        else the refusal the policy sends instead (:meth:`.policy.Policy.reported`),
        counted here: the runner sends it unless it is NOTHING."""
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

    def outbox_due(self) -> list[tuple[H, Settle]]:
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
    def stopping(self, now: float) -> None:
        """stop() was asked (at monotonic ``now``): the grace period counts from the first ask."""
        if self.stop_at is None:
            self.stop_at = now

    def grace_end(self, now: float) -> float:
        """When running jobs stop being waited for (monotonic, the worker's clock):
        ``grace_s`` after the first stop(), or after ``now`` if none was asked."""
        return (self.stop_at if self.stop_at is not None else now) + self.grace_s

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
                log.warning("job %s attempt %d: lease lost while running (%s); its effects will "
                            "be rolled back and it will not be acked", job.lease.job_id,
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

    def extend(self, job: H, seconds: float) -> Steps[float]:
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
        return answer.deadline


def drive(steps: Steps[R], extend: Callable[[Lease, float], Lease]) -> R:
    """Run a core operation with blocking calls (the thread and process runners)."""
    try:
        effect = next(steps)
        while True:
            answer: ExtendAnswer
            try:
                answer = extend(effect.lease, effect.seconds)
            except Exception as exc:  # noqa: BLE001 - the core decides what an error means
                answer = exc
            effect = steps.send(answer)
    except StopIteration as stop:
        result: R = stop.value
        return result
