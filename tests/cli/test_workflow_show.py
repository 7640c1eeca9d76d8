"""``shardq workflow show ID`` against a real ``shardq serve``: a workflow's record, how it
ended as the service's watcher recorded it (succeeded; failed, naming the step), every
step counted by state and the first ``--steps`` listed; an unknown id is NotFound (exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import shardq
from shardq import chain, chord, group

from support.service import REPO, Service, wait_until


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 1}}) as s:
        yield s


def workflow_show(svc, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "workflow", "show", *args, "--data-dir",
                           svc.data_dir], capture_output=True, text=True, timeout=60, env=env,
                          cwd=os.path.dirname(svc.data_dir))


def test_workflow_show_says_how_it_ended_and_lists_its_steps(svc):
    app = shardq.App(svc.data_dir)
    try:
        @app.task(queue="ws", name="ws.member")
        def member(ctx, i: int) -> int:
            return i

        @app.task(queue="ws", name="ws.total")
        def total(ctx, xs: list) -> int:
            return sum(xs)

        @app.task(queue="ws", name="ws.broken")
        def broken(ctx, x: int) -> int:
            raise shardq.Fail("the ledger is closed")

        ok = chord(group(member.s(i) for i in range(4)), total.s()).send()
        bad = chain(member.s(1), broken.s(), total.s()).send()
        member_job = ok.status()[0]["job_id"]
        job = json.loads(subprocess.run(
            [sys.executable, "-m", "shardq.cli", "job", "show", str(member_job), "--data-dir", svc.data_dir],
            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO),
            cwd=os.path.dirname(svc.data_dir)).stdout)
        assert job["task"]["workflow"] == ok.id  # a step's look-up names its workflow
        running = json.loads(workflow_show(svc, ok.id).stdout)
        assert running["state"] == "running" and running["steps_total"] == 5
        assert running["steps_by_state"] == {"ready": 4, "pending": 1}
        app.run_worker("ws", idle_wait_s=0.05, poll_s=0.01)
        assert ok.result(timeout=30) == 6
        with shardq.connect(svc.data_dir) as q:
            for wf in (ok, bad):
                wait_until(lambda: q.workflow(wf.id)["state"] != "running", 30, 0.05, "the watcher")
        done = json.loads(workflow_show(svc, ok.id).stdout)
        assert done["state"] == "succeeded" and done["ended_at"] >= done["started_at"]
        assert done["steps_by_state"] == {"succeeded": 5} and done["steps_shown"] == 5
        assert done["steps"][-1]["step"] == "0.1" and done["steps"][-1]["result_bytes"] == 1
        failed = json.loads(workflow_show(svc, bad.id, "--steps", "1").stdout)
        assert failed["state"] == "failed" and "the ledger is closed" in failed["error"]
        assert failed["error"].startswith("step 0.1 (ws.broken")
        assert failed["steps_by_state"] == {"succeeded": 1, "dead": 1, "pending": 1}
        assert (failed["steps_shown"], [s["step"] for s in failed["steps"]]) == (1, ["0.0"])
        missing = workflow_show(svc, "no-such-workflow")
        assert missing.returncode == 2 and "NotFound" in missing.stderr
    finally:
        app.close()
