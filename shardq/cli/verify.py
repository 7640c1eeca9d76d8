"""``shardq verify``: the chaos run and history checker (its own options; see --help)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import common


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("verify", help="chaos run + history checker", add_help=False)
    s.set_defaults(fn=run, passthrough=True)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    from .. import verify
    return verify.main(rest)
