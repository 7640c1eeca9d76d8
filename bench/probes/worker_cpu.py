"""What a worker runner's drain costs in CPU per job, which tells two builds apart where
figure Wk's throughput cannot: on a shared 2-CPU VM its pairs move by 2x either way.

    python -m bench.probes.worker_cpu [--runner thread|asyncio] [--jobs 3000]
    cd <other checkout> && PYTHONPATH=. python <this checkout>/bench/probes/worker_cpu.py  # to pair

An embedded service with two shards; ``--jobs`` no-op jobs enqueued first, then drained by
the thread runner (``Worker``, 8 threads, on the router) or the asyncio runner
(``AsyncWorker``, 50 jobs at once, an ``async def`` no-op on the asyncio client). Over the
drain only: wall microseconds per job and the CPU microseconds per job of this process
(the runner and its client). Prints one JSON object; run each build a few times,
interleaved (A B B A).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import shardq
from shardq.consumer.aioworker import AsyncWorker
from shardq.consumer.worker import Worker


class _Noop:
    is_async = True


class _AsyncNoop:
    """The asyncio runner's handler: every job is an ``async def`` task that does nothing."""

    def __call__(self, ctx: Any) -> None:
        pass

    def task_of(self, body: bytes) -> _Noop:
        return _Noop()

    def resolve(self, ctx: Any) -> tuple[None, list[Any], dict[str, Any]]:
        return None, [], {}

    async def run_async(self, task: Any, ctx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        return None


def measure(runner: str, jobs: int) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(dir="/tmp")
    with shardq.open(data_dir, shards=2) as q:
        for i in range(0, jobs, 1000):
            q.enqueue_many([{"body": b"x"} for _ in range(min(1000, jobs - i))])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if runner == "thread":
            stats = Worker(q, lambda ctx: None, concurrency=8, prune_every_s=None, log_every=10**9).run(max_jobs=jobs)
        else:
            stats = AsyncWorker(data_dir, _AsyncNoop(), concurrency=50, log_every=10**9, burst=True,
                                idle_wait_s=0.05).run()  # burst's last, empty dequeue: short
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    per_job = 1e6 / jobs
    return {"shardq": shardq.__file__, "runner": runner, "jobs": jobs, "succeeded": stats.succeeded,
            "wall_us_per_job": round(wall * per_job, 1), "cpu_us_per_job": round(cpu * per_job, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.worker_cpu")
    p.add_argument("--runner", choices=("thread", "asyncio"), default="thread")
    p.add_argument("--jobs", type=int, default=3000)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.runner, a.jobs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
