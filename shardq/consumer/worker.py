"""The worker: lease jobs, run a handler on each, heartbeat, then ack or nack.

Threads. The thread that calls :meth:`Worker.run` is the *loop*, the only thread that talks
to the queue (dequeue_many, extend, ack_many, nack), so the router need not be thread-safe.
``concurrency`` *runner* threads each run one handler at a time; in process mode a runner
hands its job to a process pool and waits for the result.

A job inside the worker::

    PENDING (leased, waiting for a runner) -> QUEUED (given to an idle runner) -> RUNNING
      -> COMMITTING (the idempotency transaction passed its lease check) -> FINISHED
      -> acked / nacked / dropped (lease lost)

The loop holds at most ``concurrency + prefetch`` leases. Rules (docs/guarantees.md says why):

* a lease whose deadline has passed is never started (celery#7918);
* every lease held (running or prefetched) is extended each time ``heartbeat_fraction`` of
  it has passed, so a prefetched job never burns a delivery while it waits for a runner;
* with an idempotency store: already seen -> skip the handler and ack; otherwise handler
  writes + claim in one transaction, committed only while the lease is still ours, then ack;
* a finished job's reports (``ctx.report``: a workflow step's arrival, a kept result) are
  made by the loop, in one pipelined round with other jobs' reports and acks
  (``settle_many``), and the job is acked in the round after they landed; the runner has
  meanwhile taken its next job;
* what each outcome sends (ack; nack with full-jitter backoff and ``"Type: message"``, or
  with ``Retry``'s delay; bury for ``Fail``), the commit margin, the retry of settlements
  that met an unavailable shard and the failed outcome of a store error are the consumer
  policy's (:mod:`.policy`), shared with the asyncio runner;
* the jobs in hand, the counters, the backoff after ShardUnavailable, the outbox of
  settlements that met it, what a run's result and the queue's answers mean, the heartbeat,
  ``ctx.extend`` and the grace period are the worker core's (:class:`.core.WorkerCore`),
  shared with the asyncio runner: this loop makes the calls it decides and waits.
  ``ctx.extend(seconds)`` from a runner is a request to the loop, which makes the call;
* stop(), SIGTERM, SIGINT: stop leasing, release pending leases, let running handlers finish
  for ``grace_s``, then release the rest and return. A second signal exits at once;
* ``burst``: return once its queue is drained and every job it leased is settled
  (:class:`.policy.Burst` says when, for every driver).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue as queue_mod
import random
import signal
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from .. import limits
from ..client.queue import Queue
from ..clock import Clock, SystemClock
from ..errors import Closed, InvalidConfig, ShardqError, ShardUnavailable
from .handling import (EXPIRED, FAILED, SKIPPED, Handler, Outcome, _child_init, _child_run, error_text,
                       execute)
from ..stopping import install_stop_signals
from .core import Held as _Job, JobState, WorkerCore, WorkerStats, drive
from .idempotency import IdempotencyStore
from .options import (CONCURRENCY_MAX, IDLE_WAIT_S, POLL_S, PRUNE_EVERY_S, Mode,  # noqa: F401 - re-exported: named as this module's
                      WorkerOptions, options_of)
# The constants stay importable from here: callers and the docs' checked figures
# (tests/project/test_docs_claims.py) name them as this module's.
from .policy import (ACK, NACK, NOTHING, Counter, COMMIT_MARGIN_S, UNAVAILABLE_BACKOFF_S_MAX,  # noqa: F401 - re-exported: named as this module's (comment above)
                     LOG_EVERY_S_DEFAULT, UNAVAILABLE_BACKOFF_S_MIN, Burst, Outbox, Policy, Progress, Settle,
                     UnavailableBackoff, burst_for)
from ..types import Lease

if TYPE_CHECKING:  # prometheus_client is imported only by a worker that serves metrics
    from .metrics import WorkerMetrics

log = logging.getLogger("shardq.worker")


# Job states inside the worker (core.JobState).
PENDING, QUEUED, RUNNING, COMMITTING, FINISHED, ABANDONED = (
    JobState.PENDING, JobState.QUEUED, JobState.RUNNING, JobState.COMMITTING, JobState.FINISHED,
    JobState.ABANDONED)
_WAKE = object()  # put on the results queue by stop()


class _ExtendRequest:
    """``ctx.extend`` from a runner thread, answered by the loop."""

    __slots__ = ("job", "seconds", "done", "deadline", "error")

    def __init__(self, job: _Job, seconds: float):
        self.job, self.seconds = job, seconds
        self.done = threading.Event()
        self.deadline = 0.0  # the new deadline, once done and no error
        self.error: BaseException | None = None


class Worker:
    """Runs ``handler(ctx)`` on jobs of ``queue``. See the module docstring."""

    def __init__(self, queue_or_router: Queue, handler: Handler, options: WorkerOptions | None = None, *,
                 idempotency: IdempotencyStore | None = None, clock: Clock | None = None,
                 rng: random.Random | None = None, metrics: WorkerMetrics | None = None, **settings: Any):
        """``options``: a :class:`.options.WorkerOptions`; or its fields as keywords
        (``queue=``, ``concurrency=``, ``burst=``...), which make one."""
        o = options_of(options, settings)
        _require(callable(handler), "handler must be callable")
        if o.mode == Mode.PROCESS:
            try:
                pickle.dumps(handler)
            except Exception as exc:  # noqa: BLE001 - pickle raises several types for what it cannot pickle
                raise InvalidConfig(f"process mode needs a module-level handler: {exc}") from None
            if idempotency is not None:
                try:
                    idempotency.reopen_spec()
                except TypeError as exc:
                    raise InvalidConfig(f"process mode: {exc}") from None
        service_id = getattr(queue_or_router, "service_id", None)
        if idempotency is not None and isinstance(service_id, str):
            idempotency.bind(service_id)
        self.options = o
        self._q = queue_or_router
        self._handler = handler
        self._queue = o.queue
        self._concurrency = o.concurrency
        self._prefetch = o.prefetch or 0
        self._mode = o.mode
        self._store = idempotency
        self._policy = Policy(backoff_base_s=o.backoff_base_s, backoff_cap_s=o.backoff_cap_s,
                              rng=rng or random.Random(), can_bury=hasattr(queue_or_router, "bury"))
        self._grace_s = float(o.grace_s)
        self._clock = clock or SystemClock()
        progress = Progress(o.log_every, o.log_every_s, self._clock.monotonic(), o.queue)
        self._core: WorkerCore[_Job] = WorkerCore(self._policy, progress,
                                self._clock, heartbeat_fraction=float(o.heartbeat_fraction),
                                lock=threading.Lock(), grace_s=float(o.grace_s), metrics=metrics)
        self._progress = self._core.progress
        self._burst = burst_for(o.burst, o.queue)
        self._poll_s, self._idle_wait_s = float(o.poll_s), float(o.idle_wait_s)
        self._prune_every_s = o.prune_every_s
        self._lock = self._core.lock       # guards _Job.lease/state/lost between loop and runners
        self._results: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self._stop_requested = False
        self._pool: ProcessPoolExecutor | None = None
        self._pool_gen = 0
        self._pool_lock = threading.Lock()
        self.stats = self._core.stats
        self._metrics = metrics  # a consumer.metrics.WorkerMetrics, or None
        # The loop makes jobs' reports, pipelined, where the client can; else the runner does.
        self._reports = hasattr(queue_or_router, "settle_many")

    # ------------------------------------------------------------------ public
    def stop(self) -> None:
        """Stop leasing; running handlers get ``grace_s`` to finish. Safe from any thread
        and from a signal handler (it sets a flag and wakes the loop, nothing else)."""
        self._core.stopping(self._clock.monotonic())  # the grace period counts from here
        self._stop_requested = True
        self._results.put(_WAKE)  # SimpleQueue.put is reentrant

    def run(self, max_jobs: int | None = None, until_idle: bool = False) -> WorkerStats:
        """Work until stopped; or until ``max_jobs`` leases (of this call) are settled; or, with
        ``until_idle`` (or the worker's ``burst``), until its queue is drained: a dequeue asked
        while nothing was in flight found nothing (:class:`.policy.Burst`). A stopped worker
        stays stopped. Returns a copy of the counters."""
        old_handlers = self._install_signals()
        results: queue_mod.SimpleQueue[Any] = queue_mod.SimpleQueue()
        self._results = results
        if self._stop_requested:
            results.put(_WAKE)
        work: queue_mod.SimpleQueue[_Job | None] = queue_mod.SimpleQueue()
        self._work = work
        self._core.jobs = {}
        if self._metrics is not None:
            in_flight = self._core.jobs
            self._metrics.count_in_flight(lambda: len(in_flight))
        self._pending: deque[_Job] = deque()
        self._core.outbox = Outbox()
        self._confirmed: list[tuple[_Job, Settle]] = []  # reports landed: acked in the next round
        self._idle = self._concurrency
        self._grace_end: float | None = None
        self._core.backoff = UnavailableBackoff()
        self._run_leased = 0
        burst = self._burst if self._burst is not None else Burst([self._queue]) if until_idle else None
        runners: list[threading.Thread] = []
        pruner_stop = threading.Event()
        try:
            self._load_config()
            if self._mode == Mode.PROCESS:
                self._pool = self._make_pool()
            for i in range(self._concurrency):
                t = threading.Thread(target=self._runner, args=(work, results), daemon=True,
                                     name=f"shardq-runner-{i}")
                t.start()
                runners.append(t)
            self._start_pruner(pruner_stop)
            why = self._loop(max_jobs, burst)
            self._progress.final(self.stats, why, self._clock.monotonic())
        finally:
            pruner_stop.set()
            abandoned = self._idle < self._concurrency  # some runner may never come back
            for _ in runners:
                work.put(None)
            if not abandoned:
                for t in runners:
                    t.join()
            self._close_pool(kill=abandoned)
            for sig, handler in (old_handlers or {}).items():
                signal.signal(sig, handler)
        return dataclasses.replace(self.stats)

    # ------------------------------------------------------------------ the loop
    def _loop(self, max_jobs: int | None, burst: Burst | None) -> str:
        """The loop; returns why it ended (for the last log line)."""
        last_fill: int | None = None
        while True:
            self._settle(self._collect(self._wait_s(last_fill)))
            self._heartbeat()
            self._dispatch()
            self._progress.tick(self.stats, len(self._core.jobs), self._clock.monotonic())
            last_fill = None
            if self._stop_requested:
                if self._shutdown_step():
                    return "stopped"
            else:
                if max_jobs is not None and self._run_leased >= max_jobs and not self._core.jobs:
                    return f"{max_jobs} jobs done"
                if burst is not None and burst.done:
                    if not self._core.jobs:
                        return "queues drained (burst)"
                else:
                    held = len(self._core.jobs)
                    token = self._core.burst_token(burst, self._queue) if burst is not None else 0
                    last_fill = self._fill(max_jobs)
                    if burst is not None:
                        if last_fill is None:
                            burst.busy(self._queue)
                        elif burst.answered(self._queue, token, held, last_fill) and not self._core.jobs:
                            return "queues drained (burst)"
            self._dispatch()

    def _wait_s(self, last_fill: int | None) -> float:
        if self._confirmed:
            return 0.0  # acks of reported jobs to send: the next round goes at once
        if self._core.backoff.s:
            return self._core.backoff.s  # a result or stop() still wakes the loop early
        if self._idle == self._concurrency and not self._core.jobs:
            return 0.0  # nothing in flight: the dequeue long-polls instead
        if last_fill and self._idle > 0:
            return 0.0  # the queue had jobs and a runner is free: keep pulling
        return self._poll_s

    def _collect(self, timeout: float) -> list[tuple[_Job, Outcome, str | None, float | None]]:
        out: list = []
        try:
            item = self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
            while True:
                if type(item) is _ExtendRequest:
                    self._extend_for_runner(item)
                elif item is not _WAKE:
                    out.append(item)
                item = self._results.get_nowait()
        except queue_mod.Empty:
            return out

    def _fill(self, max_jobs: int | None) -> int | None:
        """Lease up to the free capacity. Returns how many came, None if it did not ask."""
        # A job whose reports landed and whose ack goes in the next round holds no slot.
        cap = self._concurrency + self._prefetch - len(self._core.jobs) + len(self._confirmed)
        if max_jobs is not None:
            cap = min(cap, max_jobs - self._run_leased)
        cap = min(cap, limits.BATCH_JOBS_MAX)
        if cap <= 0:
            return None
        wait = self._idle_wait_s if not self._core.jobs else 0.0
        try:
            leases = self._q.dequeue_many(self._queue, max_jobs=cap, wait=wait, visibility=None)
        except ShardUnavailable as exc:
            self._unavailable("dequeue", exc)
            return None
        self._pending.extend(self._core.leased(leases, self._clock.now(), _Job))
        self._run_leased += len(leases)
        return len(leases)

    def _dispatch(self) -> None:
        now = self._clock.now()
        while self._pending and self._idle > 0:
            job = self._pending.popleft()
            if now >= job.lease.deadline:
                self._expired(job)
                continue
            job.state = QUEUED
            self._idle -= 1
            self._work.put(job)

    def _expired(self, job: _Job) -> None:
        self._core.finished(job, (EXPIRED, None, None))

    # ------------------------------------------------------------------ results
    def _settle(self, results: list[tuple[_Job, Outcome, str | None, float | None]]) -> None:
        """Settle finished runs as the core says; retry the outbox first. Acks go out in
        one round with the reports of the jobs just finished (:meth:`_round`)."""
        acks = self._retry_outbox()
        for job, outcome, error, delay in results:
            self._idle += 1
            if outcome == SKIPPED:
                continue
            settle = self._core.finished(job, (outcome, error, delay))
            if settle.op == ACK:
                acks.append((job, settle))
            elif settle.op != NOTHING:
                self._send(job, settle)
        if acks or self._confirmed:
            self._round(acks)

    def _round(self, acks: list[tuple[_Job, Settle]]) -> None:
        """Ack the jobs of ``acks`` with no report, and those whose reports landed in the
        round before (``_confirmed``); make the reports (``ctx.report``) of the others, all
        in one pipelined call (``settle_many``). A job is acked only after its reports
        landed, so a job whose reports land now waits for the next round (the loop turns
        again at once). A report that met an unavailable shard waits in the outbox with
        what has not landed; one refused settles its job as the core says
        (:meth:`.core.WorkerCore.reported`)."""
        reporting = [(job, settle) for job, settle in acks if job.reports]
        ready = self._confirmed + [(job, settle) for job, settle in acks if not job.reports]
        self._confirmed = []
        if not reporting:
            self._ack(ready)
            return
        acked, answers = self._q.settle_many(  # type: ignore[attr-defined]  # not in the Queue protocol; _reports says the client has it
            [job.lease for job, _ in ready], [(job.lease, r) for job, _ in reporting for r in job.reports])
        outage: BaseException | None = None
        for (job, settle), exc in zip(ready, acked):
            if isinstance(exc, ShardUnavailable):
                outage = exc
            self._core.answered(job, settle, exc, counted=True)  # an outage is counted once, below
        at = 0
        for job, settle in reporting:
            mine = answers[at:at + len(job.reports)]
            at += len(job.reports)
            decided, unavailable = self._core.reported(job, settle, mine)
            if decided is None:  # an outage: the job waits in the outbox with what did not land
                outage = outage or unavailable
                self._core.outbox.put(job, settle, job.lease)
            elif decided is not settle:  # refused: not acked
                if decided.op != NOTHING:
                    self._send(job, decided)
            else:
                self._confirmed.append((job, settle))
        if outage is not None:
            self._unavailable("settle", outage)  # one round: one outage counted

    def _ack(self, items: list[tuple[_Job, Settle]]) -> None:
        try:
            answers: list[BaseException | None] = self._ack_many([job.lease for job, _ in items])
            counted = False
        except ShardUnavailable as exc:
            self._unavailable("ack", exc)  # one call failed: one outage counted
            answers, counted = [exc] * len(items), True
        for (job, settle), answer in zip(items, answers):
            self._core.answered(job, settle, answer, counted=counted)

    def _ack_many(self, leases: list[Lease]) -> list[BaseException | None]:
        ack_many = getattr(self._q, "ack_many", None)
        if ack_many is not None:
            return ack_many(leases)
        out: list[BaseException | None] = []
        for lease in leases:
            try:
                self._q.ack(lease)
                out.append(None)
            except ShardqError as exc:
                out.append(exc)
        return out

    def _send(self, job: _Job, settle: Settle) -> None:
        """A nack or a bury, first try or retry."""
        try:
            if settle.op == NACK:
                self._q.nack(job.lease, delay=settle.delay_s, error=settle.error)
            else:
                self._q.bury(job.lease, settle.error)
            exc = None
        except ShardqError as e:
            exc = e
        self._core.answered(job, settle, exc)

    def _retry_outbox(self) -> list[tuple[_Job, Settle]]:
        """Retry the outbox's nacks and buries; returns its acks, for this turn's round."""
        if not self._core.outbox:
            return []
        retry = self._core.outbox_due()
        for job, settle in retry:
            if settle.op != ACK:
                self._send(job, settle)
        return [(job, settle) for job, settle in retry if settle.op == ACK]

    def _extend_for_runner(self, req: _ExtendRequest) -> None:
        """``ctx.extend(seconds)``, made by the core (:meth:`.core.WorkerCore.extend`)."""
        try:
            req.deadline = drive(self._core.extend(req.job, req.seconds), self._q.extend)
        except Exception as exc:  # noqa: BLE001 - LeaseLost, ShardUnavailable, InvalidJob: the handler decides
            req.error = exc
        req.done.set()

    def _ask_extend(self, job: _Job, seconds: float) -> float:
        """A runner's ``ctx.extend``: ask the loop and wait for its answer."""
        req = _ExtendRequest(job, seconds)
        self._results.put(req)
        while not req.done.wait(1.0):
            if self._stop_requested and self._grace_end is not None \
                    and self._clock.monotonic() > self._grace_end + 5:
                raise Closed("the worker stopped before the extend was made")
        if req.error is not None:
            raise req.error
        return req.deadline

    # ------------------------------------------------------------------ leases
    def _heartbeat(self) -> None:
        drive(self._core.heartbeat(self._clock.now()), self._q.extend)

    def _release(self, job: _Job, counter: Counter, *, started: bool) -> None:
        """Hand a lease back now (nack, delay 0); errors only mean it expires by itself.
        A lease whose handler never started is not counted as a delivery."""
        try:
            if started:
                self._q.nack(job.lease, delay=0.0)
            else:
                self._q.nack(job.lease, delay=0.0, delivered=False)
        except ShardqError as exc:
            log.info("job %s: release failed (%s); its lease will expire", job.lease.job_id, exc)
        self._core.jobs.pop(job.ref, None)
        setattr(self.stats, counter.value, getattr(self.stats, counter.value) + 1)

    def _unavailable(self, what: str, exc: BaseException | None) -> None:
        self._core.unavailable(what, exc)

    def _load_config(self) -> None:
        get = getattr(self._q, "queue_config", None)
        cfg: dict = {}
        while get is not None and not self._stop_requested:
            try:
                cfg = get(self._queue)
                break
            except ShardUnavailable as exc:
                self._unavailable("queue_config", exc)
                self._collect(self._core.backoff.s)  # sleeps; stop() wakes it
        self._core.backoff.reset()
        self._policy.configure(cfg)

    # ------------------------------------------------------------------ shutdown
    def _shutdown_step(self) -> bool:
        """One loop turn while stopping. True when the loop should return."""
        if self._grace_end is None:
            self._grace_end = self._core.grace_end(self._clock.monotonic())
            log.info("stopping: %d running, releasing %d not started; grace %.1fs",
                     self._concurrency - self._idle, len(self._pending), self._grace_s)
            while self._pending:
                self._release(self._pending.popleft(), Counter.RELEASED, started=False)
        if not self._core.jobs:
            return True
        if self._clock.monotonic() < self._grace_end:
            return False
        n = 0
        for job in list(self._core.jobs.values()):
            with self._lock:
                state = job.state
                if state in (QUEUED, RUNNING):
                    job.state, job.lost = ABANDONED, True
            if state in (QUEUED, RUNNING):
                n += 1
                self._release(job, Counter.ABANDONED, started=True)
        log.warning("grace period over: released the leases of %d running job(s); %d left to "
                    "expire", n, len(self._core.jobs))
        return True

    def _install_signals(self) -> dict | None:
        return install_stop_signals(self.stop, "shardq worker")

    # ------------------------------------------------------------------ runners
    def _runner(self, work: queue_mod.SimpleQueue, results: queue_mod.SimpleQueue) -> None:
        while True:
            job = work.get()
            if job is None:
                return
            outcome, error, delay = self._run_one(job)
            results.put((job, outcome, error, delay))

    def _run_one(self, job: _Job) -> tuple[str, str | None, float | None]:
        with self._lock:
            if job.state != QUEUED:
                return SKIPPED, None, None
            if self._clock.now() >= job.lease.deadline:
                return EXPIRED, None, None
            job.state = RUNNING
            lease = job.lease
        started = self._clock.monotonic()
        try:
            if self._mode == Mode.PROCESS:
                return self._run_in_pool(lease)
            return execute(self._handler, lease, self._store, lambda: self._may_commit(job),
                           lambda seconds: self._ask_extend(job, seconds),
                           max_deliveries=self._policy.max_deliveries,
                           client=self._q,  # type: ignore[arg-type]  # the router has JobCalls' methods; the Queue protocol lacks them (issue 45, item 3)
                           reports=job.reports if self._reports else None)
        except BaseException as exc:  # noqa: BLE001 - never let a runner die
            log.exception("job %s: runner error", lease.job_id)
            return FAILED, error_text(exc), None
        finally:
            if self._metrics is not None:
                self._metrics.handled(lease, self._clock.monotonic() - started)

    def _may_commit(self, job: _Job) -> bool:
        """The lease check right before the commit (runner thread): local knowledge only,
        so the router is used by the loop alone (:meth:`.policy.Policy.may_commit`)."""
        with self._lock:
            if job.lost or job.state != RUNNING:
                return False
            if not self._policy.may_commit(False, job.lease.deadline, self._clock.now()):
                job.lost = True
                return False
            job.state = COMMITTING
            return True

    # ------------------------------------------------------------------ process mode
    def _make_pool(self) -> ProcessPoolExecutor:
        spec = self._store.reopen_spec() if self._store is not None else None
        return ProcessPoolExecutor(max_workers=self._concurrency,
                                   mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_child_init, initargs=(self._handler, spec, os.getpid()))

    def _run_in_pool(self, lease: Lease) -> tuple[str, str | None, float | None]:
        with self._pool_lock:
            pool, gen = self._pool, self._pool_gen
        if pool is None:
            raise Closed("the worker's process pool is closed")
        try:
            return pool.submit(_child_run, lease, self._policy.max_deliveries).result()
        except BrokenProcessPool:
            with self._pool_lock:
                if self._pool_gen == gen:  # the first runner to notice replaces the pool
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool, self._pool_gen = self._make_pool(), gen + 1
            return FAILED, f"BrokenProcessPool: a worker process died running job {lease.job_id}", None

    def _close_pool(self, kill: bool) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if kill:  # children ignore SIGTERM/SIGINT (the group gets them too): SIGKILL
            procs = getattr(pool, "_processes", None) or {}  # no public API before 3.14
            for proc in list(procs.values()):
                proc.kill()
        pool.shutdown(wait=not kill, cancel_futures=True)

    def _start_pruner(self, stop: threading.Event) -> None:
        store, every = self._store, self._prune_every_s
        if store is None or every is None:
            return

        # Its own thread: a prune waiting for the write lock never delays a heartbeat.
        def prune_loop() -> None:
            while True:
                try:
                    n = store.prune(self._clock.now())
                    if n:
                        log.info("idempotency store: pruned %d marks", n)
                except Closed:
                    return
                except Exception:
                    log.warning("idempotency store: prune failed", exc_info=True)
                if stop.wait(every):
                    return

        threading.Thread(target=prune_loop, daemon=True, name="shardq-pruner").start()


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidConfig(message)
