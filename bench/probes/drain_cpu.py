"""What a batched drain (figure C2's calls) costs in CPU per job, which tells two builds
apart where C2's throughput cannot: on a shared 2-CPU VM its pairs move by 30% either way.

    python -m bench.probes.drain_cpu [--jobs 100000] [--batch 100]
    PYTHONPATH=<other checkout> python -m bench.probes.drain_cpu   # the other build, to pair

An embedded service with one shard; ``--jobs`` jobs of 100 bytes enqueued ``--batch`` per
call (figure B's calls), then drained with ``dequeue_many(batch)`` and ``ack_many`` (C2's).
Over the drain only: wall microseconds per job, and the CPU microseconds per job of this
process (the client) and of the service's processes (the shard, the supervisor). Prints
one JSON object; run each build a few times, interleaved.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import psutil

import shardq


def measure(jobs: int, batch: int) -> dict:
    with shardq.open(tempfile.mkdtemp(dir="/tmp"), shards=1) as q:
        for i in range(0, jobs, batch):
            q.enqueue_many([{"body": b"x" * 100} for _ in range(min(batch, jobs - i))])
        service = psutil.Process().children(recursive=True)
        before = [p.cpu_times() for p in service]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        got = 0
        while got < jobs:
            leases = q.dequeue_many(max_jobs=batch)
            if leases:
                q.ack_many(leases)
                got += len(leases)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        served = sum(a.user + a.system - b.user - b.system
                     for a, b in zip((p.cpu_times() for p in service), before))
    per_job = 1e6 / jobs
    return {"shardq": shardq.__file__, "jobs": jobs, "batch": batch, "drained": got,
            "wall_us_per_job": round(wall * per_job, 2),
            "client_cpu_us_per_job": round(cpu * per_job, 2), "service_cpu_us_per_job": round(served * per_job, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.drain_cpu")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=100)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.jobs, a.batch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
