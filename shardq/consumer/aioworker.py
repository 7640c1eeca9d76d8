"""The asyncio runner: the worker core's effects executed on one event loop.

``shardq worker myapp.tasks`` gives a queue this worker when one of its tasks is an
``async def``. On its loop (in a thread of its own) one coroutine drives the core's loop
(:meth:`.core.WorkerCore.run`, with :func:`.core.adrive`): every lease, heartbeat,
settlement (acks and reports merged in one round), outage, stop and grace period is decided
there, as for the thread worker. Up to ``concurrency`` jobs run at once, each an asyncio
task: an ``async def`` task is awaited on the loop (with an idempotency store, its
transaction runs in a thread of its own: :mod:`.aiotxn`); a plain function, or a body that
names no async task (an unknown task or a bad body is dead-lettered, never a crash loop),
runs in a thread (:class:`.threads.JobThreads`) through the same :meth:`~.handling.Runs.run`.
``await ctx.extend(s)`` sets a job's lease length; whatever a task raises is its failed
attempt (:mod:`.aiotxn`). ``stop()`` (any thread): stop leasing (a waiting dequeue is
cancelled, which leaves no lease behind), let running jobs finish for ``grace_s``, then
release their leases and cancel them (their transactions roll back). ``run_async``'s
task cancelled from outside is such a stop whose grace period is over at once. A plain task
still running then is left to finish in its thread, which neither :meth:`AsyncWorker.run`'s
``asyncio.run`` nor the interpreter's exit waits for (:mod:`.threads`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..client import aio
from ..client.contracts import AsyncResults
from ..clock import Clock, SystemClock
from ..errors import ShardqError
from ..stopping import install_stop_signals, restore_signals
from ..types import Lease
from .aiotxn import run_async
from .core import Dequeue, Held, Start, Wait, WorkerCore, WorkerStats, adrive
from .handling import AsyncHandler, Context, Report, Result, Runs, async_handler, failed, log
from .idempotency import IdempotencyStore, pruning
from .options import WorkerOptions, options_of
from .threads import JobThreads

if TYPE_CHECKING:  # prometheus_client is imported only by a worker that serves metrics
    from .metrics import WorkerMetrics

ASYNC_CONCURRENCY_DEFAULT = 50  # jobs at once: asyncio tasks are cheap
PROGRESS_DRAIN_S = 2.0  # at the end, progress calls still on their way get this long (as in the client's close)


class AsyncContext(Context):
    """``ctx`` of an async task: as :class:`Context`, with ``await ctx.extend(seconds)``
    and ``ctx.db`` the async API of :mod:`.aiotxn`."""

    __slots__ = ("_aextend",)

    def __init__(self, lease: Lease, db: Any, extend: Any = None, *, session: Any = None,
                 client: LoopCalls | None = None, reports: list[Report] | None = None,
                 aextend: Callable[[float], Awaitable[float]]):
        super().__init__(lease, db, None, session=session, client=client, reports=reports)
        self._aextend = aextend

    async def extend(self, seconds: float) -> float:  # type: ignore[override]  # awaited by an async task
        return await self._aextend(seconds)

    def _report(self) -> None:
        # An async task runs on the loop: the progress call goes out without blocking it.
        if isinstance(self.client, LoopCalls):
            self.client.progress_soon(self.lease, self.fraction, self.note)


class LoopCalls:
    """The asyncio client's calls about a running job (:class:`~shardq.client.contracts.JobCalls`),
    made blocking for code in another thread than the loop's (sync tasks, and what
    ``ctx.after_commit`` asked, run in threads). The progress calls it sends without waiting
    are its own to finish: :meth:`drain` gives them a moment at the worker's end."""

    def __init__(self, q: AsyncResults, loop: asyncio.AbstractEventLoop):
        self._q, self._loop = q, loop
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    def _wait(self, coro: Any) -> Any:
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
        task = self._loop.create_task(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the progress calls still being sent (on the loop)."""
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=timeout_s)

    def arrive(self, shard: int, barrier: str, index: int, total: int, value: bytes, ttl_s: float,
               callback: list[Any]) -> str:
        return str(self._wait(self._q.arrive(shard, barrier, index, total, value, ttl_s, callback)))

    def barrier_values(self, shard: int, barrier: str) -> list[bytes]:
        return list(self._wait(self._q.barrier_values(shard, barrier)))


class AsyncWorker:
    """Runs task jobs of ``queue`` on an event loop. :meth:`run` blocks (it owns a loop);
    :meth:`run_async` runs on the caller's loop. ``target`` is a data dir (the worker
    connects, and closes its client at the end) or an open asyncio queue client (the
    caller's: used, not closed). ``handler``: an App's tasks (``TaskHandler``, as
    ``shardq worker myapp.tasks`` gives it), or a plain function of the job's context, an
    ``async def`` awaited on the loop or a ``def`` run in a thread (:class:`~.handling.PlainHandler`)."""

    def __init__(self, target: Any, handler: AsyncHandler | Callable[[Any], Any], options: WorkerOptions | None = None,
                 *, idempotency: IdempotencyStore | None = None, clock: Clock | None = None,
                 rng: random.Random | None = None, metrics: WorkerMetrics | None = None, **settings: Any):
        """``options``: a :class:`.options.WorkerOptions`; or its fields as keywords
        (``queue=``, ``concurrency=``, ``burst=``...), which make one; by keywords,
        ``concurrency`` is 50 unless given. ``prefetch`` is 0: a job leased starts at once."""
        tasks = async_handler(handler)
        o = options_of(options, {"concurrency": ASYNC_CONCURRENCY_DEFAULT, **settings} if options is None else settings)
        self.options, self.target, self.handler, self.store = o, target, tasks, idempotency
        # The jobs run on the loop's thread; a sync task's thread reads its job unlocked.
        self.core = WorkerCore(dataclasses.replace(o, prefetch=0), clock or SystemClock(),
                               lock=contextlib.nullcontext(), rng=rng, metrics=metrics)
        self.clock, self.stats = self.core.clock, self.core.stats
        # A job's calls go through the client's blocking LoopCalls (bound in run_async); its
        # reports go with the acks.
        self.runs = Runs(tasks, idempotency, collect=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # bound to a loop at its first use (3.10+): run_async makes its own
        self._done: list[tuple[Held, Result]] = []
        self._tasks: set[asyncio.Task[None]] = set()  # the jobs running
        self._threads = JobThreads("shardq-task")  # where plain tasks run: made again by each run_async

    # ------------------------------------------------------------------ public
    def run(self, max_jobs: int | None = None) -> WorkerStats:
        """Work until stopped, until ``max_jobs`` leases (of this call) are settled, or (with
        ``burst``) until the queue is drained, as :meth:`.worker.Worker.run`. In the main
        thread SIGTERM and SIGINT stop it, a second signal exits at once, as for
        :class:`.worker.Worker` (:meth:`run_async` leaves the signals to the caller's loop)."""
        old_handlers = install_stop_signals(self.stop, "shardq worker")
        try:
            return asyncio.run(self.run_async(max_jobs))
        finally:
            restore_signals(old_handlers)

    def stop(self) -> None:
        """Stop leasing and finish (see the module docstring). Safe from any thread."""
        self.core.stopping()  # the grace period counts from here
        loop, wake = self._loop, self._wake
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has finished
                loop.call_soon_threadsafe(wake.set)

    async def run_async(self, max_jobs: int | None = None) -> WorkerStats:
        self._loop = asyncio.get_running_loop()
        self._wake, self._done = asyncio.Event(), []
        owned = isinstance(self.target, (str, os.PathLike))
        q = await aio.connect(self.target, request_timeout_s=self.options.request_timeout_s) if owned else self.target
        calls = self.runs.client = LoopCalls(q, self._loop)
        self.q = q
        store = self.store
        self._threads = JobThreads("shardq-task", store.release_thread if store is not None else None)
        try:
            if self.store is not None and isinstance(q.service_id, str):
                await asyncio.to_thread(self.store.bind, q.service_id)
            with pruning(self.store, self.clock, self.options.prune_every_s):
                try:
                    await adrive(self.core.run(max_jobs), self._perform)
                except asyncio.CancelledError:  # from outside (a TaskGroup, a lifespan's end): as a
                    await self._cancel_runners()  # grace period over at once, not left to run on unacked
                    await adrive(self.core.abandon_all(), self._perform)
                    raise
            await self._cancel_runners()  # released at the grace period's end
        finally:
            self._threads.shutdown(wait=False)  # a plain task abandoned at the grace period's end runs on
            await calls.drain(PROGRESS_DRAIN_S)
            if owned:
                await q.close()
        return dataclasses.replace(self.stats)

    async def _cancel_runners(self) -> None:
        left = [task for task in self._tasks if not task.done()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    # ------------------------------------------------------------------ the loop's effects
    async def _perform(self, effect: Any) -> Any:
        if isinstance(effect, Start):
            task = asyncio.create_task(self._run(effect.job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return None
        if isinstance(effect, Wait) or (isinstance(effect, Dequeue) and effect.wait > 0):
            self._wake.clear()  # set by a job that finished, or by stop()
            if isinstance(effect, Dequeue):  # nothing in flight: a long poll that stop() cancels
                return await self._dequeue(effect)
            unseen_stop = self.core.stop_at is not None and self.core.grace_at is None  # its wake-up may be spent
            if not self._done and effect.seconds > 0 and not unseen_stop:
                with contextlib.suppress(TimeoutError):  # (not wait_for: it can lose a cancel in 3.11)
                    async with asyncio.timeout(effect.seconds):
                        await self._wake.wait()
            else:
                await asyncio.sleep(0)  # the jobs' turn
            done, self._done = self._done, []
            return done
        return await effect.call(self.q)

    async def _dequeue(self, effect: Dequeue) -> Any:
        if self.core.stop_at is not None:
            return []
        dequeue = asyncio.ensure_future(effect.call(self.q))
        stop = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait([dequeue, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not dequeue.done():
            dequeue.cancel()  # a waiting dequeue, cancelled: no lease is left behind
            await asyncio.gather(dequeue, return_exceptions=True)
            return []
        return dequeue.result()

    async def _extend(self, job: Held, seconds: float) -> float:
        """``ctx.extend``, made by the core (:meth:`.core.WorkerCore.extend`)."""
        return await adrive(self.core.extend(job, seconds), self._perform)

    # ------------------------------------------------------------------ one job
    async def _run(self, job: Held) -> None:
        result = self.core.start(job)
        if result is None:
            try:
                result = await self._execute(job)  # cancelled at the grace period's end: nothing comes back
            except Exception as exc:  # noqa: BLE001 - the runner's own failure: the job's failed attempt, settled
                result = failed(exc, job.lease, None, None, self.core.policy.max_deliveries)
        self._done.append((job, result))
        self._wake.set()

    async def _execute(self, job: Held) -> Result:
        lease, may_commit = job.lease, functools.partial(self.core.may_commit, job)
        limit, task = self.core.policy.max_deliveries, self.handler.task_of(lease.body)
        if task is None or not task.is_async:  # plain task, unknown task or bad body: the thread path says why
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, functools.partial(  # (not to_thread: see .threads)
                self.runs.run, lease, may_commit,
                lambda s: asyncio.run_coroutine_threadsafe(self._extend(job, s), loop).result(),
                job.reports, max_deliveries=limit))
        context = functools.partial(AsyncContext, aextend=functools.partial(self._extend, job))
        return await run_async(self.runs, self._run_task, lease, context, may_commit, job.reports, limit,
                               self._threads)

    async def _run_task(self, ctx: AsyncContext) -> None:
        task, args, kwargs = self.handler.resolve(ctx)
        await self.handler.run_async(task, ctx, args, kwargs)
