"""``shardq dead-letters list|redrive|purge``.

``list`` without ``--queue`` lists every queue that holds dead letters, so a letter in a
queue the operator did not think of is not missed; ``redrive`` and ``purge`` change one
queue only (``--queue``, default ``default``), and say where dead letters wait when that
one held none. A ``--queue`` the service does not hold and its config does not declare is
refused, ``UnknownQueue`` naming the queues that exist (exit 2), as ``shardq queue`` refuses
it: a typo must not read as "no dead letters" (the SQS backend refuses it by itself).
"""
from __future__ import annotations

import argparse

import json
import sys
from typing import Any

from ..errors import UsageError
from . import common, exits

#: ``list --limit``: letters per page, the range the router's dead_letters_page takes
LIMIT_MAX = 1000


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("dead-letters", parents=[parent], help="list, redrive or purge dead letters")
    s.add_argument("action", choices=["list", "redrive", "purge"])
    s.add_argument("--queue", default=None,
                   help="list: only this queue (default: every queue with dead letters); "
                        "redrive/purge: this queue (default: default)")
    s.add_argument("--limit", type=int, default=100, help=f"list: letters per page (1 to {LIMIT_MAX})")
    s.add_argument("--cursor", help="list (with --queue): the page after the one that printed this cursor")
    s.add_argument("--id", dest="ids", type=common.job_id, action="append", metavar="JOB_ID",
                   help="redrive/purge: only this dead letter (repeat for more; as list printed it: "
                        "a number on the local shards, a message id on SQS); default: all")
    common.add_raw_flag(s)
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    if args.cursor is not None and args.queue is None:
        raise UsageError("--cursor needs --queue: a cursor continues the pages of one queue")
    if args.action == "list" and not 1 <= args.limit <= LIMIT_MAX:
        # here, not per queue: without --queue and no dead letters anywhere it exited 0
        raise UsageError(f"--limit must be 1 to {LIMIT_MAX}, got {args.limit}")
    common.check_local_ids(args, "dead-letters", **{"--id": args.ids or []})
    with common.connect(args) as q:
        if args.queue is not None:
            _check_exists(q, args.queue)
        if args.action == "list":
            if args.queue is not None:
                _list(q, args.queue, args, more_flags="")
            else:
                for name in sorted(dead_counts(q)):
                    _list(q, name, args, more_flags=f"--queue {common.shown(name)} ")
            return exits.OK
        queue = args.queue or "default"
        if args.action == "redrive":
            done = q.redrive(queue, args.ids)
            print(f"redriven: {done}")
        else:
            # by id: the SQS backend raises Unsupported (it cannot pick dead letters to delete)
            done = q.purge_dead_letters(queue, args.ids)
            print(f"purged: {done}")
        if not done and args.queue is None:
            elsewhere = dead_counts(q)
            if elsewhere:
                print("note: no --queue given, so queue 'default'; dead letters wait in "
                      + ", ".join(f"{common.shown(n)} ({c})" for n, c in sorted(elsewhere.items())), file=sys.stderr)
    return exits.OK


def dead_counts(q: Any) -> dict[str, int]:
    """Queue -> how many dead letters it holds, for the queues that hold any (approximate on
    SQS, like its stats)."""
    return {name: int(c["dead"]) for name, c in q.stats()["queues"].items()
            if isinstance(c.get("dead"), int) and c["dead"] > 0}


def _check_exists(q: Any, queue: str) -> None:
    """UnknownQueue naming the queues that exist, unless the local shards hold ``queue`` or
    their config declares it (client/queue_names.py); other backends refuse a queue they
    lack by themselves (SQS: its queues do not exist)."""
    from ..client.contracts import Control
    from ..client.queue_names import check_exists
    if isinstance(q, Control):
        check_exists(q, queue)


def _list(q: Any, queue: str, args: argparse.Namespace, more_flags: str) -> None:
    from ..client.contracts import Control
    if args.cursor is None and not isinstance(q, Control):
        items, cursor = q.dead_letters(queue, limit=args.limit), None  # any backend
    else:
        page = common.control_call(q, "dead_letters_page").dead_letters_page(queue, args.limit, args.cursor)
        items, cursor = page.items, page.cursor
    for d in items:
        print(json.dumps({"queue": queue, "job_id": d.job_id, "key": d.key, "attempts": d.attempts,
                          "error": d.error, **common.body_fields(d.body, args.raw)}))
    if cursor is not None:
        print(f"more: {more_flags}--cursor {cursor}", file=sys.stderr)
