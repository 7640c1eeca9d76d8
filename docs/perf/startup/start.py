"""Process start-up, two source trees alternating: python start.py OLD_TREE NEW_TREE
(each tree a checkout whose shardq/ is compiled: python -m compileall -q shardq)."""
import subprocess, time, statistics, sys, os
OLD, NEW = sys.argv[1], sys.argv[2]
PY = sys.executable
def run(root, args):
    env = dict(os.environ, PYTHONPATH=root)
    t = time.perf_counter(); subprocess.run([PY, *args], env=env, cwd="/tmp", check=True, capture_output=True); return (time.perf_counter() - t) * 1e3
cases = {"import shardq": ["-c", "import shardq"], "shard process imports": ["-c", "import shardq.shard.process"],
         "shardq --help": ["-m", "shardq.cli", "--help"]}
for name, args in cases.items():
    old, new = [], []
    for i in range(15):
        for root, out in (((OLD, old), (NEW, new)) if i % 2 else ((NEW, new), (OLD, old))):
            out.append(run(root, args))
    print(f"{name:24s} before {statistics.median(old):6.1f} ms   after {statistics.median(new):6.1f} ms  (medians of 15, alternating)")
