"""A minimal beanstalkd protocol client: put, reserve-with-timeout, delete, on one TCP socket.

The protocol is text lines ending in CRLF; a job body follows its command or reply line
and ends in CRLF too::

    put <pri> <delay> <ttr> <bytes>\\r\\n<body>\\r\\n  ->  INSERTED <id>
    reserve-with-timeout <seconds>\\r\\n
        ->  RESERVED <id> <bytes>\\r\\n<body>\\r\\n  |  TIMED_OUT
    delete <id>\\r\\n                                   ->  DELETED | NOT_FOUND

Commands on one connection are answered in order, so ``*_many`` send all commands before
reading the replies (pipelining); beanstalkd has no batch command.
"""
from __future__ import annotations

import math
import socket
from collections.abc import Sequence

PRIORITY = 1024
TTR_S = 30  # time-to-run: the lease; a reserved job not deleted by then is delivered again


class BeanstalkError(Exception):
    """beanstalkd answered something other than the success reply."""


class Job(tuple):
    """(id, body) of a reserved job."""

    __slots__ = ()

    def __new__(cls, job_id: int, body: bytes):
        return tuple.__new__(cls, (job_id, body))

    job_id = property(lambda self: self[0])
    body = property(lambda self: self[1])


class Connection:
    def __init__(self, host: str, port: int):
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self._sock.makefile("rb")

    def close(self) -> None:
        self._rfile.close()
        self._sock.close()

    # Commands, as bytes.

    @staticmethod
    def _put_cmd(body: bytes) -> bytes:
        return b"put %d 0 %d %d\r\n%s\r\n" % (PRIORITY, TTR_S, len(body), body)

    @staticmethod
    def _reserve_cmd(wait_s: float) -> bytes:
        # The protocol takes whole seconds; round up so a wait is never shorter than asked.
        return b"reserve-with-timeout %d\r\n" % math.ceil(max(wait_s, 0.0))

    # Replies.

    def _line(self) -> bytes:
        line = self._rfile.readline()
        if not line.endswith(b"\r\n"):
            raise BeanstalkError(f"connection closed mid-reply: {line!r}")
        return line[:-2]

    def _read_inserted(self) -> int:
        line = self._line()
        if not line.startswith(b"INSERTED "):
            raise BeanstalkError(f"put: {line.decode(errors='replace')}")
        return int(line.split()[1])

    def _read_reserved(self) -> Job | None:
        line = self._line()
        if line == b"TIMED_OUT":
            return None
        if not line.startswith(b"RESERVED "):
            raise BeanstalkError(f"reserve: {line.decode(errors='replace')}")
        _, job_id, size = line.split()
        data = self._rfile.read(int(size) + 2)
        if len(data) != int(size) + 2 or not data.endswith(b"\r\n"):
            raise BeanstalkError("reserve: truncated job body")
        return Job(int(job_id), data[:-2])

    def _read_deleted(self) -> None:
        line = self._line()
        if line != b"DELETED":
            raise BeanstalkError(f"delete: {line.decode(errors='replace')}")

    # Operations.

    def put(self, body: bytes) -> int:
        self._sock.sendall(self._put_cmd(body))
        return self._read_inserted()

    def put_many(self, bodies: Sequence[bytes]) -> list[int]:
        self._sock.sendall(b"".join(self._put_cmd(b) for b in bodies))
        return [self._read_inserted() for _ in bodies]

    def reserve(self, wait_s: float) -> Job | None:
        self._sock.sendall(self._reserve_cmd(wait_s))
        return self._read_reserved()

    def reserve_ready(self, n: int) -> list[Job]:
        """Up to ``n`` jobs that are ready now (n pipelined zero-timeout reserves)."""
        self._sock.sendall(self._reserve_cmd(0) * n)
        jobs = [self._read_reserved() for _ in range(n)]
        return [j for j in jobs if j is not None]

    def delete(self, job_id: int) -> None:
        self._sock.sendall(b"delete %d\r\n" % job_id)
        self._read_deleted()

    def delete_many(self, job_ids: Sequence[int]) -> None:
        self._sock.sendall(b"".join(b"delete %d\r\n" % i for i in job_ids))
        for _ in job_ids:
            self._read_deleted()
