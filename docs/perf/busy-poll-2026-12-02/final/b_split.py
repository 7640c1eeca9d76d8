"""B's shape: 100 jobs per enqueue_many, one producer; CPU per call of the client and the shard."""
import os, resource, shutil, sys, tempfile, time
import psutil, shardq
d = tempfile.mkdtemp(dir="/tmp")
q = shardq.open(os.path.join(d, "sq"), shards=1)
shard = psutil.Process().children(recursive=True)  # the shard processes shardq.open started
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
body = b"x" * 100
batches = [[{"body": body, "key": f"k{(i*100+j) % 1000}"} for j in range(100)] for i in range(calls)]
for b in batches[:20]:
    q.enqueue_many(b)
def cpu(ps): return sum(p.cpu_times().user + p.cpu_times().system for p in ps)
s0 = cpu(shard); c0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
for b in batches:
    q.enqueue_many(b)
t1 = time.perf_counter(); c1 = resource.getrusage(resource.RUSAGE_SELF); s1 = cpu(shard)
ccpu = (c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
print(f"{calls} calls: {(t1-t0)/calls*1e6:.0f} us/call wall, {calls*100/(t1-t0):,.0f} jobs/s; "
      f"client CPU {ccpu/calls*1e6:.0f} us/call (user {(c1.ru_utime-c0.ru_utime)/calls*1e6:.0f}), shard CPU {(s1-s0)/calls*1e6:.0f} us/call")
q.close()
shutil.rmtree(d, ignore_errors=True)
