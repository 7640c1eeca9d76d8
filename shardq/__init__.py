"""shardq: a durable, sharded, lease-based job queue.

Layout (imports point down this list, never up):

* ``cli/`` -- the ``shardq`` command;
* ``service/`` -- the supervisor that runs the shard processes;
* ``consumer/`` -- the worker runner, running one job, idempotency stores;
* ``backends/`` -- other engines behind the same ``Queue`` protocol (``sqs``: Amazon SQS FIFO);
* ``client/`` -- the ``Queue`` protocol, the router apps embed (``router``) and its
  connection to a shard;
* ``shard/`` -- the pure state machine (``state``), its pairing with the log (``durable``),
  the shard process (``process``) and the wire it speaks (``wire``);
* ``wal/`` -- the write-ahead log;
* ``errors``, ``types``, ``limits``, ``clock``, ``config``, ``datadir`` -- the ground floor.

``verify/`` is the chaos run and history checker: a tool, imported by nothing at runtime.

Public API::

    q = shardq.open("var/shardq", shards=4, config=cfg)   # embedded service + router
    q = shardq.connect("var/shardq")                      # router to `shardq serve`
    q = shardq.connect("sqs://us-east-1/myapp")           # the same protocol on SQS FIFO
"""
from __future__ import annotations

from .config import Config, QueueConfig
from .client.queue import Queue
from .client.router import Router
from .errors import (AuthError, Closed, CorruptLog, DataDirLocked, InvalidConfig, InvalidJob, JobGone,
                     LeaseLost, LogFailed, NotADataDir, NotFound, ProtocolError, QueueFull,
                     ShardCountMismatch, ShardqError, ShardUnavailable, UnknownQueue, Unsupported,
                     UsageError)
from .types import DeadLetter, JobId, Lease

__all__ = [
    "open", "connect", "Queue", "Router", "Lease", "DeadLetter", "JobId", "Config", "QueueConfig",
    "Worker", "ShardqError", "InvalidJob", "UnknownQueue", "InvalidConfig", "ProtocolError",
    "AuthError", "NotFound", "LeaseLost", "JobGone", "QueueFull", "ShardUnavailable", "Closed",
    "ShardCountMismatch", "NotADataDir", "DataDirLocked", "UsageError", "Unsupported",
    "CorruptLog", "LogFailed",
]


def open(data_dir, shards: int | None = None, config=None, **router_options) -> Router:  # noqa: A001
    """Start the service embedded in this process (supervisor thread + shard processes) and
    return a router to it; ``close()`` stops both. ``config``: dict, TOML path, or None."""
    from .service.supervisor import Supervisor
    sup = Supervisor(data_dir, config, shards).start(background=True)
    try:
        return Router(sup.dd.path, supervisor=sup, **router_options)
    except BaseException:
        sup.stop()
        raise


def connect(target, **options) -> Queue:
    """A client of the queue service at ``target``: the data dir of a running ``shardq
    serve`` (a path), or ``sqs://<region>/<prefix>[?endpoint=URL]`` (Amazon SQS FIFO,
    ``pip install shardq[sqs]``). Every backend returns a :class:`Queue`."""
    from .backends import for_target
    backend = for_target(target)
    return (backend or Router)(target, **options)


def __getattr__(name):
    if name == "Worker":  # imported lazily: the worker pulls in sqlite3 and signal handling
        from .consumer.worker import Worker
        return Worker
    raise AttributeError(f"module 'shardq' has no attribute {name!r}")
