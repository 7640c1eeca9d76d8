"""bench/probes/thread_switches.py runs end to end in quick mode: every job enqueued, and the
kernel's counts read for each kind of thread. No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_thread_switches_benchmark_runs(tmp_path):
    out = tmp_path / "switches.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.thread_switches", "--quick", "--threads", "4",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and res["threads"] == 4 and len(res["runs"]) == 1
    run = res["runs"][0]
    assert run["jobs"] == 400 and run["enqueued_ok"] is True and run["jobs_per_s"] > 0
    # each producer waited for each reply, so it blocked at least once per job on average
    # or found it already there; the shards did work for every job
    assert run["producers"]["voluntary"] > 0 and run["shards"]["cpu_us"] > 0
    assert "producers" in r.stdout and "shards" in r.stdout
