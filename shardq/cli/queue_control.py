"""``shardq queue pause|resume NAME``: stop or restart leasing from a queue, durably.
``shardq queue limit NAME [--concurrency N] [--rate 50/s] ...``: change the limits of a queue
that declares some, at run time and durably (docs/limits.md)."""
from __future__ import annotations

from . import common, exits

#: flag -> limit key; "none" removes that limit
_LIMIT_FLAGS = ("concurrency", "rate", "burst", "group_concurrency", "group_rate")


def register(sub, parent) -> None:
    s = sub.add_parser("queue", parents=[parent],
                       help="pause or resume a queue (a paused queue leases nothing; enqueue, "
                            "ack, nack and extend keep working), or change its limits")
    s.add_argument("action", choices=["pause", "resume", "limit"])
    s.add_argument("name", help="the queue")
    for key in _LIMIT_FLAGS:
        s.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar="VALUE",
                       help=f"limit: new {key} ('none' removes it)")
    s.add_argument("--reset", action="store_true", help="limit: back to the config's limits")
    s.set_defaults(fn=run)


def _value(key: str, text: str):
    if text.lower() == "none":
        return None
    if key in ("concurrency", "group_concurrency"):
        return int(text) if text.strip().lstrip("-").isdigit() else text  # the shard names a bad value
    if key == "burst":
        try:
            return float(text)
        except ValueError:
            return text
    return text


def run(args) -> int:
    if args.action == "limit":
        return _limit(args)
    with common.connect(args) as q:
        changed = common.control_call(q, args.action)(args.name)
    word = "paused" if args.action == "pause" else "resumed"
    print(f"{word}: {args.name}" + ("" if changed else f" (it was {word} already)"))
    return exits.OK


def _limit(args) -> int:
    values = {k: _value(k, getattr(args, k)) for k in _LIMIT_FLAGS if getattr(args, k) is not None}
    if args.reset == bool(values):
        print("shardq queue limit: give --reset or at least one of "
              + ", ".join(f"--{k.replace('_', '-')}" for k in _LIMIT_FLAGS))
        return exits.USAGE
    with common.connect(args) as q:
        figures = common.control_call(q, "set_limits")(args.name, None if args.reset else values)
    common.print_json({"queue": args.name, "limits": figures})
    return exits.OK
