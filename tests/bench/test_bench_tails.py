"""bench/probes/tails.py runs end to end in quick mode: every job reached the waiting consumer
exactly once, most calls of figures L and W were split into their steps (the shard's own
events lined up with the clients' on the one CLOCK_MONOTONIC), and the lone call's path
crossed no thread in the shard. No timing is asserted."""
import json
import shutil
import subprocess
import sys
import tempfile

from support.service import REPO


def test_tails_probe_runs_and_splits_the_calls(tmp_path):
    out = tmp_path / "tails.json"
    data = tempfile.mkdtemp(prefix="sqt-")  # short: shardq's unix sockets live under it
    try:
        r = subprocess.run([sys.executable, "-m", "bench.probes.tails", "--quick", "--dir", data,
                            "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["exactly_once"] is True and (res["calls"], res["samples"]) == (60, 30)
    assert res["L"]["samples"] >= 45 and res["W"]["samples"] >= 20
    for step in ("write + shard wake-up", "validation + state", "log append", "fdatasync", "write + client wake-up",
                 "call"):
        assert res["L"][step]["p50"] > 0 and res["W"][step]["p50"] > 0
    for step in ("fdatasync to the lease's write", "write + consumer wake-up", "W: enqueue called to lease returned"):
        assert res["W"][step]["p50"] > 0
    # a lone call is read, committed and answered on the loop's thread: no hand-off
    assert res["L"]["shard thread hand-offs per call (mean)"] == 0
    assert set(res["cpu_per_call"]) == {"A", "L", "W"}
    assert "every job reached the consumer once: True" in r.stdout
