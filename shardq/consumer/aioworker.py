"""The asyncio worker: task jobs on one event loop, with the guarantees of the thread worker.

``shardq worker myapp.tasks`` gives a queue this worker when one of its tasks is an
``async def``. On its loop (in a thread of its own):

* up to ``concurrency`` jobs run at once, each an asyncio task. An ``async def`` task is
  awaited on the loop; a plain function runs in a thread (``asyncio.to_thread``) through
  the same :func:`~shardq.consumer.handling.execute` as the thread worker; a body that is
  not a task, or names an unknown task, is dead-lettered (never a crash loop);
* a lease whose deadline has passed is never started; every lease is extended each time
  ``heartbeat_fraction`` of it has passed; ``await ctx.extend(s)`` sets a job's lease length;
* with an idempotency store, an async task's ``ctx.db`` is its transaction, run in a
  thread (:mod:`.aiotxn`): seen check, the task's statements, claim, lease check, commit.
  The loop does no SQLite work;
* success -> ack (merged per loop turn by the client); failure -> nack with backoff, or
  the delay of ``Retry``, or bury for ``Fail`` (:mod:`.dispatch` applies the task's retries);
* ``stop()`` (any thread): stop leasing (a waiting dequeue is cancelled, which leaves no
  lease behind), let running jobs finish for ``grace_s``, then cancel them (their
  transactions roll back) and release their leases.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
from typing import Any

from .. import limits
from ..client import aio
from ..clock import Clock, SystemClock
from ..errors import InvalidJob, LeaseLost, ShardqError, ShardUnavailable
from ..types import Lease
from .aiotxn import TxnThread
from .dispatch import TaskHandler
from .handling import (BURY, DONE, DUPLICATE, FAILED, LOST, RETRY, Context, backoff_delay,
                       execute, failure_result)
from .idempotency import IdempotencyStore
from .worker import COMMIT_MARGIN_S, CONCURRENCY_MAX, WorkerStats, _require

log = logging.getLogger("shardq.worker")

HEARTBEAT_TICK_S = 0.1  # how often leases are checked for a heartbeat


class AsyncContext(Context):
    """``ctx`` of an async task: as :class:`Context`, with ``await ctx.extend(seconds)``
    and ``ctx.db`` the async API of :mod:`.aiotxn`."""

    __slots__ = ("_aextend",)

    def __init__(self, lease: Lease, db: Any, aextend):
        super().__init__(lease, db, None)
        self._aextend = aextend

    async def extend(self, seconds: float) -> float:  # type: ignore[override]
        return await self._aextend(seconds)


class _Job:
    __slots__ = ("lease", "lost", "extend_at", "lease_s", "task")

    def __init__(self, lease: Lease, extend_at: float):
        self.lease, self.lost, self.extend_at = lease, False, extend_at
        self.lease_s: float | None = None  # set by ctx.extend: heartbeats renew by this
        self.task: asyncio.Task | None = None


class AsyncWorker:
    """Runs task jobs of ``queue`` on an event loop. :meth:`run` blocks (it owns a loop);
    :meth:`run_async` runs on the caller's loop."""

    def __init__(self, target, handler: TaskHandler, queue: str = "default", concurrency: int = 50,
                 idempotency: IdempotencyStore | None = None, grace_s: float = 30.0,
                 log_every: int = 1000, heartbeat_fraction: float = 0.5, idle_wait_s: float = 1.0,
                 backoff_base_s: float = 1.0, backoff_cap_s: float = 300.0,
                 clock: Clock | None = None, rng: random.Random | None = None,
                 request_timeout_s: float = 5.0):
        _require(isinstance(concurrency, int) and 1 <= concurrency <= CONCURRENCY_MAX,
                 f"concurrency must be an int in [1, {CONCURRENCY_MAX}]")
        _require(0 < heartbeat_fraction < 1, "heartbeat_fraction must be in (0, 1)")
        _require(grace_s >= 0 and idle_wait_s >= 0, "bad grace_s/idle_wait_s")
        self.target, self.handler, self.queue = target, handler, queue
        self.concurrency, self.store, self.grace_s = concurrency, idempotency, float(grace_s)
        self.log_every, self.heartbeat_fraction = log_every, heartbeat_fraction
        self.idle_wait_s = idle_wait_s
        self.backoff_base_s, self.backoff_cap_s = backoff_base_s, backoff_cap_s
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.request_timeout_s = request_timeout_s
        self.stats = WorkerStats()
        self.jobs: dict[tuple, _Job] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._started = threading.Event()

    # ------------------------------------------------------------------ public
    def run(self) -> WorkerStats:
        return asyncio.run(self.run_async())

    def stop(self) -> None:
        """Stop leasing and finish (see the module docstring). Safe from any thread."""
        self._stop_requested = True
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass  # the loop has finished

    async def run_async(self) -> WorkerStats:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        self.q = q = await aio.connect(self.target, request_timeout_s=self.request_timeout_s)
        try:
            if self.store is not None and isinstance(q.service_id, str):
                await asyncio.to_thread(self.store.bind, q.service_id)
            cfg = await self._queue_config()
            self.visibility = float(cfg.get("visibility_timeout", limits.VISIBILITY_TIMEOUT_S_DEFAULT))
            self.max_deliveries = int(cfg.get("max_deliveries", limits.MAX_DELIVERIES_DEFAULT))
            heart = asyncio.create_task(self._heartbeats())
            self._started.set()
            try:
                await self._lease_loop()
                await self._shutdown()
            finally:
                heart.cancel()
        finally:
            await q.close()
        return dataclasses.replace(self.stats)

    async def _queue_config(self) -> dict:
        delay = 0.1
        while not self._stop.is_set():
            try:
                return await self.q.queue_config(self.queue)
            except ShardUnavailable as exc:
                log.warning("queue_config: shard unavailable (%s); retrying in %.1fs", exc, delay)
                await self._sleep_or_stop(delay)
                delay = min(delay * 2, 5.0)
        return {}

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------------ leasing
    async def _lease_loop(self) -> None:
        slot_free = asyncio.Event()
        self._slot_free = slot_free
        backoff = 0.0
        while not self._stop.is_set():
            room = self.concurrency - len(self.jobs)
            if room <= 0:
                slot_free.clear()
                await _first(self._stop.wait(), slot_free.wait())
                continue
            dequeue = asyncio.ensure_future(self.q.dequeue_many(
                self.queue, max_jobs=room, wait=self.idle_wait_s if not self.jobs else 0.2))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([dequeue, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not dequeue.done():
                dequeue.cancel()  # a waiting dequeue, cancelled: no lease is left behind
                await asyncio.gather(dequeue, return_exceptions=True)
                break
            try:
                leases = dequeue.result()
            except ShardUnavailable as exc:
                self.stats.unavailable += 1
                backoff = min(5.0, max(0.1, backoff * 2))
                log.warning("dequeue: shard unavailable (%s); retrying in %.1fs", exc, backoff)
                await self._sleep_or_stop(backoff)
                continue
            except asyncio.CancelledError:
                break
            backoff = 0.0
            now = self.clock.now()
            self.stats.leased += len(leases)
            for lease in leases:
                job = _Job(lease, now + self.heartbeat_fraction * (lease.deadline - now))
                self.jobs[(lease.job_id, lease.token)] = job
                job.task = asyncio.create_task(self._run_job(job))

    async def _shutdown(self) -> None:
        running = [j.task for j in self.jobs.values() if j.task is not None]
        log.info("stopping: %d running; grace %.1fs", len(running), self.grace_s)
        if running:
            done, left = await asyncio.wait(running, timeout=self.grace_s)
            for t in left:
                t.cancel()
            if left:
                await asyncio.gather(*left, return_exceptions=True)
                log.warning("grace period over: cancelled %d running job(s) and released their leases",
                            len(left))

    # ------------------------------------------------------------------ one job
    async def _run_job(self, job: _Job) -> None:
        lease = job.lease
        try:
            if self.clock.now() >= lease.deadline:
                log.warning("job %s attempt %d: lease expired before it started; not running it",
                            lease.job_id, lease.attempt)
                self.stats.expired += 1
                return
            task = self.handler.task_of(lease.body)
            if task is not None and task.is_async:
                outcome, error, delay = await self._execute_async(job)
            else:  # plain task, unknown task or bad body: the thread path says why
                outcome, error, delay = await asyncio.to_thread(
                    execute, self.handler, lease, self.store, lambda: self._may_commit(job),
                    lambda s: asyncio.run_coroutine_threadsafe(self._extend(job, s), self._loop).result())
            await self._settle(job, outcome, error, delay)
        except asyncio.CancelledError:  # the grace period ended
            job.lost = True
            self.stats.abandoned += 1
            try:
                await asyncio.shield(self.q.nack(job.lease, delay=0.0))
            except (ShardqError, asyncio.CancelledError):
                pass  # the lease expires by itself
        finally:
            self.jobs.pop((lease.job_id, lease.token), None)
            self._slot_free.set()

    async def _execute_async(self, job: _Job):
        lease = job.lease
        ctx: AsyncContext | None = None
        txn = None
        try:
            db = None
            if self.store is not None:
                txn = TxnThread(self.store, lease.job_id, lambda: self._may_commit(job))
                if not await txn.begin():
                    return DUPLICATE, None, None
                db = txn.db
            ctx = AsyncContext(lease, db, lambda s: self._extend(job, s))
            task, args, kwargs = self.handler.resolve(ctx)
            await self.handler.run_async(task, ctx, args, kwargs)
        except BaseException as exc:
            if txn is not None:
                await txn.finish(commit=False)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return failure_result(exc, lease, ctx, max_deliveries=self.max_deliveries)
        if txn is None:
            return DONE, None, None
        return await txn.finish(commit=True), None, None

    def _may_commit(self, job: _Job) -> bool:
        """The lease check right before a commit (the transaction's thread): what the
        worker knows, no round trip (see docs/guarantees.md)."""
        margin = min(COMMIT_MARGIN_S, 0.1 * self.visibility)
        return not job.lost and self.clock.now() < job.lease.deadline - margin

    async def _settle(self, job: _Job, outcome: str, error: str | None, delay: float | None) -> None:
        lease = job.lease
        try:
            if outcome == LOST or job.lost:
                log.warning("job %s attempt %d: lease lost; not acking", lease.job_id, lease.attempt)
                self.stats.lost += 1
            elif outcome in (DONE, DUPLICATE):
                await self._ack(job)
                if outcome == DONE:
                    self.stats.succeeded += 1
                else:
                    self.stats.duplicates += 1
            elif outcome == BURY:
                self.stats.failed += 1
                await self.q.bury(lease, error)
            else:
                self.stats.failed += 1
                if outcome == RETRY and delay is not None:
                    delay = max(0.0, min(float(delay), limits.DELAY_S_MAX))
                elif lease.attempt >= self.max_deliveries:
                    delay = 0.0
                else:  # FAILED: a runner error outside the task (the store, the thread)
                    delay = backoff_delay(lease.attempt, self.backoff_base_s, self.backoff_cap_s, self.rng)
                await self.q.nack(lease, delay=delay, error=error)
        except LeaseLost as exc:
            log.warning("job %s: %s after the lease was lost (%s); the queue redelivers it",
                        lease.job_id, outcome, exc)
        except ShardUnavailable as exc:
            self.stats.unavailable += 1
            log.warning("job %s: shard unavailable settling it (%s); its lease will expire", lease.job_id, exc)
        n = self.stats.processed
        if n % self.log_every == 0:
            log.info("%d jobs processed; %d ok, %d duplicate, %d failed, %d lost; in flight %d", n,
                     self.stats.succeeded, self.stats.duplicates, self.stats.failed, self.stats.lost,
                     len(self.jobs))

    async def _ack(self, job: _Job) -> None:
        """Ack; a shard that is down is retried until the lease's deadline."""
        delay = 0.05
        while True:
            try:
                await self.q.ack(job.lease)
                return
            except ShardUnavailable:
                if self.clock.now() + delay >= job.lease.deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------------ leases
    async def _extend(self, job: _Job, seconds: float) -> float:
        """``ctx.extend``: extend now; later heartbeats renew by ``seconds``."""
        seconds = float(seconds)
        if not 0 < seconds <= limits.VISIBILITY_TIMEOUT_S_MAX:
            raise InvalidJob(f"ctx.extend: seconds must be in (0, {limits.VISIBILITY_TIMEOUT_S_MAX}]")
        if job.lost:
            raise LeaseLost(f"job {job.lease.job_id}: the lease was lost")
        try:
            new = await self.q.extend(job.lease, seconds)
        except LeaseLost:
            job.lost = True
            raise
        now = self.clock.now()
        job.lease, job.lease_s = new, seconds
        job.extend_at = now + self.heartbeat_fraction * (new.deadline - now)
        return new.deadline

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TICK_S)
            now = self.clock.now()
            due = [j for j in self.jobs.values() if not j.lost and now >= j.extend_at]
            if due:
                await asyncio.gather(*(self._beat(j) for j in due))

    async def _beat(self, job: _Job) -> None:
        try:
            await self._extend(job, job.lease_s or self.visibility)
        except LeaseLost as exc:
            log.warning("job %s attempt %d: lease lost while running (%s); its effects will be "
                        "rolled back and it will not be acked", job.lease.job_id, job.lease.attempt, exc)
        except ShardUnavailable as exc:
            self.stats.unavailable += 1
            log.warning("extend: shard unavailable (%s)", exc)


async def _first(*aws) -> None:
    """Wait until the first of ``aws`` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
