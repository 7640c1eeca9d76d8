"""Micro-benchmark of one shard's engine, in one process, on a temporary directory.

    python -m bench.probes.engine_micro [--jobs 1000000] [--keys 100000] [--json PATH]

Measures, against a :class:`~shardq.shard.durable.DurableShard` with the real WAL (one
fdatasync per commit):

* enqueue jobs/s, ``--batch`` jobs per commit (the shard process's group commit), and one
  job per commit for ``--single`` jobs (the latency-bound reference);
* memory: RSS growth per pending job beyond its body bytes, at ``--jobs`` pending;
* replay: seconds to reopen the shard with every job pending, from segments only and from
  a checkpoint (after a compaction, whose time and size are reported too), with records/s
  and operations/s;
* dequeue + ack jobs/s, ``--batch`` leases per dequeue, one commit for the dequeue and one
  for its acks.

Automatic compaction is off while measuring (``compact_min_bytes`` = 1 TiB) so each figure
times one thing; compaction is timed on its own. Bodies are ``--body-bytes`` long and
unique; keys cycle through ``--keys`` values.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import psutil

from shardq import config as shardq_config
from shardq.clock import SystemClock
from shardq.shard.durable import DurableShard


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.probes.engine_micro", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=1_000_000, help="jobs enqueued and pending (default 1,000,000)")
    p.add_argument("--keys", type=int, default=100_000, help="distinct keys (default 100,000)")
    p.add_argument("--batch", type=int, default=1000, help="jobs per commit in the batched runs")
    p.add_argument("--single", type=int, default=10_000, help="jobs enqueued one per commit")
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--dir", default=None, help="parent of the temporary shard directories")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    return p.parse_args(argv)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def dir_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def make_config(args) -> shardq_config.Config:
    return shardq_config.parse({
        "limits": {"max_pending_jobs": max(args.jobs, args.single) + 1, "compact_min_bytes": 2**40},
        "queue_defaults": {"max_body_bytes": max(args.body_bytes, 1)},
    })


def body(i: int, size: int) -> bytes:
    return f"{i:012d}".encode().ljust(size, b".")[:size]


def open_shard(path: str, config) -> tuple[DurableShard, float]:
    shard = DurableShard(path, 0, config)
    t0 = time.perf_counter()
    shard.open()
    return shard, time.perf_counter() - t0


def enqueue_batched(shard: DurableShard, args, clock) -> float:
    state, n, batch, size, keys = shard.state, args.jobs, args.batch, args.body_bytes, args.keys
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        items = [(body(i, size), f"k{i % keys}", "default", 0, 0, None)
                 for i in range(start, min(start + batch, n))]
        state.enqueue_many(items, clock.now())
        shard.commit()
    return time.perf_counter() - t0


def enqueue_single(shard: DurableShard, args, clock, n: int) -> float:
    state, size, keys = shard.state, args.body_bytes, args.keys
    t0 = time.perf_counter()
    for i in range(n):
        state.enqueue(body(i, size), clock.now(), f"k{i % keys}")
        shard.commit()
    return time.perf_counter() - t0


def dequeue_ack_batched(shard: DurableShard, args, clock) -> tuple[int, float]:
    state, batch = shard.state, args.batch
    done = 0
    t0 = time.perf_counter()
    while True:
        leases = state.dequeue("default", clock.now(), 300.0, batch)
        if not leases:
            break
        shard.commit()
        now = clock.now()
        for lease in leases:
            state.ack(lease.job_id, lease.token, now)
        shard.commit()
        done += len(leases)
    return done, time.perf_counter() - t0


def run(args) -> dict:
    clock = SystemClock()
    config = make_config(args)
    parent = tempfile.mkdtemp(prefix="shardq-micro-", dir=args.dir)
    res: dict = {
        "params": {"jobs": args.jobs, "keys": args.keys, "batch": args.batch, "single": args.single,
                   "body_bytes": args.body_bytes},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": os.cpu_count(), "dir": parent},
    }
    try:
        main_dir = os.path.join(parent, "main")
        shard, _ = open_shard(main_dir, config)
        rss0 = rss()
        secs = enqueue_batched(shard, args, clock)
        rss1 = rss()
        n = args.jobs
        res["enqueue_batched"] = {"jobs": n, "seconds": secs, "jobs_per_s": n / secs,
                                  "log_bytes": dir_bytes(main_dir)}
        res["memory"] = {"pending_jobs": n, "rss_before": rss0, "rss_after": rss1,
                         "body_bytes_total": n * args.body_bytes,
                         "rss_per_job_beyond_body": (rss1 - rss0 - n * args.body_bytes) / n}
        shard.close()
        del shard
        gc.collect()

        shard, secs = open_shard(main_dir, config)
        st = shard.replay_stats
        res["reopen_segments"] = {"jobs": len(shard.state.jobs), "seconds": secs, "records": st.records,
                                  "records_per_s": st.records / secs, "ops_per_s": n / secs,
                                  "log_bytes": dir_bytes(main_dir)}
        t0 = time.perf_counter()
        shard.compact()
        res["compact"] = {"seconds": time.perf_counter() - t0, "checkpoint_bytes": shard.log.checkpoint_bytes}
        shard.close()
        del shard
        gc.collect()

        shard, secs = open_shard(main_dir, config)
        st = shard.replay_stats
        res["reopen_checkpoint"] = {"jobs": len(shard.state.jobs), "seconds": secs, "records": st.records,
                                    "records_per_s": st.records / secs, "ops_per_s": n / secs,
                                    "checkpoint": st.checkpoint}
        done, secs = dequeue_ack_batched(shard, args, clock)
        res["dequeue_ack_batched"] = {"jobs": done, "seconds": secs, "jobs_per_s": done / secs}
        if done != n:
            raise SystemExit(f"dequeue+ack drained {done} of {n} jobs")
        shard.close()
        del shard
        shutil.rmtree(main_dir)
        gc.collect()

        single = min(args.single, args.jobs)
        single_dir = os.path.join(parent, "single")
        shard, _ = open_shard(single_dir, config)
        secs = enqueue_single(shard, args, clock, single)
        res["enqueue_single"] = {"jobs": single, "seconds": secs, "jobs_per_s": single / secs,
                                 "commit_us": secs / single * 1e6}
        shard.close()
        shard, secs = open_shard(single_dir, config)
        st = shard.replay_stats
        res["reopen_single_records"] = {"jobs": len(shard.state.jobs), "seconds": secs, "records": st.records,
                                        "records_per_s": st.records / secs}
        shard.close()
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return res


def table(res: dict) -> str:
    p = res["params"]
    rows = [
        (f"enqueue, {p['batch']} jobs/commit", f"{res['enqueue_batched']['jobs_per_s']:,.0f} jobs/s",
         f"{res['enqueue_batched']['jobs']:,} jobs in {res['enqueue_batched']['seconds']:.2f} s, "
         f"log {res['enqueue_batched']['log_bytes'] / 2**20:,.1f} MiB"),
        ("enqueue, 1 job/commit", f"{res['enqueue_single']['jobs_per_s']:,.0f} jobs/s",
         f"{res['enqueue_single']['jobs']:,} jobs, {res['enqueue_single']['commit_us']:.0f} us/commit"),
        (f"dequeue+ack, {p['batch']}/commit", f"{res['dequeue_ack_batched']['jobs_per_s']:,.0f} jobs/s",
         f"{res['dequeue_ack_batched']['jobs']:,} jobs in {res['dequeue_ack_batched']['seconds']:.2f} s"),
        ("reopen from segments", f"{res['reopen_segments']['seconds']:.2f} s",
         f"{res['reopen_segments']['records']:,} records ({res['reopen_segments']['records_per_s']:,.0f}/s), "
         f"{res['reopen_segments']['ops_per_s']:,.0f} jobs/s"),
        ("compaction (checkpoint)", f"{res['compact']['seconds']:.2f} s",
         f"checkpoint {res['compact']['checkpoint_bytes'] / 2**20:,.1f} MiB"),
        ("reopen from checkpoint", f"{res['reopen_checkpoint']['seconds']:.2f} s",
         f"{res['reopen_checkpoint']['records']:,} records ({res['reopen_checkpoint']['records_per_s']:,.0f}/s), "
         f"{res['reopen_checkpoint']['ops_per_s']:,.0f} jobs/s"),
        ("reopen, 1 job/record", f"{res['reopen_single_records']['seconds']:.3f} s",
         f"{res['reopen_single_records']['records']:,} records "
         f"({res['reopen_single_records']['records_per_s']:,.0f}/s)"),
        ("RSS per pending job", f"{res['memory']['rss_per_job_beyond_body']:,.0f} B",
         f"beyond its {p['body_bytes']} B body, at {res['memory']['pending_jobs']:,} pending "
         f"(RSS {res['memory']['rss_before'] / 2**20:,.0f} -> {res['memory']['rss_after'] / 2**20:,.0f} MiB)"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    head = (f"shardq engine micro-benchmark: {p['jobs']:,} jobs, {p['keys']:,} keys, "
            f"{p['body_bytes']} B bodies (Python {res['machine']['python']}, {res['machine']['cpus']} CPUs)")
    return "\n".join([head] + [f"  {a:<{w0}}  {b:>{w1}}   {c}" for a, b, c in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.jobs < 1 or args.keys < 1 or args.batch < 1 or args.body_bytes < 1:
        raise SystemExit("--jobs, --keys, --batch and --body-bytes must be positive")
    res = run(args)
    print(table(res))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
