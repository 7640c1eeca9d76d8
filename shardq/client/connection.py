"""The threaded client's lanes to one shard: blocking connections of their own, each written to
and read from by the one caller holding it (no other thread, no future, no hand-off); each a
shell around a :class:`~.channel.Channel` (request ids, and the replies of requests whose
caller left).

A call takes a free lane of its shard, and another opens while fewer than :data:`LANES_MAX`
are open; a call that finds every one taken, or cannot connect, is answered :data:`SHARED` at
once, nothing sent: the router sends it the shared way, on its asyncio connections
(:mod:`.aioconn`), which pipeline and merge many threads' calls. A lane never re-sends and
never waits to connect: a break is reported (:class:`~.core.ConnectionLost`, saying whether
the request was written) and the engine decides, as for any call; after a failed connect
the lanes are not tried again for :data:`DOWN_S`.

While its replies have been coming quickly and callers have mostly found the first lane free,
a caller first polls for its reply without sleeping, for up to the router's ``busy_poll_us``
(:mod:`shardq.busypoll`): on the machines measured, waking from a sleep cost a lone call more
than the wait itself. A waiting dequeue alone takes a lane too, without the poll (its reply is
not about to come); at its deadline it is withdrawn (``cancel_wait``) and the caller reads
until the shard says so, so that a lease the wait made meanwhile is released at once. A
dequeue past its request timeout is read for a moment too (``WITHDRAW_SETTLE_S``); a reply
later still is read by the lane's next caller, and what it leased released.
"""
from __future__ import annotations

import os
import select
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from .. import limits
from ..busypoll import BUSY_POLL_US_DEFAULT, BusyPoll
from ..clock import Clock, SystemClock
from ..errors import ProtocolError
from ..protocol import wire
from ..protocol.sockio import connect_unix, shut
from .channel import RELEASE, Channel
from .core import WITHDRAW_SETTLE_S, ConnectionLost

#: What :meth:`Lane.call` returns when the call must go the shared way.
SHARED: Any = object()
LANES_MAX = 16      # a shard's lanes in one router: more callers at once go the shared way
DOWN_S = 0.5        # after a failed connect, calls go the shared way (which retries) this long
#: A handshake on a lane takes at most this long (one with a running shard: a millisecond);
#: past it the call goes the shared way, whose retries keep to the call's retry_s (a paused
#: shard's 2 s handshake had come on top of it)
CONNECT_S = 0.25
READ_BYTES = 64 << 10  # one read of a lane's replies takes at most this much (a larger frame: several)
_LEN = struct.Struct("!i")
_BROKEN = (EOFError, OSError, ValueError, msgpack.UnpackException, ProtocolError)


class Lanes:
    """Shard ``index``'s lanes: up to ``most`` blocking connections, one caller on each (see
    the module doc). A call takes a free one, opening another while fewer than ``most`` are
    open; with every one taken it is answered :data:`SHARED`. They share one busy-poll
    policy (a call that finds the first lane taken counts as one not alone) and the shard's
    enqueue sessions. ``release``: hands back, unstarted, the lease rows of a late reply
    nobody takes."""

    def __init__(self, index: int, address: str, authkey: bytes, role: str = "client",
                 busy_poll_us: int = BUSY_POLL_US_DEFAULT, clock: Clock | None = None, client_id: int = 0,
                 release: Callable[[list[Any]], None] | None = None, most: int = LANES_MAX):
        self.index, self.address, self.authkey, self.role = index, address, authkey, role
        self._mono = (clock or SystemClock()).monotonic
        self.chan = Channel(index, client_id, 0.0, hold=False)  # its sessions: every lane's
        self.release = release
        self.busy_poll = BusyPoll(busy_poll_us)
        self.most = most
        self.all = [Lane(self, self.chan)]
        self._grow = threading.Lock()
        self.down_until = 0.0  # after a failed connect, the shared way (which retries) until then
        self.connects = 0

    def call(self, op: str, args: list[Any], timeout: float, wait: bool = False) -> Any:
        """Make one request on a free lane: :data:`SHARED`, nothing sent, when none is free,
        they are closed or cannot connect, or for a request the shared way must refuse with
        its precise error (one that cannot be encoded or is over the frame limit). Else
        ``(value, error)``: the reply's value, or the shard's error, a ConnectionLost, or
        :class:`TimeoutError` when no reply came within ``timeout`` (``wait``: a
        ``dequeue_wait``, then withdrawn)."""
        lane = self._take()
        if lane is None:
            return SHARED
        try:
            if self.chan.closed:
                lane.broken()
                return SHARED
            if lane.conn is None and not lane.connect():
                return SHARED
            return lane.call(op, args, timeout, wait)
        finally:
            lane.lock.release()

    def busy(self) -> bool:
        """Every lane is taken now (and no other may open)."""
        return len(self.all) >= self.most and all(lane.lock.locked() for lane in self.all)

    def _take(self) -> Lane | None:
        lanes = self.all
        if lanes[0].lock.acquire(False):
            return lanes[0]
        self.busy_poll.note_shared()
        for lane in lanes[1:]:
            if lane.lock.acquire(False):
                return lane
        with self._grow:
            if len(self.all) >= self.most or self.chan.closed:
                return None
            lane = Lane(self, Channel(self.index, 0, 0.0, hold=False))
            lane.chan.sessions = self.chan.sessions
            lane.lock.acquire()
            self.all = [*self.all, lane]  # (a new list: others iterate the old one)
            return lane

    def forget(self) -> None:
        """In a forked child: close this process's copies of the lanes' sockets, sending
        nothing and shutting nothing down (the parent's connections stay as they are)."""
        for lane in self.all:
            conn, lane.conn, lane._fd = lane.conn, None, -1
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Close every lane (:meth:`Lane.close`)."""
        self.chan.closed = True
        for lane in self.all:
            lane.close()


class Lane:
    """One lane of :class:`Lanes`: a blocking connection and the channel of its requests,
    used by the one caller holding ``lock``."""

    def __init__(self, lanes: Lanes, chan: Channel) -> None:
        self.lanes, self.chan = lanes, chan
        self._mono = lanes._mono
        self.lock = threading.Lock()
        self.conn: Connection | None = None
        self._fd = -1
        self._buf = bytearray()                 # bytes read but not yet a whole frame
        self._scratch = bytearray(READ_BYTES)   # what one read lands in (see wire.read_frames)
        self._poll: Callable[[int], list[tuple[int, int]]] = select.poll().poll

    def call(self, op: str, args: list[Any], timeout: float, wait: bool) -> Any:
        chan, fd, busy = self.chan, self._fd, self.lanes.busy_poll
        rid = chan.next_rid
        try:
            data = wire.pack([[rid, op, args]])
        except (ValueError, TypeError, OverflowError):
            return SHARED
        if len(data) > limits.FRAME_BYTES_MAX:
            return SHARED
        chan.next_rid = rid + 1
        sent_at = self._mono()
        try:
            _write_frame(fd, _LEN.pack(len(data)) + data)
        except (OSError, ValueError):
            self.broken()
            return None, ConnectionLost(f"connection to shard {self.lanes.index} lost", sent=False)
        try:
            ready = not wait and busy.wanted() and busy.spin(self._poll)
            deadline = sent_at + timeout
            while True:
                reply = self._read(rid, deadline, ready)
                ready = False
                if reply is not None:
                    if not wait:
                        busy.note(self._mono() - sent_at)
                    status, payload = reply
                    return (payload, None) if status == wire.OK else (None, wire.error_from_payload(payload))
                if self._mono() >= deadline:
                    self._leave(rid, op)
                    return None, TimeoutError()
        except _BROKEN:
            self.broken()
            return None, ConnectionLost(f"connection to shard {self.lanes.index} lost", sent=True)

    def _leave(self, rid: int, op: str) -> None:
        """The caller of ``rid`` leaves before its reply (:meth:`Channel.left`): a wait is
        withdrawn, and read for until the shard confirms (or the reply beats it)."""
        chan = self.chan
        chan.left(rid, op)
        frames, _ = chan.flush(0.0)
        for frame in frames:
            _write_frame(self._fd, frame)
        end = self._mono() + WITHDRAW_SETTLE_S
        while chan.orphans() and self._mono() < end:
            self._read(0, end, False)

    def _read(self, mine: int, deadline: float, ready: object) -> tuple[int, Any] | None:
        """Read what the socket has (waiting until ``deadline`` unless the caller saw it
        ``ready``) and hand every reply but ``mine``'s to the channel; ``(status, payload)``
        of ``mine``'s if it came."""
        fd = self._fd
        if not ready and not self._poll(max(0, int((deadline - self._mono()) * 1000) + 1)):
            return None
        found = None
        # Each frame is decoded before the next read (it may be a view of the scratch buffer).
        for frame in wire.read_frames(fd, self._buf, self._scratch):
            replies = msgpack.unpackb(frame, raw=False, use_list=True)
            if len(replies) == 1 and replies[0][0] == mine:
                found = replies[0][1:]  # the usual frame: the caller's reply alone ([status, payload])
                continue
            for reply in replies:
                if reply[0] == mine:
                    found = reply[1:]
            for waiter, rows, _ in self.chan.replies(r for r in replies if r[0] != mine):
                if waiter is RELEASE and self.lanes.release is not None:
                    self.lanes.release(rows)
        return found

    def connect(self) -> bool:
        lanes, now = self.lanes, self._mono()
        if now < lanes.down_until:
            return False
        try:
            conn = connect_unix(lanes.address, lanes.authkey, CONNECT_S, lanes.role)
        except Exception:  # noqa: BLE001 - the shared way connects again, with the retry rules (core.Attempts)
            lanes.down_until = now + DOWN_S
            return False
        self.conn, self._fd, self._buf = conn, conn.fileno(), bytearray()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        self._poll = poller.poll
        self.chan.connected()
        lanes.connects += 1
        return True

    def broken(self) -> None:
        conn, self.conn, self._fd = self.conn, None, -1
        self.chan.broken(0.0)  # what a late reply would have leased expires by itself
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close the lane, once the late replies it waits for have come (a moment at most).
        A caller on it meanwhile finds its connection ended (its call reports
        ConnectionLost, and the shared way then Closed) and closes it itself."""
        self.chan.closed = True
        if self.lock.acquire(False):
            try:
                end = self._mono() + WITHDRAW_SETTLE_S  # a late reply's leases: read, to release them
                while self.conn is not None and self.chan.orphans() and self._mono() < end:
                    self._read(0, end, False)
                self.broken()
            except _BROKEN:
                self.broken()
            finally:
                self.lock.release()
        elif (conn := self.conn) is not None:
            try:
                shut(conn.fileno())
            except OSError:
                pass  # its caller closed it meanwhile


def _write_frame(fd: int, data: bytes) -> None:
    """One frame (its length header and payload: ``multiprocessing.connection``'s framing,
    what the shard reads), in one write where the socket takes it."""
    view = memoryview(data)[os.write(fd, data):]  # (one write, the usual case; the rest if cut short)
    while view:
        view = view[os.write(fd, view):]

