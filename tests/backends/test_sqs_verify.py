"""``shardq verify --target sqs://...`` against moto: worker kills and stalls, then the history
checker, which must pass.

Sizes: 5 s of faults (each kind dealt at least once, a round of two faults planned in
about 3 s) at 15 jobs a second per producer, about 180 jobs: enough for every count asserted
below, and few enough that the drain through moto (about 40 jobs a second with one lease
per worker) takes a second or two instead of the 17 s it took at 40 a second for 8 s. The
longer run on moto is in docs/scale-out.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import shardq
from support.service import REPO


def _verify(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "verify", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tmp_path), check=False)


def test_verify_against_sqs_passes_with_worker_faults(moto, tmp_path):
    out = tmp_path / "report.json"
    target = moto.target()
    proc = _verify(["--target", target, "--duration", "5", "--fault-interval", "1.5", "--seed", "13",
                    "--rate", "15", "--stall-prob", "0.01", "--drain-timeout", "90", "--json", str(out),
                    "--dedup", "--nack-prob", "0.05", "--extend-prob", "0.05"],
                   tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] is True and "VERDICT: PASS" in proc.stdout
    assert set(rep["faults"]) == {"kill_worker", "pause_worker"}
    assert rep["faults"]["kill_worker"] >= 1 and rep["faults"]["pause_worker"] >= 1
    assert rep["info"]["jobs_ok"] > 50 and rep["info"]["drained"] is True
    # Failed handlers' nacks (ChangeMessageVisibility) and heartbeats ran on SQS too.
    assert rep["info"]["nacks_ok"] >= 1 and rep["info"]["extends_ok"] >= 1, rep["info"]
    # A queue that still holds jobs is refused: the checker must see every job's history.
    with shardq.connect(target) as q:
        q.enqueue(b"left over")
    again = _verify(["--target", target, "--duration", "1"], tmp_path, timeout=60)
    assert again.returncode == 2 and "not empty" in again.stderr


def test_verify_refuses_a_target_that_is_not_a_backend(tmp_path):
    proc = _verify(["--target", "var/elsewhere", "--duration", "1"], tmp_path, timeout=60)
    assert proc.returncode == 2 and "not a backend target" in proc.stderr


def test_verify_against_sqs_with_the_worker_runner_passes(moto, tmp_path):
    """The worker runner on the SQS backend (one lease at a time there: moto mis-orders a
    timed-out batch of one group), its handler failing and extending some jobs."""
    out = tmp_path / "report.json"
    proc = _verify(["--target", moto.target(), "--duration", "5", "--fault-interval", "1.5", "--seed", "14",
                    "--rate", "15", "--drain-timeout", "90", "--json", str(out), "--worker-kind", "runner",
                    "--dedup", "--nack-prob", "0.05", "--extend-prob", "0.05"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] is True and rep["args"]["worker_kind"] == "runner" and rep["args"]["worker_batch"] == 1
    assert rep["faults"]["kill_worker"] >= 1 and rep["info"]["jobs_ok"] > 50 and rep["info"]["drained"] is True
    assert rep["info"]["nacks"] >= 1 and "handler runs" in proc.stdout
