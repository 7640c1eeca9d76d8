"""``shardq worker module:function [options]``: run a :class:`~shardq.consumer.worker.Worker` from
the command line against a running service."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable

from ..errors import InvalidConfig, ShardqError
from ..consumer.handling import load_handler
from ..consumer.idempotency import SqliteStore
from ..consumer.worker import Worker


def main(argv: list[str] | None = None, connect: Callable[[str], Any] | None = None) -> int:
    """``shardq worker module:function [options]``. Returns the exit status."""
    p = argparse.ArgumentParser(prog="shardq worker",
                                description="Run a handler on the jobs of one queue.")
    p.add_argument("handler", help="module:function, imported with the current directory on sys.path")
    p.add_argument("--queue", default="default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--connect", default="var/shardq", metavar="DATA_DIR")
    p.add_argument("--mode", choices=("thread", "process"), default="thread")
    p.add_argument("--idempotency", metavar="PATH.sqlite",
                   help="SQLite idempotency store: exactly-once effects through ctx.db")
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--grace", type=float, default=30.0, help="seconds running jobs get on SIGTERM")
    p.add_argument("--log-every", type=int, default=1000)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handler = load_handler(args.handler)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"shardq worker: cannot load {args.handler!r}: {exc}", file=sys.stderr)
        return 2
    if connect is None:
        import shardq
        connect = shardq.connect
    store = router = None
    try:
        store = SqliteStore(args.idempotency) if args.idempotency else None
        # Requests must time out well inside a lease, so one hung shard cannot stall the
        # heartbeats of jobs on the other shards past their deadlines.
        router = connect(args.connect, request_timeout_s=5.0)
        Worker(router, handler, queue=args.queue, concurrency=args.concurrency, mode=args.mode,
               idempotency=store, prefetch=args.prefetch, grace_s=args.grace,
               log_every=args.log_every).run()
    except InvalidConfig as exc:
        print(f"shardq worker: {exc}", file=sys.stderr)
        return 2
    except ShardqError as exc:
        print(f"shardq worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if router is not None:
            router.close()
        if store is not None:
            store.close()
    return 0
