"""The shard's cost of B's request (100 jobs), in-process, via bench.probes.shard_path.Loop; cProfile and bytecodes."""
import cProfile, os, pstats, sys, tempfile, time
sys.path.insert(0, os.getcwd())  # run from the project root
from bench.probes.shard_path import Loop, BODY, CLIENT_ID, _bytecodes
tmp = tempfile.mkdtemp(dir="/dev/shm")
loop = Loop(tmp, 0)
def b():
    loop.call("enqueue", [[[BODY, f"k{(loop.rid*100 + j) % 1000}", "default", 0, 0, None] for j in range(100)],
                          [CLIENT_ID, loop.rid + 1, loop.rid + 1]])
for _ in range(300): b()
best = 1e9
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(300): b()
    best = min(best, (time.perf_counter() - t0) / 300)
print(f"B request: {best*1e6:.0f} us per 100-job call hot on tmpfs")
n, top = _bytecodes(b, 50)
print(f"{n:.0f} bytecodes per call")
for w, c in top: print(f"  {c:8.0f} {w}")
pr = cProfile.Profile(); pr.enable()
for _ in range(300): b()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
print("failures", loop.failures)
