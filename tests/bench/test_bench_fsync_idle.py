"""bench/probes/fsync_idle.py runs end to end in quick mode: every file and gap measured, the
reserved files (as the log reserves a segment) kept their size through their appends, the
``dsync`` file's records made durable by their write alone, and the probe's files were removed.
No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_fsync_idle_probe_runs(tmp_path):
    out = tmp_path / "fsync.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.fsync_idle", "--quick", "--gaps-ms", "1,5",
                        "--file-mib", "2", "--dir", str(tmp_path), "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["samples"] == 10 and res["reserved_kept_its_size"] is True
    assert {(x["file"], x["gap_ms"]) for x in res["results"]} == {
        (f, g) for f in ("reserved", "zeroed", "growing", "dsync") for g in (1.0, 5.0)}
    for x in res["results"]:
        assert 0 < x["write_us"]["p50"] <= x["write_us"]["p99"]
        assert 0 < x["durable_us"]["p50"] <= x["durable_us"]["p99"]
        if x["file"] == "dsync":  # pwritev(RWF_DSYNC): no fdatasync of its own
            assert x["fdatasync_us"]["p99"] == 0 and x["durable_us"] == x["write_us"]
        else:
            assert 0 < x["fdatasync_us"]["p50"] <= x["fdatasync_us"]["p99"]
    assert list(tmp_path.iterdir()) == [out]
