"""bench/probes/crowd.py runs end to end in quick mode, phased: every job acked once, the
shard's fsyncs and CPU counted in both phases, each client's switches read. No timing or
count is asserted beyond what every run must show."""
import json
import subprocess
import sys

from support.service import REPO


def test_crowd_probe_runs_and_splits_the_phases(tmp_path):
    out = tmp_path / "crowd.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.crowd", "--quick", "--phased", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and (res["producers"], res["consumers"], res["jobs"]) == (4, 2, 400)
    (run,) = res["runs"]
    assert run["acked"] == 400 and run["jobs_per_s"] > 0
    # every enqueue and every ack is answered after an fsync: some fsyncs in each phase,
    # never more than one per request of either
    enqueue, lease_ack = run["phases"]["enqueue"], run["phases"]["lease_ack"]
    assert 0 < enqueue["fsyncs_per_job"] <= 1.0 and 0 < lease_ack["fsyncs_per_job"] <= 2.0
    assert run["cpu_us_per_job"]["producers"] > 0 and run["cpu_us_per_job"]["consumers"] > 0
    # each producer waits for each reply: at least one voluntary switch per job on average,
    # or it found the reply there while polling; the counts exist for both sides
    assert len(run["switches_per_job"]["producers"]) == 2 and len(run["switches_per_job"]["consumers"]) == 2
    assert "medians: jobs/s" in r.stdout
