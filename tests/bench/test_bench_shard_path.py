"""bench/probes/shard_path.py runs end to end in quick mode: every reply was OK, every request shape
(figure B's request of 100 jobs too) was timed, and the bytecode counts name the shard's own
functions. No timing is asserted."""
import json
import subprocess
import sys

from support.service import REPO


def test_shard_path_benchmark_runs(tmp_path):
    out = tmp_path / "path.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.shard_path", "--quick", "--dir", str(tmp_path),
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and res["calls"] == 200
    assert set(res["results"]) == {"enqueue", "lease+ack", "wake", "batch"}
    assert res["results"]["batch"]["calls"] == 20  # a tenth: its jobs pile up
    for shape in res["results"].values():
        assert shape["us_per_call"] > 0
        # a lone request runs hundreds of bytecodes in the shard; none of them are the driver's
        assert shape["bytecodes_per_call"] > 100
        names = [where for where, _ in shape["top"]]
        assert any(n.startswith("shardq/shard/") for n in names)
        assert not any(n.startswith("bench/probes/shard_path.py") for n in names)
    # each shape names the module that does its work (not one function: they move between refactors)
    assert any(w.startswith("shardq/shard/queues.py:") for w, _ in res["results"]["enqueue"]["top"])
    assert any(w.startswith("shardq/shard/leases.py:") for w, _ in res["results"]["lease+ack"]["top"])
    # figure B's request of 100 jobs: many times a lone job's work
    assert any(w.startswith("shardq/shard/queues.py:") for w, _ in res["results"]["batch"]["top"])
    assert res["results"]["batch"]["bytecodes_per_call"] > 10 * res["results"]["enqueue"]["bytecodes_per_call"]
    # figure W's iteration: the enqueue and the waiter's lease, both in its traced part
    wake = [w for w, _ in res["results"]["wake"]["top"]]
    assert any(w.startswith("shardq/shard/queues.py:") for w in wake)
    assert any(w.startswith("shardq/shard/leases.py:") for w in wake)
    assert list(tmp_path.iterdir()) == [out]  # the shard's log directory was removed
