"""``python -m bench.aio`` runs end to end in quick mode and both drains deliver every job
exactly once. No timing is asserted: speed belongs in docs/performance.md."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_aio_benchmark_runs_and_delivers_every_job_once(tmp_path):
    out = tmp_path / "aio.json"
    proc = subprocess.run([sys.executable, "-m", "bench.aio", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["ok"] is True and results["jobs"] == 2000
    figures = results["figures"]
    assert set(figures) == {"produce/asyncio", "produce/threads", "drain/asyncio", "drain/threads"}
    assert figures["produce/asyncio"]["distinct_ids"] and figures["produce/threads"]["distinct_ids"]
    assert figures["drain/asyncio"]["exactly_once"] and figures["drain/threads"]["exactly_once"]
