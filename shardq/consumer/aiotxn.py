"""``async def`` tasks on the asyncio runner, and ``ctx.db`` for them.

Without an idempotency store the task is awaited on the loop. With one, the job goes through
the same :meth:`~shardq.consumer.handling.Runs.run` as every other (seen check, BEGIN, the
task, claim, lease check, commit, in that order) in a thread of its own: a SQLite
transaction belongs to one thread and blocks while it works. That thread starts the task
on the loop and, until it ends, runs the statements the task awaits on ``ctx.db``
(``await ctx.db.execute(sql, params)`` returns the rows; ``executemany(sql, rows)``;
``run(fn, *args)`` calls ``fn(cursor, *args)`` there). The loop never touches the database.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue as queue_mod
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..types import Lease
from .handling import DONE, Abandoned, Context, Report, Result, Runs, failed
from .threads import job_thread

#: ``run(ctx)``: the task's coroutine for a job (its context made by the runner)
RunAsync = Callable[[Any], Awaitable[Any]]


def _execute(cur: Any, sql: str, params: Any = ()) -> list[Any]:
    cur.execute(sql, params)
    return cur.fetchall() if cur.description is not None else []


def _executemany(cur: Any, sql: str, rows: Iterable[Any]) -> int:
    cur.executemany(sql, rows)
    return int(cur.rowcount)


class InlineDb:
    """The async ``ctx.db`` API over a cursor in this very thread (an async task run by a
    thread worker, on a loop of its own). Every call goes through :meth:`run`."""

    def __init__(self, cursor: Any):
        self.cursor = cursor

    async def execute(self, sql: str, params: Any = ()) -> list[Any]:
        return list(await self.run(_execute, sql, params))

    async def executemany(self, sql: str, rows: Iterable[Any]) -> int:
        return int(await self.run(_executemany, sql, rows))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.cursor, *args)


class _BridgedDb(InlineDb):
    """The async ``ctx.db`` of a task whose transaction lives in another thread: each call
    is run there (:meth:`_OnLoop.__call__` serves them) and awaited here."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(None)
        self._loop = loop
        self.requests: queue_mod.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any] | None] = \
            queue_mod.SimpleQueue()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        fut = self._loop.create_future()
        self.requests.put((fn, args, fut))
        return await fut


class _OnLoop:
    """The handler :meth:`Runs.run` calls in the transaction's thread: start the task on the
    loop, serve its ``ctx.db`` calls until it ends; return its value or raise what it raised."""

    def __init__(self, run: RunAsync, loop: asyncio.AbstractEventLoop):
        self.run, self.loop = run, loop
        self.fut: concurrent.futures.Future[tuple[Any, BaseException | None]] | None = None

    def __call__(self, ctx: Context) -> Any:
        cursor, db = ctx.db, _BridgedDb(self.loop)
        ctx.db = db
        fut = asyncio.run_coroutine_threadsafe(self._guarded(ctx), self.loop)
        self.fut = fut
        fut.add_done_callback(lambda _: db.requests.put(None))
        while (request := db.requests.get()) is not None:
            fn, args, answer = request
            try:
                value, error = fn(cursor, *args), None
            except BaseException as exc:  # noqa: BLE001 - the task decides
                value, error = None, exc
            self.loop.call_soon_threadsafe(_settle, answer, value, error)
        try:
            value, raised = fut.result()
        except concurrent.futures.CancelledError:  # the runner gave the job up (its grace period ended)
            raise Abandoned(f"job {ctx.job_id}: given up at the grace period's end") from None
        if raised is None:
            return value
        raise raised

    async def _guarded(self, ctx: Context) -> tuple[Any, BaseException | None]:
        """The task: ``(value, None)`` or ``(None, what it raised)``; nothing it raises ends its
        asyncio task (a SystemExit would leave the loop, a CancelledError come here bare)."""
        try:
            return await self.run(ctx), None
        except BaseException as exc:  # noqa: BLE001 - a task never ends its runner
            if _runners_cancel(exc):
                raise
            return None, exc


def _runners_cancel(exc: BaseException) -> bool:
    """``exc`` is the runner's cancel of the job (grace over), not the task's own (a failure)."""
    return isinstance(exc, asyncio.CancelledError) and bool((this := asyncio.current_task()) and this.cancelling())


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


async def run_async(runs: Runs, run: RunAsync, lease: Lease, context: Callable[..., Context],
                    may_commit: Callable[[], bool] | None, reports: list[Report] | None,
                    max_deliveries: int | None, threads: concurrent.futures.Executor | None = None) -> Result:
    """One job of an ``async def`` task, as ``runs`` runs its jobs: ``run(ctx)`` awaited on
    the loop, without a store; with one, in :meth:`Runs.run` in a thread of its own. A
    cancelled job cancels the task (its transaction rolls back, quietly: :class:`Abandoned`)
    and raises CancelledError. ``threads``: where what ``ctx.after_commit`` asked runs
    without a store (the worker's :class:`~.threads.JobThreads`; None: the loop's default
    executor). Neither that nor the transaction's thread holds the process's exit
    (:mod:`.threads`)."""
    if runs.store is None:
        reports = reports if runs.collect else None
        ctx = context(lease, None, None, client=runs.client, reports=reports)
        try:
            await run(ctx)
            if ctx.has_after:  # it may block (a client call): in a thread
                await asyncio.get_running_loop().run_in_executor(threads, ctx.run_after)
            return DONE, None, None
        except BaseException as exc:  # noqa: BLE001 - a task never ends its runner
            if _runners_cancel(exc):
                raise
            return failed(exc, lease, ctx, reports, max_deliveries)
    loop, store = asyncio.get_running_loop(), runs.store
    handler = _OnLoop(run, loop)
    done: asyncio.Future[Result] = loop.create_future()

    def in_thread() -> None:
        try:
            result = runs.run(lease, may_commit, None, reports, max_deliveries=max_deliveries, handler=handler,
                              context=context)
        finally:
            store.release_thread()  # this thread ends: its store connection with it (one a job, else)
        try:
            loop.call_soon_threadsafe(_settle, done, result, None)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    job_thread(in_thread, f"shardq-txn-{lease.job_id}")
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        if handler.fut is not None:
            handler.fut.cancel()
        raise
