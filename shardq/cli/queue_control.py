"""``shardq queue pause|resume NAME``: stop or restart leasing from a queue, durably."""
from __future__ import annotations

from . import common, exits


def register(sub, parent) -> None:
    s = sub.add_parser("queue", parents=[parent],
                       help="pause or resume a queue (a paused queue leases nothing; enqueue, "
                            "ack, nack and extend keep working)")
    s.add_argument("action", choices=["pause", "resume"])
    s.add_argument("name", help="the queue")
    s.set_defaults(fn=run)


def run(args) -> int:
    with common.connect(args) as q:
        changed = common.control_call(q, args.action)(args.name)
    word = "paused" if args.action == "pause" else "resumed"
    print(f"{word}: {args.name}" + ("" if changed else f" (it was {word} already)"))
    return exits.OK
