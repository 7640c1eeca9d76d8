"""The workflows figure (``bench/workflows.py``) runs end to end at a tiny size on shardq's
side: both shapes drained by ``shardq worker``, every member run once, the chord's callback
once with every member's value. No timing is asserted: the numbers belong in
docs/performance.md. A side whose framework is not installed is reported skipped, with
the reason, and nothing of it is run."""
import json
import os
import subprocess
import sys

from bench import workflows
from bench.workers import chords

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEMBERS = 40


def test_a_chord_and_plain_jobs_run_each_member_once_and_the_callback_once():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.workflows", "--members", str(MEMBERS), "--no-celery",
         "--settle", "0.2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(proc.stdout)
    assert (fig["members"], fig["shards"], fig["concurrency"], fig["runs"]) == (MEMBERS, 2, 8, 1)
    assert list(fig["sides"]) == ["shardq"]
    side = fig["sides"]["shardq"]
    assert side["status"] == "ok" and side["worker"] == chords.SHARDQ_WORKER
    (plain,), (chord,) = side["runs"]["plain"], side["runs"]["chord"]
    for run in (plain, chord):
        assert run["stopped"] is None, run
        assert run["delivery"]["exactly_once"] is True, run
        assert run["send_s"] > 0 and run["drain_s"] > 0, run
    assert plain["delivery"]["expected"] == MEMBERS
    assert chord["delivery"]["expected"] == MEMBERS + 1  # the members and the callback
    assert chord["callback_runs"] == 1 and chord["callback_value"] == MEMBERS
    assert chord["result_s"] > chord["drain_s"]  # the callback ran before its result was read
    summary = side["summary"]
    assert summary["every_member_once"] is True and summary["callback_once"] is True
    assert summary["chord_over_plain"] == round(chord["drain_s"] / plain["drain_s"], 3)
    assert fig["target_met"] is (summary["chord_over_plain"] <= workflows.TARGET_RATIO)


def test_a_side_whose_framework_is_missing_is_skipped_with_the_reason(tmp_path):
    side = chords.Side("absent", "absent worker", ("no_such_framework_wf",), lambda b: [])
    got = workflows._side_runs(side, "redis-always", MEMBERS, 1, str(tmp_path), 2, "during", 0.0)
    assert got["status"] == "skipped"
    assert "not installed: no_such_framework_wf" in got["reason"]
    assert got["runs"] == {"plain": [], "chord": []}
    assert workflows.summary(got) == {}
