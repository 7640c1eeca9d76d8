"""The asyncio client: ``q = await shardq.aio.connect("var/shardq")``.

An executor of the client engine (:mod:`.engine`), as the threaded
:class:`~shardq.client.router.Router` is: the same calls, wire protocol, typed errors and
retry rules, as coroutines over one asyncio connection per shard (:mod:`.aioconn`, a shell
around the connection state machine of :mod:`.channel`). Keys map to shards as in the
router, so both clients can be mixed.

* Calls made in one event-loop turn leave in one frame per shard; single-job ``enqueue``
  and single-lease ``ack`` calls of a turn are merged into one request per shard, so many
  coroutines each sending one job cost what one batch does.
* Cancelling a call leaves no lease behind: a watch is forgotten; a waiting dequeue is
  withdrawn; a dequeue already written is left to answer, and whatever a request its
  caller left leases is released at once (a ``nack`` that does not count as a delivery),
  a reply that came before the cancel landed included.
* ``close()`` fails the calls still out: one whose request was written with
  :class:`~shardq.errors.OutcomeUnknown` (the shard may have applied it), any other with
  :class:`~shardq.errors.Closed`.
* ``async for lease in q.consume("emails", concurrency=50)`` yields leases, holding at most
  ``concurrency`` that are not yet settled through this client (:mod:`.aioconsume`).
* A client belongs to the event loop that connected it: a call from any other raises
  :class:`~shardq.errors.UsageError` at once (connect one client per loop).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import asyncio
import os
from asyncio import get_running_loop
from collections.abc import AsyncIterator, Callable, Coroutine

from .. import limits
from ..datadir import DataDir
from ..errors import Closed, ShardUnavailable, UsageError
from ..protocol import validate
from ..types import JobId, Lease
from .aioconn import ShardConn
from . import aioconsume
from .aioconsume import Consumer
from .channel import Request
from .core import ConnectionLost, ack_error
from .effects import OPEN, Abandon, AsyncExecutor, Collect, Op, Owner, Park, Send, Sleep, Submit, Wake, deliver
from .engine import Calls, learn_owner, place, release
from .routing import job_item, lease_shard

if TYPE_CHECKING:
    from .contracts import AsyncQueue as AsyncQueueContract
    from .contracts import AsyncResults

T = TypeVar("T")
OTHER_LOOP = "this client belongs to another event loop; connect one per loop"
FORKED = ("this client was connected in the parent process, before a fork: its connections and enqueue "
          "sessions are the parent's; connect one in this process")
LOOP_CLOSED = ("this client's event loop has closed (it was connected in another one: at import time, or in "
               "an asyncio.run of its own?); connect it in the loop that uses it, e.g. in a lifespan handler")


async def connect(target: str | os.PathLike[str], *, retry_s: float = 15.0,
                  request_timeout_s: float = 30.0, _role: str = "client") -> AsyncQueue:
    """An asyncio client of the ``shardq serve`` whose data dir is ``target``. Connects to
    every shard now (a shard that is down is connected to when first needed). Raises
    :class:`~shardq.errors.ServiceNotRunning` within a second when no service runs there.
    ``_role`` as :class:`~shardq.client.router.Router`'s."""
    q = AsyncQueue(target, retry_s=retry_s, request_timeout_s=request_timeout_s, _role=_role)
    await q._open()
    return q


class AsyncQueue(Calls, AsyncExecutor):
    """See the module docstring. Create with :func:`connect`; one per event loop (a call
    from another raises :class:`~shardq.errors.UsageError`). Its calls beside the hot ones
    below come from the one table of both clients (:class:`~shardq.client.engine.Calls`)."""

    loop: asyncio.AbstractEventLoop  # the loop that connected it (set by _open)

    def __init__(self, data_dir: str | os.PathLike[str], *, retry_s: float = 15.0,
                 request_timeout_s: float = 30.0, _role: str = "client") -> None:
        # _role "service": a part of shardq serve itself (its SQS listener), whose connections
        # a shard holds apart from its clients' limit and does not busy-poll after answering
        # (protocol/sockio.py), as the Router's
        dd = DataDir(data_dir)
        self._role = _role
        self._init_calls(dd, retry_s, request_timeout_s)
        self._bind_effects()
        self._key = dd.authkey()
        self._sockets = [dd.socket_path(i) for i in range(self.shards)]
        self.conns: list[ShardConn] = []
        self._asking: dict[str, asyncio.Future[Any]] = {}  # queue -> its placement question in flight
        self._background: set[asyncio.Task[Any]] = set()
        self._consumers: list[Consumer] = []

    async def _open(self, check: bool = True, connect_s: float = 2.0) -> None:
        """Connect to every shard, trying for up to ``connect_s`` (``retry_s`` at most): a
        shard not reached by then is connected to when a request needs it."""
        self.loop = asyncio.get_running_loop()
        self._watch_forks()
        if check:  # fail now, not after retry_s, when no service runs at all (off the loop: it polls)
            await asyncio.to_thread(DataDir(self.data_dir).require_service)
        self.conns = [ShardConn(i, path, self._key, self.client_id, self.retry_s, self.request_timeout_s,
                                self._release_rows, self._role) for i, path in enumerate(self._sockets)]
        self._chans = [c.chan for c in self.conns]
        deadline = self.loop.time() + min(self.retry_s, connect_s)
        for r in await asyncio.gather(*(c.connect(deadline) for c in self.conns), return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, ShardUnavailable):
                await self.close()
                raise r

    # ------------------------------------------------------------------ the executor
    def _now(self) -> float:
        return self.loop.time()

    async def _do_send(self, effect: Send) -> list[Any]:
        calls, retry_s, timeout_s, errors = effect
        deadline = self.loop.time() + (self.retry_s if retry_s is None else retry_s)
        return await self._drive(deliver(self, calls, deadline, timeout_s, errors))

    async def _submit(self, effect: Submit) -> list[Any]:  # (in their order per shard: one turn, one frame)
        return [self._request(s, op, args, effect.deadline - self.loop.time()) for s, op, args in effect.calls]

    async def _park(self, effect: Park) -> tuple[None, list[Any]]:  # only to the shards connected now
        return None, [self._request(s, op, args, retry_s=0) if self.conns[s].proto is not None else None
                      for s, op, args in effect.calls]

    def _forked(self) -> None:
        """Every call of the copy fails its loop check (UsageError) before it touches a
        socket; the parent's are left alone."""
        self.loop = _FORKED

    def _check(self) -> None:
        """A hot call's checks (the table's calls: :meth:`_bind`, :meth:`_request`)."""
        if self._closed:
            raise Closed("client is closed")
        if get_running_loop() is not self.loop:
            raise self._wrong_loop()

    def _wrong_loop(self) -> UsageError:
        """The error of a call from a loop that is not this client's."""
        if self.loop is _FORKED:
            return UsageError(FORKED)
        return UsageError(LOOP_CLOSED if self.loop.is_closed() else OTHER_LOOP)

    def _bind(self, fn: Callable[..., Op[T]]) -> Callable[..., Coroutine[Any, Any, T]]:
        """A call of the table, refused at once (UsageError) from another event loop: its
        futures and connections are this client's loop's, where it would hang or fail
        obscurely."""
        async def method(*args: Any, **kwargs: Any) -> T:
            if get_running_loop() is not self.loop:
                raise self._wrong_loop()
            return await self._drive(fn(self, *args, **kwargs))
        return method

    @staticmethod
    async def _sleep(effect: Sleep) -> None:
        await asyncio.sleep(effect.seconds)

    def _request(self, shard: int, op: str, args: list[Any],
                 retry_s: float | None = None) -> tuple[ShardConn, Request | None, asyncio.Future[Any]]:
        if self._closed:
            raise Closed("client is closed")
        conn = self.conns[shard]
        return (conn, *conn.request(op, args, retry_s))

    async def _learn_owner(self, effect: Owner) -> int | None:
        """Do an :class:`~.effects.Owner`: calls that meet an unknown queue at once share one
        question."""
        queue, ask = effect
        asking = self._asking.get(queue)
        if asking is None:
            asking = self._asking[queue] = asyncio.ensure_future(self._drive(learn_owner(self, queue, ask)))
        try:
            return await asyncio.shield(asking)
        finally:
            if asking.done() and self._asking.get(queue) is asking:
                del self._asking[queue]

    async def _wake(self, effect: Wake) -> list[Any]:
        """Do a :class:`~shardq.client.effects.Wake`."""
        _, _, handles, deadline, settled = effect
        futs = [h[2] for h in handles if h is not None]
        pending = [f for f in futs if not f.done()]
        if pending and len(futs) - len(pending) <= settled:
            await asyncio.wait(pending, timeout=max(0.0, deadline - self.loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        return [_outcome(h) for h in handles]

    @staticmethod
    async def _collect(effect: Collect) -> list[Any]:
        """Do a :class:`~shardq.client.effects.Collect`."""
        if effect.timeout_s is not None:
            await asyncio.wait([h[2] for h in effect.handles], timeout=effect.timeout_s)
        else:
            for _, _, fut in effect.handles:
                if not fut.done():
                    try:
                        await fut
                    except Exception:  # noqa: BLE001, S110 - read in its place below
                        pass
        # as _outcome, inline (no call per request); nothing here cancels a request's future
        return [(fut.exception() or fut.result()) if fut.done() else OPEN for _, _, fut in effect.handles]

    @staticmethod
    async def _abandon(effect: Abandon) -> list[Any]:
        """Do an :class:`~shardq.client.effects.Abandon` (:meth:`~.channel.Channel.abandon`)."""
        for h in effect.handles:
            # (cancelled: its caller's cancellation reached the future it awaited)
            if h is not None and (not h[2].done() or h[2].cancelled()):
                h[0].abandon(h[1], h[2])
                h[2].cancel()
        return [_outcome(h) for h in effect.handles]

    # ------------------------------------------------------------------ the hot calls
    async def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                      priority: int = 0, dedup_id: str | None = None) -> JobId:
        """Durably add a job; returns its id once the owning shard has fsynced it."""
        self._check()
        item = job_item(body, key, queue, delay, priority, dedup_id)
        shard = self._placed(queue, key, priority, dedup_id)
        if shard is None:
            shard = await self._drive(place(self, queue, key, priority, dedup_id))
        conn = self.conns[shard]
        got: tuple[JobId, bool] = await conn.merged(conn.chan.enqueue_part, item)  # (its id, resent)
        return got[0]

    async def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if it was leased again since (an ack past the lease's
        deadline still deletes it while nobody leased it since)."""
        self._check()
        conn = self.conns[lease_shard(lease, self.shards)]
        try:
            err, resent = await conn.merged(conn.chan.ack_part, [lease.job_id, lease.token])
        finally:
            self._settled([lease])
        if err is not None and (error := ack_error(err, resent)) is not None:
            raise error

    def consume(self, queue: str = "default", concurrency: int = 10, *, wait: float = 1.0,
                visibility: float | None = None) -> AsyncIterator[Lease]:
        """``async for lease in q.consume(queue, concurrency=50)``: leases, at most
        ``concurrency`` held at once (a lease is held until this client acks, nacks or
        buries it, or its current deadline passes: an extend through this client moves
        it). Leaving the loop releases leases fetched but not yet handed out (not counted
        as deliveries)."""
        validate.count("concurrency", concurrency, limits.BATCH_JOBS_MAX)
        return Consumer(self, queue, concurrency, wait, visibility).run()

    def _settled(self, leases: list[Lease]) -> None:
        if self._consumers:
            aioconsume.settled(self._consumers, leases)

    def _extending(self, lease: Lease) -> Callable[[float | None], None] | None:
        return aioconsume.extending(self._consumers, lease) if self._consumers else None

    def _release(self, leases: list[Lease]) -> None:
        if leases:
            self.spawn(self._drive(release(self, leases)))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Close the connections. The replies of abandoned dequeues and withdrawn waits,
        and the releases of what they leased and of what a running ``consume()`` loop
        fetched and had not handed out, get a moment (2 s each) to finish first.
        The calls still out then fail: with OutcomeUnknown where the request was written
        (the shard may have applied it), else with Closed."""
        if self._closed:
            return
        if get_running_loop() is not self.loop:
            raise self._wrong_loop()
        for consumer in self._consumers:  # a consume() loop still running ends with Closed: its unhanded leases first
            self._release(consumer.unhanded())
        await asyncio.gather(*(c.settle_orphans(2.0) for c in self.conns))
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        self._closed = True
        for c in self.conns:
            c.close()

    def _loop_gone(self) -> None:
        """Its event loop has closed without :meth:`close`: nothing can run on it any more,
        so its connections are ended here, at once, rather than by the garbage collector
        (the shards count each against their connection limit until then)."""
        self._closed = True
        for c in self.conns:
            c.drop()

    async def __aenter__(self) -> AsyncQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _outcome(handle: tuple[ShardConn, Request | None, asyncio.Future[Any]] | None) -> Any:
    """What a waiting call was answered: :data:`~.effects.OPEN`, its value or its error."""
    if handle is None or not handle[2].done():
        return OPEN
    fut = handle[2]
    return ConnectionLost("abandoned", sent=True) if fut.cancelled() else fut.exception() or fut.result()


_FORKED: Any = object()  # the loop of a client copied by a fork (AsyncQueue._forked)


if TYPE_CHECKING:  # mypy checks the declared contracts (client/contracts.py) hold
    def _contracts(q: AsyncQueue) -> tuple[AsyncQueueContract, AsyncResults]:
        return q, q
