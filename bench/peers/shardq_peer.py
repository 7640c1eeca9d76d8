"""shardq through its public API: ``shardq.open`` starts the shard processes and returns a
router; client processes call ``shardq.connect(data_dir)``. The router is thread-safe.

If ``import shardq`` or ``shardq.open`` fails, the peer is skipped with that error as the
reason. If the package has no ``connect``, figures D and W run their clients as threads
sharing the router, and the results say so.
"""
from __future__ import annotations

import os
from typing import Any
from collections.abc import Sequence

from .base import Adapter, Client, ClientSpec, Item, SkipPeer

QUEUE = "default"
CONFIG = {"queues": {QUEUE: {"visibility_timeout": 30}}}
CLOSE_TIMEOUT_S = 5.0  # shard processes still running this long after close() are stopped


class ShardqClient(Client):
    """Operations on one router; a handle is a ``Lease``."""

    batch_mode = "native"

    def __init__(self, router: Any):
        self._q = router

    def enqueue(self, body: bytes, key: str) -> None:
        self._q.enqueue(body, key=key, queue=QUEUE)

    def enqueue_many(self, items: Sequence[Item]) -> None:
        self._q.enqueue_many([{"body": body, "key": key} for body, key in items], queue=QUEUE)

    def dequeue(self, wait_s: float) -> Any | None:
        return self._q.dequeue(QUEUE, wait=wait_s)

    def dequeue_many(self, n: int, wait_s: float) -> list[Any]:
        return self._q.dequeue_many(QUEUE, max_jobs=n, wait=wait_s)

    def ack(self, handle: Any) -> None:
        self._q.ack(handle)

    def ack_many(self, handles: Sequence[Any]) -> None:
        self._q.ack_many(list(handles))

    def body_of(self, handle: Any) -> bytes:
        return handle.body

    def close(self) -> None:
        self._q.close()


def default_shard_count() -> int:
    """The shard count a service gets on this machine from the default config
    (``service.shards = 0``), which is what the benchmark measures unless told otherwise."""
    try:
        from shardq.config import parse
    except Exception:  # noqa: BLE001 - setup() skips the peer with the import error
        return 1
    return parse({}).resolved_shards()


def connect_client(data_dir: str, busy_poll_us: int | None = None) -> ShardqClient:
    """A client in another process: its own connection to the running shards."""
    import shardq

    options = {} if busy_poll_us is None else {"busy_poll_us": busy_poll_us}
    return ShardqClient(shardq.connect(data_dir, **options))


class ShardqAdapter(Adapter):
    name = "shardq"
    batch_mode = ShardqClient.batch_mode
    durability = "WAL, fsync before reply"
    thread_safe = True

    def __init__(self, shards: int | None = None, lease_sync: str = "batched", restarted: bool = False,
                 busy_poll_us: int | None = None):
        self.shards = shards or default_shard_count()
        self.lease_sync = lease_sync
        # None: the router's default (left out, so older versions run too)
        self.options = {} if busy_poll_us is None else {"busy_poll_us": busy_poll_us}
        self.restarted = restarted  # measure on a data dir that was used, stopped and reopened
        self.client: ShardqClient | None = None
        self._data_dir = ""
        self._servers: list = []  # psutil.Process of each shard process
        self._has_connect = False

    def setup(self, tmpdir: str) -> None:
        try:
            import shardq
        except Exception as e:  # noqa: BLE001 - any import failure means: not ready to benchmark
            raise SkipPeer(f"import shardq failed: {type(e).__name__}: {e}") from None
        if not hasattr(shardq, "open"):
            raise SkipPeer("shardq has no open()")
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._data_dir = os.path.join(tmpdir, "shardq")
        try:
            queue = dict(CONFIG["queues"][QUEUE])
            if self.lease_sync != "batched":  # the default; left out, older versions run too
                queue["lease_sync"] = self.lease_sync
            cfg = {"queues": {QUEUE: queue}}
            if self.options:  # the shards poll as the routers do
                cfg["service"] = {"busy_poll_us": self.options["busy_poll_us"]}
            if self.restarted:
                # The newest segment is then a reopened one, not a fresh preallocated file.
                first = shardq.open(self._data_dir, shards=self.shards, config=cfg)
                warm = first.enqueue_many([{"body": b"warm", "key": f"w{i}"} for i in range(8 * self.shards)])
                first.ack_many(first.dequeue_many(QUEUE, max_jobs=len(warm)))
                first.close()
            router = shardq.open(self._data_dir, shards=self.shards, config=cfg, **self.options)
        except Exception as e:  # noqa: BLE001 - any failure to open skips the peer with its error
            raise SkipPeer(f"shardq.open failed: {type(e).__name__}: {e}") from None
        self.client = ShardqClient(router)
        self._has_connect = hasattr(shardq, "connect")
        # The shard processes are the children shardq.open started (not multiprocessing's
        # helper processes, which outlive close() by design).
        self._servers = [p for p in psutil.Process().children(recursive=True)
                         if p.pid not in before and not _is_mp_helper(p)]

    def teardown(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        _stop_leftovers(self._servers)
        self._servers = []

    def client_spec(self) -> ClientSpec | None:
        if not self._has_connect:
            return None
        return ClientSpec(__name__, "connect_client", {"data_dir": self._data_dir, **self.options})

    def server_pids(self) -> list[int]:
        return [p.pid for p in self._servers]


def _stop_leftovers(procs: list) -> None:
    """SIGTERM, by PID, any shard process that close() left running."""
    import psutil

    _gone, alive = psutil.wait_procs(procs, timeout=CLOSE_TIMEOUT_S)
    for p in alive:
        p.terminate()
    _gone, alive = psutil.wait_procs(alive, timeout=CLOSE_TIMEOUT_S)
    for p in alive:
        p.kill()


def _is_mp_helper(proc) -> bool:
    import psutil

    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline
