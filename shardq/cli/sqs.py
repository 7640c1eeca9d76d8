"""``shardq sqs init [--config PATH] --connect sqs://<region>/<prefix>``: create or update the
SQS FIFO queues (and their dead-letter queues) of a config; prints what it did."""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sqs", help="Amazon SQS FIFO backend: set up queues")
    inner = s.add_subparsers(dest="sqs_command", required=True)
    i = inner.add_parser("init", parents=[parent],
                         help="create or update the FIFO queues of the config's [queues] (idempotent)")
    i.add_argument("--high-throughput", action="store_true",
                   help="high-throughput FIFO: DeduplicationScope=messageGroup, "
                        "FifoThroughputLimit=perMessageGroupId")
    i.set_defaults(fn=init)


def init(args: argparse.Namespace) -> int:
    from ..backends.sqs_admin import init as init_queues
    from ..backends.sqs_client import Api
    from ..backends.sqs_mapping import parse_target
    target = common.target(args)
    if not str(target).startswith("sqs://"):
        raise UsageError(f"--connect {target!r}: shardq sqs init needs sqs://<region>/<prefix>")
    api = Api(parse_target(target))
    for line in init_queues(api, common.load_config(args.config), high_throughput=args.high_throughput):
        print(common.shown(line, backslash=False))
    return exits.OK
