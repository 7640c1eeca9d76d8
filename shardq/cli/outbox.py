"""``shardq outbox init|relay|status --dsn DSN``: the transactional-enqueue outbox.

* ``init`` creates the outbox tables in the database (the relay does too when it starts);
* ``relay`` moves committed outbox rows into the queue service (``--data-dir``) until
  SIGTERM/SIGINT; it exits 1 with ``OutboxBehind`` if rows it must resend are older than
  the queue's dedup window (docs/guarantees.md);
* ``status`` prints how far the outbox is behind, as JSON.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("outbox", help="transactional enqueue: the outbox table and its relay")
    cmds = p.add_subparsers(dest="outbox_command", required=True)
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument("--dsn", required=True, help="the application's PostgreSQL (postgresql://... or key=value)")
    db.add_argument("--table", default=None, help="outbox table name (default shardq_outbox)")

    i = cmds.add_parser("init", parents=[db], help="create the outbox tables (idempotent)")
    i.set_defaults(fn=run_init)

    r = cmds.add_parser("relay", parents=[parent, db], help="move committed outbox rows into the queue")
    r.add_argument("--batch", type=int, default=None, help="rows per transaction (default 500)")
    r.add_argument("--poll", type=common.number, default=None,
                   help="seconds between polls when no notification comes (default 5)")
    common.add_log_level(r)
    r.set_defaults(fn=run_relay)

    s = cmds.add_parser("status", parents=[db], help="rows waiting, oldest age, attempts, rejected (JSON)")
    s.set_defaults(fn=run_status)


def _table(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.table is None else {"table": args.table}


def run_init(args: argparse.Namespace) -> int:
    from ..outbox import install
    scope = install(args.dsn, **_table(args))
    common.print_json({"table": args.table or "shardq_outbox", "scope": scope})
    return exits.OK


def run_status(args: argparse.Namespace) -> int:
    from ..outbox import status
    common.print_json(status(args.dsn, **_table(args)))
    return exits.OK


def run_relay(args: argparse.Namespace) -> int:
    return common.stoppable_while_starting("shardq outbox relay", lambda: _relay(args))


def _relay(args: argparse.Namespace) -> int:
    from ..outbox import Relay
    logging.getLogger().setLevel(args.log_level)
    options = _table(args)
    if args.batch is not None:
        options["batch_rows"] = args.batch
    if args.poll is not None:
        options["poll_s"] = args.poll
    # Requests time out well inside the dedup window's margin, so a hung shard cannot keep
    # a batch open for long.
    with common.connect(args, request_timeout_s=5.0) as q:
        relay = Relay(args.dsn, q, **options)
        try:
            stats = relay.run()
        finally:
            relay.close()
    logging.getLogger("shardq.outbox").info("stopped: %s", stats)
    return exits.OK
