"""``shardq worker`` as a real process: the start line it prints, and ``--burst``, which
exits 0 once every queue it serves is drained, in each mode the command runs (a handler on
threads, a handler on processes, tasks on an asyncio loop). One service for the module;
each test works a queue of its own."""
from __future__ import annotations

import re

import pytest

from shardq.tasks.body import encode
from support.service import Service, run_worker as worker

N_JOBS = 20


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2) as s:
        yield s


HANDLER = "def handle(ctx):\n    assert ctx.body.startswith(b'job ')\n"
ASYNC_TASKS = ("import asyncio\nimport shardq\napp = shardq.App({data_dir!r})\n"
               "@app.task(queue='burst-asyncio')\nasync def greet(ctx, n):\n    await asyncio.sleep(0)\n")


@pytest.mark.parametrize("mode", ["threads", "processes", "asyncio"])
def test_burst_drains_the_queue_then_exits_0_after_a_start_line(svc, tmp_path, mode):
    """The start line names the queue, mode, concurrency and store; the worker settles every
    job, exits 0 by itself, and leaves the job that is delayed and not yet due."""
    queue = f"burst-{mode}"
    if mode == "asyncio":
        (tmp_path / "burst_tasks.py").write_text(ASYNC_TASKS.format(data_dir=svc.data_dir))
        bodies = [encode("burst_tasks.greet", [i], {}) for i in range(N_JOBS)]
        target = ["burst_tasks"]
        what = "tasks of burst_tasks"
    else:
        (tmp_path / "burst_handler.py").write_text(HANDLER)
        bodies = [b"job %d" % i for i in range(N_JOBS)]
        target = ["burst_handler:handle", "--queue", queue] + (["--mode", "process"] if mode == "processes" else [])
        what = "handler burst_handler:handle"
    with svc.connect() as q:
        q.enqueue_many([{"body": b, "queue": queue, "key": f"k{i % 3}"} for i, b in enumerate(bodies)])
        q.enqueue(bodies[0], queue=queue, delay=3600)  # not due: a burst worker does not wait for it
        r = worker(svc, str(tmp_path), *target, "--concurrency", "4", "--idempotency", "effects.sqlite",
                   "--burst")
        counts = q.stats()["queues"][queue]
    assert r.returncode == 0, r.stderr
    start = [l for l in r.stderr.splitlines() if " started: " in l]
    assert len(start) == 1 and re.search(
        rf"shardq.worker INFO worker \d+ started: {what}; queue {queue} \({mode}\); concurrency 4; "
        r"idempotency store SQLite effects.sqlite; progress every 1000 jobs and every 10s; "
        r"--burst: exits once the queues are drained$", start[0]), r.stderr
    assert f"queue {queue}: queues drained (burst) after " in r.stderr
    assert f": {N_JOBS} ok, 0 duplicate, 0 failed, 0 lost, 0 expired" in r.stderr, r.stderr
    assert (counts["ready"], counts["in_flight"], counts["delayed"], counts["dead"]) == (0, 0, 1, 0)


CANCELLING_TASK = ("import asyncio\nimport shardq\napp = shardq.App({data_dir!r})\n"
                   "@app.task(queue='cancels-itself', retries=1)\nasync def stop(ctx):\n"
                   "    t = asyncio.create_task(asyncio.sleep(10))\n    t.cancel()\n    await t\n")


def test_an_async_task_that_raises_cancelled_error_itself_fails_as_any_error(svc, tmp_path):
    """A task whose own code raises CancelledError (it awaited a task it cancelled) was never
    reported: its job stayed leased and heartbeated for ever and --burst never exited. Only
    the worker's own cancellation (its grace period's end) means 'nothing comes back'."""
    (tmp_path / "cancel_tasks.py").write_text(CANCELLING_TASK.format(data_dir=svc.data_dir))
    with svc.connect() as q:
        q.enqueue(encode("cancel_tasks.stop", [], {}), queue="cancels-itself")
        r = worker(svc, str(tmp_path), "cancel_tasks", "--burst")
        counts = q.stats()["queues"]["cancels-itself"]
    assert r.returncode == 0, r.stderr  # (it exits: before, it held the lease for ever)
    assert counts["in_flight"] == 0 and counts["ready"] == 0, counts
    assert re.search(r"0 ok, 0 duplicate, [1-9]\d* failed", r.stderr) and "CancelledError" in r.stderr, r.stderr


def test_a_worker_without_a_store_says_so_and_bad_flags_exit_2_naming_flag_and_value(svc, tmp_path):
    (tmp_path / "burst_handler.py").write_text(HANDLER)
    r = worker(svc, str(tmp_path), "burst_handler:handle", "--queue", "burst-empty", "--burst")
    assert r.returncode == 0, r.stderr
    assert "queue burst-empty (threads); concurrency 8; no idempotency store (effects at least once)" in r.stderr
    for flag, value in [("--log-every", "0"), ("--log-every-s", "0"), ("--log-every-s", "1e9"),
                        ("--concurrency", "0"), ("--concurrency", "1025"), ("--prefetch", "-1"), ("--grace", "-1"),
                        ("--queue", "")]:
        r = worker(svc, str(tmp_path), "burst_handler:handle", flag, value)
        assert r.returncode == 2, r.stderr  # (a bad flag's exit status, not a setup error's 5)
        assert f"error: UsageError: {flag} must be" in r.stderr, r.stderr
        assert f"got {value!r}" in r.stderr or f"got {value}" in r.stderr or flag.startswith("--log"), r.stderr
