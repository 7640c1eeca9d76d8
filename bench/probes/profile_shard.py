"""Profile a shard under a chosen workload: ``python -m bench.probes.profile_shard [--threads 16]``.

Runs an embedded 2-shard service with ``SHARDQ_PROFILE`` set (each shard process writes a
cProfile dump when it stops), drives single-call enqueues from N threads sharing one router,
then prints where shard 0 spent its time and, per shard, its loop iterations and the jobs it
took per iteration (the single enqueues a commit shared: combined ones and group commit).
Used for the profile findings in docs/performance.md.
"""
from __future__ import annotations

import argparse
import os
import pstats
import resource
import shutil
import tempfile
import threading
import time

import shardq


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.profile_shard", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--jobs", type=int, default=32000)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sqprof", dir="/tmp")
    prof = os.path.join(tmp, "prof")
    os.environ["SHARDQ_PROFILE"] = prof
    q = shardq.open(os.path.join(tmp, "d"), shards=a.shards)
    per = a.jobs // a.threads

    def produce(t: int) -> None:
        for i in range(per):
            q.enqueue(b"x" * 100, key=f"k{t}-{i % 50}")

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(a.threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stats = q.stats()["shards"]
    q.close()
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = per * a.threads
    print(f"{a.threads} threads, {n} single enqueues: {n / wall:,.0f} jobs/s")
    print(f"CPU per job: client {1e6 * (me.ru_utime + me.ru_stime) / n:.0f} us, "
          f"shards {1e6 * (kids.ru_utime + kids.ru_stime) / n:.0f} us")
    for sh in stats:
        print(f"shard {sh['shard']}: {sh['iterations']} loop iterations, "
              f"{sh['jobs'] / max(sh['iterations'], 1):.1f} jobs an iteration")
    print("\nshard 0, by own time:")
    pstats.Stats(f"{prof}.shard0").sort_stats("tottime").print_stats(a.top)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
