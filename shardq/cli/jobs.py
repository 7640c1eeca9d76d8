"""``shardq enqueue|dequeue|ack|nack``: one job at a time, from a shell."""
from __future__ import annotations

import argparse

import json
import sys

from ..client.routing import job_shard
from ..types import Lease
from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("enqueue", parents=[parent], help="enqueue one job; prints its id")
    s.add_argument("body", help="job body (UTF-8 text), or - to read bytes from stdin")
    s.add_argument("--key")
    s.add_argument("--queue", default="default")
    s.add_argument("--delay", type=common.number, default=0.0)
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--dedup-id")
    s.set_defaults(fn=enqueue)

    s = sub.add_parser("dequeue", parents=[parent],
                       help=f"lease jobs; prints one JSON line per lease (exit {exits.EMPTY} if none)")
    s.add_argument("--queue", default="default")
    s.add_argument("--wait", type=common.number, default=0.0)
    s.add_argument("--visibility", type=common.number)
    s.add_argument("--max", type=int, default=1)
    common.add_raw_flag(s)
    s.set_defaults(fn=dequeue)

    for name, fn in (("ack", ack), ("nack", nack)):
        s = sub.add_parser(name, parents=[parent], help=f"{name} a lease (job id and token from dequeue)")
        s.add_argument("job_id", type=common.job_id)
        s.add_argument("token", type=common.lease_token)
        if name == "nack":
            s.add_argument("--delay", type=common.number, default=0.0)
            s.add_argument("--error")
        s.set_defaults(fn=fn)


def enqueue(args: argparse.Namespace) -> int:
    body = args.body.encode() if args.body != "-" else sys.stdin.buffer.read()
    with common.connect(args) as q:
        print(q.enqueue(body, key=args.key, queue=args.queue, delay=args.delay, priority=args.priority,
                        dedup_id=args.dedup_id))
    return exits.OK


def dequeue(args: argparse.Namespace) -> int:
    with common.connect(args) as q:
        leases = q.dequeue_many(args.queue, max_jobs=args.max, wait=args.wait, visibility=args.visibility)
    for l in leases:
        print(json.dumps({"job_id": l.job_id, "token": l.token, "key": l.key, "attempt": l.attempt,
                          "deadline": l.deadline, **common.body_fields(l.body, args.raw)}))
    return exits.OK if leases else exits.EMPTY


def _lease(args: argparse.Namespace, q: object) -> Lease:
    from ..client.router import Router
    from ..types import Lease
    if isinstance(q, Router) and isinstance(args.job_id, int):
        # an id no shard of this service made is no such job, as job show and job cancel
        # say (NotFound), not the bad lease that the router's ack would call it
        job_shard(args.job_id, q.shards)
    # The local shards find a job by its id; the sqs backend acks in queue "default" (the
    # CLI's queue; a token of another queue is refused there with LeaseLost).
    return Lease(args.job_id, None, b"", "default", 0, args.token, 0.0)


def ack(args: argparse.Namespace) -> int:
    common.check_local_ids(args, "ack", job_id=args.job_id, token=args.token)
    with common.connect(args) as q, common.naming_a_job(args.job_id):
        q.ack(_lease(args, q))
    return exits.OK


def nack(args: argparse.Namespace) -> int:
    common.check_local_ids(args, "nack", job_id=args.job_id, token=args.token)
    with common.connect(args) as q, common.naming_a_job(args.job_id):
        q.nack(_lease(args, q), delay=args.delay, error=args.error)
    return exits.OK
