"""The asyncio client: ``q = await shardq.aio.connect("var/shardq")``.

The same wire protocol, authentication, typed errors and retry rules as the threaded
:class:`~shardq.client.router.Router`, as coroutines on asyncio unix-socket transports
(:mod:`.aioconn` holds the connection: handshake, pipelining, coalescing, reconnects). Both
drive one client core (:mod:`.core`, :mod:`.routing`), which decides what is sent, re-sent,
kept and released; this module moves the requests and awaits.

* Keys map to shards as in the router (``crc32(key) % N``), so both clients can be mixed.
* Calls made in one event-loop turn leave in one frame per shard; single-job ``enqueue``
  and single-lease ``ack`` calls of a turn are merged into one request per shard, so many
  coroutines each sending one job cost what one batch does.
* ``dequeue(wait=...)`` long-polls as the router does: it asks every shard, then leaves a
  waiting dequeue (``dequeue_wait``) at each, and the first shard with a job answers with
  the lease; the others are withdrawn (a queue with priorities waits with a ``watch``).
  Cancelling it leaves no lease behind: a watch is forgotten; a waiting dequeue is
  withdrawn; a dequeue already written is left to answer. Whatever a request its caller
  left leases is released at once (a ``nack`` that does not count as a delivery).
* ``async for lease in q.consume("emails", concurrency=50)`` yields leases, holding at most
  ``concurrency`` that are not yet settled (acked, nacked, buried or expired) through
  this client.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import asyncio
import itertools
import os

from collections import deque
from collections.abc import AsyncIterator, Coroutine

from .. import limits
from ..clock import SystemClock
from ..datadir import DataDir
from ..protocol import status_file
from ..errors import Closed, ShardqError, ShardUnavailable
from ..protocol import validate
from ..types import JobId, Lease
from .aioconn import ShardConn
from .channel import Request
from .engine import (AsyncExecutor, Calls, Effect, Owner, Release, Send, Settled, Sleep, Status, Transmit,
                     WaitAny, call, deliver, note_priorities)
from .core import ConnectionLost, ack_error, release_call
from .routing import (job_item, lease_shard, leases_of, placed_owner)

if TYPE_CHECKING:
    from .contracts import AsyncQueue as AsyncQueueContract
    from .contracts import AsyncResults

_now = SystemClock.now


async def connect(target: str | os.PathLike[str], *, retry_s: float = 15.0,
                  request_timeout_s: float = 30.0) -> AsyncQueue:
    """An asyncio client of the ``shardq serve`` whose data dir is ``target``. Connects to
    every shard now (a shard that is down is connected to when first needed). Raises
    :class:`~shardq.errors.ServiceNotRunning` within a second when no service runs there."""
    q = AsyncQueue(target, retry_s=retry_s, request_timeout_s=request_timeout_s)
    await q._open()
    return q


class AsyncQueue(Calls, AsyncExecutor):
    """See the module docstring. Create with :func:`connect`; one per event loop. Its calls
    beside the hot ones below come from the one table of both clients
    (:class:`~shardq.client.engine.Calls`)."""

    def __init__(self, data_dir: str | os.PathLike[str], *, retry_s: float = 15.0,
                 request_timeout_s: float = 30.0) -> None:
        dd = DataDir(data_dir)
        self.data_dir = dd.path
        self.shards = dd.shards()
        self.service_id = dd.service_id()
        self.retry_s, self.request_timeout_s = retry_s, request_timeout_s
        self._key = dd.authkey()
        self._client_id = int.from_bytes(os.urandom(8), "little") >> 1
        self._sockets = [dd.socket_path(i) for i in range(self.shards)]
        self.conns: list[ShardConn] = []
        self._rr = itertools.count()
        self._queue_cfg: dict[str, dict[str, Any]] = {}
        self._owners: dict[str, int | None] = {}  # queue -> the shard of all its jobs if placed (docs/limits.md)
        self._asking: dict[str, asyncio.Future[Any]] = {}  # queue -> its placement question in flight
        self._prioritized: set[str] = set()  # queues known to use priorities (sticky)
        self._noted: set[str] = set()        # queues every shard was told so (note_priorities)
        self._background: set[asyncio.Task[Any]] = set()
        self._consumers: list[_Consumer] = []
        self._closed = False

    async def _open(self) -> None:
        self.loop = asyncio.get_running_loop()
        # fail now, not after retry_s, when no service runs at all (off the loop: it polls)
        await asyncio.to_thread(DataDir(self.data_dir).require_service)
        self.conns = [ShardConn(i, path, self._key, self._client_id, self.retry_s,
                                self.request_timeout_s, self._release_rows)
                      for i, path in enumerate(self._sockets)]
        deadline = self.loop.time() + min(self.retry_s, 2.0)
        results = await asyncio.gather(*(c.connect(deadline) for c in self.conns), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ShardUnavailable):
                await self.close()
                raise r

    # ------------------------------------------------------------------ the executor
    def _now(self) -> float:
        return self.loop.time()

    def _session(self, shard: int) -> list[int]:
        return self.conns[shard].chan.sessions.open()

    def _done(self, shard: int, session: list[int]) -> None:
        self.conns[shard].chan.sessions.close(session)

    async def _effect(self, effect: Effect) -> Any:
        if type(effect) is Send:
            calls, retry_s, timeout_s, errors = effect
            deadline = self.loop.time() + (self.retry_s if retry_s is None else retry_s)
            return await self._drive(deliver(self, calls, deadline, timeout_s, errors))
        if type(effect) is Transmit:
            return await self._transmit(effect)
        if type(effect) is WaitAny:
            return await self._wait_any(effect)
        if type(effect) is Release:
            self._release_leases(effect.leases)
            return None
        if type(effect) is Sleep:
            await asyncio.sleep(effect.seconds)
            return None
        if type(effect) is Owner:
            await self._learn_owner(effect.queue, effect.ask)
            return self._owners[effect.queue]
        if type(effect) is Status:
            status_file.add_to(effect.shards, DataDir(self.data_dir).run_dir)
            return None
        if type(effect) is Settled:
            for lease in effect.leases:
                self._settled(lease)
            return None
        raise TypeError(f"not an effect: {effect!r}")

    async def _transmit(self, effect: Transmit) -> list[Any]:
        """Do a :class:`~shardq.client.engine.Transmit`: the calls sent at once (in their
        order per shard: one turn, one frame), each its value, its error or its
        :class:`~.core.ConnectionLost` in its place, waiting ``timeout_s`` at most for all
        (None: each its request timeout); the engine decides what is sent again."""
        calls, deadline, timeout_s = effect
        started = [self._request(s, op, args, deadline - self.loop.time()) for s, op, args in calls]
        try:
            if timeout_s is not None:
                await asyncio.wait([f for _, _, f in started], timeout=timeout_s)
            got: list[Any] = []
            for (_, _, fut), (s, op, _) in zip(started, calls):
                if timeout_s is not None and not fut.done():
                    got.append(ShardUnavailable(f"shard {s} did not answer {op} within {timeout_s:.1f} s"))
                    continue
                try:
                    got.append(await fut)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - returned in its place
                    got.append(exc)
            return got
        finally:
            for conn, req, fut in started:
                if not fut.done() or fut.cancelled():
                    conn.abandon(req, fut)

    def _request(self, shard: int, op: str, args: list[Any],
                 retry_s: float | None = None) -> tuple[ShardConn, Request | None, asyncio.Future[Any]]:
        if self._closed:
            raise Closed("client is closed")
        conn = self.conns[shard]
        return (conn, *conn.request(op, args, retry_s))

    async def _call(self, shard: int, op: str, args: list[Any], retry_s: float | None = None) -> Any:
        return await self._drive(call(shard, op, args, retry_s))

    async def _learn_owner(self, queue: str, ask: int) -> None:
        """As :meth:`Router._learn_owner`: a queue's placement, asked once (docs/limits.md).
        Calls that meet an unknown queue at once share one question."""
        asking = self._asking.get(queue)
        if asking is None:
            asking = self._asking[queue] = asyncio.ensure_future(self._call(ask, "queue_config", [queue]))
        try:
            cfg = await asyncio.shield(asking)
        finally:
            if asking.done() and self._asking.get(queue) is asking:
                del self._asking[queue]
        self._queue_cfg.setdefault(queue, cfg)
        self._owners.setdefault(queue, placed_owner(cfg))

    # ------------------------------------------------------------------ producing
    async def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                      priority: int = 0, dedup_id: str | None = None) -> JobId:
        """Durably add a job; returns its id once the owning shard has fsynced it."""
        if self._closed:
            raise Closed("client is closed")
        item = job_item(body, key, queue, delay, priority, dedup_id)
        if priority and queue not in self._noted:
            await self._drive(note_priorities(self, [queue]))
        shard = self._shard_for(key)
        if queue not in self._owners:
            await self._learn_owner(queue, shard)
        owner = self._owners[queue]
        conn = self.conns[shard if owner is None else owner]  # a placed queue: its owner
        fut = conn.enqueue(item)
        try:
            got: tuple[JobId, bool] = await fut  # (its id, resent): one part of a merged enqueue
            return got[0]
        except asyncio.CancelledError:
            conn.forget(fut)
            raise

    async def _wait_any(self, effect: WaitAny) -> list[Any] | None:
        """Do a :class:`~shardq.client.engine.WaitAny`: the waiting calls go to the shards
        connected now; when it ends, the ones still open are abandoned
        (:meth:`ShardConn.abandon` withdraws a waiting dequeue and forgets a watch).
        Cancelled, it leaves no lease behind: what it was answered is released unstarted."""
        started = [(i,) + self._request(shard, op, args, retry_s=0)
                   for i, (shard, op, args) in enumerate(effect.calls) if self.conns[shard].proto is not None]
        if not started:
            return None
        limit = effect.limit_s if len(started) == len(effect.calls) else effect.short_s
        try:
            waiting = {f for _, _, _, f in started}
            end = self.loop.time() + limit
            while waiting:
                done, waiting = await asyncio.wait(waiting, timeout=max(0.0, end - self.loop.time()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                # A lease, an error or a broken connection ends the wait; so does its end.
                if not done or effect.first or any(f.cancelled() or f.exception() is not None or f.result()
                                                   for f in done):
                    break
        except BaseException:  # cancelled: nobody takes what was answered
            for (_, op, args), got in zip(effect.calls, self._answers(effect, started)):
                if op == "dequeue_wait" and type(got) is list and got:
                    self._release_leases([lease for _, lease in leases_of(args[0], got)])
            raise
        return self._answers(effect, started)

    @staticmethod
    def _answers(effect: WaitAny, started: list[Any]) -> list[Any]:
        """Abandon the waiting calls still open; per call its value, its error or None."""
        out: list[Any] = [None] * len(effect.calls)
        for i, conn, req, f in started:
            if not f.done():
                conn.abandon(req, f)
                f.cancel()
            elif f.cancelled():
                continue
            elif f.exception() is None:
                out[i] = f.result()
            elif not isinstance(f.exception(), (ShardUnavailable, ConnectionLost)):  # its connection broke
                out[i] = f.exception()
        return out

    async def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if the lease is no longer current."""
        if self._closed:
            raise Closed("client is closed")
        conn = self.conns[lease_shard(lease, self.shards)]
        fut = conn.ack([lease.job_id, lease.token])
        try:
            err, resent = await fut
        except asyncio.CancelledError:
            conn.forget(fut)
            raise
        finally:
            self._settled(lease)
        if err is not None and (error := ack_error(err, resent)) is not None:
            raise error

    def consume(self, queue: str = "default", concurrency: int = 10, *, wait: float = 1.0,
                visibility: float | None = None) -> AsyncIterator[Lease]:
        """``async for lease in q.consume(queue, concurrency=50)``: leases, at most
        ``concurrency`` held at once (a lease is held until this client acks, nacks or
        buries it, or its deadline passes). Leaving the loop releases leases fetched but
        not yet handed out (not counted as deliveries)."""
        validate.count("concurrency", concurrency, limits.BATCH_JOBS_MAX)
        return _Consumer(self, queue, concurrency, wait, visibility).run()

    def _settled(self, lease: Lease) -> None:
        for c in self._consumers:
            c.settled(lease)

    def _release_rows(self, shard: int, rows: list[Any]) -> None:
        """Release leases nobody will get (an abandoned dequeue's reply): not deliveries."""
        self._release_leases([lease for _, lease in leases_of("", rows)])  # a release needs no queue name

    def _release_leases(self, leases: list[Lease]) -> None:
        """Hand ``leases`` back unstarted (not deliveries), without waiting."""
        for lease in leases:
            self.spawn(self._release_one(lease))

    async def _release_one(self, lease: Lease) -> None:
        try:
            await self._call(*release_call(lease))
        except ShardqError:
            pass  # it expires by itself

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Close the connections. The replies of abandoned dequeues and withdrawn waits,
        and the releases of what they leased, get a moment (2 s each) to finish first."""
        if self._closed:
            return
        await asyncio.gather(*(c.settle_orphans(2.0) for c in self.conns))
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        self._closed = True
        for c in self.conns:
            c.close()

    async def __aenter__(self) -> AsyncQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Consumer:
    """State of one ``consume()`` loop."""

    def __init__(self, q: AsyncQueue, queue: str, concurrency: int, wait: float, visibility: float | None):
        self.q, self.queue, self.concurrency = q, queue, concurrency
        self.wait, self.visibility = wait, visibility
        self.held: dict[tuple[Any, ...], float] = {}   # (job_id, token) -> deadline
        self.buffer: deque[Lease] = deque()
        self.freed = asyncio.Event()

    def settled(self, lease: Lease) -> None:
        if self.held.pop((lease.job_id, lease.token), None) is not None:
            self.freed.set()

    def _expire(self) -> float | None:
        now = _now()  # lease deadlines are wall-clock seconds
        for ref, deadline in list(self.held.items()):
            if deadline <= now:
                del self.held[ref]
        return min(self.held.values(), default=None)

    async def run(self) -> AsyncIterator[Lease]:
        q = self.q
        q._consumers.append(self)
        try:
            while True:
                if not self.buffer:
                    soonest = self._expire()
                    room = self.concurrency - len(self.held)
                    if room <= 0:
                        self.freed.clear()
                        timeout = None if soonest is None else max(0.0, soonest - _now())
                        try:
                            await asyncio.wait_for(self.freed.wait(), timeout)
                        except TimeoutError:
                            pass
                        continue
                    leases = await q.dequeue_many(self.queue, max_jobs=room, wait=self.wait,
                                                  visibility=self.visibility)
                    for lease in leases:
                        self.held[(lease.job_id, lease.token)] = lease.deadline
                    self.buffer.extend(leases)
                    continue
                yield self.buffer.popleft()
        finally:
            q._consumers.remove(self)
            left, self.buffer = list(self.buffer), deque()
            q._release_leases(left)


if TYPE_CHECKING:  # mypy checks the declared contracts (client/contracts.py) hold
    def _contracts(q: AsyncQueue) -> tuple[AsyncQueueContract, AsyncResults]:
        return q, q
