"""Consumer processes drain N jobs enqueued before them (figure M's drain, alone): the
drain rate, the CPU per job of the shard and of the consumers, and the latency of each
dequeue and ack (docs/performance.md, "Figure M in two phases"); since 2026-12-02 also
the user time and voluntary context switches of the shard, the consumers' user and system
time and context switches, and how idle both CPUs were during the drain.

    cd TREE && python docs/perf/loop-appends-2026-12-02/drain4.py [N=10000] [CONSUMERS=4] [DIR=/tmp]

Imports shardq from the current directory (run it in each tree to compare two versions).
"""
import os, sys, time, tempfile, shutil, multiprocessing as mp, statistics
sys.path.insert(0, os.getcwd())
import shardq
from shardq.service.supervisor import Supervisor
N = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
C = int(sys.argv[2]) if len(sys.argv) > 2 else 4
DIR = sys.argv[3] if len(sys.argv) > 3 else "/tmp"

def consumer(path, barrier, out):
    q = shardq.Router(path)
    barrier.wait()
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]; st0 = (time.perf_counter(), sum(v), v[3] + v[4])
    dq, ak = [], []
    n = 0
    t0 = time.perf_counter()
    while True:
        a = time.perf_counter()
        l = q.dequeue(wait=0.2)
        b = time.perf_counter()
        if l is None:
            break
        q.ack(l)
        c = time.perf_counter()
        dq.append(b - a); ak.append(c - b); n += 1
    import resource
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]; st1 = (time.perf_counter(), sum(v), v[3] + v[4])
    t = os.times(); r = resource.getrusage(resource.RUSAGE_SELF)
    out.put((n, t0, b, dq, ak, t.user + t.system, t.user, t.system, r.ru_nvcsw, r.ru_nivcsw, st0, st1))
    q.close()

if __name__ == "__main__":
    d = tempfile.mkdtemp(dir=DIR)
    sup = Supervisor(d + "/data", {"http": {"listen": ""}}, 1)
    sup.start(background=True)
    q0 = shardq.Router(sup.dd.path)
    for i in range(0, N, 500):
        q0.enqueue_many([{"body": b"x" * 100, "key": str(j % 1000)} for j in range(i, i + 500)])
    q0.close()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(C), ctx.Queue()
    ps = [ctx.Process(target=consumer, args=(sup.dd.path, barrier, out)) for _ in range(C)]
    import psutil
    shard = [c for c in psutil.Process().children(recursive=True) if "shard" in " ".join(c.cmdline())]
    c0 = sum(sum(x.cpu_times()[:2]) for x in shard)
    u0 = sum(x.cpu_times()[0] for x in shard); cs0 = sum(x.num_ctx_switches()[0] for x in shard)
    for p in ps: p.start()
    res = [out.get() for _ in ps]
    c1 = sum(sum(x.cpu_times()[:2]) for x in shard)
    u1 = sum(x.cpu_times()[0] for x in shard); cs1 = sum(x.num_ctx_switches()[0] for x in shard)
    for p in ps: p.join()
    sup.stop(); shutil.rmtree(d)
    n = sum(r[0] for r in res); t0 = min(r[1] for r in res)
    last = max(r[1] + sum(r[3]) + sum(r[4]) for r in res)
    dq = [x for r in res for x in r[3]]; ak = [x for r in res for x in r[4]]
    q = lambda xs, p: sorted(xs)[int(len(xs) * p)] * 1e6
    print(f"shard CPU {(c1 - c0) / n * 1e6:.0f} us/job, consumers {sum(r[5] for r in res) / n * 1e6:.0f} us/job (incl. start-up)", end="; ")
    print(f"shard user {(u1-u0)/n*1e6:.0f} blocks {(cs1-cs0)/n:.2f}; consumers user {sum(r[6] for r in res)/n*1e6:.0f} sys {sum(r[7] for r in res)/n*1e6:.0f} blocks {sum(r[8] for r in res)/n:.2f} preempted {sum(r[9] for r in res)/n:.2f}", end="; ")
    a = min((r[10] for r in res)); b = max((r[11] for r in res))
    print(f"idle {(b[2]-a[2])/(b[1]-a[1])*100:.0f}% of both CPUs", end="; ")
    print(f"drained {n} in {last - t0:.2f}s = {n / (last - t0):.0f}/s; dequeue p50 {q(dq, .5):.0f} p90 {q(dq, .9):.0f} us; ack p50 {q(ak, .5):.0f} p90 {q(ak, .9):.0f} us")
