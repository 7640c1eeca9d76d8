"""A real ``ShardServer`` driven in this process and thread, one iteration at a time
(the loop of ``bench/probes/shard_path.py``), with more clients on socketpairs: for tests
of what one loop iteration reads, serves and sends."""
from __future__ import annotations

import socket
import struct

import msgpack

from shardq.shard.conn import FrameConn

_LEN = struct.Struct("!i")


def add_client(lp) -> tuple[socket.socket, FrameConn]:
    """Another client connection on the loop's shard: our end, and the shard's."""
    ours, theirs = socket.socketpair()
    conn = FrameConn(theirs.detach())
    srv = lp.server
    srv.conns.add(conn)
    srv._by_fd[conn.fd] = conn
    srv._poller.register(conn.fd, 1)  # EPOLLIN
    return ours, conn


def send_frame(sock: socket.socket, requests: list) -> None:
    """One frame of ``requests`` (each ``[rid, op, args]``), whole."""
    sock.sendall(framed(requests))


def framed(requests: list) -> bytes:
    data = msgpack.packb(requests)
    return _LEN.pack(len(data)) + data


def iterate(lp) -> None:
    """One iteration, and its replies sent (the committer's thread sends a crowd's)."""
    lp.server.iterate()
    lp.server.committer.drain()


def replied(sock: socket.socket) -> list[int]:
    """The request ids of every reply sent to ``sock`` so far (after :func:`iterate`)."""
    return [r[0] for r in replies(sock)]


def replies(sock: socket.socket) -> list[list]:
    """Every reply sent to ``sock`` so far, in order: ``[rid, status, payload]``."""
    sock.setblocking(False)
    buf = b""
    try:
        while chunk := sock.recv(1 << 20):
            buf += chunk
    except BlockingIOError:
        pass
    out = []
    while buf:
        (n,) = _LEN.unpack_from(buf)
        out += msgpack.unpackb(buf[4:4 + n], raw=False)
        buf = buf[4 + n:]
    return out
