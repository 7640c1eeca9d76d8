"""``shardq workflow show ID``: a workflow's record and its steps (docs/workflows.md)."""
from __future__ import annotations

import argparse

import json

from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("workflow", parents=[parent],
                       help="show a workflow by id: how it ended (or that it runs), and its steps")
    s.add_argument("action", choices=["show"])
    s.add_argument("workflow_id")
    s.add_argument("--steps", type=int, default=None, metavar="N",
                   help="list at most N steps (default: 200; every step is counted by state)")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..client.contracts import Results
    from ..errors import InvalidJob, Unsupported
    from ..tasks.workflow import DESCRIBE_STEPS_MAX, describe
    steps = DESCRIBE_STEPS_MAX if args.steps is None else args.steps
    if steps < 0:
        raise InvalidJob(f"--steps must be 0 or more, got {steps}")
    with common.connect(args) as q:
        if not isinstance(q, Results):
            raise Unsupported(f"{type(q).__name__} keeps no workflow records (the local shards' service does)")
        print(json.dumps(describe(q, args.workflow_id, steps)))
    return exits.OK
