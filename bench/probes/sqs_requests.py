"""SQS API requests per job, by call pattern (what a million jobs costs: docs/scale-out.md).

Counts every HTTP request the backend's boto3 client sends (a ``before-send`` event hook, so
botocore's retries count too), after the one-off queue lookups. Patterns:

* ``single``  -- enqueue, dequeue, ack: one job per call;
* ``batched`` -- enqueue_many, dequeue_many and ack_many in tens (the batched worker path);
* ``worker``  -- producers batch; ``shardq.Worker`` (8 threads, its default prefetch) consumes.

    .venv/bin/python -m bench.probes.sqs_requests [--target sqs://REGION/PREFIX?endpoint=URL] [--jobs N]

Without ``--target`` it starts a moto server (tests/support/sqs_server.py) for the run. Requests
are counted, not timed: the figures do not depend on the machine, only on the call pattern
(and, for ``worker``, on how jobs interleave with its polling).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import shardq

PATTERNS = ("single", "batched", "worker")
TARGET_BATCHED = 0.35  # requests per job the batched worker path must stay within
CONFIG = {"queues": {"default": {"visibility_timeout": 30, "max_deliveries": 5}}}


def _counter(q) -> Counter:
    counts: Counter = Counter()
    q.client.meta.events.register("before-send.sqs",
                                  lambda event_name, **kw: counts.update([event_name.rsplit(".", 1)[-1]]))
    return counts


def _single(q, jobs: int) -> None:
    for i in range(jobs):
        q.enqueue(f"job {i}".encode(), key=f"k{i % 10}")
    for _ in range(jobs):
        lease = q.dequeue("default", wait=1)
        q.ack(lease)


def _batched(q, jobs: int) -> None:
    for lo in range(0, jobs, 10):
        q.enqueue_many([{"body": f"job {i}".encode(), "key": f"k{i % 10}"} for i in range(lo, min(jobs, lo + 10))])
    done = 0
    while done < jobs:
        leases = q.dequeue_many("default", max_jobs=10, wait=1)
        assert all(e is None for e in q.ack_many(leases))
        done += len(leases)


def _worker(q, jobs: int) -> None:
    for lo in range(0, jobs, 10):
        q.enqueue_many([{"body": f"job {i}".encode(), "key": f"k{i % 10}"} for i in range(lo, min(jobs, lo + 10))])
    w = shardq.Worker(q, lambda ctx: None, concurrency=8, idle_wait_s=1.0)
    stats = w.run(max_jobs=jobs)
    assert stats.succeeded == jobs, stats


def measure(target: str, pattern: str, jobs: int) -> dict:
    """Run ``pattern`` on ``jobs`` jobs against an empty queue ``default`` of ``target``."""
    run = {"single": _single, "batched": _batched, "worker": _worker}[pattern]
    with shardq.connect(target) as q:
        q.queue_config("default")  # the one-off lookups, not counted
        counts = _counter(q)
        run(q, jobs)
    total = sum(counts.values())
    return {"pattern": pattern, "jobs": jobs, "requests": total,
            "requests_per_job": round(total / jobs, 3), "by_operation": dict(sorted(counts.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.sqs_requests", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="sqs:// target (default: a moto server started for the run)")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    server = None
    if a.target is None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, os.path.join(repo, "tests"))
        from support.sqs_server import MotoServer
        server = MotoServer().start()
    try:
        from shardq.backends.sqs_admin import init
        from shardq.backends.sqs_client import Api
        from shardq.backends.sqs_mapping import parse_target
        from shardq.config import parse
        rows = []
        for pattern in PATTERNS:
            target = a.target or server.target()
            init(Api(parse_target(target)), parse(CONFIG))
            rows.append(measure(target, pattern, a.jobs))
    finally:
        if server is not None:
            server.stop()
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'pattern':<10}{'jobs':>7}{'requests':>10}{'per job':>9}  by operation")
        for r in rows:
            print(f"{r['pattern']:<10}{r['jobs']:>7}{r['requests']:>10}{r['requests_per_job']:>9}  "
                  + ", ".join(f"{k} {v}" for k, v in r["by_operation"].items()))
    batched = next(r for r in rows if r["pattern"] == "batched")["requests_per_job"]
    return 0 if batched <= TARGET_BATCHED else 1


if __name__ == "__main__":
    sys.exit(main())
