"""The no-op job's only effect: a line saying it ran, and the harness's reader of those lines.

Every framework's no-op task calls :func:`record` with its job id: one ``write(2)`` of
``"<id> <CLOCK_MONOTONIC ns>\\n"`` to an append-only file named by ``$BENCH_WK_RECORD``,
opened once per process. That is the same few microseconds for every framework, far below
what any of them spends per job, and it touches neither the broker nor its fsyncs (a Redis
SADD would add a round trip, and an fsync under ``appendfsync always``). ``O_APPEND``
writes this small are not interleaved, so threads and processes can share the file. The
file is a measurement log, not a durability claim: it is never fsynced.

The timestamps give the drain rate (first run to last run), so a worker's start-up time is
not counted as draining.
"""
from __future__ import annotations

import os
import time

RECORD_ENV = "BENCH_WK_RECORD"

_fds: dict[int, int] = {}  # pid -> fd: a forked child (an rq job) opens its own


def record(job_id: str) -> None:
    """Note that the job ``job_id`` ran, now."""
    pid = os.getpid()
    fd = _fds.get(pid)
    if fd is None:
        fd = _fds[pid] = os.open(os.environ[RECORD_ENV],
                                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, f"{job_id} {time.monotonic_ns()}\n".encode())


class RecordReader:
    """Reads the record file as it grows: the ids that ran, in order, and when."""

    def __init__(self, path: str):
        self._path = path
        self._offset = 0
        self._partial = b""
        self.ids: list[str] = []
        self.first_ns: int | None = None
        self.last_ns: int | None = None

    def poll(self) -> int:
        """Read what was appended since the last poll; returns how many runs it added."""
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished line stays for the next poll
        for line in lines:
            job_id, ns = line.rsplit(b" ", 1)
            self.ids.append(job_id.decode())
            t = int(ns)
            self.first_ns = t if self.first_ns is None else min(self.first_ns, t)
            self.last_ns = t if self.last_ns is None else max(self.last_ns, t)
        return len(lines)
