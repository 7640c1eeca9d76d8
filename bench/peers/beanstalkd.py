"""beanstalkd, with its binlog fsynced after every write (``-b <dir> -f 0``).

Jobs go to the ``default`` tube; beanstalkd has no job key, so the key is not sent.
Lease = reserve (TTR 30 s), ack = delete. Batches are pipelined commands (see
beanstalk_proto); beanstalkd has no batch command.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from . import servers
from .base import Client, Item, ServerAdapter
from .beanstalk_proto import Connection, Job


class BeanstalkClient(Client):
    batch_mode = "pipeline"

    def __init__(self, port: int):
        self._conn = Connection(servers.HOST, port)

    def enqueue(self, body: bytes, key: str) -> None:
        self._conn.put(body)

    def enqueue_many(self, items: Sequence[Item]) -> None:
        self._conn.put_many([body for body, _key in items])

    def dequeue(self, wait_s: float) -> Job | None:
        return self._conn.reserve(wait_s)

    def dequeue_many(self, n: int, wait_s: float) -> list[Job]:
        jobs = self._conn.reserve_ready(n)
        if jobs or wait_s <= 0:
            return jobs
        first = self._conn.reserve(wait_s)
        if first is None:
            return []
        return [first, *self._conn.reserve_ready(n - 1)] if n > 1 else [first]

    def ack(self, handle: Job) -> None:
        self._conn.delete(handle.job_id)

    def ack_many(self, handles: Sequence[Job]) -> None:
        self._conn.delete_many([h.job_id for h in handles])

    def body_of(self, handle: Job) -> bytes:
        return handle.body

    def close(self) -> None:
        self._conn.close()


class BeanstalkdAdapter(ServerAdapter):
    client_class = "BeanstalkClient"
    name = "beanstalkd"
    batch_mode = BeanstalkClient.batch_mode
    durability = "binlog, fsync every write (-f 0)"


    def setup(self, tmpdir: str) -> None:
        binary = servers.require_binary("beanstalkd")
        binlog_dir = os.path.join(tmpdir, "beanstalkd")
        os.makedirs(binlog_dir)
        self._port = servers.free_port()
        argv = [binary, "-l", servers.HOST, "-p", str(self._port), "-b", binlog_dir, "-f", "0"]
        self._proc = servers.start(argv, self._port, os.path.join(tmpdir, "beanstalkd.log"))
        self.client = BeanstalkClient(self._port)


