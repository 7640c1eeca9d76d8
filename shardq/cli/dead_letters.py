"""``shardq dead-letters list|redrive|purge``."""
from __future__ import annotations

import json
import sys

from . import common, exits
from .jobs import _ref


def register(sub, parent) -> None:
    s = sub.add_parser("dead-letters", parents=[parent], help="list, redrive or purge dead letters")
    s.add_argument("action", choices=["list", "redrive", "purge"])
    s.add_argument("--queue", default="default")
    s.add_argument("--limit", type=int, default=100, help="list: letters per page (at most 1000)")
    s.add_argument("--cursor", help="list: the page after the one that printed this cursor")
    s.add_argument("--id", dest="ids", type=_ref, action="append", metavar="JOB_ID",
                   help="redrive/purge: only this dead letter (repeat for more; as list printed it: "
                        "a number on the local shards, a message id on SQS); default: all")
    s.set_defaults(fn=run)


def run(args) -> int:
    with common.connect(args) as q:
        if args.action == "list":
            if args.cursor is None and not hasattr(q, "dead_letters_page"):
                items, cursor = q.dead_letters(args.queue, limit=args.limit), None  # any backend
            else:
                page = common.control_call(q, "dead_letters_page")(args.queue, args.limit, args.cursor)
                items, cursor = page.items, page.cursor
            for d in items:
                print(json.dumps({"job_id": d.job_id, "key": d.key, "attempts": d.attempts, "error": d.error,
                                  "body": d.body.decode("utf-8", "replace")}))
            if cursor is not None:
                print(f"more: --cursor {cursor}", file=sys.stderr)
        elif args.action == "redrive":
            print(f"redriven: {q.redrive(args.queue, args.ids)}")
        else:
            # by id: the SQS backend raises Unsupported (it cannot pick dead letters to delete)
            print(f"purged: {q.purge_dead_letters(args.queue, args.ids)}")
    return exits.OK
