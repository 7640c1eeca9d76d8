"""``shardq verify``: the chaos run and history checker (its own options; see --help)."""
from __future__ import annotations


def register(sub, parent) -> None:
    s = sub.add_parser("verify", help="chaos run + history checker", add_help=False)
    s.set_defaults(fn=run, passthrough=True)


def run(args, rest: list[str]) -> int:
    from .. import verify
    return verify.main(rest)
