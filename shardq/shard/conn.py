"""A shard's side of one client connection: ``multiprocessing.connection`` framing, read
and written without blocking the shard loop.

Clients use ``Connection.send_bytes``/``recv_bytes``. Their framing is a 4-byte big-endian
signed length (or -1 and an 8-byte length for frames of 2 GiB and more), then the payload.
The shard parses that framing itself from non-blocking reads, so a client that stalls in
the middle of a frame only leaves bytes in its own buffer instead of stalling the loop, and
an announced length over the limit is refused before anything is allocated for it. Nothing
is ever unpickled: payloads are msgpack, decoded by :mod:`shardq.protocol.wire`.
"""
from __future__ import annotations

import os
import struct
from collections import deque
from typing import TYPE_CHECKING

from .. import limits
from ..protocol.sockio import shut
from ..protocol.wire import read_frames

if TYPE_CHECKING:
    from .acceptor import ConnectionSlots

_LEN = struct.Struct("!i")
_LEN64 = struct.Struct("!Q")
SEND_TIMEOUT_S = 1.0   # a client that takes none of its replies for this long is dropped
# A client with more replies than this waiting for it is read no more, and dropped: one
# that takes a trickle (a bare read of 64 KiB now and then) never meets SEND_TIMEOUT_S, and
# its replies grew the shard's memory without bound (~100 MB/s of barrier values). Two
# frames' worth: a client that reads its replies never comes near it.
UNREAD_BYTES_MAX = 2 * limits.FRAME_BYTES_MAX
# A client that began a frame and has not sent the rest this long after is dropped: a
# half-sent frame held its bytes (up to 64 MiB) for ever. A 64 MiB frame takes 64 of the
# loop's reads, well within it even while the loop is busy.
FRAME_COMPLETE_S = 30.0


class FrameConn:
    """One client connection. Reads parse frames without blocking; writes never block
    either: what the socket does not take at once waits in ``out``, in order, and the
    committer writes it when the client reads again (or drops a client that stops reading
    for ``SEND_TIMEOUT_S``), so one slow reader never delays another client's replies."""

    __slots__ = ("fd", "buf", "closed", "dead", "out", "out_bytes", "progress_at", "close_when_sent", "slots",
                 "role", "begun_at", "parked")

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.closed = False
        self.dead = False  # a send failed: no more sends; the loop sees EOF and drops it
        self.out: deque[memoryview] = deque()  # bytes the socket has not taken yet, in order
        self.out_bytes = 0
        self.progress_at = 0.0   # when the backlog last shrank or began (the committer's clock)
        self.close_when_sent = False
        self.slots: ConnectionSlots | None = None  # the acceptor's ConnectionSlots this connection holds one of
        #: who is at the other end (protocol/sockio.py ROLES), as its hello said: the loop
        #: polls for the next request only after replying to a "client" (process.py)
        self.role = "client"
        self.begun_at = 0.0  # when the frame ``buf`` holds the start of was begun (the loop's clock); 0: none
        self.parked = 0  # its waiting dequeues and watches parked in the loop (limits.PARKED_WAITS_MAX)
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self.fd

    def read_frames(self, scratch: bytearray) -> list[bytes] | list[memoryview]:
        """Every complete frame now readable, after one read of at most ``len(scratch)``
        bytes into ``scratch`` (the loop's buffer, shared by its connections: reads happen
        on the loop thread only). A frame may be a view of ``scratch``: decode it before the
        next read (:func:`~shardq.protocol.wire.read_frames`). EOFError when the peer closed;
        ProtocolError for a frame over the size limit."""
        try:
            return read_frames(self.fd, self.buf, scratch)
        except BlockingIOError:
            return []

    def send(self, payload: bytes) -> bool:
        """Queue one frame and write what the socket takes now, without blocking. True if
        nothing is left waiting. OSError if the connection is broken."""
        n = len(payload)
        data = (_LEN.pack(n) if n < 0x7FFFFFFF else _LEN.pack(-1) + _LEN64.pack(n)) + payload
        if self.out:
            self.out.append(memoryview(data))
            self.out_bytes += len(data)
            return False
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return True
        self.out.append(memoryview(data)[sent:])
        self.out_bytes += len(data) - sent
        return False

    def flush(self) -> bool:
        """Write what waits in ``out`` as far as the socket takes it. True when all is sent.
        OSError if the connection is broken."""
        out = self.out
        while out:
            view = out[0]
            try:
                sent = os.write(self.fd, view)
            except BlockingIOError:
                return False
            self.out_bytes -= sent
            if sent < len(view):
                out[0] = view[sent:]
                return False
            out.popleft()
        return True

    def shut(self) -> None:
        """Stop the connection without freeing the descriptor: the loop reads EOF, drops
        it, and only then is it closed, so the number cannot be reused under the loop."""
        self.dead = True
        shut(self.fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.out.clear()
            try:
                os.close(self.fd)
            except OSError:
                pass
