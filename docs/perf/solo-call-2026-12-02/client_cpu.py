"""CPU of a lone caller's enqueue (docs/performance.md, "What was tried": the solo path).

    python docs/perf/solo-call-2026-12-02/client_cpu.py TREE DIR [CALLS]

Imports shardq from TREE, starts one shard with its data in DIR (/dev/shm: no fsync cost),
and prints 3 rounds of CALLS lone enqueues: wall, user and system microseconds per call of
this process (the caller; the supervisor thread in it is idle meanwhile), and its voluntary
context switches per call (how often it slept).
"""
import os, sys, time, tempfile, shutil, resource
sys.path.insert(0, sys.argv[1])
import shardq
from shardq.service.supervisor import Supervisor
d = tempfile.mkdtemp(dir=sys.argv[2])
sup = Supervisor(d + "/data", {"http": {"listen": ""}}, 1)
sup.start(background=True)
N = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
res = []
with shardq.Router(sup.dd.path, supervisor=sup) as q:
    for _ in range(300): q.enqueue(b"x" * 100, key="k")
    for rnd in range(3):
        r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        for i in range(N): q.enqueue(b"x" * 100, key=str(i % 1000))
        dt = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
        res.append((dt / N * 1e6, (r1.ru_utime - r0.ru_utime) / N * 1e6, (r1.ru_stime - r0.ru_stime) / N * 1e6, (r1.ru_nvcsw - r0.ru_nvcsw) / N))
sup.stop(); shutil.rmtree(d)
print(" ".join(f"wall {w:.0f} user {u:.0f} sys {s:.0f} vcs {v:.2f} |" for w, u, s, v in res))
