"""bench/probes/http_overhead.py runs end to end in quick mode: both figures with the listener off
and on, every job delivered once, every scrape answered. No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_http_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "http.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.http_overhead", "--quick", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and set(res["summary"]) == {"A", "M"}
    on = [x for x in res["runs"] if x["http"]]
    assert on and all(x["scrapes_ok"] > 0 and x["scrapes_failed"] == 0 for x in on)
    assert all(x["delivered_once"] for x in res["runs"] if x["figure"] == "M")
