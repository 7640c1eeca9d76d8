"""bench/probes/client_path.py runs end to end in quick mode: every wait got its job, and each shape's
Python calls and bytecodes were counted in each of its three parts. No count is asserted beyond its
shape: they move between refactors."""
import json
import subprocess
import sys

import pytest

from support.service import REPO


def test_client_path_probe_runs(tmp_path):
    out = tmp_path / "path.json"
    r = subprocess.run([sys.executable, "-m", "bench.probes.client_path", "--quick", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] is True and res["calls"] == 20 and res["busy_poll_us"] == 0
    assert set(res["results"]) == {"enqueue", "dequeue_wait", "ack"}
    for shape in res["results"].values():
        # each part holds some of the client's Python: the request's write and its reply's read were seen
        assert all(n > 0 for n in shape["calls_by_part"]), shape
        assert all(n > 0 for n in shape["bytecodes_by_part"]), shape
        assert shape["calls"] == pytest.approx(sum(shape["calls_by_part"]))  # (means: floats)
        assert shape["bytecodes"] > shape["calls"]
    # a dequeue(wait) after a lease makes two requests (a lease round, then the wait): more before its reply
    assert res["results"]["dequeue_wait"]["calls_by_part"][1] > res["results"]["enqueue"]["calls_by_part"][1]
