"""One authenticated connection from a router to a shard, shared by many threads: a shell around the
connection's state machine (:class:`~.channel.Channel`: request ids, the table of requests due a reply,
frames, what a break means, withdrawals), which it drives under one lock, moving bytes and waking threads.

Requests from concurrent threads are coalesced: whichever thread finds no send in progress sends everything
queued so far (pipelining without a sender thread). Every reply but a lone call's (below) is read by the
connection's reader thread, which reads while replies are due and sleeps while none is; a caller waiting
for its reply sleeps on its :class:`Future` until that thread settles it. A request queued with ``on=`` goes
only on that connection, so a caller's later request cannot overtake an earlier one that must be re-sent
(``Router._submit``).

A caller alone on the connection (nothing pending, no send in progress, the socket free to read) takes a
shorter path, :meth:`ShardClient.call_solo`: no future, no pending entry; it sends its frame and reads until
its own reply, settling any others it reads (the reader thread waits for it meanwhile). While its replies
have been coming quickly, it first polls for its reply without sleeping, for up to the router's ``busy_poll_us``
(:mod:`shardq.busypoll`): on the machines measured, waking from a sleep cost a lone call more than the wait
itself. A lone waiting dequeue takes this path too (``Router._wait_solo``), without the poll: its reply is
not about to come.
"""
from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

from collections.abc import Callable
from typing import Any

import msgpack

from ..protocol import wire as protocol
from .. import limits
from ..clock import Clock, SystemClock
from ..conditions import CountedCondition
from ..errors import ProtocolError, ShardUnavailable
from ..protocol.sockio import connect_unix
from ..busypoll import BUSY_POLL_US_DEFAULT, BusyPoll
from .channel import RELEASE, Channel, Completion, Request
from .core import ConnectionLost as ConnectionLost  # re-exported: tests import it from here
from .core import Attempts


_SET_LOCK = threading.Lock()  # makes Future.set a test-and-set: one setter wins, always
#: What :meth:`ShardClient.call_solo` returns when the connection is shared right now.
SHARED = object()


class Future:
    """A reply slot. ``wait`` blocks on a plain lock, the cheapest wake-up CPython has.
    ``set`` may race (reader vs. a breaking connection): the first call wins, later ones
    change nothing, and the lock is released exactly once. Once set it lets go of its
    request (``req``; ``epoch`` stays), so the two leave no garbage cycle behind."""

    __slots__ = ("_lock", "done", "value", "error", "callback", "req", "epoch")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.value = None
        self.error: BaseException | None = None
        self.callback: Callable[[Future], None] | None = None
        self.req: Request | None = None  # its request in the channel, until settled (None: failed at once)
        self.epoch = -1  # the connection its request went on (-1: none)

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        with _SET_LOCK:
            if self.done:
                return
            self.value, self.error, self.done = value, error, True
        self.req = None  # (after ``done``: a caller that finds no request finds it settled)
        self._lock.release()
        if self.callback is not None:
            self.callback(self)

    def wait(self, timeout: float | None = None) -> bool:
        if self.done:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            self._lock.release()
            return True
        return self.done


class ShardClient:
    def __init__(self, index: int, address: str, authkey: bytes, role: str = "client",
                 busy_poll_us: int = BUSY_POLL_US_DEFAULT, clock: Clock | None = None, client_id: int = 0,
                 release: Callable[[list[Any]], None] | None = None):
        self.index = index
        self._mono = (clock or SystemClock()).monotonic  # every deadline here is on this clock
        self.address, self.authkey = address, authkey
        self.role = role  # what the handshake says this connection is (protocol.sockio)
        self.chan = Channel(index, client_id, 0.0, hold=False)  # only ever used with _lock held
        self._release = release  # lease rows nobody will take (an abandoned dequeue's reply)
        self._lock = threading.Lock()
        self._idle = CountedCondition(self._lock)  # signalled when a send ends, or orphans settle
        self._sending: Connection | None = None
        self._conn: Connection | None = None
        self._fd = -1  # the descriptor of _conn, set with it (a lone call reads it under _lock)
        self._flushing = False
        self._read_lock = threading.Lock()     # held by whoever reads the socket (reader thread, lone call)
        self._reader_cond = threading.Condition()
        self._reader_wanted = False             # replies are due that no lone call will read
        self._reader_active = False
        self._buf = bytearray()                 # bytes read but not yet a whole frame
        self._scratch = bytearray(READ_BYTES)   # what one read lands in (see wire.read_frames)
        self._poller = select.poll()            # readability of the connection (lone calls)
        self._poller_fd = -1
        self._busy = BusyPoll(busy_poll_us)     # how call_solo waits for its reply
        self.connects = 0

    # ------------------------------------------------------------------ connection
    @property
    def connected(self) -> bool:
        return self._conn is not None

    def ensure_connected(self, deadline: float) -> None:
        """Connect if not connected, retrying until ``deadline`` (monotonic)."""
        attempts = Attempts(self.index, self.address, "router", deadline)
        while self._conn is None:
            with self._lock:
                if self._conn is not None:
                    return
                if self.chan.closed:
                    raise ShardUnavailable(f"shard {self.index}: router closed")
                try:
                    conn = connect_unix(self.address, self.authkey, attempts.timeout(self._mono()), self.role)
                except Exception as e:  # noqa: BLE001 - Attempts.failed says which are worth another try
                    delay = attempts.failed(e, self._mono())
                else:
                    self._conn, self._fd, self._buf = conn, conn.fileno(), bytearray()
                    self.chan.connected()
                    self.connects += 1
                    threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                     name=f"shardq-reader-{self.index}").start()
                    return
            time.sleep(delay)  # backoff between connection attempts, not synchronisation

    def close(self) -> None:
        with self._lock:
            self.chan.closed = True
            conn = self._conn
        if conn is not None:
            self._broken(conn)

    def settle_orphans(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the replies of abandoned dequeues and withdrawn waits,
        so that a lease one of them made is released as it comes (before a close)."""
        self._want_reader()
        with self._lock:
            self._idle.wait_for(lambda: self._conn is None or not self.chan.orphans(), timeout)

    # ------------------------------------------------------------------ requests
    def submit(self, op: str, args: list[Any], *, on: int = 0, fut: Future | None = None) -> Future:
        """Send one request (coalesced with other threads'); the reader thread reads its
        reply and settles the future. ``on``: the connection it must go on (an earlier
        request's ``Future.epoch``); on any other, or none, it fails at once with
        ConnectionLost, unsent (:meth:`Channel.submit`). ``fut``: the caller's (new) future
        to settle."""
        if fut is None:
            fut = Future()
        with self._lock:
            got = self.chan.submit(op, args, fut, 0.0, on=on)
            if isinstance(got, BaseException):
                fut.set(error=got)
                return fut
            fut.req, fut.epoch = got, got.epoch
            flush = not self._flushing
            self._flushing = True
        if flush:
            self._flush()  # else the thread sending now takes ours too
        if not fut.done:
            self._want_reader()
        return fut

    def forget(self, fut: Future) -> bool:
        """The caller stopped waiting for ``fut`` (timeout, cancellation, another shard's
        answer): :meth:`Channel.abandon` (a waiting dequeue is withdrawn). True when its
        reply came first: ``fut`` is being settled by the thread that read it."""
        req = fut.req
        if req is None:  # failed at once, or settled already
            return False
        with self._lock:
            answered = self.chan.abandon(req, fut)
            flush = bool(self.chan.outbox) and not self._flushing
            self._flushing = self._flushing or flush
        if flush:
            self._flush()  # a withdrawal (cancel_wait), read for as the wait it withdraws
        return answered

    def call_solo(self, op: str, args: list[Any], timeout: float, wait: bool = False) -> Any:
        """One request on the shortest path, when this caller is alone on the connection
        (connected, nothing pending, no send in progress, nobody reading). Returns
        :data:`SHARED` without sending anything otherwise, or for a request the general path
        must refuse with its precise error (one that cannot be encoded or is over the frame
        limit). Else ``(value, error)``: the reply's value, or the shard's error, a
        :class:`ConnectionLost` (``sent`` as for a future), or :class:`TimeoutError` when no
        reply came within ``timeout`` (a late one is then dropped). Other threads' requests
        queued meanwhile go out right after it, and replies read here settle their futures;
        the wait starts with a busy poll when :class:`BusyPoll` says so, unless the request
        itself waits (``wait``: a ``dequeue_wait``, withdrawn if it times out), whose reply
        is not about to come."""
        if not self._read_lock.acquire(False):
            self._busy.note_shared()
            return SHARED
        try:
            chan = self.chan  # (its attributes read inline: this is the hottest path)
            with self._lock:
                conn, fd = self._conn, self._fd
                if conn is None or self._flushing or chan.pending or chan.outbox:
                    if conn is not None:
                        self._busy.note_shared()
                    return SHARED
                rid = chan.next_rid
                chan.next_rid = rid + 1
                self._flushing = True  # others queue behind this send; _flush below sends theirs
                self._sending = conn
            try:
                data = protocol.pack([[rid, op, args]])
            except (ValueError, TypeError, OverflowError):
                data = None
            if data is None or len(data) > limits.FRAME_BYTES_MAX:
                self._flush()
                return SHARED
            busy = self._busy
            try:
                sent_at = self._mono()
                _write_frame(fd, _LEN.pack(len(data)) + data)
            except (OSError, ValueError):
                self._broken(conn)
                self._flush()
                return None, ConnectionLost(f"connection to shard {self.index} lost", sent=False)
            self._flush()  # clears the send flag, after sending whatever others queued meanwhile
            try:
                deadline = sent_at + timeout
                ready = not wait and busy.wanted() and busy.spin(self._poll_for(fd), chan.pending)
                while True:
                    reply = self._read_once(conn, max(deadline - self._mono(), 0.0), rid, ready, fd)
                    ready = False
                    if reply is not None:
                        if not wait:
                            busy.note(self._mono() - sent_at)
                        status, payload = reply
                        if status == protocol.OK:
                            return payload, None
                        return None, protocol.error_from_payload(payload)
                    if self._conn is not conn:
                        return None, ConnectionLost(f"connection to shard {self.index} lost", sent=True)
                    if self._mono() >= deadline:
                        with self._lock:
                            self.chan.left(rid, op)  # a late dequeue's leases are released; a wait withdrawn
                            flush = bool(chan.outbox) and not self._flushing
                            self._flushing = self._flushing or flush
                        if flush:
                            self._flush()
                        return None, TimeoutError()
            except (EOFError, OSError, ValueError, msgpack.UnpackException, ProtocolError):
                self._broken(conn)
                return None, ConnectionLost(f"connection to shard {self.index} lost", sent=True)
        finally:
            self._read_lock.release()
            if chan.pending or chan.outbox:
                self._want_reader()

    def _flush(self) -> None:
        """Write what the channel has to send, until nothing is left (only the thread that
        set ``_flushing``)."""
        while True:
            with self._lock:
                conn = self._conn
                frames, done = self.chan.flush(0.0) if conn is not None and self.chan.outbox else ([], [])
                self._sending = conn if frames else None
                if not frames:
                    self._flushing = False
                    if self._idle.waiters:
                        self._idle.notify_all()
            if done:
                self._settle(done)
            if not frames or conn is None:  # (frames come only while connected)
                return
            written = 0
            try:
                fd = conn.fileno()
                for data in frames:
                    _write_frame(fd, data)
                    written += 1
            except (OSError, ValueError):
                self._broken(conn, written)

    def _settle(self, done: list[Completion]) -> None:
        for waiter, value, error in done:
            if waiter is RELEASE:
                if self._release is not None:
                    self._release(value)
            else:
                waiter.set(value, error)

    def _poll_for(self, fd: int) -> Callable[[int], list[tuple[int, int]]]:
        """The ``poll`` method of a poller registered for ``fd`` (kept while the fd is)."""
        if self._poller_fd != fd:
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN)
            self._poller_fd = fd
        return self._poller.poll

    def _read_once(self, conn: Connection, timeout: float | None, mine: int = 0,
                   ready: object = False, fd: int = -1) -> tuple[int, Any] | None:
        """Read what the socket has (waiting up to ``timeout``, unless the caller saw it
        ``ready``; None: until something comes) and settle every complete reply. Only with
        ``_read_lock`` held. Returns ``(status, payload)`` of the reply to request ``mine``
        (a :meth:`call_solo` caller's, which has no future; ``fd``: ``conn``'s) if it was read."""
        fd = conn.fileno() if fd < 0 else fd
        if timeout is not None and not ready:
            poll = self._poller.poll if self._poller_fd == fd else self._poll_for(fd)
            if not poll(max(0, int(timeout * 1000) + 1)):
                return None
        found = None
        # Each frame is decoded before the next read (it may be a view of the scratch buffer).
        for frame in protocol.read_frames(fd, self._buf, self._scratch):
            replies = msgpack.unpackb(frame, raw=False, use_list=True)
            if mine:
                if len(replies) == 1 and replies[0][0] == mine:
                    found = replies[0][1:]  # ([status, payload]) the lone call's reply alone: not the channel's
                    continue
                for rid, status, payload in replies:
                    found = (status, payload) if rid == mine else found
            with self._lock:
                done = self.chan.replies(replies)
                if self._idle.waiters:
                    self._idle.notify_all()
            self._settle(done)
        return found

    def _want_reader(self) -> None:
        with self._reader_cond:
            self._reader_wanted = True
            if not self._reader_active:
                self._reader_cond.notify()

    def _read_loop(self, conn: Connection) -> None:
        """The connection's reader thread: reads while replies are due (waiting for the read
        lock while a lone call reads its own), then sleeps until asked again (a request
        submitted, or left due by a lone call). It owns ``conn``: the only thread that
        closes it, once no send and no reader uses it, so its descriptor number can never
        be reused under another thread's read or write."""
        try:
            while self._conn is conn:
                with self._reader_cond:
                    while not self._reader_wanted and self._conn is conn:
                        self._reader_cond.wait()
                    self._reader_wanted = False
                    self._reader_active = True
                try:
                    # not only the requests written: one queued but not yet written was
                    # queued before its caller asked for a reader, and is read for too
                    while self._conn is conn and self.chan:
                        with self._read_lock:
                            if self._conn is not conn or not self.chan:
                                break
                            self._read_once(conn, None)
                finally:
                    with self._reader_cond:
                        self._reader_active = False
        except (EOFError, OSError, ValueError, msgpack.UnpackException, ProtocolError):
            self._broken(conn)
        finally:
            with self._lock:
                while self._sending is conn:
                    self._idle.wait()
            with self._read_lock:  # a lone call may still be reading it
                conn.close()

    def _broken(self, conn: Connection, whole_frames: int | None = None) -> None:
        """``conn`` broke (a write failed after ``whole_frames`` frames of the last flush)."""
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            done = self.chan.broken(0.0, whole_frames)
            if self._idle.waiters:
                self._idle.notify_all()
        _shutdown(conn)  # a blocked read returns; the reader thread closes it
        with self._reader_cond:
            self._reader_cond.notify()
        self._settle(done)


_LEN = struct.Struct("!i")
READ_BYTES = 256 << 10  # one read of replies takes at most this much


def _write_frame(fd: int, data: bytes) -> None:
    """One frame (its length header and payload: ``multiprocessing.connection``'s framing,
    what the shard reads), in one write where the socket takes it."""
    view = memoryview(data)[os.write(fd, data):]  # (one write, the usual case; the rest if cut short)
    while view:
        view = view[os.write(fd, view):]


def _shutdown(conn: Connection) -> None:
    """End the connection for both directions without freeing its descriptor."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()
