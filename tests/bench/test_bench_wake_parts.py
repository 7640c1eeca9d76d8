"""bench/probes/wake_parts.py runs end to end in quick mode: every job reached the waiting consumer
exactly once, and each of a sample's three times was taken. No timing is asserted."""
import json
import subprocess
import sys
import tempfile
import shutil

import pytest

from support.service import REPO


@pytest.mark.parametrize("client", ["router", "aio"])
def test_wake_parts_benchmark_runs(tmp_path, client):
    out = tmp_path / "wake.json"
    data = tempfile.mkdtemp(prefix="sqw-")  # short: shardq's unix sockets live under it
    try:
        r = subprocess.run([sys.executable, "-m", "bench.probes.wake_parts", "--quick",
                            "--dir", data, "--json", str(out), "--client", client], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["exactly_once"] is True and res["samples"] == 30 and res["gap_ms"] == 10
    assert res["client"] == client
    assert res["alone_samples"] == 30  # 15 before the consumer started, 15 after it stopped
    assert set(res["ms"]) == {"enqueue", "woke", "got", "got - enqueue", "enqueue alone"}
    for name in ("enqueue", "got", "enqueue alone"):
        assert set(res["ms"][name]) == {"p50", "p90", "p99"} and res["ms"][name]["p50"] > 0
    # the queue has no priorities: the shard answers the waiting dequeue with the lease, no watch
    assert res["woke_seen"] == 0 and res["ms"]["woke"] == {}
    assert "every job reached the consumer once: True" in r.stdout
