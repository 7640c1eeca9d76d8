"""Figure M's crowd against one shard, counted rather than timed: where its CPU and fsyncs go.

    python -m bench.probes.crowd [--jobs 10000] [--runs 3] [--phased] [--busy-poll-us N] [--json PATH]
    python -m bench.probes.crowd --quick        # 400 jobs, 4 producers, 2 consumers: checks that it runs

16 producer and 4 consumer processes (figure M's shape: one job a call, ``dequeue(wait=0.5)``
then ``ack``), each its own ``shardq.connect``, against a service of one shard. Per run:

* jobs/s, and the drain after the last producer finished (the part of M that varied);
* fsyncs per job (the shard's ``fsyncs`` counter): how well group commit shares them;
* CPU microseconds per job of the producers, the consumers and the shard (``getrusage``
  in each client, ``/proc`` for the shard), and the clients' context switches per job,
  voluntary (they slept) and involuntary (they were runnable, another ran: a client that
  busy-polls on a crowded machine).

``--phased`` lets the consumers start only once every producer is done, so fsyncs and the
shard's CPU split into the enqueue phase and the lease + ack phase. These counts move far
less with the machine's load than jobs/s does, so a change shows in a few runs on a busy
VM. Exit status 0 when every job was acked once; no timing is checked.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

QUEUE = "crowd"
BODY = b"x" * 100
KEYS = 1000
WAIT_S = 0.5       # a consumer's dequeue, as figure M's drain step
STALL_S = 10.0     # a consumer gives up when nothing came for this long


def _usage() -> tuple[float, int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_nivcsw


def _producer(path: str, first: int, count: int, producers: int, kw: dict, barrier, out) -> None:
    import shardq
    q = shardq.connect(path, **kw)
    try:
        barrier.wait()
        u0, t0 = _usage(), time.monotonic()
        for i in range(first, count, producers):
            q.enqueue(BODY, key=f"k{i % KEYS}", queue=QUEUE)
        t1, u1 = time.monotonic(), _usage()
        out.put(("producer", t0, t1, [b - a for a, b in zip(u0, u1)], len(range(first, count, producers))))
    finally:
        q.close()


def _consumer(path: str, target: int, kw: dict, barrier, go, acked, out) -> None:
    import shardq
    q = shardq.connect(path, **kw)
    try:
        barrier.wait()
        go.wait()
        u0, n = _usage(), 0
        last = time.monotonic()
        while acked.value < target and time.monotonic() - last < STALL_S:
            lease = q.dequeue(QUEUE, wait=WAIT_S)
            if lease is None:
                continue
            q.ack(lease)
            n += 1
            last = time.monotonic()
            with acked.get_lock():
                acked.value += 1
        u1 = _usage()
        out.put(("consumer", 0.0, last, [b - a for a, b in zip(u0, u1)], n))
    finally:
        q.close()


def _shard_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def one_run(jobs: int, producers: int, consumers: int, phased: bool, busy_poll_us: int | None) -> dict[str, Any]:
    import psutil

    import shardq
    root = tempfile.mkdtemp(prefix="sq-crowd-")
    path = os.path.join(root, "data")
    kw = {} if busy_poll_us is None else {"busy_poll_us": busy_poll_us}
    cfg: dict[str, Any] = {"queues": {QUEUE: {"visibility_timeout": 60}}}
    if busy_poll_us is not None:
        cfg["service"] = {"busy_poll_us": busy_poll_us}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    router = shardq.open(path, shards=1, config=cfg, **kw)
    procs: list = []
    try:
        shard = [p.pid for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
        ctx = mp.get_context("spawn")
        barrier, go, acked, out = ctx.Barrier(producers + consumers + 1), ctx.Event(), ctx.Value("q", 0), ctx.Queue()
        if not phased:
            go.set()
        procs = [ctx.Process(target=_producer, args=(path, i, jobs, producers, kw, barrier, out))
                 for i in range(producers)]
        procs += [ctx.Process(target=_consumer, args=(path, jobs, kw, barrier, go, acked, out))
                  for _ in range(consumers)]
        for p in procs:
            p.start()
        fsyncs0, cpu0 = router.shard_metrics()[0]["fsyncs"], _shard_cpu(shard)
        barrier.wait()
        results, middle = [], None
        if phased:
            results = [out.get(timeout=600) for _ in range(producers)]
            middle = (router.shard_metrics()[0]["fsyncs"], _shard_cpu(shard))
            go.set()
        results += [out.get(timeout=600) for _ in range(len(procs) - len(results))]
        fsyncs1, cpu1 = router.shard_metrics()[0]["fsyncs"], _shard_cpu(shard)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        router.close()
        shutil.rmtree(root, ignore_errors=True)
    made = [r for r in results if r[0] == "producer"]
    took = [r for r in results if r[0] == "consumer"]
    start, produced, end = min(r[1] for r in made), max(r[2] for r in made), max(r[2] for r in took)
    acked_n = sum(r[4] for r in took)

    def per_job(values: list, i: int, n: int, scale: float = 1.0) -> float:
        return round(sum(v[3][i] for v in values) / max(n, 1) * scale, 2)

    run = {"jobs": jobs, "acked": acked_n, "jobs_per_s": round(jobs / (end - start)),
           "drain_after_per_s": round(jobs / (end - produced)) if end > produced else None,
           "fsyncs_per_job": round((fsyncs1 - fsyncs0) / jobs, 3),
           "cpu_us_per_job": {"producers": per_job(made, 0, jobs, 1e6), "consumers": per_job(took, 0, acked_n, 1e6),
                              "shard": round((cpu1 - cpu0) / jobs * 1e6, 1)},
           "switches_per_job": {"producers": [per_job(made, 1, jobs), per_job(made, 2, jobs)],
                                "consumers": [per_job(took, 1, acked_n), per_job(took, 2, acked_n)]}}
    if middle is not None:
        run["phases"] = {"enqueue": {"fsyncs_per_job": round((middle[0] - fsyncs0) / jobs, 3),
                                     "shard_cpu_us_per_job": round((middle[1] - cpu0) / jobs * 1e6, 1)},
                         "lease_ack": {"fsyncs_per_job": round((fsyncs1 - middle[0]) / jobs, 3),
                                       "shard_cpu_us_per_job": round((cpu1 - middle[1]) / jobs * 1e6, 1)}}
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.crowd", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--producers", type=int, default=16)
    p.add_argument("--consumers", type=int, default=4)
    p.add_argument("--phased", action="store_true", help="consumers start once every producer is done")
    p.add_argument("--busy-poll-us", type=int, default=None, help="every router's and the shard's (default: theirs)")
    p.add_argument("--quick", action="store_true", help="1 run of 400 jobs, 4 producers, 2 consumers")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.jobs, a.runs, a.producers, a.consumers = 400, 1, 4, 2
    runs = [one_run(a.jobs, a.producers, a.consumers, a.phased, a.busy_poll_us) for _ in range(a.runs)]
    for r in runs:
        print(json.dumps(r))
    print("medians: jobs/s", statistics.median(r["jobs_per_s"] for r in runs),
          "fsyncs/job", statistics.median(r["fsyncs_per_job"] for r in runs),
          "CPU us/job producers / consumers / shard",
          *(statistics.median(r["cpu_us_per_job"][k] for r in runs) for k in ("producers", "consumers", "shard")),
          "involuntary switches/job of consumers",
          statistics.median(r["switches_per_job"]["consumers"][1] for r in runs))
    ok = all(r["acked"] == r["jobs"] for r in runs)
    if not ok:
        print("not every job was acked once")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "jobs": a.jobs, "producers": a.producers,
                       "consumers": a.consumers, "phased": a.phased, "busy_poll_us": a.busy_poll_us,
                       "runs": runs, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
