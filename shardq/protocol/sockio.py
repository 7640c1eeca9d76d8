"""Socket helpers shared by the shard (server) and the client side.

``multiprocessing.connection`` has no timeouts; a peer that stops answering during the
authentication handshake would block the caller forever. These helpers bound every
handshake with kernel socket timeouts (SO_RCVTIMEO/SO_SNDTIMEO), which make blocking reads
and writes on the descriptor fail instead of hanging.

After both sides are authenticated the client says who it is (:func:`hello`: a
``client``, or ``service`` for the connections of ``shardq serve`` itself: the HTTP
listener, the schedules), and the shard answers with its verdict:
:data:`ADMITTED`, or :data:`TURNED_AWAY` and why (it holds its ``limits.max_connections``
clients). Service connections have a small pool of their own, so a shard full of clients
is still seen by ``/metrics``. A client turned away learns it
before sending anything, so it knows no request of its reached the shard.
"""
from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from ..errors import ProtocolError, TooManyConnections

HANDSHAKE_TIMEOUT_S = 5.0
#: The wire's version, named in the verdict: a client of another version learns at once
#: that it cannot talk to this shard (ProtocolError), instead of failing on its replies.
WIRE_VERSION = 1
_ADMITTED_PREFIX = b"#SHARDQ-ADMITTED"
ADMITTED = _ADMITTED_PREFIX + b" wire=%d" % WIRE_VERSION
TURNED_AWAY = b"#SHARDQ-TURNED-AWAY "
VERDICT_BYTES_MAX = 1024
_HELLO_PREFIX = b"#SHARDQ-HELLO "
ROLES = ("client", "service")


def hello(role: str) -> bytes:
    """What a client sends after authenticating: the wire version and its role."""
    return _HELLO_PREFIX + b"wire=%d role=%s" % (WIRE_VERSION, role.encode())


def role_of(message: bytes) -> str | None:
    """The role a :func:`hello` names, or None for anything else."""
    if not message.startswith(_HELLO_PREFIX):
        return None
    fields = dict(f.split(b"=", 1) for f in message[len(_HELLO_PREFIX):].split() if b"=" in f)
    role = fields.get(b"role", b"").decode("ascii", "replace")
    return role if role in ROLES else None


def shut(fd: int) -> None:
    """End the socket ``fd`` for both directions without freeing the descriptor: a thread
    blocked on it returns (EOF), and its owner closes it once nobody uses it, so the number
    is never reused under another thread's read or write. Nothing if it is gone already."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def socket_timeouts(fd: int, seconds: float) -> None:
    """Set (0 = clear) the kernel send/receive timeouts of a socket descriptor."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    s = socket.socket(fileno=fd)  # borrowed, not duplicated: needs no descriptor (EMFILE)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    finally:
        s.detach()


def connect_unix(address: str, authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT_S,
                 role: str = "client") -> Connection:
    """Connect and authenticate (both directions) within ``timeout`` seconds, as ``role``
    (see above).

    Raises OSError (including timeouts), EOFError, multiprocessing's AuthenticationError,
    :class:`TooManyConnections` when the shard turned the connection away, or
    :class:`ProtocolError` when it speaks another wire version.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(address)
        s.settimeout(None)
        fd = s.detach()
    except BaseException:
        s.close()
        raise
    socket_timeouts(fd, timeout)
    conn = Connection(fd)
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        conn.send_bytes(hello(role))
        verdict = conn.recv_bytes(VERDICT_BYTES_MAX)
        if verdict != ADMITTED:
            if verdict.startswith(TURNED_AWAY):
                raise TooManyConnections(verdict[len(TURNED_AWAY):].decode("utf-8", "replace"))
            if verdict.startswith(_ADMITTED_PREFIX):
                theirs = verdict[len(_ADMITTED_PREFIX):].strip().decode("ascii", "replace")[:32]
                raise ProtocolError(f"the shard speaks {theirs or 'an unnamed wire version'}, this client "
                                    f"wire={WIRE_VERSION}: upgrade the apps that embed the router together "
                                    f"with serve")
            raise EOFError(f"unexpected handshake verdict {verdict[:64]!r}")
    except BaseException:
        conn.close()
        raise
    socket_timeouts(fd, 0)
    return conn
