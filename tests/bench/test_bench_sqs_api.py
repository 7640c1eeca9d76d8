"""bench/sqs_api.py runs end to end in quick mode: moto's server, shardq's SQS listener and
shardq's own client, each sending and draining, every message delivered once by both of
shardq's faces, the single-call percentiles and issue 46's targets reported. No timing is
asserted: the figures belong in docs/performance.md."""
import json
import subprocess
import sys

from support.service import REPO


def test_sqs_api_benchmark_runs(tmp_path):
    out = tmp_path / "sqs.json"
    r = subprocess.run([sys.executable, "-m", "bench.sqs_api", "--quick", "--clients", "2", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True
    cells = {(x["target"], x["figure"]): x for x in res["throughput"]}
    assert set(cells) == {(t, f) for t in ("moto", "sqs", "native") for f in ("send", "drain")}
    for target in ("sqs", "native"):
        drain = cells[(target, "drain")]
        assert (drain["received"], drain["duplicates"], drain["missing"]) == (200, 0, 0), drain
    assert all(cells[c]["per_s"] > 0 for c in cells)
    assert set(res["single"]) == {"moto", "sqs", "native"} and res["single"]["sqs"]["calls"] == 100
    assert len(res["targets"]) == 5  # send and drain against moto and native, and the single call's p99
    assert "sqs/moto" in r.stdout and "machine: fsync" in r.stdout
    assert res["probes"]["fsync_per_s"] > 0 and res["probes"]["pipe_rtt_per_s"] > 0
