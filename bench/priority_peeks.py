"""What the queue-wide priority round costs a single consumer, and what skipping it on a
queue that never used priorities gains. Figure C (lease + ack, one job per call, one
consumer) with the router's plain path and with the peek round forced, alternating in one
run against one ``shardq serve`` (a real process, ``--shards N``).

    python -m bench.priority_peeks [--jobs 1500] [--rounds 6] [--shards 2] [--json PATH]
    python -m bench.priority_peeks --quick          # 200 jobs, 1 round: checks that it runs

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
from .peers.base import SkipPeer

KEYS = 1000
BODY = b"x" * 100


def measure(q, jobs: int, peek: bool) -> float:
    """Lease and ack ``jobs`` jobs, one per call; jobs per second."""
    if peek:
        q._prioritized.add("default")
    else:
        q._prioritized.discard("default")
    t0 = time.perf_counter()
    for _ in range(jobs):
        lease = q.dequeue()
        if lease is None:
            raise RuntimeError("the queue ran dry before the round ended")
        q.ack(lease)
    return jobs / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.priority_peeks", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1500, help="jobs per round and path (default 1500)")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each path once per round (default 6)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="200 jobs, 1 round")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.jobs, a.rounds = 200, 1
    runs: dict[str, list[float]] = {"plain": [], "peek": []}
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
                total = 2 * a.jobs * a.rounds
                for start in range(0, total, 1000):
                    q.enqueue_many([{"body": BODY, "key": f"k{i % KEYS}"}
                                    for i in range(start, min(total, start + 1000))])
                for rnd in range(a.rounds):
                    order = ("plain", "peek") if rnd % 2 == 0 else ("peek", "plain")
                    for path in order:
                        runs[path].append(measure(q, a.jobs, path == "peek"))
                left = q.stats()["queues"]["default"]
                ok = all(left[k] == 0 for k in ("ready", "waiting", "in_flight", "dead"))
        finally:
            serve.teardown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"shards": a.shards, "jobs": a.jobs, "rounds": a.rounds, "runs": runs,
              "median": med, "plain_over_peek": med["plain"] / med["peek"], "ok": ok}
    print(f"C, {a.shards} shards, lease + ack per job (median of {a.rounds}):")
    print(f"  plain path  {med['plain']:8,.0f} jobs/s")
    print(f"  peek round  {med['peek']:8,.0f} jobs/s")
    print(f"  plain / peek = {result['plain_over_peek']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
