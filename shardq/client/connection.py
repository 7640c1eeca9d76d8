"""One authenticated connection from a router to a shard, shared by many threads.

Requests from concurrent threads are coalesced: whichever thread finds no send in progress
sends everything queued so far as one frame (pipelining without a sender thread). A reader
thread matches replies to :class:`Future` objects by request id. If the connection breaks,
every pending future fails with :class:`ConnectionLost`, which says whether the request had
been written (``sent``): the owner may re-send a request never written, and decides by the
op's retry policy (:data:`shardq.shard.wire.RETRY`) for one that was. Each future is taken
out of the pending table exactly once (by the reader, by the breaking of the connection, or
by :meth:`ShardClient.forget` when its caller gives up), so it is set at most once.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Connection

import msgpack

from ..shard import wire as protocol
from .. import limits
from ..errors import AuthError, InvalidJob, ProtocolError, ShardUnavailable
from ..shard.sockio import HANDSHAKE_TIMEOUT_S, connect_unix


class ConnectionLost(Exception):
    """The connection broke before the reply came (internal; the router re-sends or raises
    ShardUnavailable / OutcomeUnknown). ``sent``: the request had been written to the socket,
    so the shard may have applied it."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


_SET_LOCK = threading.Lock()  # makes Future.set a test-and-set: one setter wins, always


class Future:
    """A reply slot. ``wait`` blocks on a plain lock, the cheapest wake-up CPython has.
    ``set`` may race (reader vs. a breaking connection): the first call wins, later ones
    change nothing, and the lock is released exactly once."""

    __slots__ = ("_lock", "done", "value", "error", "callback", "rid", "sent")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.value = None
        self.error: BaseException | None = None
        self.callback = None
        self.rid = 0
        self.sent = False

    def set(self, value=None, error: BaseException | None = None) -> None:
        with _SET_LOCK:
            if self.done:
                return
            self.value, self.error, self.done = value, error, True
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

    def result(self, timeout: float | None = None):
        if not self.wait(timeout):
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return self.value


class ShardClient:
    def __init__(self, index: int, address: str, authkey: bytes):
        self.index = index
        self.address = address
        self.authkey = authkey
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # signalled when a send finishes
        self._sending: Connection | None = None
        self._conn: Connection | None = None
        self._pending: dict[int, Future] = {}
        self._outbox: list = []
        self._flushing = False
        self._next_rid = 1
        self._closed = False
        self.connects = 0

    # ------------------------------------------------------------------ connection
    @property
    def connected(self) -> bool:
        return self._conn is not None

    def ensure_connected(self, deadline: float) -> None:
        """Connect if not connected, retrying until ``deadline`` (monotonic)."""
        if self._conn is not None:
            return
        delay = 0.005
        while True:
            with self._lock:
                if self._conn is not None:
                    return
                if self._closed:
                    raise ShardUnavailable(f"shard {self.index}: router closed")
                try:
                    conn = connect_unix(self.address, self.authkey,
                                        max(0.05, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
                except (OSError, EOFError) as e:  # absent, refused, reset, or silent (timeout)
                    err = e
                except Exception as e:  # AuthenticationError and friends
                    if type(e).__name__ == "AuthenticationError":
                        raise AuthError(f"shard {self.index}: authentication failed (wrong key file?)") from None
                    err = e
                else:
                    self._conn = conn
                    self.connects += 1
                    threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                     name=f"shardq-reader-{self.index}").start()
                    return
            if time.monotonic() + delay > deadline:
                raise ShardUnavailable(f"shard {self.index} at {self.address} is not reachable: {err}")
            time.sleep(delay)  # backoff between connection attempts, not synchronisation
            delay = min(delay * 2, 0.2)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            self._broken(conn)

    # ------------------------------------------------------------------ requests
    def submit(self, op: str, args: list) -> Future:
        fut = Future()
        with self._lock:
            if self._conn is None:
                fut.set(error=ConnectionLost(f"shard {self.index} not connected", sent=False))
                return fut
            rid = self._next_rid
            self._next_rid = rid + 1
            fut.rid = rid
            self._pending[rid] = fut
            self._outbox.append((fut, [rid, op, args]))
            if self._flushing:
                return fut  # the thread sending now will take ours too
            self._flushing = True
        self._flush()
        return fut

    def forget(self, fut: Future) -> None:
        """The caller stopped waiting for ``fut`` (timeout, cancellation): take it out of
        the pending table so nothing is kept for a reply nobody reads."""
        self._pending.pop(fut.rid, None)

    def _flush(self) -> None:
        while True:
            with self._lock:
                batch, self._outbox = self._outbox, []
                conn = self._conn
                if not batch or conn is None:
                    self._flushing = False
                    self._sending = None
                    self._idle.notify_all()
                    return
                self._sending = conn
                for fut, _ in batch:
                    fut.sent = True  # from here on the shard may see it (see below)
            try:
                frames = self._encode(batch)
                for data in frames:
                    conn.send_bytes(data)
            except (OSError, ValueError):
                # A shard executes only whole frames, and a failed send never delivered a
                # whole one: these requests were not applied and may be sent again.
                for fut, _ in batch:
                    fut.sent = False
                self._broken(conn)
                with self._lock:
                    self._flushing = False
                    self._sending = None
                    self._idle.notify_all()
                return

    def _encode(self, batch: list) -> list[bytes]:
        """The frames for ``batch``: one, unless the requests together pass the frame limit
        (a shard drops a connection that sends a larger frame). A request that cannot be
        encoded (text with a lone surrogate, an integer msgpack cannot hold) fails on its
        own with InvalidJob instead of breaking the connection for every caller."""
        pack = protocol.pack
        try:
            data = pack([req for _, req in batch])
            if len(data) <= limits.FRAME_BYTES_MAX:
                return [data]
        except (ValueError, TypeError, OverflowError):
            pass
        frames: list[bytes] = []
        parts: list[bytes] = []
        size = 0
        for fut, req in batch:
            try:
                one = pack(req)
            except (ValueError, TypeError, OverflowError) as e:
                self._refuse(fut, InvalidJob(f"{req[1]}: the request cannot be encoded: {e}"))
                continue
            if len(one) + 5 > limits.FRAME_BYTES_MAX:  # the router cuts batches: a bug if seen
                self._refuse(fut, InvalidJob(f"{req[1]}: a request of {len(one)} bytes is over the "
                                             f"{limits.FRAME_BYTES_MAX}-byte frame limit"))
                continue
            if parts and size + len(one) + 5 > limits.FRAME_BYTES_MAX:
                frames.append(protocol.pack_array(parts))
                parts, size = [], 0
            parts.append(one)
            size += len(one)
        if parts:
            frames.append(protocol.pack_array(parts))
        return frames

    def _refuse(self, fut: Future, error: BaseException) -> None:
        self._pending.pop(fut.rid, None)
        fut.sent = False
        fut.set(error=error)

    def _read_loop(self, conn: Connection) -> None:
        """Owns ``conn``: the only thread that closes it, once no send is using it, so its
        descriptor number can never be reused under another thread's read or write."""
        try:
            self._read_replies(conn)
        finally:
            with self._lock:
                while self._sending is conn:
                    self._idle.wait()
            conn.close()

    def _read_replies(self, conn: Connection) -> None:
        """Read reply frames with one read per wake-up (Connection.recv_bytes reads the
        length and the payload apart: two reads per reply) and settle their futures."""
        unpackb = msgpack.unpackb
        pending = self._pending
        fd, buf = conn.fileno(), bytearray()
        while True:
            try:
                data = os.read(fd, protocol.READ_BYTES)
                if not data:
                    raise EOFError
                buf += data
                frames = protocol.split_frames(buf)  # a frame over the limit is refused
                batches = [unpackb(f, raw=False, use_list=True) for f in frames]
            except (EOFError, OSError, ValueError, msgpack.UnpackException, ProtocolError):
                self._broken(conn)
                return
            for replies in batches:
                for rid, status, payload in replies:
                    fut = pending.pop(rid, None)
                    if fut is None:
                        continue  # a watch whose caller stopped waiting
                    if status == protocol.OK:
                        fut.set(payload)
                    else:
                        fut.set(error=protocol.error_from_payload(payload))

    def _broken(self, conn: Connection) -> None:
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            pending, self._pending = self._pending, {}
            self._outbox = []
        _shutdown(conn)  # wakes the reader, which closes it
        # The old reader may still pop replies from ``pending``: take each future out with
        # an atomic pop rather than iterate the dict, so each is set by one thread only.
        failed = []
        for rid in list(pending):
            fut = pending.pop(rid, None)
            if fut is not None:
                failed.append(fut)
        message = f"connection to shard {self.index} lost"
        for fut in failed:
            fut.set(error=ConnectionLost(message, sent=fut.sent))


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
