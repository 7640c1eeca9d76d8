"""shardq: a durable, sharded, lease-based job queue.

Layout: ``wal/`` is the write-ahead log; ``shard/`` the pure state machine (``state``),
its durable pairing with the log (``durable``) and the shard process (``process``);
``router`` is the client apps embed; ``supervisor`` runs the shard processes;
``worker``, ``handling`` and ``idempotency`` are the consumer side; ``cli`` is the ``shardq`` command.

Public API::

    q = shardq.open("var/shardq", shards=4, config=cfg)   # embedded service + router
    q = shardq.connect("var/shardq")                      # router to `shardq serve`
"""
from __future__ import annotations

from .config import Config, QueueConfig
from .errors import (AuthError, Closed, CorruptLog, InvalidConfig, InvalidJob, JobGone, LeaseLost,
                     LogFailed, NotFound, ProtocolError, QueueFull, ShardCountMismatch, ShardqError,
                     ShardUnavailable, UnknownQueue)
from .router import Router
from .types import DeadLetter, Lease

__all__ = [
    "open", "connect", "Router", "Lease", "DeadLetter", "Config", "QueueConfig", "Worker",
    "ShardqError", "InvalidJob", "UnknownQueue", "InvalidConfig", "ProtocolError", "AuthError",
    "NotFound", "LeaseLost", "JobGone", "QueueFull", "ShardUnavailable", "Closed",
    "ShardCountMismatch", "CorruptLog", "LogFailed",
]


def open(data_dir, shards: int | None = None, config=None, **router_options) -> Router:  # noqa: A001
    """Start the service embedded in this process (supervisor thread + shard processes) and
    return a router to it; ``close()`` stops both. ``config``: dict, TOML path, or None."""
    from .supervisor import Supervisor
    sup = Supervisor(data_dir, config, shards).start(background=True)
    try:
        return Router(sup.dd.path, supervisor=sup, **router_options)
    except BaseException:
        sup.stop()
        raise


def connect(data_dir, **router_options) -> Router:
    """A router to the service running on ``data_dir`` (``shardq serve``)."""
    return Router(data_dir, **router_options)


def __getattr__(name):
    if name == "Worker":  # imported lazily: the worker pulls in sqlite3 and signal handling
        from .worker import Worker
        return Worker
    raise AttributeError(f"module 'shardq' has no attribute {name!r}")
