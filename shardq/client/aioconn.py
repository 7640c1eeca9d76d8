"""One asyncio connection to a shard: a shell around the connection's state machine
(:class:`~.channel.Channel`: request ids, the pending table, the merging of single enqueues
and acks, deadlines, what a break means, orphaned leases, withdrawals), which moves its
bytes and resolves its callers' futures. Used by :mod:`shardq.client.aio`.

* **Handshake.** The HMAC challenge of ``multiprocessing.connection`` runs once per
  connection on a blocking socket in a thread (``asyncio.to_thread``); the socket is then
  handed to the event loop (``loop.create_unix_connection(sock=...)``). Everything after
  that is native asyncio: a :class:`asyncio.Protocol` parses reply frames as bytes arrive,
  with no reader task and no executor.
* **Coalescing.** What is queued during one event-loop turn leaves in one frame, written by
  a callback scheduled with ``call_soon``; so 200 coroutines enqueuing one job each cost the
  shard about one request per turn, like a batch (:meth:`~.channel.Channel.flush`).
* **Reconnects** are tried while a request waits to be written, until the latest of their
  retry deadlines; then each fails with :class:`~shardq.errors.ShardUnavailable`. One timer
  per connection fails the requests past their request timeout (:meth:`~.channel.Channel.tick`).
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, cast
from collections.abc import Callable

import msgpack

from ..errors import AuthError, Closed, ProtocolError, ShardUnavailable
from ..protocol import wire
from ..protocol.sockio import connect_unix
from .channel import RELEASE, Channel, Completion, Request
from .core import Attempts


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
    """The connection to shard ``index``; the client makes requests and awaits their futures."""

    def __init__(self, index: int, address: str, authkey: bytes, client_id: int, retry_s: float,
                 request_timeout_s: float, release: Callable[[list[Any]], None], role: str = "client"):
        self.index, self.address, self.authkey, self.role = index, address, authkey, role
        self.chan = Channel(index, client_id, retry_s, request_timeout_s, gone=asyncio.Future.done)
        self._release = release  # wire lease rows nobody takes (an orphaned reply) -> release them
        self.loop = asyncio.get_running_loop()
        self.proto: _Protocol | None = None
        self.connects = 0
        self._flush_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reconnecting: asyncio.Task[Any] | None = None
        self._quiet: asyncio.Event | None = None  # set when no orphaned request is left (closing)

    async def connect(self, deadline: float) -> None:
        """Connect and authenticate, retrying until ``deadline`` (loop time)."""
        attempts = Attempts(self.index, self.address, self.role, deadline)
        while True:
            if self.chan.closed:
                raise Closed("client is closed")
            try:
                conn = await asyncio.to_thread(connect_unix, self.address, self.authkey,
                                               attempts.timeout(self.loop.time()), self.role)
                try:
                    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the loop's from here on
                finally:
                    conn.close()
                sock.setblocking(False)
                _, proto = await self.loop.create_unix_connection(lambda: _Protocol(self), sock=sock)
            except Exception as exc:  # noqa: BLE001 - Attempts.failed says which are worth another try
                await asyncio.sleep(attempts.failed(exc, self.loop.time()))  # back-off between attempts
                continue
            if self.chan.closed:
                proto.transport.close()
                raise Closed("client is closed")
            self.proto = proto
            self.chan.connected()
            self.connects += 1
            return self._schedule_flush()

    async def _reconnect(self) -> None:
        while self.proto is None and (deadline := self.chan.reconnect_deadline()) is not None:
            try:
                await self.connect(deadline)
            except (ShardUnavailable, Closed, AuthError, ProtocolError) as exc:
                self._settle(self.chan.unreachable(exc))
                return

    # ------------------------------------------------------------------ requests
    def request(self, op: str, args: list[Any], retry_s: float | None = None
                ) -> tuple[Request | None, asyncio.Future[Any]]:
        """Queue a request for this turn's frame; its future gets its value or error (a
        break: :class:`~.core.ConnectionLost`, the engine decides what is sent again)."""
        fut = self.loop.create_future()
        got = self.chan.submit(op, args, fut, self.loop.time(), retry_s)
        if isinstance(got, BaseException):
            fut.set_exception(got)
            return None, fut
        self._schedule_flush()
        return got, fut

    async def merged(self, add: Callable[[list[Any], Any], None], item: list[Any]) -> Any:
        """A single-job enqueue or single-lease ack (``add``: the channel's
        :meth:`~.channel.Channel.enqueue_part` or :meth:`~.channel.Channel.ack_part`), merged
        with this turn's others: ``(id, resent)`` or ``(error, resent)``. A caller cancelled
        takes its part out of the merged request."""
        if self.chan.closed:
            raise Closed("client is closed")
        fut = self.loop.create_future()
        add(item, fut)
        self._schedule_flush()
        try:
            return await fut
        except asyncio.CancelledError:
            self.chan.forget(fut)
            raise

    def abandon(self, req: Request | None, fut: asyncio.Future[Any]) -> None:
        """``fut``'s caller gave up (:meth:`~.channel.Channel.abandon`)."""
        if req is not None:
            self.chan.abandon(req, fut)
        if self.chan.outbox:
            self._schedule_flush()  # a withdrawal

    def _schedule_flush(self) -> None:
        if self._flush_handle is None and not self.chan.closed:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        proto = self.proto
        if proto is not None and (proto.transport is None or proto.transport.is_closing()):
            return  # connection_lost follows, and flushes
        frames, done = self.chan.flush(self.loop.time())
        self._settle(done)
        if frames and proto is not None and proto.transport is not None:  # (frames come only while connected)
            write = proto.transport.write
            for frame in frames:
                write(frame)
        elif self.chan.outbox and not self.chan.up and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = self.loop.create_task(self._reconnect())
        self._arm()

    def _arm(self) -> None:
        deadline = self.chan.next_deadline()
        if deadline is not None and (self._timer is None or self._timer.when() > deadline):
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._settle(self.chan.tick(self.loop.time()))
        self._arm()

    def _settle(self, done: list[Completion]) -> None:
        for fut, value, error in done:
            if fut is RELEASE:
                self._release(value)
            elif not fut.done():
                if error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(error)
        if self._quiet is not None and not self.chan.orphans():
            self._quiet.set()

    # ------------------------------------------------------------------ replies and breaks
    def on_replies(self, replies: list[Any]) -> None:
        self._settle(self.chan.replies(replies))
        if self.chan.outbox:
            self._schedule_flush()  # a merged enqueue refused as a whole, item by item

    async def settle_orphans(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the replies of abandoned dequeues and withdrawn waits,
        so that a lease one of them made is released as it comes (before a close)."""
        if not self.chan.orphans():
            return
        self._quiet = asyncio.Event()
        try:  # (not wait_for: in 3.11 it loses a cancel that comes as the wait ends)
            async with asyncio.timeout(timeout):
                await self._quiet.wait()
        except TimeoutError:
            pass  # what is still out expires by itself
        finally:
            self._quiet = None

    def protocol_error(self, why: str) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.abort()  # connection_lost follows

    def on_lost(self, proto: _Protocol) -> None:
        if self.proto is not proto:
            return
        self.proto = None
        self._settle(self.chan.broken(self.loop.time()))
        self._schedule_flush()  # what waits to be written: reconnect

    def drop(self) -> None:
        """End the connection with the loop closed (:meth:`~.aio.AsyncQueue._loop_gone`): the
        transport's ``close`` would schedule on that loop, so its socket is shut and closed
        here; nothing is settled (no caller is left to tell)."""
        proto, self.proto = self.proto, None
        self.chan.closed = True
        transport = None if proto is None else proto.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the shard ended it first
        raw = getattr(transport, "_sock", None)  # (the selector transport's socket: no public close off its loop)
        if raw is not None:
            raw.close()
            transport._sock = None  # type: ignore[attr-defined]  # closed: else its __del__ warns it was not

    def close(self) -> None:
        for handle in (self._flush_handle, self._timer, self._reconnecting):
            if handle is not None:
                handle.cancel()
        self._settle(self.chan.close())
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None
