"""bench/probes/priority_peeks.py runs end to end in quick mode: both paths measured, every job
leased and acked. No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_priority_peeks_benchmark_runs(tmp_path):
    out = tmp_path / "peeks.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.priority_peeks", "--quick", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and set(res["runs"]) == {"C plain", "C peek", "C2 plain", "C2 peek"}
    assert all(len(r) == 1 and r[0] > 0 for r in res["runs"].values())
