"""Where a many-threaded producer's time goes: jobs/s of N threads enqueueing one job per
call through one embedded router (``shardq.open``, figure B-threads' shape), with the
context switches and CPU of each kind of thread, counted by the kernel (``/proc``).

    python -m bench.probes.thread_switches [--threads 16] [--jobs 8000] [--runs 3] [--shards 2] [--json PATH]
    python -m bench.probes.thread_switches --quick        # 400 jobs, 1 run: checks that it runs

Per job, for the producer threads, the router's I/O thread (started only when a call needs
it: one that meets every lane of its shard taken, a batch across shards; with combining,
single enqueues rarely do, and its row then says "not started"), and the shard processes
(every thread of each): voluntary switches (the thread blocked: a lock, a read, a poll),
involuntary ones (the scheduler preempted it) and CPU microseconds. Throughput on a shared
2-core VM moves by a third between runs; the switch counts move by a few percent, so they
are what tells two builds apart (docs/performance.md, "Many threads, one router").
Linux only. Exit status: 0 when every job was enqueued (the queue holds them all); 1
otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import shardq

BODY = b"x" * 100


def thread_counts(pid: int, tid: int) -> tuple[int, int, float]:
    """(voluntary switches, involuntary switches, CPU seconds) of one thread."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        on_cpu_ns = int(f.read().split()[0])  # nanoseconds; /proc's stat counts 10 ms ticks
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]), on_cpu_ns / 1e9


def process_counts(pid: int) -> tuple[int, int, float]:
    """The same, summed over every thread of a process (threads that ended are not counted)."""
    total = [0, 0, 0.0]
    for path in glob.glob(f"/proc/{pid}/task/*"):
        try:
            counts = thread_counts(pid, int(os.path.basename(path)))
        except (FileNotFoundError, ProcessLookupError):
            continue
        for i, v in enumerate(counts):
            total[i] += v
    return total[0], total[1], total[2]


def one_run(threads: int, jobs: int, shards: int) -> dict:
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix="sq-switches-") as tmp:
        q = shardq.open(os.path.join(tmp, "d"), shards=shards)
        try:
            shard_pids = q.ping()
            # connect every shard's lane (the I/O thread starts if a call needs it: counted from then)
            q.enqueue_many([{"body": b"warm", "key": f"warm-{s}"} for s in range(shards * 8)])
            io = {t.native_id for t in threading.enumerate() if t.name == "shardq-io"}
            before = {"io": {t: thread_counts(me, t) for t in io},
                      "shards": [process_counts(p) for p in shard_pids]}
            per = jobs // threads
            producers: list = []

            def produce(t: int) -> None:
                tid = threading.get_native_id()
                start = thread_counts(me, tid)
                for i in range(per):
                    q.enqueue(BODY, key=f"k{t}-{i % 50}")
                end = thread_counts(me, tid)  # before the thread ends and leaves /proc
                producers.append(tuple(b - a for a, b in zip(start, end)))

            workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            seconds = time.perf_counter() - t0
            io |= {t.native_id for t in threading.enumerate() if t.name == "shardq-io"}
            after = {"io": {t: thread_counts(me, t) for t in io},
                     "shards": [process_counts(p) for p in shard_pids]}
            done = per * threads
            counts = q.stats()["queues"]["default"]
            held = counts["ready"] + counts["waiting"] - shards * 8  # waiting: behind its key's head
        finally:
            q.close()

    def per_job(rows_before, rows_after) -> dict:
        diff = [sum(b[i] - a[i] for a, b in zip(rows_before, rows_after)) for i in range(3)]
        return {"voluntary": diff[0] / done, "involuntary": diff[1] / done, "cpu_us": diff[2] / done * 1e6}

    return {
        "jobs": done, "seconds": seconds, "jobs_per_s": done / seconds, "enqueued_ok": held == done,
        "producers": per_job([(0, 0, 0.0)] * len(producers), producers),
        # (a thread started during the run: from zero; none: None, not zeros that look measured)
        "io": per_job([before["io"].get(t, (0, 0, 0.0)) for t in after["io"]], list(after["io"].values()))
        if after["io"] else None,
        "shards": per_job(before["shards"], after["shards"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--jobs", type=int, default=8000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="400 jobs, 1 run")
    p.add_argument("--json", help="write every run here")
    a = p.parse_args(argv)
    if a.quick:
        a.jobs, a.runs = 400, 1
    runs = [one_run(a.threads, a.jobs, a.shards) for _ in range(a.runs)]
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731 - a one-line local helper
    print(f"{a.threads} threads, {a.shards} shards, {a.jobs} jobs, medians of {a.runs}: "
          f"{med(lambda r: r['jobs_per_s']):,.0f} jobs/s")
    print(f"{'per job':10s} {'voluntary':>10s} {'involuntary':>12s} {'CPU µs':>8s}")
    for kind in ("producers", "io", "shards"):
        measured = [r for r in runs if r[kind] is not None]
        if not measured:
            print(f"{kind:10s} not started (no call needed it)")
            continue
        mid = lambda f: statistics.median(f(r) for r in measured)  # noqa: E731 - as med, over those measured
        print(f"{kind:10s} {mid(lambda r: r[kind]['voluntary']):10.2f} "
              f"{mid(lambda r: r[kind]['involuntary']):12.2f} {mid(lambda r: r[kind]['cpu_us']):8.0f}")
    ok = all(r["enqueued_ok"] for r in runs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "threads": a.threads, "shards": a.shards, "runs": runs,
                       "ok": ok}, f, indent=1)
    if not ok:
        print("not every job was enqueued", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
