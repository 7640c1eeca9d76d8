"""A fresh broker for one runner and run, started and stopped by PID.

:func:`start` returns a :class:`Broker`: ``env`` holds what the app modules read (see
``apps/__init__.py``), ``settings`` what the worker command line needs, ``durability`` the
setting in force in words (for Redis, read back from the running server).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..peers import servers
from ..peers.base import SkipPeer
from ..peers.redis_peer import persistence_in_force, start_server
from .apps import HUEY_SQLITE_ENV, REDIS_URL_ENV, SHARDQ_DIR_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_READY_TIMEOUT_S = 60.0


@dataclass
class Broker:
    kind: str
    durability: str
    env: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        servers.stop_tree(self.proc)
        self.proc = None


def start(kind: str, tmpdir: str, shards: int) -> Broker:
    """Start a broker of ``kind`` (see runners.py) with its data under ``tmpdir``; raise
    SkipPeer if it cannot run here."""
    if kind.startswith("redis-"):
        return _redis(kind, tmpdir)
    if kind == "shardq":
        return _shardq(tmpdir, shards)
    if kind == "sqlite":
        path = os.path.join(tmpdir, "huey.sqlite")
        return Broker(kind, "SQLite WAL, synchronous=FULL (SqliteHuey fsync=True)",
                      env={HUEY_SQLITE_ENV: path})
    raise ValueError(f"unknown broker {kind!r}")


def _redis(kind: str, tmpdir: str) -> Broker:
    try:
        import redis
    except ImportError:
        raise SkipPeer("the redis client is not installed (pip install -e '.[bench]')") from None
    persistence = kind.split("-", 1)[1]
    proc, port = start_server(tmpdir, persistence)
    url = f"redis://{servers.HOST}:{port}/0"
    broker = Broker(kind, "", env={REDIS_URL_ENV: url}, settings={"redis_url": url}, proc=proc)
    try:
        client = redis.Redis(host=servers.HOST, port=port)
        got = persistence_in_force(client)
        client.close()
    except BaseException:
        broker.stop()
        raise
    if persistence == "always" and (got.get("appendonly"), got.get("appendfsync")) != (
            "yes", "always"):
        broker.stop()
        raise SkipPeer(f"redis-server did not take appendfsync always: {got}")
    aof = (f"AOF appendfsync {got.get('appendfsync')}" if got.get("appendonly") == "yes"
           else "no AOF")
    snapshots = f"RDB save '{got.get('save')}'" if got.get("save") else "no RDB"
    broker.durability = f"Redis {persistence}: {aof}, {snapshots}"
    return broker


def _shardq(tmpdir: str, shards: int) -> Broker:
    try:
        import shardq
    except Exception as e:  # noqa: BLE001 - any import failure skips the peer
        raise SkipPeer(f"import shardq failed: {type(e).__name__}: {e}") from None
    data_dir = os.path.join(tmpdir, "shardq")
    # As a user runs it from the repo (its config, listener included), but the listener on any
    # free port: the default one, or the one SHARDQ_HTTP_LISTEN names, may be held by the user's
    # own service (the README's first command), and the flag beats both.
    argv = [sys.executable, "-m", "shardq.cli", "serve", "--data-dir", data_dir,
            "--shards", str(shards), "--http-listen", "127.0.0.1:0"]
    log_path = os.path.join(tmpdir, "shardq-serve.log")
    proc = servers.spawn(argv, log_path, cwd=REPO)
    broker = Broker("shardq", f"shardq serve, {shards} shards: WAL fsynced before each reply",
                    env={SHARDQ_DIR_ENV: data_dir},
                    settings={"data_dir": data_dir,
                              "idempotency_path": os.path.join(tmpdir, "idempotency.sqlite")},
                    proc=proc)
    deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise SkipPeer(f"shardq serve exited with {proc.returncode}; see {log_path}")
        try:
            with shardq.connect(data_dir, retry_s=0.2, request_timeout_s=2) as q:
                q.ping()
            return broker
        except Exception:  # noqa: BLE001 - not ready yet, whatever the error: retried until the deadline
            if time.monotonic() > deadline:
                broker.stop()
                raise SkipPeer(f"shardq serve not ready within {SERVE_READY_TIMEOUT_S} s")  # noqa: B904 - the last connect error stays as its context
            time.sleep(0.05)
