"""The asyncio client against the threaded router, in one process (``python -m bench.aio``).

Two figures, each run with both clients on the same service in the same run:

* **produce**: ``--producers`` concurrent callers (coroutines / threads), each enqueuing one
  job per call until ``--jobs`` are in. The asyncio client merges the single enqueues of
  one event-loop turn into one request per shard; the router pipelines the threads' calls.
* **drain**: a consumer holding up to ``--concurrency`` leases, acking each job one call
  at a time: ``async for lease in q.consume(queue, concurrency=C)`` with one task per
  lease, against ``C`` threads each doing ``dequeue``/``ack``.

Each drain checks that every job came exactly once. No timing is asserted anywhere:
figures belong in docs/performance.md, measured on a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import shardq

BODY = b"x" * 64


# ---------------------------------------------------------------------------- asyncio
async def aio_produce(data_dir: str, queue: str, jobs: int, producers: int) -> tuple[float, list]:
    q = await shardq.aio.connect(data_dir)
    ids: list = []
    left = [jobs]

    async def producer():
        while left[0] > 0:
            left[0] -= 1
            ids.append(await q.enqueue(BODY, queue=queue))

    t0 = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(producers)))
    elapsed = time.perf_counter() - t0
    await q.close()
    return elapsed, ids


async def aio_drain(data_dir: str, queue: str, jobs: int, concurrency: int) -> tuple[float, list]:
    q = await shardq.aio.connect(data_dir)
    got: list = []

    async def handle(lease):
        await q.ack(lease)
        got.append(lease.job_id)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        n = 0
        async for lease in q.consume(queue, concurrency=concurrency, wait=1.0):
            tg.create_task(handle(lease))
            n += 1
            if n == jobs:
                break
    elapsed = time.perf_counter() - t0
    await q.close()
    return elapsed, got


# ---------------------------------------------------------------------------- threads
def thread_produce(router, queue: str, jobs: int, producers: int) -> tuple[float, list]:
    ids: list = []
    lock = threading.Lock()
    left = [jobs]

    def producer():
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            ids.append(router.enqueue(BODY, queue=queue))

    return _timed_threads(producer, producers), ids


def thread_drain(router, queue: str, jobs: int, concurrency: int) -> tuple[float, list]:
    got: list = []
    lock = threading.Lock()

    def consumer():
        while True:
            with lock:
                if len(got) >= jobs:
                    return
            lease = router.dequeue(queue, wait=0.2)
            if lease is None:
                continue
            router.ack(lease)
            with lock:
                got.append(lease.job_id)

    return _timed_threads(consumer, concurrency), got


def _timed_threads(fn, n: int) -> float:
    threads = [threading.Thread(target=fn, daemon=True) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aio", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--producers", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2,000 jobs: checks it runs")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--tmpdir", default=None, help="where the data dir goes")
    args = p.parse_args(argv)
    jobs = 2_000 if args.quick else args.jobs
    tmp = tempfile.mkdtemp(prefix="sqbench", dir=args.tmpdir or "/tmp")
    results: dict = {"jobs": jobs, "producers": args.producers, "concurrency": args.concurrency,
                     "shards": args.shards, "cpus": os.cpu_count(), "figures": {}}
    ok = True
    try:
        with shardq.open(os.path.join(tmp, "data"), shards=args.shards) as router:
            data_dir = router.data_dir
            rows = [
                ("produce", "asyncio", lambda: asyncio.run(aio_produce(data_dir, "aio", jobs, args.producers))),
                ("produce", "threads", lambda: thread_produce(router, "thr", jobs, args.producers)),
                ("drain", "asyncio", lambda: asyncio.run(aio_drain(data_dir, "aio", jobs, args.concurrency))),
                ("drain", "threads", lambda: thread_drain(router, "thr", jobs, args.concurrency)),
            ]
            produced: dict[str, list] = {}
            for figure, client, fn in rows:
                print(f"{figure} with {client} ...", file=sys.stderr, flush=True)
                elapsed, ids = fn()
                entry = {"seconds": round(elapsed, 4), "jobs_per_s": round(len(ids) / elapsed)}
                if figure == "produce":
                    produced[client] = ids
                    entry["distinct_ids"] = len(set(ids)) == jobs
                else:
                    entry["exactly_once"] = sorted(ids) == sorted(produced[client])
                ok = ok and entry.get("distinct_ids", True) and entry.get("exactly_once", True)
                results["figures"][f"{figure}/{client}"] = entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'figure':<10}{'client':<10}{'jobs/s':>10}{'seconds':>10}  check")
    for name, e in results["figures"].items():
        figure, client = name.split("/")
        check = "ok" if e.get("distinct_ids", e.get("exactly_once")) else "FAILED"
        print(f"{figure:<10}{client:<10}{e['jobs_per_s']:>10}{e['seconds']:>10.3f}  {check}")
    results["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
