"""``shardq worker module:function [options]``: run a :class:`~shardq.consumer.worker.Worker`
against a running service."""
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
    p.add_argument("handler", help="module:function, imported with the current directory on sys.path")
    p.add_argument("--queue", default="default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--mode", choices=("thread", "process"), default="thread")
    p.add_argument("--idempotency", metavar="PATH.sqlite|postgresql://...",
                   help="idempotency store, exactly-once effects through ctx.db: a SQLite file, "
                        "or a PostgreSQL URL (postgresql:// or postgres://; needs shardq[postgres])")
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--grace", type=float, default=30.0, help="seconds running jobs get on SIGTERM")
    p.add_argument("--log-every", type=int, default=1000)
    p.add_argument("--log-level", default="INFO")


def register(sub, parent) -> None:
    s = sub.add_parser("worker", parents=[parent], help="run a handler on the jobs of one queue")
    add_arguments(s)
    s.set_defaults(fn=run)


def run(args, connect: Callable[..., Any] | None = None) -> int:
    from ..consumer.handling import load_handler
    from ..consumer.worker import Worker
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handler = load_handler(args.handler)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"cannot load {args.handler!r}: {exc}") from None
    if args.idempotency and not is_url(args.idempotency):
        parent = os.path.dirname(os.path.abspath(args.idempotency))
        if not os.path.isdir(parent):
            raise UsageError(f"--idempotency {args.idempotency}: directory {parent} does not exist")
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
        Worker(router, handler, queue=args.queue, concurrency=args.concurrency, mode=args.mode,
               idempotency=store, prefetch=args.prefetch, grace_s=args.grace,
               log_every=args.log_every).run()
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
                                description="Run a handler on the jobs of one queue.")
    add_arguments(p)
    args = p.parse_args(argv)
    return run_guarded(lambda: run(args, connect))
