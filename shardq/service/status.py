"""The supervisor's end of ``<data>/run/supervisor.json``: the file's format and its readers
are in :mod:`shardq.protocol.status_file`, which says what it holds and why each update is
one ``pwrite`` into space reserved at start."""
from __future__ import annotations

import json
import os
from typing import Any

from ..clock import SystemClock
from ..protocol.status_file import BYTES_PER_SHARD, REASON_CHARS_MAX, path


class StatusBoard:
    """The supervisor's end: ``publish(shards)`` after every change of a shard's status."""

    def __init__(self, run_dir: str, shards: int, pid: int | None = None):
        self.path = path(run_dir)
        self.pid = pid or os.getpid()
        self.size = 1024 + shards * BYTES_PER_SHARD
        self.clock = SystemClock()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError:
            pass  # no room even for this: publish() writes what it can
        self.failed_once = False

    def publish(self, shards: list[dict[str, Any]]) -> bool:
        """Overwrite the file with ``shards`` (one dict per shard). False if it could not be
        written (the caller logs that once); never raises."""
        rows = [dict(sh, reason=(sh.get("reason") or "")[:REASON_CHARS_MAX] or None) for sh in shards]
        data = json.dumps({"pid": self.pid, "time": self.clock.now(), "shards": rows}).encode()
        self.size = max(self.size, len(data))  # a longer write once: pad every later one to it
        try:
            os.pwrite(self.fd, data.ljust(self.size), 0)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
