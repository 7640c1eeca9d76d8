"""What the queue-wide priority round costs a single consumer, and what skipping it on a
queue that never used priorities gains. Figures C (lease + ack, one job per call, one
consumer) and C2 (lease 100 + ack 100 per call) with the router's plain path and with the
peek round forced, alternating in one run against one ``shardq serve`` (a real process,
``--shards N``).

    python -m bench.probes.priority_peeks [--jobs 1500] [--rounds 6] [--shards 2] [--json PATH]
    python -m bench.probes.priority_peeks --quick          # 200 jobs, 1 round: checks that it runs

The plain path asks one shard (a lease, then an ack); the peek round also asks every
other shard which priorities it has ready, in parallel, before it keeps a lease. Medians
are reported with the ratio plain / peek. Exit status: 0 when every job was leased and
acked (the queue ends empty); 1 otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from .http_overhead import ServeAdapter
from ..peers.base import SkipPeer

KEYS = 1000
BODY = b"x" * 100


BATCH = 100  # jobs per call in C2


def measure(q, jobs: int, peek: bool, batch: int) -> float:
    """Lease and ack ``jobs`` jobs, ``batch`` per call; jobs per second."""
    if peek:
        q._prioritized.add("default")
    else:
        q._prioritized.discard("default")
    t0 = time.perf_counter()
    done = 0
    while done < jobs:
        if batch == 1:
            lease = q.dequeue()
            if lease is None:
                raise RuntimeError("the queue ran dry before the round ended")
            q.ack(lease)
            done += 1
        else:
            leases = q.dequeue_many(max_jobs=min(batch, jobs - done))
            if not leases:
                raise RuntimeError("the queue ran dry before the round ended")
            if any(q.ack_many(leases)):
                raise RuntimeError("an ack failed")
            done += len(leases)
    return jobs / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.priority_peeks", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1500,
                   help="C: jobs per round and path (default 1500; C2 ten times that)")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each path once per round (default 6)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="200 jobs, 1 round")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.jobs, a.rounds = 200, 1
    runs: dict[str, list[float]] = {f"{fig} {path}": [] for fig in ("C", "C2") for path in ("plain", "peek")}
    with tempfile.TemporaryDirectory(prefix="sq-peeks-") as tmp:
        serve = ServeAdapter(a.shards, http=False)
        try:
            serve.setup(tmp)
        except SkipPeer as e:
            print(f"shardq serve did not start: {e}", file=sys.stderr)
            return 1
        try:
            import shardq
            with shardq.connect(serve.data_dir) as q:
                total = 2 * a.jobs * a.rounds * (1 + 10)
                for start in range(0, total, 1000):
                    q.enqueue_many([{"body": BODY, "key": f"k{i % KEYS}"}
                                    for i in range(start, min(total, start + 1000))])
                for rnd in range(a.rounds):
                    order = ("plain", "peek") if rnd % 2 == 0 else ("peek", "plain")
                    for path in order:
                        runs[f"C {path}"].append(measure(q, a.jobs, path == "peek", 1))
                    for path in order:
                        runs[f"C2 {path}"].append(measure(q, 10 * a.jobs, path == "peek", BATCH))
                left = q.stats()["queues"]["default"]
                ok = all(left[k] == 0 for k in ("ready", "waiting", "in_flight", "dead"))
        finally:
            serve.teardown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = {fig: med[f"{fig} plain"] / med[f"{fig} peek"] for fig in ("C", "C2")}
    result = {"shards": a.shards, "jobs": a.jobs, "rounds": a.rounds, "runs": runs,
              "median": med, "plain_over_peek": ratio, "ok": ok}
    print(f"{a.shards} shards, one consumer, medians of {a.rounds} (jobs/s):")
    print(f"  {'figure':<28} {'plain path':>10} {'peek round':>10} {'plain/peek':>10}")
    for fig, what in (("C", "lease + ack, 1 per call"), ("C2", f"lease + ack, {BATCH} per call")):
        print(f"  {fig + ' ' + what:<28} {med[fig + ' plain']:10,.0f} {med[fig + ' peek']:10,.0f} {ratio[fig]:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
