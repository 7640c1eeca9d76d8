"""A raw connection to one shard process of a test service, for tests of the wire itself,
and a key per shard to aim a job at one."""
from __future__ import annotations

import msgpack

from shardq.client.router import shard_for_key
from shardq.datadir import DataDir
from shardq.protocol.sockio import connect_unix


def key_per_shard(shards: int) -> dict[int, str]:
    """A key that lands on each shard of ``shards``: shard -> key."""
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < shards:
        keys.setdefault(shard_for_key(f"k{i}", shards), f"k{i}")
        i += 1
    return keys


class Raw:
    """A raw connection to one shard: one request at a time, its reply by request id."""

    def __init__(self, svc, shard: int):
        dd = DataDir(svc.data_dir)
        self.conn = connect_unix(dd.socket_path(shard), dd.authkey())
        self.rid = 0

    def send(self, op: str, args: list) -> int:
        self.rid += 1
        self.conn.send_bytes(msgpack.packb([[self.rid, op, args]]))
        return self.rid

    def reply(self, rid: int, timeout: float = 10.0) -> list:
        while self.conn.poll(timeout):
            for r in msgpack.unpackb(self.conn.recv_bytes(), raw=False, strict_map_key=False):
                if r[0] == rid:
                    return r[1:]
        raise AssertionError(f"no reply to request {rid} within {timeout} s")

    def call(self, op: str, *args):
        status, payload = self.reply(self.send(op, list(args)))
        assert status == 0, payload
        return payload

    def error(self, op: str, *args) -> list:
        status, payload = self.reply(self.send(op, list(args)))
        assert status == 1, payload
        return payload

    def close(self) -> None:
        self.conn.close()
