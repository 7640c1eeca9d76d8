"""``shardq job show`` of results and workflow steps: a live step names the barrier it
reports to, a job acked with its result kept reads ``succeeded`` with the result's size,
and one with nothing kept is NotFound (exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest

import shardq
from shardq import chord, group

from support.service import REPO, Service


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2) as s:
        yield s


def show(svc, job_id) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "job", "show", str(job_id), "--data-dir",
                           svc.data_dir], capture_output=True, text=True, timeout=60, env=env,
                          cwd=os.path.dirname(svc.data_dir))


def test_job_show_of_a_step_a_kept_result_and_a_finished_job(svc):
    app = shardq.App(svc.data_dir)
    try:
        @app.task(queue="js", name="js.member")
        def member(ctx, i: int) -> int:
            return i

        @app.task(queue="js", name="js.total", keep_result=600)
        def total(ctx, xs: list) -> list:
            return xs

        @app.task(queue="js", name="js.plain")
        def plain(ctx) -> None:
            return None

        wf = chord(group(member.s(i) for i in range(3)), total.s()).send()
        first = wf.status()[0]["job_id"]
        live = json.loads(show(svc, first).stdout)
        assert live["state"] == "ready" and live["task"]["name"] == "js.member"
        assert live["task"]["reports_to"]["index"] == 0 and live["task"]["reports_to"]["total"] == 3
        assert live["progress"] is None and "result_bytes" not in live
        plain_id = plain.send()
        app.run_worker("js", idle_wait_s=0.05, poll_s=0.01)
        assert wf.result(timeout=30) == [0, 1, 2]
        callback = wf.status()[-1]["job_id"]
        done = json.loads(show(svc, callback).stdout)
        assert done["state"] == "succeeded" and done["result_bytes"] == len(msgpack.packb([0, 1, 2]))
        assert done["result_expires_at"] > 0
        gone = show(svc, plain_id)
        assert gone.returncode == 2 and f"NotFound: no such job: {plain_id}" in gone.stderr  # no result kept
    finally:
        app.close()


def test_job_show_of_an_id_past_its_range_says_the_range(svc):
    """``shardq job show 9223372036854775808`` said the id 'must be a non-negative
    integer': it is one. The message gives the range."""
    r = show(svc, 2**63)
    assert r.returncode != 0 and "must be an integer in [0, 2**63 - 1]" in r.stderr, r.stderr
