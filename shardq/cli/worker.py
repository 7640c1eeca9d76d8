"""``shardq worker module:function [options]``: run a :class:`~shardq.consumer.worker.Worker`
against a running service.

``shardq worker myapp.tasks [more.modules ...]`` (modules, no colon): run every task of
the modules, one worker per queue of their tasks (``--queue`` to pick some), routing each
job by its task name (:mod:`shardq.consumer.taskworker`)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable

from ..errors import UsageError
from ..pgconn import is_url
from . import common, exits


def open_store(target: str):
    """The idempotency store ``--idempotency`` names, picked by the URL scheme: a PostgreSQL
    URL opens a :class:`~shardq.consumer.postgres.PostgresStore`, anything else is a SQLite file."""
    if is_url(target):
        from ..consumer.postgres import PostgresStore
        return PostgresStore(target)
    from ..consumer.idempotency import SqliteStore
    return SqliteStore(target)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("handler", nargs="+", metavar="TARGET",
                   help="module:function (one handler), or module(s) of tasks; imported with the "
                        "current directory on sys.path")
    p.add_argument("--queue", action="append", default=None,
                   help="queue to work (default: 'default' for a handler; every queue of the "
                        "tasks for modules); repeat for several")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--mode", choices=("thread", "process"), default="thread")
    p.add_argument("--idempotency", metavar="PATH.sqlite|postgresql://...",
                   help="idempotency store, exactly-once effects through ctx.db: a SQLite file, "
                        "or a PostgreSQL URL (postgresql:// or postgres://; needs shardq[postgres])")
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--grace", type=float, default=30.0, help="seconds running jobs get on SIGTERM")
    p.add_argument("--log-every", type=int, default=1000)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics on this address (port 0: any free port; printed)")


def register(sub, parent) -> None:
    s = sub.add_parser("worker", parents=[parent], help="run a handler, or every task of some modules")
    add_arguments(s)
    s.set_defaults(fn=run)


def run(args, connect: Callable[..., Any] | None = None) -> int:
    from ..consumer.handling import load_handler
    from ..consumer.worker import Worker
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.idempotency and not is_url(args.idempotency):
        parent = os.path.dirname(os.path.abspath(args.idempotency))
        if not os.path.isdir(parent):
            raise UsageError(f"--idempotency {args.idempotency}: directory {parent} does not exist")
    task_mode = not any(":" in t for t in args.handler)
    if not task_mode and len(args.handler) != 1:
        raise UsageError("give one module:function, or module names (no colon) of tasks")
    if not task_mode and args.queue and len(args.queue) != 1:
        raise UsageError("a module:function handler works one --queue")
    try:
        if task_mode:
            from ..consumer.dispatch import load_tasks
            load_tasks(args.handler)  # import errors are usage errors, before connecting
        else:
            handler = load_handler(args.handler[0])
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"cannot load {' '.join(args.handler)!r}: {exc}") from None
    target = common.target(args)
    if connect is None:
        import shardq
        connect = shardq.connect
    store = router = None
    try:
        store = open_store(args.idempotency) if args.idempotency else None
        # Requests must time out well inside a lease, so one hung shard cannot stall the
        # heartbeats of jobs on the other shards past their deadlines.
        router = connect(target, request_timeout_s=5.0)
        metrics = _serve_metrics(args)
        if task_mode:
            from ..consumer.taskworker import Options, TaskWorkers
            TaskWorkers(args.handler, router, target, args.queue,
                        Options(concurrency=args.concurrency, mode=args.mode, prefetch=args.prefetch,
                                grace_s=args.grace, log_every=args.log_every, metrics=metrics),
                        idempotency_path=args.idempotency, store=store).run()
        else:
            Worker(router, handler, queue=(args.queue or ["default"])[0], concurrency=args.concurrency,
                   mode=args.mode, idempotency=store, prefetch=args.prefetch, grace_s=args.grace,
                   log_every=args.log_every, metrics=metrics).run()
    finally:
        if router is not None:
            router.close()
        if store is not None:
            store.close()
    return exits.OK


def main(argv: list[str] | None = None, connect: Callable[..., Any] | None = None) -> int:
    """The worker command on its own (tests, embedding): parse ``argv``, run, return the exit
    status; errors print ``error: Type: message`` like every ``shardq`` command."""
    from .main import run_guarded
    p = argparse.ArgumentParser(prog="shardq worker", parents=[common.common_parser()],
                                description="Run a handler, or every task of some modules.")
    add_arguments(p)
    args = p.parse_args(argv)
    return run_guarded(lambda: run(args, connect))


def _task_name(lease) -> str:
    """The task a job calls (the metrics label of ``shardq worker MODULE``)."""
    from ..consumer import taskbody
    try:
        return taskbody.decode(lease.body)[0]
    except taskbody.BadBody:
        return "(not a task)"


def _serve_metrics(args):
    """``--metrics HOST:PORT``: a WorkerMetrics served on that address, or None."""
    if not args.metrics:
        return None
    from ..consumer.metrics import WorkerMetrics
    from ..errors import InvalidConfig
    handler_mode = any(":" in t for t in args.handler)  # one module:function, labelled by its name
    metrics = WorkerMetrics(task=" ".join(args.handler), task_of=None if handler_mode else _task_name)
    try:
        host, port = metrics.serve(args.metrics)
    except OSError as e:
        raise InvalidConfig(f"--metrics {args.metrics}: cannot listen: {e.strerror or e}") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"shardq worker: metrics at http://{shown}:{port}/metrics", file=sys.stderr, flush=True)
    return metrics
