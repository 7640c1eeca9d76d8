"""CPU seconds of every process a command starts, grouped by role (the figure M breakdown
in docs/performance.md, "Where figure M's CPU goes").

    python docs/perf/m-cpu-2026-12-02/cpu_by_proc.py .venv/bin/python -m bench.run --figures M \
        --only shardq --runs 1 --no-scaling --no-install --jobs 40000 --json /tmp/m.json

Samples every Python, beanstalkd and redis-server process each 50 ms and keeps each one's
last CPU times; run it with --jobs 10000 and 40000 and take the difference, so the client
processes' start-up (outside figure M's timed window) cancels out.
"""
import collections
import os
import subprocess
import sys
import time

import psutil


def role(cmdline: str) -> str:
    for needle, name in (("shardq.shard.process", "shard"), ("spawn_main", "client"), ("bench.run", "bench"),
                         ("beanstalkd", "beanstalkd"), ("redis-server", "redis")):
        if needle in cmdline:
            return name
    return cmdline[:60]


def main() -> None:
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = {}
    while proc.poll() is None:
        for q in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            c = " ".join(q.info["cmdline"] or [])
            if q.info["pid"] == os.getpid() or q.info["cpu_times"] is None:
                continue
            if "python" in c or "beanstalkd" in c or "redis-server" in c:
                seen[q.info["pid"]] = (c, q.info["cpu_times"].user, q.info["cpu_times"].system)
        time.sleep(0.05)
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for c, user, system in seen.values():
        g = groups[role(c)]
        g[0] += 1
        g[1] += user
        g[2] += system
    for name, (n, user, system) in sorted(groups.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
        print(f"{n:3d} procs user {user:6.2f} sys {system:6.2f}  {name}")


if __name__ == "__main__":
    main()
