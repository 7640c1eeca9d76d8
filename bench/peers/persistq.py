"""persist-queue's ``SQLiteAckQueue``, in-process, SQLite ``synchronous=FULL``, auto-commit.

persist-queue has no option for the synchronous level, so it is set with a PRAGMA on both of
the queue's connections (its ``_putter`` and ``_getter`` attributes) and read back; the
adapter refuses to run if it did not take. The queue is in WAL mode, where FULL means the
WAL is fsynced at every commit; every put, get (marks the row unacked) and ack is a commit.

The queue wakes a waiting ``get`` through a ``threading.Event``, so it is shared by threads
of one process, not by processes: figures D and W run its clients as threads. It has no
batch operations.
"""
from __future__ import annotations

import os
from typing import Any

from .base import Adapter, Client, SkipPeer

SYNCHRONOUS_FULL = 2


def _persistqueue_module():
    try:
        import persistqueue
    except ImportError:
        raise SkipPeer("persist-queue is not installed (pip install persist-queue)") from None
    return persistqueue


class PersistqClient(Client):
    """Operations on one shared SQLiteAckQueue; a handle is its raw row dict."""

    def __init__(self, queue: Any, empty: type[Exception]):
        self._q = queue
        self._empty = empty

    def enqueue(self, body: bytes, key: str) -> None:
        self._q.put(body)

    def dequeue(self, wait_s: float) -> dict | None:
        try:
            if wait_s > 0:
                return self._q.get(block=True, timeout=wait_s, raw=True)
            return self._q.get(block=False, raw=True)
        except self._empty:
            return None

    def ack(self, handle: dict) -> None:
        if self._q.ack(id=handle["pqid"]) is None:
            raise RuntimeError(f"persist-queue did not ack job {handle['pqid']}")

    def body_of(self, handle: dict) -> bytes:
        return handle["data"]


class PersistqAdapter(Adapter):
    name = "persistq"
    durability = "SQLite WAL, synchronous=FULL, auto_commit"
    thread_safe = True  # multithreading=True: separate put/get connections, internal locks

    def __init__(self) -> None:
        self._q = None
        self.client: PersistqClient | None = None

    def setup(self, tmpdir: str) -> None:
        persistqueue = _persistqueue_module()
        path = os.path.join(tmpdir, "persistq")
        self._q = persistqueue.SQLiteAckQueue(path, multithreading=True, auto_commit=True)
        for conn in {id(c): c for c in (self._q._putter, self._q._getter)}.values():
            conn.execute("PRAGMA synchronous=FULL")
            level = conn.execute("PRAGMA synchronous").fetchone()[0]
            if level != SYNCHRONOUS_FULL:
                self.teardown()
                raise SkipPeer(f"SQLite refused synchronous=FULL (got {level})")
        self.client = PersistqClient(self._q, persistqueue.Empty)

    def teardown(self) -> None:
        if self._q is not None:
            self._q.close()
            self._q = None
        self.client = None
