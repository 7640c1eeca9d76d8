"""``ctx.db`` for ``async def`` tasks: the idempotency transaction, driven from the loop,
run in a thread.

A SQLite transaction belongs to one thread and blocks while it works, so an async task's
transaction lives in a thread of its own (:class:`TxnThread`) for the length of the job:
the seen check, ``BEGIN``, every statement the task awaits, the claim, the lease check
and the commit all run there, in that order, as in :func:`~shardq.consumer.handling.execute`.
The event loop never touches the database; it only awaits the thread's answers.

An async task uses ``await ctx.db.execute(sql, params)`` (returns the rows),
``await ctx.db.executemany(sql, rows)`` and ``await ctx.db.run(fn, *args)`` (``fn(cursor,
*args)`` in the transaction's thread, for anything else).
"""
from __future__ import annotations

import asyncio
import queue as queue_mod
import threading
from typing import Any
from collections.abc import Callable

from .handling import DONE, DUPLICATE, LOST
from .idempotency import IdempotencyStore


def _execute(cur, sql: str, params=()) -> list:
    cur.execute(sql, params)
    return cur.fetchall() if cur.description is not None else []


def _executemany(cur, sql: str, rows) -> int:
    cur.executemany(sql, rows)
    return cur.rowcount


class InlineDb:
    """The async ``ctx.db`` API over a cursor in this very thread (an async task run by a
    thread worker, on a loop of its own)."""

    def __init__(self, cursor: Any):
        self.cursor = cursor

    async def execute(self, sql: str, params=()) -> list:
        return _execute(self.cursor, sql, params)

    async def executemany(self, sql: str, rows) -> int:
        return _executemany(self.cursor, sql, rows)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.cursor, *args)


_COMMIT, _ABORT = object(), object()


class TxnThread:
    """One job's idempotency transaction in its own thread. Use::

        txn = TxnThread(store, job_id, may_commit)
        if await txn.begin():              # False: already processed (skip, ack)
            try:
                value = await task(ctx with db=txn.db)
            except BaseException:
                await txn.finish(commit=False); raise
            outcome = await txn.finish(commit=True, result=encoded)  # DONE, DUPLICATE or LOST

    ``result`` (bytes, optional) is kept with the job's mark (``Txn.claim``). With
    ``read_kept=True``, a job found processed (``begin()`` False, or ``DUPLICATE``) has the
    result its first delivery kept in ``kept_result``, read in the transaction's thread so
    the loop never touches the database.
    """

    def __init__(self, store: IdempotencyStore, job_id: int | str,
                 may_commit: Callable[[], bool] | None, read_kept: bool = False):
        self._store, self._job_id, self._may_commit = store, job_id, may_commit
        self._read_kept = read_kept
        self.kept_result: bytes | None = None
        self._requests: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self._loop = asyncio.get_running_loop()
        self._begun: asyncio.Future = self._loop.create_future()
        self._ended: asyncio.Future = self._loop.create_future()
        self.db = _BridgedDb(self)

    async def begin(self) -> bool:
        threading.Thread(target=self._run, daemon=True, name=f"shardq-txn-{self._job_id}").start()
        return await self._begun

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        fut = self._loop.create_future()
        self._requests.put((fn, args, fut))
        return await fut

    async def finish(self, commit: bool, result: bytes | None = None) -> str:
        """Claim (keeping ``result`` with the mark) + lease check + commit (``commit``) or
        roll back; the outcome."""
        self._requests.put((_COMMIT if commit else _ABORT, (result,), None))
        return await asyncio.shield(self._ended)

    # ------------------------------------------------------------------ the thread
    def _answer(self, fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        def set_it():
            if not fut.done():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(value)
        try:
            self._loop.call_soon_threadsafe(set_it)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    def _run(self) -> None:
        try:
            if self._store.seen(self._job_id):
                self._keep_result()
                self._answer(self._begun, False)
                return
            with self._store.transaction() as txn:
                self._answer(self._begun, True)
                outcome = self._serve(txn)
            if outcome == DUPLICATE:
                self._keep_result()  # the other delivery's, committed: read after our rollback
            self._answer(self._ended, outcome)
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, never lost
            self._answer(self._begun, error=exc)
            self._answer(self._ended, error=exc)

    def _keep_result(self) -> None:
        if self._read_kept:
            self.kept_result = self._store.kept_result(self._job_id)

    def _serve(self, txn) -> str:
        while True:
            fn, args, fut = self._requests.get()
            if fn is _ABORT:
                txn.abort()
                return LOST
            if fn is _COMMIT:
                # No result: claim(job_id) alone, as a store written before results takes it.
                claimed = txn.claim(self._job_id) if args[0] is None else txn.claim(self._job_id, args[0])
                if not claimed:
                    txn.abort()  # another delivery committed it while we ran
                    return DUPLICATE
                if self._may_commit is not None and not self._may_commit():
                    txn.abort()  # lease lost: roll back, the redelivery wins
                    return LOST
                return DONE
            try:
                self._answer(fut, fn(txn.db, *args))
            except BaseException as exc:  # noqa: BLE001 - the task decides
                self._answer(fut, error=exc)


class _BridgedDb:
    """The async ``ctx.db`` of :class:`TxnThread`."""

    def __init__(self, txn: TxnThread):
        self._txn = txn

    async def execute(self, sql: str, params=()) -> list:
        return await self._txn.call(_execute, sql, params)

    async def executemany(self, sql: str, rows) -> int:
        return await self._txn.call(_executemany, sql, rows)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._txn.call(fn, *args)
