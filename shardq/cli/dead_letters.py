"""``shardq dead-letters list|redrive|purge``."""
from __future__ import annotations

import json

from . import common, exits


def register(sub, parent) -> None:
    s = sub.add_parser("dead-letters", parents=[parent], help="list, redrive or purge dead letters")
    s.add_argument("action", choices=["list", "redrive", "purge"])
    s.add_argument("--queue", default="default")
    s.add_argument("--limit", type=int, default=100)
    s.set_defaults(fn=run)


def run(args) -> int:
    with common.connect(args) as q:
        if args.action == "list":
            for d in q.dead_letters(args.queue, limit=args.limit):
                print(json.dumps({"job_id": d.job_id, "key": d.key, "attempts": d.attempts, "error": d.error,
                                  "body": d.body.decode("utf-8", "replace")}))
        elif args.action == "redrive":
            print(f"redriven: {q.redrive(args.queue)}")
        else:
            print(f"purged: {q.purge_dead_letters(args.queue)}")
    return exits.OK
