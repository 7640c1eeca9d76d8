"""A shard's side of one client connection: ``multiprocessing.connection`` framing, read
and written without blocking the shard loop.

Clients use ``Connection.send_bytes``/``recv_bytes``. Their framing is a 4-byte big-endian
signed length (or -1 and an 8-byte length for frames of 2 GiB and more), then the payload.
The shard parses that framing itself from non-blocking reads, so a client that stalls in
the middle of a frame only leaves bytes in its own buffer instead of stalling the loop, and
an announced length over the limit is refused before anything is allocated for it. Nothing
is ever unpickled: payloads are msgpack, decoded by :mod:`shardq.shard.wire`.
"""
from __future__ import annotations

import os
import select
import socket
import struct

from .. import limits
from ..errors import ProtocolError

_LEN = struct.Struct("!i")
_LEN64 = struct.Struct("!Q")
READ_BYTES = 1 << 20
SEND_TIMEOUT_S = 1.0   # a client that does not read its replies for this long is dropped


class FrameConn:
    __slots__ = ("fd", "buf", "closed", "dead")

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.closed = False
        self.dead = False  # a send failed: no more sends; the loop sees EOF and drops it
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self.fd

    def read_frames(self) -> list[bytes]:
        """Every complete frame now readable. EOFError when the peer closed; ProtocolError
        for a frame over the size limit."""
        try:
            data = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError
        buf = self.buf
        buf += data
        frames = []
        pos, n = 0, len(buf)
        while n - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            head = 4
            if size == -1:
                if n - pos < 12:
                    break
                (size,) = _LEN64.unpack_from(buf, pos + 4)
                head = 12
            if size < 0 or size > limits.FRAME_BYTES_MAX:
                raise ProtocolError(f"frame of {size} bytes announced; limit {limits.FRAME_BYTES_MAX}")
            end = pos + head + size
            if end > n:
                break
            frames.append(bytes(buf[pos + head:end]))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    def send(self, payload: bytes) -> None:
        """Write one frame. OSError if the client does not take it within SEND_TIMEOUT_S."""
        n = len(payload)
        header = _LEN.pack(n) if n < 0x7FFFFFFF else _LEN.pack(-1) + _LEN64.pack(n)
        view = memoryview(header + payload)
        while view:
            try:
                sent = os.write(self.fd, view)
            except BlockingIOError:
                _, writable, _ = select.select([], [self.fd], [], SEND_TIMEOUT_S)
                if not writable:
                    raise OSError("client is not reading its replies") from None
                continue
            view = view[sent:]

    def shut(self) -> None:
        """Stop the connection without freeing the descriptor: the loop reads EOF, drops
        it, and only then is it closed, so the number cannot be reused under the loop."""
        self.dead = True
        try:
            s = socket.socket(fileno=os.dup(self.fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
        except OSError:
            pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                os.close(self.fd)
            except OSError:
                pass
