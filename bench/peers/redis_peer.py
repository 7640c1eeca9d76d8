"""Redis with the append-only file fsynced on every write (``--appendfsync always``).

The reliable-queue pattern: enqueue = LPUSH onto the queue list; lease = LMOVE (BLMOVE when
waiting) from the queue's tail to the head of a processing list; ack = LREM from the
processing list. Redis lists have no job key, so the key is not sent. Bodies are unique in
the benchmark, so LREM of one body removes exactly that delivery. Batches are pipelines of
the same commands (no MULTI).

:func:`start_server` is shared with figure Wk, which also runs Redis at its default
persistence (RDB snapshots, no AOF).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from . import servers
from .base import Client, Item, ServerAdapter, SkipPeer

QUEUE = "bench:queue"
PROCESSING = "bench:processing"


def _redis_module():
    try:
        import redis
    except ImportError:
        raise SkipPeer("the redis client is not installed (pip install redis)") from None
    return redis


class RedisClient(Client):
    batch_mode = "pipeline"

    def __init__(self, port: int):
        self._r = _redis_module().Redis(host=servers.HOST, port=port)

    def enqueue(self, body: bytes, key: str) -> None:
        self._r.lpush(QUEUE, body)

    def enqueue_many(self, items: Sequence[Item]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for body, _key in items:
            pipe.lpush(QUEUE, body)
        pipe.execute()

    def dequeue(self, wait_s: float) -> bytes | None:
        if wait_s > 0:
            return self._r.blmove(QUEUE, PROCESSING, wait_s, "RIGHT", "LEFT")
        return self._r.lmove(QUEUE, PROCESSING, "RIGHT", "LEFT")

    def _move_ready(self, n: int) -> list[bytes]:
        pipe = self._r.pipeline(transaction=False)
        for _ in range(n):
            pipe.lmove(QUEUE, PROCESSING, "RIGHT", "LEFT")
        return [b for b in pipe.execute() if b is not None]

    def dequeue_many(self, n: int, wait_s: float) -> list[bytes]:
        bodies = self._move_ready(n)
        if bodies or wait_s <= 0:
            return bodies
        first = self.dequeue(wait_s)
        if first is None:
            return []
        return [first, *self._move_ready(n - 1)] if n > 1 else [first]

    def ack(self, handle: bytes) -> None:
        self._r.lrem(PROCESSING, 1, handle)

    def ack_many(self, handles: Sequence[bytes]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for body in handles:
            pipe.lrem(PROCESSING, 1, body)
        pipe.execute()

    def body_of(self, handle: bytes) -> bytes:
        return handle

    def close(self) -> None:
        self._r.close()


# Command-line settings per persistence mode; "default" adds nothing: Redis's own defaults.
PERSISTENCE_ARGS = {
    "always": ["--appendonly", "yes", "--appendfsync", "always", "--save", ""],
    "default": [],
}


def start_server(tmpdir: str, persistence: str):
    """Start redis-server on a free 127.0.0.1 port, data under ``tmpdir``; return
    ``(process, port)``. ``persistence`` is a key of PERSISTENCE_ARGS."""
    binary = servers.require_binary("redis-server")
    data_dir = os.path.join(tmpdir, "redis")
    os.makedirs(data_dir)
    port = servers.free_port()
    argv = [binary, "--bind", servers.HOST, "--port", str(port),
            *PERSISTENCE_ARGS[persistence], "--dir", data_dir, "--daemonize", "no"]
    return servers.start(argv, port, os.path.join(tmpdir, "redis.log")), port


def persistence_in_force(client) -> dict[str, str]:
    """What the running server says about its persistence (CONFIG GET), for the report."""
    got = {}
    for name in ("appendonly", "appendfsync", "save"):
        got.update(client.config_get(name))
    return got


class RedisAdapter(ServerAdapter):
    client_class = "RedisClient"
    name = "redis"
    batch_mode = RedisClient.batch_mode
    durability = "AOF, appendfsync always"
    thread_safe = True  # redis-py takes a pooled connection per command


    def setup(self, tmpdir: str) -> None:
        _redis_module()
        self._proc, self._port = start_server(tmpdir, "always")
        self.client = RedisClient(self._port)
        got = self.client._r.config_get("appendfsync").get("appendfsync")
        if got != "always":
            self.teardown()
            raise SkipPeer(f"redis-server runs with appendfsync={got!r}, not 'always'")

