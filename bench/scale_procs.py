"""Scaling past one client process: enqueue throughput against shard count and the number
of producer *processes* (each with its own router), so the client's GIL is not the limit.

    python -m bench.scale_procs [--shards 1,2,4] [--producers 1,2,4] [--jobs 20000]
                                [--threads 8] [--json PATH]

Per cell: a fresh embedded service with S shards; P spawned producer processes wait on a
barrier, then together enqueue ``--jobs`` jobs in all (100-byte bodies, 1,000 keys), once
with ``enqueue_many`` batches of 100 ("batched") and once with single ``enqueue`` calls from
``--threads`` threads per process ("single"). Reported: jobs/s from the first start to the
last finish. Every enqueue is durable (fsynced) before it returns. Used on a 16-core
machine for docs/performance.md; on 2 cores the curve is flat (CPU-bound).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time

BODY = b"x" * 100


def _producer(data_dir, index, count, mode, threads, barrier, results):
    import shardq
    q = shardq.connect(data_dir)
    keys = [f"k{(index * 7919 + i) % 1000}" for i in range(count)]
    barrier.wait()
    t0 = time.time()
    if mode == "batched":
        for i in range(0, count, 100):
            q.enqueue_many([{"body": BODY, "key": k} for k in keys[i:i + 100]])
    else:
        def run(part):
            for k in part:
                q.enqueue(BODY, key=k)
        ts = [threading.Thread(target=run, args=(keys[t::threads],)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    results.put((t0, time.time()))
    q.close()


def cell(data_dir: str, producers: int, jobs: int, mode: str, threads: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(producers), ctx.Queue()
    per = jobs // producers
    procs = [ctx.Process(target=_producer, args=(data_dir, i, per, mode, threads, barrier, results))
             for i in range(producers)]
    for p in procs:
        p.start()
    spans = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return per * producers / (max(e for _, e in spans) - min(s for s, _ in spans))


def main(argv=None) -> int:
    import shardq
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--producers", default="1,2,4")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--modes", default="batched,single")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    shard_counts = [int(x) for x in a.shards.split(",")]
    producer_counts = [int(x) for x in a.producers.split(",")]
    out = {"cpus": os.cpu_count(), "jobs": a.jobs, "threads_per_producer": a.threads, "cells": []}
    for shards in shard_counts:
        tmp = tempfile.mkdtemp(prefix="sqscale", dir="/tmp")
        q = shardq.open(os.path.join(tmp, "d"), shards=shards)
        try:
            for mode in a.modes.split(","):
                for producers in producer_counts:
                    n = a.jobs * (5 if mode == "batched" else 1)
                    rate = cell(q.data_dir, producers, n, mode, a.threads)
                    out["cells"].append({"shards": shards, "producers": producers, "mode": mode,
                                         "jobs": n, "jobs_per_s": rate})
                    print(f"shards={shards} producers={producers} mode={mode:<8} {rate:>12,.0f} jobs/s",
                          flush=True)
        finally:
            q.close()
            shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
