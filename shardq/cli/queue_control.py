"""``shardq queue pause|resume NAME``: stop or restart leasing from a queue, durably.
``shardq queue purge NAME``: delete every job of a queue but its dead letters (ready,
delayed, waiting, leased), durably; prints how many.
``shardq queue limit NAME [--concurrency N] [--rate 50/s] ...``: change the limits of a queue
that declares some, at run time and durably (docs/limits.md).

NAME must be a queue that exists: one the service holds (it has or had jobs) or one its
config declares. Any other is refused (``UnknownQueue``, exit 2, naming the queues that
exist) unless ``--create`` says a new queue is meant: a typo must not leave a phantom queue
in stats, the console and backups for good. Each limit value is checked on the command line
by the config's own check (``config.check_limit``, exit 2 with the flag); the values
together are checked by the shard, against the queue's config, with the config's
``check_limits`` (a ``burst`` without a ``rate``), and refused with exit 2 too."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..config import check_limit
from ..errors import InvalidConfig, UsageError
from . import common, exits

#: flag -> limit key; "none" removes that limit
_LIMIT_FLAGS = ("concurrency", "rate", "burst", "group_concurrency", "group_rate")


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("queue", parents=[parent],
                       help="pause or resume a queue (a paused queue leases nothing; enqueue, "
                            "ack, nack and extend keep working), purge it (every job but its dead "
                            "letters, leased ones too), or change its limits")
    s.add_argument("action", choices=["pause", "resume", "purge", "limit"])
    s.add_argument("name", help="the queue: one the service holds or its config declares (else --create)")
    s.add_argument("--create", action="store_true",
                   help="NAME is a new queue: pause (or limit) it before it holds any job")
    for key in _LIMIT_FLAGS:
        s.add_argument(f"--{_flag(key)}", dest=key, metavar="VALUE", type=_limit_value(key),
                       help=f"limit: new {key} ('none' removes it)")
    s.add_argument("--reset", action="store_true", help="limit: back to the config's limits")
    s.set_defaults(fn=run)


def _flag(key: str) -> str:
    return key.replace("_", "-")


class _Removed:
    """A flag's 'none': that limit removed (argparse keeps None for a flag not given)."""


REMOVED = _Removed()


def _limit_value(key: str) -> Callable[[str], Any]:
    """argparse's type for ``--KEY``: the value as the config checks it (check_limit), so a
    bad one is a usage error (exit 2) naming the flag, and nothing reaches the service."""
    def parse(text: str) -> Any:
        if text.strip().lower() == "none":
            return REMOVED
        value: object = text
        try:
            value = int(text) if key.endswith("concurrency") else float(text) if key == "burst" else text
        except ValueError:
            pass  # check_limit names what it expected
        try:
            return check_limit(f"--{_flag(key)}", key, value)
        except InvalidConfig as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"--{_flag(key)}: ")) from None
    parse.__name__ = key  # argparse names the type in some messages
    return parse


def run(args: argparse.Namespace) -> int:
    if args.action != "limit" and (args.reset or any(getattr(args, k) is not None for k in _LIMIT_FLAGS)):
        raise UsageError(f"queue {args.action} takes no limit flags (they belong to queue limit)")
    if args.action == "limit":
        return _limit(args)
    if args.action == "purge":
        return _purge(args)
    with common.connect(args) as q:
        control = common.control_call(q, args.action)
        call = control.pause if args.action == "pause" else control.resume
        if not args.create:
            check_exists(q, args.name)
        changed = call(args.name)
    word = "paused" if args.action == "pause" else "resumed"
    print(f"{word}: {common.shown(args.name)}" + ("" if changed else f" (it was {word} already)"))
    return exits.OK


def check_exists(q: Any, name: str) -> None:
    """UnknownQueue naming the queues that exist, unless ``name`` is one (client/queue_names.py)."""
    from ..client.queue_names import check_exists as known
    known(q, name, create_hint="give --create to make a new one, or declare it as [queues.NAME] in the config")


def _purge(args: argparse.Namespace) -> int:
    if args.create:
        raise UsageError("queue purge takes no --create: a new queue holds nothing to purge")
    with common.connect(args) as q:
        purge = common.control_call(q, "purge").purge
        check_exists(q, args.name)
        gone = purge(args.name)
    print(f"purged: {common.shown(args.name)} ({gone} job{'' if gone == 1 else 's'} deleted)")
    return exits.OK


def _limit(args: argparse.Namespace) -> int:
    values = {k: None if v is REMOVED else v for k in _LIMIT_FLAGS if (v := getattr(args, k)) is not None}
    if args.reset == bool(values):
        raise UsageError("queue limit: give --reset or at least one of "
                         + ", ".join(f"--{_flag(k)}" for k in _LIMIT_FLAGS))
    with common.connect(args) as q:
        call = common.control_call(q, "set_limits").set_limits
        if not args.create:
            check_exists(q, args.name)
        try:
            figures = call(args.name, None if args.reset else values)
        except InvalidConfig as e:
            # the values together, checked by the shard against the queue's config: still a
            # bad command line (exit 2), not a bad config file
            raise UsageError(f"queue limit {args.name}: {e}") from None
    common.print_json({"queue": args.name, "limits": figures})
    return exits.OK
