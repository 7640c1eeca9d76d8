"""One asyncio connection to a shard: framing, pipelining with coalescing, reconnects and
the retry policy. Used by :mod:`shardq.client.aio`.

* **Handshake.** The HMAC challenge of ``multiprocessing.connection`` runs once per
  connection on a blocking socket in a thread (``asyncio.to_thread``); the socket is then
  handed to the event loop (``loop.create_unix_connection(sock=...)``). Everything after
  that is native asyncio: a :class:`asyncio.Protocol` parses reply frames as bytes arrive,
  with no reader task and no executor.
* **Framing** is ``multiprocessing.connection``'s: a 4-byte big-endian signed length (or
  ``-1`` and an 8-byte length), then a msgpack array of requests, as the threaded client.
* **Coalescing.** Requests made during one event-loop turn leave in one frame (cut only
  past the frame limit, by the client core's cutter the threaded connection uses too:
  :func:`~shardq.client.core.encode_frames`), sent by a callback scheduled with ``call_soon``.
  Single-job ``enqueue`` calls of a turn are merged into one wire ``enqueue`` (one session,
  one id list; cut at ``BATCH_JOBS_MAX`` jobs and ``MERGE_BYTES_MAX`` bytes), and
  single-lease ``ack`` calls into one wire ``ack``; so 200 coroutines enqueuing one job each
  cost the shard about one request per turn, like a batch. A merged enqueue that the shard
  refuses as a whole (all-or-nothing) is re-sent call by call, so one caller's bad queue
  never fails another's job.
* **After a break** the connection decides nothing for the client's calls: every request
  it was given by :class:`~shardq.client.aio.AsyncQueue` fails with
  :class:`~shardq.client.core.ConnectionLost` (``sent``: it was written), and the engine
  (:func:`~shardq.client.engine.deliver`, the threaded client's too) decides what is sent
  again. The exception is the merged enqueues and acks of the hot path, which only the
  connection knows: they are re-queued here, with their sessions, by the same retry table
  (:func:`~shardq.client.core.after_break`). Reconnects are retried until each request's
  deadline, then :class:`~shardq.errors.ShardUnavailable`.
* **Giving up.** A caller that is cancelled or times out removes its waiter: a request
  nobody waits for any more is dropped from the outbox (never sent) or from the pending
  table (its reply is ignored). The one exception is a ``dequeue`` already written: its
  reply may hold leases, so it stays until the reply comes and those leases are released
  at once (``nack``, not counted as a delivery). A ``watch`` is simply forgotten.
* **Withdrawing a waiting dequeue** (:meth:`ShardConn.abandon`). A ``dequeue_wait`` nobody
  waits for any more is withdrawn with ``cancel_wait``. It stays pending until the shard
  says it was withdrawn (no reply will come); if the shard had answered it first, the
  leases of that reply are released at once, as an abandoned ``dequeue``'s. A broken
  connection takes the shard's waits with it, so a withdrawal is never re-sent.
"""
from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Any, cast
from collections.abc import Callable

import msgpack

from .. import limits
from ..errors import AuthError, Closed, ProtocolError, ShardUnavailable, TooManyConnections
from ..protocol import wire
from ..protocol.sockio import HANDSHAKE_TIMEOUT_S, connect_unix
from .core import (RECONNECT_DELAY_S_MAX, RECONNECT_DELAY_S_MIN, ConnectionLost, Sessions, after_break, encode_frames,
                   failed_connect, unreachable)

MERGE_BYTES_MAX = 8 * 1024 * 1024           # a merged enqueue holds at most this many body bytes
_HEADER = struct.Struct("!i")
_BIG = struct.Struct("!Q")
_OWN_DEADLINE = frozenset(("watch", "dequeue_wait"))  # the caller times these; no request timeout


class Req:
    """One wire request and the callers waiting for it.

    ``parts``: the waiters, each ``(future, n)`` where ``n`` is how many results of a merged
    request are theirs (1 for a single call; None: the whole result)."""

    __slots__ = ("op", "args", "parts", "sent", "resent", "retry_deadline", "timer", "session",
                 "on_orphan_reply", "rid", "merged", "report")

    def __init__(self, op: str, args: list[Any], parts: list[Any], retry_deadline: float, merged: bool = False):
        self.op, self.args, self.parts = op, args, parts
        self.sent = self.resent = False
        self.retry_deadline = retry_deadline
        self.timer: asyncio.TimerHandle | None = None
        self.session: list[Any] | None = None
        self.on_orphan_reply: Callable[[Any], None] | None = None  # dequeue: release leases
        self.rid = 0
        self.merged = merged
        self.report = False  # a break fails it with ConnectionLost: the engine decides (engine.deliver)


class _Protocol(asyncio.Protocol):
    def __init__(self, conn: ShardConn):
        self.conn = conn
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a unix stream's

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            frames = wire.split_frames(self.buf)  # a frame over the limit is refused
        except ProtocolError as e:
            self.conn.protocol_error(f"reply {e}")
            return
        for frame in frames:
            try:
                replies = msgpack.unpackb(frame, raw=False, use_list=True)
            except Exception:  # noqa: BLE001 - whatever msgpack raises, the frame is a protocol error
                self.conn.protocol_error("undecodable reply frame")
                return
            self.conn.on_replies(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.on_lost(self)


class ShardConn:
    """The connection to shard ``index``; the owner calls :meth:`submit` and awaits."""

    def __init__(self, index: int, address: str, authkey: bytes, client_id: int, retry_s: float,
                 request_timeout_s: float, release: Callable[[int, list[Any]], None]):
        self.index, self.address, self.authkey = index, address, authkey
        self.client_id = client_id
        self.retry_s, self.request_timeout_s = retry_s, request_timeout_s
        self._release = release  # (shard, wire lease rows) -> release them (orphaned dequeue)
        self.loop = asyncio.get_running_loop()
        self.proto: _Protocol | None = None
        self.closed = False
        self.connects = 0
        self.outbox: list[Req] = []
        self.pending: dict[int, Req] = {}
        self.enq_parts: list[tuple[asyncio.Future[Any], list[Any]]] = []   # single enqueues of this turn
        self.ack_parts: list[tuple[asyncio.Future[Any], list[Any]]] = []   # single acks of this turn
        self._flush_handle: asyncio.Handle | None = None
        self._reconnecting: asyncio.Task[Any] | None = None
        self._next_rid = 1
        self.sessions = Sessions(client_id)  # enqueue sessions not yet answered
        self._quiet: asyncio.Event | None = None  # set when no orphaned request is left (closing)

    # ------------------------------------------------------------------ connecting
    async def connect(self, deadline: float) -> None:
        """Connect and authenticate, retrying until ``deadline`` (loop time)."""
        delay = RECONNECT_DELAY_S_MIN
        while True:
            if self.closed:
                raise Closed("client is closed")
            timeout = max(0.05, min(HANDSHAKE_TIMEOUT_S, deadline - self.loop.time()))
            try:
                conn = await asyncio.to_thread(connect_unix, self.address, self.authkey, timeout)
                try:
                    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the loop's from here on
                finally:
                    conn.close()
                sock.setblocking(False)
                _, proto = await self.loop.create_unix_connection(lambda: _Protocol(self), sock=sock)
            except Exception as exc:  # noqa: BLE001 - failed_connect says which are worth another try
                if (fatal := failed_connect(self.index, exc)) is not None:
                    raise fatal from None
                err: BaseException = exc
            else:
                if self.closed:
                    proto.transport.close()
                    raise Closed("client is closed")
                self.proto = proto
                self.connects += 1
                self._schedule_flush()
                return
            if self.loop.time() + delay > deadline:
                raise unreachable(self.index, self.address, err, "client")
            await asyncio.sleep(delay)  # backoff between connection attempts
            delay = min(delay * 2, RECONNECT_DELAY_S_MAX)

    def _ensure_connecting(self) -> None:
        if self.proto is None and not self.closed and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = self.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while self.proto is None and not self.closed and self.outbox:
            deadline = max(r.retry_deadline for r in self.outbox)
            try:
                await self.connect(deadline)
            except (ShardUnavailable, Closed, AuthError, ProtocolError) as exc:
                self._fail_unsent(exc)
                return

    def _fail_unsent(self, exc: BaseException) -> None:
        """No connection came back: every request still waiting to be sent fails."""
        reqs, self.outbox = self.outbox, []
        for req in reqs:
            self._fail(req, exc if not isinstance(exc, ShardUnavailable) or isinstance(exc, TooManyConnections)
                       else ShardUnavailable(f"shard {self.index}: {exc}"))
        for parts in (self.enq_parts, self.ack_parts):
            items, parts[:] = list(parts), []
            for fut, _ in items:
                if not fut.done():
                    fut.set_exception(exc)

    # ------------------------------------------------------------------ submitting
    def submit(self, req: Req) -> None:
        """Queue ``req`` for the next flush (this loop turn)."""
        if self.closed:
            self._fail(req, Closed("client is closed"))
            return
        self._arm_timer(req)
        self.outbox.append(req)
        self._schedule_flush()

    def submit_enqueue(self, fut: asyncio.Future[Any], item: list[Any]) -> None:
        self.enq_parts.append((fut, item))
        self._schedule_flush()

    def submit_ack(self, fut: asyncio.Future[Any], pair: list[Any]) -> None:
        self.ack_parts.append((fut, pair))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _arm_timer(self, req: Req) -> None:
        if req.timer is None and req.op not in _OWN_DEADLINE:
            req.timer = self.loop.call_later(self.request_timeout_s, self._timed_out, req)

    def _timed_out(self, req: Req) -> None:
        req.timer = None
        self._fail(req, ShardUnavailable(f"shard {self.index} did not answer {req.op} within "
                                         f"{self.request_timeout_s:.1f} s"), keep_dequeue=True)
        self._check_quiet()

    def _merge(self) -> None:
        """Turn this turn's single enqueues and acks into merged requests."""
        now = self.loop.time()
        if self.enq_parts:
            parts, self.enq_parts = self.enq_parts, []
            chunk: list[Any] = []
            size = 0
            for fut, item in parts:
                if fut.done():
                    continue  # its caller gave up before it was sent
                if chunk and (len(chunk) >= limits.BATCH_JOBS_MAX or size + len(item[0]) > MERGE_BYTES_MAX):
                    self._add_merged_enqueue(chunk, now)
                    chunk, size = [], 0
                chunk.append((fut, item))
                size += len(item[0])
            if chunk:
                self._add_merged_enqueue(chunk, now)
        if self.ack_parts:
            parts, self.ack_parts = self.ack_parts, []
            live = [(f, p) for f, p in parts if not f.done()]
            for i in range(0, len(live), limits.BATCH_JOBS_MAX):
                chunk = live[i:i + limits.BATCH_JOBS_MAX]
                req = Req("ack", [[p for _, p in chunk]], [(f, 1) for f, _ in chunk],
                          now + self.retry_s, merged=True)
                self._arm_timer(req)
                self.outbox.append(req)

    def _add_merged_enqueue(self, chunk: list[Any], now: float) -> None:
        req = Req("enqueue", [[item for _, item in chunk], None], [(f, 1) for f, _ in chunk],
                  now + self.retry_s, merged=True)
        self._arm_timer(req)
        self.outbox.append(req)

    def _flush(self) -> None:
        self._flush_handle = None
        self._merge()
        proto = self.proto
        if proto is None or proto.transport is None or proto.transport.is_closing():
            if self.outbox:
                self._ensure_connecting()
            return
        reqs, self.outbox = self.outbox, []
        out: list[Req] = []
        for req in reqs:
            if not req.parts and (req.on_orphan_reply is None
                                  or req.op == "cancel_wait" and req.args[0] not in self.pending):
                self._finish(req)  # nobody waits for it (or the wait it withdraws) any more: never sent
                continue
            if req.op == "enqueue" and req.args[1] is None:  # a merged one (the engine's have theirs)
                req.session = self.sessions.open()
                req.args[1] = req.session
            rid = self._next_rid
            self._next_rid = rid + 1
            req.rid = rid
            req.sent = True
            self.pending[rid] = req
            out.append(req)
        if out:
            # One frame, cut only past the frame limit; a request that cannot be encoded fails alone.
            frames = encode_frames([[r.rid, r.op, r.args] for r in out], lambda i, error: self._fail(out[i], error))
            write = proto.transport.write
            for payload, _ in frames:
                self._write(write, payload)

    @staticmethod
    def _write(write: Callable[[bytes], object], payload: bytes) -> None:
        """Write one frame: ``payload`` (a msgpack array of requests) after its length."""
        n = len(payload)
        write((_HEADER.pack(n) if n <= 0x7FFFFFFF else _HEADER.pack(-1) + _BIG.pack(n)) + payload)

    # ------------------------------------------------------------------ replies
    def on_replies(self, replies: list[Any]) -> None:
        pending = self.pending
        for rid, status, payload in replies:
            req = pending.pop(rid, None)
            if req is None:
                continue  # a watch or a request whose callers gave up
            if status == wire.OK:
                self._complete(req, payload)
            elif req.merged and req.op == "enqueue" and len(req.parts) > 1:
                self._unmerge(req)  # all-or-nothing: nothing applied; re-send call by call
            else:
                self._fail(req, wire.error_from_payload(payload))
        if self._quiet is not None:
            self._check_quiet()

    def _has_orphans(self) -> bool:
        return any(not r.parts and r.on_orphan_reply is not None for r in self.pending.values())

    def _check_quiet(self) -> None:
        if self._quiet is not None and not self._has_orphans():
            self._quiet.set()

    async def settle_orphans(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the replies of abandoned dequeues and withdrawn waits,
        so that a lease one of them made is released as it comes (before a close)."""
        if not self._has_orphans():
            return
        self._quiet = asyncio.Event()
        try:
            await asyncio.wait_for(self._quiet.wait(), timeout)
        except TimeoutError:
            pass  # what is still out expires by itself
        finally:
            self._quiet = None

    def _complete(self, req: Req, payload: Any) -> None:
        self._finish(req)
        if not req.parts:
            if req.on_orphan_reply is not None:
                req.on_orphan_reply(payload)
            return
        if req.merged:
            for i, (fut, _) in enumerate(req.parts):
                if not fut.done():
                    fut.set_result((payload[i], req.resent))
        else:
            fut = req.parts[0][0]
            if not fut.done():
                fut.set_result((payload, req.resent))

    def _unmerge(self, req: Req) -> None:
        self._finish(req)
        now = self.loop.time()
        for (fut, _), item in zip(req.parts, req.args[0]):
            if not fut.done():
                single = Req("enqueue", [[item], None], [(fut, 1)], now + self.retry_s, merged=True)
                self.submit(single)

    def _fail(self, req: Req, exc: BaseException, keep_dequeue: bool = False) -> None:
        """Fail every waiter of ``req``. A written dequeue whose reply may still come stays
        pending (``keep_dequeue``) so its leases can be released when it does."""
        parts, req.parts = req.parts, []
        if keep_dequeue and req.op == "dequeue" and req.sent and req.rid in self.pending:
            req.on_orphan_reply = self._orphan_release()
        else:
            self.pending.pop(req.rid, None)
            self._finish(req)
        if req in self.outbox:
            self.outbox.remove(req)
        for fut, _ in parts:
            if not fut.done():
                fut.set_exception(exc)

    def _finish(self, req: Req) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        if req.session is not None:
            self.sessions.close(req.session)

    def abandon(self, req: Req, fut: asyncio.Future[Any]) -> None:
        """``fut``'s caller gave up (cancelled, timed out, or another shard answered its
        wait). Its waiter goes; a request left with no waiter leaves the outbox or the
        pending table, except that a written dequeue stays until its reply, to release its
        leases, and a written waiting dequeue is withdrawn (:meth:`_withdraw`)."""
        req.parts = [p for p in req.parts if p[0] is not fut]
        if req.parts:
            return
        if not req.sent:
            if req in self.outbox:
                self.outbox.remove(req)
            self._finish(req)
        elif req.op == "dequeue" and req.rid in self.pending:
            req.on_orphan_reply = self._orphan_release()
        elif req.op == "dequeue_wait":
            if self.pending.get(req.rid) is req:  # not yet answered, failed or gone
                self._withdraw(req)
        else:
            self.pending.pop(req.rid, None)
            self._finish(req)

    def forget(self, fut: asyncio.Future[Any]) -> None:
        """A single enqueue/ack caller gave up: find the merged request holding its future
        (a rare path, so a scan) and abandon it there."""
        for req in list(self.pending.values()) + self.outbox:
            if req.merged and any(p[0] is fut for p in req.parts):
                self.abandon(req, fut)
                return

    def _withdraw(self, req: Req) -> None:
        """Withdraw the written waiting dequeue ``req`` nobody waits for (``cancel_wait``).
        It stays pending until the shard says it was withdrawn; a reply that beat the
        withdrawal has its leases released unstarted."""
        req.on_orphan_reply = self._orphan_release()
        cancel = Req("cancel_wait", [req.rid], [], self.loop.time())
        cancel.on_orphan_reply = lambda withdrawn: self._withdrawn(req) if withdrawn is True else None
        self.submit(cancel)

    def _withdrawn(self, req: Req) -> None:
        """The shard withdrew ``req``'s wait: it will never be answered."""
        if self.pending.get(req.rid) is req:
            del self.pending[req.rid]
            self._finish(req)
        self._check_quiet()

    def _orphan_release(self) -> Callable[[Any], None]:
        return lambda rows: self._release(self.index, rows) if rows else None

    # ------------------------------------------------------------------ breaking
    def protocol_error(self, why: str) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.abort()  # connection_lost follows

    def on_lost(self, proto: _Protocol) -> None:
        if self.proto is not proto:
            return
        self.proto = None
        reqs = sorted(self.pending.values(), key=lambda r: r.rid)
        self.pending = {}
        requeue = []
        now = self.loop.time()
        for req in reqs:
            if req.on_orphan_reply is not None and not req.parts:
                self._finish(req)  # an abandoned dequeue: its leases (if any) expire
                continue
            if req.report:
                self._fail(req, ConnectionLost(f"connection to shard {self.index} lost", sent=req.sent))
                continue
            error = after_break(self.index, req.op, req.sent, now >= req.retry_deadline)
            if error is not None:
                self._fail(req, error)
                continue
            req.resent = req.resent or req.sent
            req.sent = False
            requeue.append(req)
        self.outbox[:0] = [r for r in requeue if r.parts or r.on_orphan_reply is not None]
        self._check_quiet()
        if not self.closed:
            self._ensure_connecting()

    def close(self) -> None:
        self.closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        exc = Closed("client is closed")
        for req in list(self.pending.values()) + self.outbox:
            self._fail(req, exc)
        self.pending, self.outbox = {}, []
        for parts in (self.enq_parts, self.ack_parts):
            for fut, _ in parts:
                if not fut.done():
                    fut.set_exception(exc)
            parts.clear()
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None
