"""The thread and process runner: one loop thread that executes the worker core's effects.

The thread that calls :meth:`Worker.run` is the *loop*: it drives the core's loop
(:meth:`.core.WorkerCore.run`) with :func:`.core.drive` and is the only thread that talks
to the queue, so the router need not be thread-safe. ``concurrency`` *runner* threads each
run one job at a time (:meth:`.handling.Runs.run`); in process mode a runner hands its job to
a process pool and waits for the result. ``ctx.extend(seconds)`` from a runner is a request
to the loop, which makes the call (:meth:`.core.WorkerCore.extend`).

What is leased (at most ``concurrency + prefetch`` leases held), when a lease is extended,
what each outcome sends, the outbox, the reports before acks, stop and the grace period are
the core's, shared with the asyncio runner (docs/guarantees.md says why). stop(), SIGTERM,
SIGINT: stop leasing, release pending leases, let running handlers finish for ``grace_s``,
then release the rest and return; a second signal exits at once. ``burst``: return once the
queue is drained and every job leased is settled (:class:`.policy.Burst`).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import queue as queue_mod
import random
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from ..client.contracts import Buries, JobCalls, Settles
from ..client.queue import Queue
from ..clock import Clock, SystemClock
from ..errors import Closed, InvalidConfig
from ..stopping import install_stop_signals, restore_signals
from .core import Effect, Held, Start, Wait, WorkerCore, WorkerStats, drive
from .handling import FAILED, Handler, ProcessPool, Result, Runs, error_text
from .idempotency import IdempotencyStore, pruning
from .options import Mode, WorkerOptions, options_of
from .threads import job_thread

if TYPE_CHECKING:  # prometheus_client is imported only by a worker that serves metrics
    from .metrics import WorkerMetrics

log = logging.getLogger("shardq.worker")
_WAKE = object()  # put on the results queue by stop()


class _ExtendRequest(NamedTuple):
    """``ctx.extend`` from a runner thread, made by the loop, which answers it."""

    job: Held
    seconds: float
    answer: Future[float]


class Worker:
    """Runs ``handler(ctx)`` on jobs of ``queue``. See the module docstring."""

    def __init__(self, queue_or_router: Queue, handler: Handler, options: WorkerOptions | None = None, *,
                 idempotency: IdempotencyStore | None = None, clock: Clock | None = None,
                 rng: random.Random | None = None, metrics: WorkerMetrics | None = None, **settings: Any):
        """``options``: a :class:`.options.WorkerOptions`; or its fields as keywords
        (``queue=``, ``concurrency=``, ``burst=``...), which make one."""
        o = options_of(options, settings)
        if not callable(handler):
            raise InvalidConfig("handler must be callable")
        if o.mode == Mode.PROCESS:
            try:
                pickle.dumps(handler)
            except Exception as exc:  # noqa: BLE001 - pickle raises several types for what it cannot pickle
                raise InvalidConfig(f"process mode needs a module-level handler: {exc}") from None
            try:
                idempotency is None or idempotency.reopen_spec()
            except TypeError as exc:
                raise InvalidConfig(f"process mode: {exc}") from None
        service_id = queue_or_router.service_id
        if idempotency is not None and isinstance(service_id, str):
            idempotency.bind(service_id)
        self.options, self._q, self._store = o, queue_or_router, idempotency
        self._core = core = WorkerCore(o, clock or SystemClock(), lock=threading.Lock(), rng=rng,
                                       can_bury=isinstance(queue_or_router, Buries), metrics=metrics)
        self._clock, self.stats = core.clock, core.stats
        # The loop makes jobs' reports, pipelined, where the client can; else the runner does,
        # through the calls about a job, where the client has them (else a job gets no client).
        self._runs = Runs(handler, idempotency, queue_or_router if isinstance(queue_or_router, JobCalls) else None,
                          collect=isinstance(queue_or_router, Settles))
        self._results: queue_mod.SimpleQueue[Any] = queue_mod.SimpleQueue()
        self._work: queue_mod.SimpleQueue[Held | None] = queue_mod.SimpleQueue()
        self._pool: ProcessPool | None = None

    # ------------------------------------------------------------------ public
    def stop(self) -> None:
        """Stop leasing; running handlers get ``grace_s`` to finish. Safe from any thread
        and from a signal handler (it sets a flag and wakes the loop, nothing else)."""
        self._core.stopping()  # the grace period counts from here
        self._results.put(_WAKE)  # SimpleQueue.put is reentrant

    def run(self, max_jobs: int | None = None, until_idle: bool = False) -> WorkerStats:
        """Work until stopped; or until ``max_jobs`` leases (of this call) are settled; or, with
        ``until_idle`` (or the worker's ``burst``), until its queue is drained: a dequeue asked
        while nothing was in flight found nothing (:class:`.policy.Burst`). A stopped worker
        stays stopped. Returns a copy of the counters."""
        old_handlers = install_stop_signals(self.stop, "shardq worker")
        self._results = results = queue_mod.SimpleQueue[Any]()
        if self._core.stop_at is not None:
            results.put(_WAKE)
        self._work = work = queue_mod.SimpleQueue[Held | None]()
        core = self._core
        runners: list[threading.Thread] = []
        try:
            if self.options.mode == Mode.PROCESS:
                spec = self._store.reopen_spec() if self._store is not None else None
                self._pool = ProcessPool(self.options.concurrency, self._runs.handler, spec)
            for i in range(self.options.concurrency):  # daemon threads: an abandoned job holds no exit (.threads)
                runners.append(job_thread(self._runner, f"shardq-runner-{i}", work, results))
            with pruning(self._store, self._clock, self.options.prune_every_s):
                drive(core.run(max_jobs, until_idle), self._perform)
        finally:
            abandoned = core.idle < self.options.concurrency  # some runner may never come back
            for _ in runners:
                work.put(None)
            if not abandoned:
                for t in runners:
                    t.join()
            if self._pool is not None:
                self._pool.close(kill=abandoned)
            restore_signals(old_handlers)
        return dataclasses.replace(self.stats)

    # ------------------------------------------------------------------ the loop's effects
    def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, Start):
            self._work.put(effect.job)
            return None
        if not isinstance(effect, Wait):
            return effect.call(self._q)
        out: list[tuple[Held, Result]] = []
        try:  # the runs that finished, waiting up to effect.seconds for the first
            item = self._results.get(timeout=effect.seconds) if effect.seconds > 0 else self._results.get_nowait()
            while True:
                if type(item) is _ExtendRequest:  # a runner's ctx.extend: made here, answered there
                    job, seconds, answer = item
                    try:
                        answer.set_result(drive(self._core.extend(job, seconds), self._perform))
                    except Exception as exc:  # noqa: BLE001 - LeaseLost, ShardUnavailable, InvalidJob: the handler decides
                        answer.set_exception(exc)
                elif item is not _WAKE:
                    out.append(item)
                item = self._results.get_nowait()
        except queue_mod.Empty:
            return out

    def _ask_extend(self, job: Held, seconds: float) -> float:
        """A runner's ``ctx.extend``: ask the loop and wait for its answer."""
        answer: Future[float] = Future()
        self._results.put(_ExtendRequest(job, seconds, answer))
        while True:
            try:
                return answer.result(1.0)
            except TimeoutError:
                grace_at = self._core.grace_at
                if grace_at is not None and self._clock.monotonic() > grace_at + 5:
                    raise Closed("the worker stopped before the extend was made") from None

    # ------------------------------------------------------------------ runners
    def _runner(self, work: queue_mod.SimpleQueue[Held | None], results: queue_mod.SimpleQueue[Any]) -> None:
        while (job := work.get()) is not None:
            results.put((job, self._run_one(job)))

    def _run_one(self, job: Held) -> Result:
        not_run = self._core.start(job)
        if not_run is not None:
            return not_run
        lease = job.lease
        try:
            limit = self._core.policy.max_deliveries
            if self._pool is not None:
                return self._pool.run(lease, limit)
            return self._runs.run(lease, lambda: self._core.may_commit(job), lambda s: self._ask_extend(job, s),
                                  job.reports, max_deliveries=limit)
        except BaseException as exc:  # noqa: BLE001 - never let a runner die
            log.exception("job %s: runner error", lease.job_id)
            return FAILED, error_text(exc), None
