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
* a finished job's reports (``ctx.report``: a workflow step's arrival, a kept result) are
  awaited on the loop, merged with other jobs' per loop turn by the client, before its ack;
* what each outcome sends (ack, merged per loop turn by the client; nack with backoff or
  ``Retry``'s delay; bury for ``Fail``), the commit margin, the outbox of settlements that
  met an unavailable shard (retried until they land or the lease ends) and the failed
  outcome of an idempotency-store error are the consumer policy's (:mod:`.policy`), the
  same as the thread worker's; :mod:`.dispatch` applies the task's retries;
* ``stop()`` (any thread): stop leasing (a waiting dequeue is cancelled, which leaves no
  lease behind), let running jobs finish for ``grace_s``, then cancel them (their
  transactions roll back) and release their leases;
* ``burst``: return once its queue is drained and every job it leased is settled, and the
  progress lines: the policy's (:class:`.policy.Burst`, :class:`.policy.Progress`), as for
  the thread worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import threading
from typing import Any, Protocol

from ..client import aio
from ..clock import Clock, SystemClock
from ..errors import ShardqError, ShardUnavailable
from ..types import Lease
from .aiotxn import TxnThread
from .handling import DONE, DUPLICATE, EXPIRED, Context, Report, Result, execute
from .idempotency import IdempotencyStore
from .policy import (ACK, NACK, NOTHING, Policy, Progress, Settle,
                     burst_for)
from .core import ExtendAnswer, Held, JobState, R, Steps, WorkerCore, WorkerStats
from .options import WorkerOptions, options_of

log = logging.getLogger("shardq.worker")

HEARTBEAT_TICK_S = 0.1  # how often leases are checked for a heartbeat
ASYNC_CONCURRENCY_DEFAULT = 50  # jobs at once: asyncio tasks are cheap



class AsyncTask(Protocol):
    is_async: bool


class AsyncHandler(Protocol):
    """What this worker runs jobs with (:class:`shardq.tasks.dispatch.TaskHandler`, a layer
    above, is the one): a plain handler that a thread calls for sync tasks, and the async path
    on the loop for async ones."""

    def __call__(self, ctx: Context) -> Any: ...

    def task_of(self, body: bytes) -> AsyncTask | None: ...

    def resolve(self, ctx: Any) -> tuple[Any, list, dict]: ...

    async def run_async(self, task: Any, ctx: Any, args: list, kwargs: dict) -> Any: ...

class AsyncContext(Context):
    """``ctx`` of an async task: as :class:`Context`, with ``await ctx.extend(seconds)``
    and ``ctx.db`` the async API of :mod:`.aiotxn`."""

    __slots__ = ("_aextend",)

    def __init__(self, lease: Lease, db: Any, aextend, client: LoopCalls | None = None,
                 reports: list[Report] | None = None):
        super().__init__(lease, db, None, client=client, reports=reports)
        self._aextend = aextend

    async def extend(self, seconds: float) -> float:  # type: ignore[override]
        return await self._aextend(seconds)

    def _report(self) -> None:
        # An async task runs on the loop: the progress call goes out without blocking it.
        if isinstance(self.client, LoopCalls):
            self.client.progress_soon(self.lease, self.fraction, self.note)


class LoopCalls:
    """The asyncio client's calls about a running job (:class:`~.handling.JobCalls`),
    made blocking for code in another thread than the loop's (sync tasks, and what
    ``ctx.after_commit`` asked, run in threads)."""

    def __init__(self, q: Any, loop: asyncio.AbstractEventLoop):
        self._q, self._loop = q, loop

    def _wait(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def put_result(self, lease: Lease, value: bytes, ttl_s: float) -> None:
        self._wait(self._q.put_result(lease, value, ttl_s))

    def progress(self, lease: Lease, fraction: float | None, note: str | None) -> None:
        self._wait(self._q.progress(lease, fraction, note))

    def progress_soon(self, lease: Lease, fraction: float | None, note: str | None) -> None:
        """From the loop's thread: send it, log a failure, do not wait."""
        async def send() -> None:
            try:
                await self._q.progress(lease, fraction, note)
            except ShardqError as exc:
                log.warning("job %s: progress not recorded: %s: %s", lease.job_id, type(exc).__name__, exc)
        spawn = getattr(self._q, "spawn", None)
        (spawn or self._loop.create_task)(send())

    def arrive(self, shard: int, barrier: str, index: int, total: int, value: bytes, ttl_s: float,
               callback: list) -> str:
        return self._wait(self._q.arrive(shard, barrier, index, total, value, ttl_s, callback))

    def barrier_values(self, shard: int, barrier: str) -> list[bytes]:
        return self._wait(self._q.barrier_values(shard, barrier))


class _Job(Held):
    __slots__ = ("task", "parked")

    def __init__(self, lease: Lease, extend_at: float):
        super().__init__(lease, extend_at, JobState.RUNNING)  # FINISHED once run: no more heartbeats
        self.task: asyncio.Task | None = None
        self.parked = False  # its settlement waits in the outbox: it keeps its slot


class AsyncWorker:
    """Runs task jobs of ``queue`` on an event loop. :meth:`run` blocks (it owns a loop);
    :meth:`run_async` runs on the caller's loop. ``target`` is a data dir (the worker
    connects, and closes its client at the end) or an open asyncio queue client (the
    caller's: used, not closed)."""

    def __init__(self, target: Any, handler: AsyncHandler, options: WorkerOptions | None = None, *,
                 idempotency: IdempotencyStore | None = None, clock: Clock | None = None,
                 rng: random.Random | None = None, **settings: Any):
        """``options``: a :class:`.options.WorkerOptions`; or its fields as keywords
        (``queue=``, ``concurrency=``, ``burst=``...), which make one; by keywords,
        ``concurrency`` is 50 unless given."""
        o = options_of(options, {"concurrency": ASYNC_CONCURRENCY_DEFAULT, **settings} if options is None else settings)
        self.options = o
        self.target, self.handler, self.queue = target, handler, o.queue
        self.concurrency, self.store, self.grace_s = o.concurrency, idempotency, float(o.grace_s)
        self.log_every, self.heartbeat_fraction = o.log_every, o.heartbeat_fraction
        self.idle_wait_s = o.idle_wait_s
        self.policy = Policy(backoff_base_s=o.backoff_base_s, backoff_cap_s=o.backoff_cap_s,
                             rng=rng or random.Random())
        self.clock = clock or SystemClock()
        # The jobs run on the loop's thread; a sync task's thread reads its job unlocked.
        progress = Progress(o.log_every, o.log_every_s, self.clock.monotonic(), o.queue)
        self.core: WorkerCore[_Job] = WorkerCore(self.policy, progress,
                               self.clock, heartbeat_fraction=float(o.heartbeat_fraction),
                               lock=contextlib.nullcontext(), grace_s=float(o.grace_s))
        self.progress, self.backoff = self.core.progress, self.core.backoff
        self.burst = burst_for(o.burst, o.queue)
        self.request_timeout_s = o.request_timeout_s
        self.stats = self.core.stats
        self.jobs = self.core.jobs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: LoopCalls | None = None  # the client's calls about a job, for threads
        self._stop = asyncio.Event()  # bound to a loop at its first use (3.10+): run_async makes its own
        self._stop_requested = False
        self._started = threading.Event()
        self._outbox_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ public
    def run(self) -> WorkerStats:
        return asyncio.run(self.run_async())

    def stop(self) -> None:
        """Stop leasing and finish (see the module docstring). Safe from any thread."""
        self._stop_requested = True
        self.core.stopping(self.clock.monotonic())  # the grace period counts from here
        loop, ev = self._loop, self._stop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass  # the loop has finished

    async def run_async(self) -> WorkerStats:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._slot_free = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        owned = isinstance(self.target, (str, os.PathLike))
        if owned:
            q = await aio.connect(self.target, request_timeout_s=self.request_timeout_s)
        else:
            q = self.target
        self.q = q
        self._calls = LoopCalls(q, self._loop)
        try:
            if self.store is not None and isinstance(q.service_id, str):
                await asyncio.to_thread(self.store.bind, q.service_id)
            self.policy.configure(await self._queue_config())
            heart = asyncio.create_task(self._heartbeats())
            self._started.set()
            try:
                drained = await self._lease_loop()
                await self._shutdown(drained)
            finally:
                heart.cancel()
            self.progress.final(self.stats, "queues drained (burst)" if drained else "stopped",
                                self.clock.monotonic())
        finally:
            if owned:
                await q.close()
        return dataclasses.replace(self.stats)

    async def _queue_config(self) -> dict:
        while not self._stop.is_set():
            try:
                cfg = await self.q.queue_config(self.queue)
                self.backoff.reset()
                return cfg
            except ShardUnavailable as exc:
                await self._sleep_or_stop(self._unavailable("queue_config", exc))
        return {}

    def _unavailable(self, what: str, exc: BaseException | None) -> float:
        """Count and log a ShardUnavailable answer; how long to wait before the next try."""
        return self.core.unavailable(what, exc)

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ leasing
    async def _lease_loop(self) -> bool:
        """Lease until stopped; True if it ended because ``burst`` found its queues drained."""
        slot_free, burst = self._slot_free, self.burst
        while not self._stop.is_set():
            room = self.concurrency - len(self.jobs)
            done = burst is not None and burst.done
            if done and not self.jobs:
                return True
            if room <= 0 or done:  # full, or drained: wait for a job to end
                if burst is not None and not done:
                    burst.busy(self.queue)
                slot_free.clear()
                await _first(self._stop.wait(), slot_free.wait())
                continue
            held = len(self.jobs)
            token = self.core.burst_token(burst, self.queue) if burst is not None else 0
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
                await self._sleep_or_stop(self._unavailable("dequeue", exc))
                continue
            except asyncio.CancelledError:
                break
            for job in self.core.leased(leases, self.clock.now(), _Job):
                job.task = asyncio.create_task(self._run_job(job))
            if burst is not None:
                burst.answered(self.queue, token, held, len(leases))
        return False

    async def _shutdown(self, drained: bool = False) -> None:
        """Let running jobs finish and settle (the outbox included) within the grace
        period; then cancel the jobs still running (released) and leave what the outbox
        holds to expire. ``drained``: burst found nothing left, nothing runs."""
        if not drained:
            log.info("stopping: %d running; grace %.1fs", len(self.jobs), self.grace_s)
        end = self.core.grace_end(self.clock.monotonic())  # on the worker's clock, as for threads
        while self.jobs and self.clock.monotonic() < end:
            busy = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
            if self._outbox_task is not None and not self._outbox_task.done():
                busy.append(self._outbox_task)
            if not busy:
                break
            # In slices: a clock that is not the loop's (a test's) is read again after each.
            await asyncio.wait(busy, timeout=min(HEARTBEAT_TICK_S, end - self.clock.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        left = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            log.warning("grace period over: cancelled %d running job(s) and released their leases",
                        len(left))
        if self._outbox_task is not None and not self._outbox_task.done():
            self._outbox_task.cancel()
            await asyncio.gather(self._outbox_task, return_exceptions=True)
        if self.jobs:
            log.warning("%d settlement(s) not sent; their leases will expire", len(self.jobs))

    # ------------------------------------------------------------------ one job
    async def _run_job(self, job: _Job) -> None:
        lease = job.lease
        result: Result
        try:
            if self.clock.now() >= lease.deadline:
                result = EXPIRED, None, None
            else:
                task = self.handler.task_of(lease.body)
                if task is not None and task.is_async:
                    result = await self._execute_async(job)
                else:  # plain task, unknown task or bad body: the thread path says why
                    loop = asyncio.get_running_loop()
                    result = await asyncio.to_thread(
                        execute, self.handler, lease, self.store, lambda: self._may_commit(job),
                        lambda s: asyncio.run_coroutine_threadsafe(self._extend(job, s), loop).result(),
                        max_deliveries=self.policy.max_deliveries, client=self._calls, reports=job.reports)
            settle = self.core.finished(job, result)
            if settle.op != NOTHING:
                await self._send(job, settle)
        except asyncio.CancelledError:  # the grace period ended
            job.lost = True
            self.stats.abandoned += 1
            try:
                await asyncio.shield(self.q.nack(job.lease, delay=0.0))
            except (ShardqError, asyncio.CancelledError):
                pass  # the lease expires by itself
        finally:
            if not job.parked:
                self._forget(job)

    async def _execute_async(self, job: _Job):
        """An async task, with the idempotency transaction in its own thread. Any error of
        the store (at BEGIN, the claim, COMMIT or ROLLBACK) is a failed attempt, as in
        :func:`~.handling.execute`: the policy makes it a nack with its error text."""
        lease = job.lease
        ctx: AsyncContext | None = None
        txn = None
        try:
            db = None
            if self.store is not None:
                txn = TxnThread(self.store, lease.job_id, lambda: self._may_commit(job))
                if not await txn.begin():
                    again = getattr(self.handler, "finish_duplicate", None)
                    if again is not None:
                        ctx = AsyncContext(lease, None, lambda s: self._extend(job, s), self._calls,
                                           job.reports)
                        kept = await asyncio.to_thread(self.store.kept_result, lease.job_id)
                        await asyncio.to_thread(again, ctx, kept)
                    return DUPLICATE, None, None
                db = txn.db
            ctx = AsyncContext(lease, db, lambda s: self._extend(job, s), self._calls, job.reports)
            task, args, kwargs = self.handler.resolve(ctx)
            await self.handler.run_async(task, ctx, args, kwargs)
            if txn is None:
                await asyncio.to_thread(ctx.run_after)
                return DONE, None, None
            outcome = await txn.finish(commit=True, result=ctx.kept)  # claim, lease check, COMMIT
            if outcome == DONE:
                await asyncio.to_thread(ctx.run_after)
            return outcome, None, None
        except BaseException as exc:
            failure = exc
            if txn is not None:
                try:  # roll back; after a failed BEGIN, claim or COMMIT this re-raises that error
                    await txn.finish(commit=False)
                except asyncio.CancelledError:
                    raise
                except BaseException as store_exc:  # noqa: BLE001 - the store's error is the failure
                    failure = store_exc  # as with the thread worker: the store's error wins
            if isinstance(exc, asyncio.CancelledError):
                raise
            job.reports.clear()  # a failed attempt reports nothing
            return self.policy.failure(failure, lease, ctx)

    def _may_commit(self, job: _Job) -> bool:
        """The lease check right before a commit (the transaction's thread)."""
        return self.policy.may_commit(job.lost, job.lease.deadline, self.clock.now())

    async def _send(self, job: _Job, settle: Settle) -> None:
        """Send an ack, nack or bury, first try or retry. Unsent for ShardUnavailable: it
        goes to the outbox, and the job keeps its slot until it lands or its lease ends.
        An ack goes after the job's reports (``ctx.report``) landed, as the core says
        (:meth:`.core.WorkerCore.reported`); the reports are merged with other jobs' per
        loop turn by the client."""
        if settle.op == ACK and job.reports:
            answers = await self.q.report_many([(job.lease, r) for r in job.reports])
            decided, outage = self.core.reported(job, settle, answers)
            if decided is None:  # met an unavailable shard: parked with what did not land
                self.core.unavailable(settle.op, outage)
                self.core.outbox.put(job, settle, job.lease)
                self._park(job)
                return
            if decided is not settle:  # refused: not acked
                if decided.op == NOTHING:
                    self._forget(job)
                    return
                settle = decided
        lease = job.lease
        try:
            if settle.op == ACK:
                await self.q.ack(lease)
            elif settle.op == NACK:
                await self.q.nack(lease, delay=settle.delay_s, error=settle.error)
            else:
                await self.q.bury(lease, settle.error)
            exc = None
        except ShardqError as e:
            exc = e
        if self.core.answered(job, settle, exc):
            self._park(job)
        else:
            self._slot_free.set()

    def _park(self, job: _Job) -> None:
        """The job's settlement waits in the outbox: it keeps its slot until it lands."""
        job.parked = True
        if self._outbox_task is None or self._outbox_task.done():
            self._outbox_task = asyncio.create_task(self._retry_outbox())

    async def _retry_outbox(self) -> None:
        """Retry what the outbox holds after each backoff wait, until it is empty."""
        while len(self.core.outbox):
            await asyncio.sleep(self.core.backoff.retry_s)
            retry = self.core.outbox_due()
            self._slot_free.set()  # what was given up left the worker's hands
            await asyncio.gather(*(self._send(job, settle) for job, settle in retry))

    def _forget(self, job: _Job) -> None:
        self.core.forget(job)
        self._slot_free.set()

    # ------------------------------------------------------------------ leases
    async def _extend(self, job: _Job, seconds: float) -> float:
        """``ctx.extend``, made by the core (:meth:`.core.WorkerCore.extend`)."""
        return await self._drive(self.core.extend(job, seconds))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TICK_S)
            self.progress.tick(self.stats, len(self.jobs), self.clock.monotonic())
            await self._drive(self.core.heartbeat(self.clock.now()))

    async def _drive(self, steps: Steps[R]) -> R:
        """Run a core operation, awaiting each call it asks for."""
        try:
            effect = next(steps)
            while True:
                answer: ExtendAnswer
                try:
                    answer = await self.q.extend(effect.lease, effect.seconds)
                except Exception as exc:  # noqa: BLE001 - the core decides what an error means
                    answer = exc
                effect = steps.send(answer)
        except StopIteration as stop:
            result: R = stop.value
            return result


async def _first(*aws) -> None:
    """Wait until the first of ``aws`` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
