"""The benchmark harness runs end to end in quick mode and every job is delivered exactly
once in effect. No timing is asserted: speed belongs in docs/performance.md."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_benchmark_runs_and_delivers_every_job_once(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--only", "shardq", "--no-install",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["ok"] is True
    figures = results["peers"]["shardq"]["figures"]
    drained = {name: f["summary"] for name, f in figures.items() if "exactly_once" in f["summary"]}
    assert {"C", "C2"} <= set(drained), sorted(figures)
    for name, summary in drained.items():
        assert summary["exactly_once"] is True, (name, summary)
        assert summary["missing"] == 0 and summary["duplicates"] == 0, (name, summary)
