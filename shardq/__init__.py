"""shardq: a durable, sharded, lease-based job queue.

Layout (imports point down this list, never up; docs/design.md "Layers" is the map, and
tests/project/test_layers.py holds the code to it):

* ``cli/`` -- the ``shardq`` command; ``verify/`` -- the chaos run and history checker (a
  tool, imported by nothing at runtime);
* ``service/`` -- the supervisor that runs the shard processes (and publishes their status),
  the scheduler of periodic jobs, and the HTTP listener of ``shardq serve`` (Prometheus
  metrics, the web console in ``service/console/``);
* ``tasks/`` -- ``App``, ``@app.task``, the task body, running task jobs by name;
* ``outbox/`` -- transactional enqueue (``shardq.outbox.enqueue(conn, ...)``): the outbox
  table in your PostgreSQL and its relay;
* ``consumer/`` -- the worker runners (thread, process, asyncio) and their one policy,
  running one job, idempotency stores (SQLite, PostgreSQL);
* ``backends/`` -- other engines behind the same ``Queue`` protocol (``sqs``: Amazon SQS FIFO);
* ``backup/`` -- ``shardq backup`` of a serving service and ``shardq restore``;
* ``client/`` -- the ``Queue`` protocol, the client core, the router apps embed (``router``)
  and the asyncio client (``aio``); beside it ``shard/`` -- the pure state machine
  (``state``), its pairing with the log (``durable``) and the shard process (``process``);
* ``protocol/`` -- what both sides agree on: the wire, the handshake, job checks, the
  supervisor's status file;
* ``wal/`` -- the write-ahead log;
* ``errors``, ``types``, ``limits``, ``clock``, ``config``, ``datadir``, ``schedules``,
  ``pgconn``, ... -- the ground floor (``pgconn``: connecting to your PostgreSQL, psycopg
  imported on first use; ``schedules``: when periodic jobs tick, pure).

Public API (run as a doctest by tests/project/test_docs.py, from the repo root with ``shardq serve``
running on the default config)::

    >>> import shardq
    >>> q = shardq.connect("var/shardq")                  # router to `shardq serve`
    >>> job_id = q.enqueue(b"resize photo 7", key="album-1")
    >>> lease = q.dequeue("default", wait=1.0)
    >>> lease.job_id == job_id, lease.body, lease.attempt
    (True, b'resize photo 7', 1)
    >>> q.ack(lease)
    >>> q.close()

    >>> e = shardq.open("var/embedded", shards=2, config={"queue_defaults": {"max_deliveries": 3}})
    >>> e.queue_config("default")["max_deliveries"]       # embedded service + router
    3
    >>> e.close()                                         # stops the embedded service too

    ``shardq.connect("sqs://us-east-1/myapp")`` gives the same protocol on Amazon SQS FIFO
    (docs/scale-out.md). The asyncio client is ``q = await shardq.aio.connect("var/shardq")``; tasks are
    ``app = shardq.App("var/shardq")`` with ``@app.task`` and ``.send()`` (docs/tasks.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (AuthError, Cancelled, Closed, CorruptLog, DataDirLocked, Fail, InvalidConfig,
                     InvalidJob, JobGone, LeaseLost, LogFailed, NotADataDir, NotFound, OutcomeUnknown,
                     ProtocolError, QueueFull, Retry, ShardCountMismatch, ShardqError, ShardUnavailable,
                     TooManyConnections, UnknownQueue, Unsupported, UsageError)
from .errors import JobFailed, OutboxBehind, StoreUnavailable, WorkflowCancelled
from .types import DeadLetter, JobId, Lease

if TYPE_CHECKING:
    from .client import aio
    from .client.queue import Queue
    from .client.router import Router
    from .config import Config, QueueConfig
    from .consumer.postgres import PostgresStore
    from .service.embedded import App
    from .tasks.app import Exponential, Task
    from .consumer.worker import Worker
    from .tasks.workflow import Workflow, chain, chord, group

# Imported on first use (PEP 562), so that a process that needs one part does not load the
# others: a shard process needs neither the router nor asyncio, and `import shardq` in an app
# loads neither the worker (sqlite3, signal handling) nor psycopg until they are used.
# name -> (module, attribute; None: the module itself)
_LAZY = {
    "Config": (".config", "Config"), "QueueConfig": (".config", "QueueConfig"),
    "App": (".service.embedded", "App"), "Exponential": (".tasks.app", "Exponential"),
    "Task": (".tasks.app", "Task"),
    "chain": (".tasks.workflow", "chain"), "group": (".tasks.workflow", "group"),
    "chord": (".tasks.workflow", "chord"), "Workflow": (".tasks.workflow", "Workflow"),
    "Queue": (".client.queue", "Queue"), "Router": (".client.router", "Router"),
    "Worker": (".consumer.worker", "Worker"), "PostgresStore": (".consumer.postgres", "PostgresStore"),
    "aio": (".client.aio", None),  # `await shardq.aio.connect(...)`
    "outbox": (".outbox", None),   # `shardq.outbox.enqueue(conn, ...)` after a plain `import shardq`
}

__all__ = [
    "open", "connect", "Queue", "Router", "Lease", "DeadLetter", "JobId", "Config", "QueueConfig",
    "Worker", "ShardqError", "InvalidJob", "UnknownQueue", "InvalidConfig", "ProtocolError",
    "AuthError", "NotFound", "LeaseLost", "JobGone", "QueueFull", "ShardUnavailable", "OutcomeUnknown",
    "TooManyConnections", "Closed",
    "ShardCountMismatch", "NotADataDir", "DataDirLocked", "UsageError", "Unsupported",
    "CorruptLog", "LogFailed", "App", "Task", "Exponential", "Retry", "Fail", "aio", "Cancelled",
    "PostgresStore", "StoreUnavailable", "OutboxBehind", "JobFailed", "chain", "group", "chord",
    "Workflow", "WorkflowCancelled",
]


def open(data_dir: str, shards: int | None = None, config: Any = None, **router_options: Any) -> Router:  # noqa: A001 - shardq.open is the public API name (shadows the builtin inside this module only)
    """Start the service embedded in this process (supervisor thread + shard processes) and
    return a router to it; ``close()`` stops both. ``config``: dict, TOML path, or None."""
    from .service.embedded import open_service
    return open_service(data_dir, shards, config, **router_options)


def connect(target: Any, **options: Any) -> Queue:
    """A client of the queue service at ``target``: the data dir of a running ``shardq
    serve`` (a path), or ``sqs://<region>/<prefix>[?endpoint=URL]`` (Amazon SQS FIFO,
    ``pip install shardq[sqs]``). Every backend returns a :class:`Queue`."""
    from .backends import connect as connect_target
    return connect_target(target, **options)


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'shardq' has no attribute {name!r}") from None
    import importlib
    value = importlib.import_module(module, __name__)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # found here once; later lookups are plain attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
