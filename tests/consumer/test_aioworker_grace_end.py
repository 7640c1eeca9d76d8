"""The asyncio runner at its grace period's end, with real processes (``shardq serve`` and a
``shardq worker`` in asyncio mode, or an app that embeds ``AsyncWorker.run_async``).

A job still running when the grace period ends is abandoned: its lease is released, its
asyncio task cancelled, and the worker returns (docs/guarantees.md, "Shutdown"). Before:

- a *plain* task (``def``, run in a thread) kept the process up until it returned: the
  thread was the loop's default executor's (``asyncio.to_thread``), which ``asyncio.run``
  joins at its end, so a SIGTERMed worker with ``--grace 1`` exited only when a 30 s task
  was done (a hung task: never), its lease long released; an app whose ``asyncio.run``
  cancelled ``run_async`` waited the same way. The thread runner's threads never held the
  exit (daemon threads, not joined once a job was abandoned: shardq/consumer/threads.py).
- an *async* task abandoned under ``--idempotency`` was logged after the worker's totals as
  ``job N attempt 1 failed`` with a ``concurrent.futures.CancelledError`` traceback (its
  transaction's thread took the cancel for the task's failure), which contradicted the
  totals (``0 failed ... 1 abandoned``) and matched no documented failure line.

Synchronisation is by polls with a deadline; the tasks sleep as their work (far longer than
any wait here), and the only timing checked is an exit well within its bound.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from shardq.tasks.body import encode
from support.service import REPO, Service, short_tmpdir, wait_exit, wait_until

GRACE_S = 1
EXIT_BOUND_S = 10  # the worker exits within this of SIGTERM (expected: about GRACE_S)
TASK_S = 60        # how long each task would run: far past the bound

APP = textwrap.dedent("""
    import asyncio, os, time
    import shardq

    app = shardq.App(os.environ["SHARDQ_DATA_DIR"])
    QUEUE, MARKS = os.environ["GRACE_QUEUE"], os.environ["GRACE_MARKS"]

    def _started(ctx):
        open(os.path.join(MARKS, f"started-{ctx.job_id}"), "w").close()

    @app.task(queue=QUEUE, name="grace.ping")
    async def ping(ctx):  # an async task makes the queue's worker an asyncio one
        pass

    @app.task(queue=QUEUE, name="grace.slow")
    def slow(ctx, secs):  # a plain task: runs in a thread
        _started(ctx)
        time.sleep(secs)  # the work, longer than the test waits
        open(os.path.join(MARKS, f"returned-{ctx.job_id}"), "w").close()

    @app.task(queue=QUEUE, name="grace.asleep")
    async def asleep(ctx, secs):
        _started(ctx)
        await asyncio.sleep(secs)  # the work, longer than the test waits
""")

EMBEDDED = textwrap.dedent("""
    import asyncio, os, sys, time
    sys.path[:0] = [{repo!r}]
    from shardq.consumer.aioworker import AsyncWorker

    data_dir, queue, marks = sys.argv[1:4]

    def slow(ctx):  # a plain handler: runs in a thread
        open(os.path.join(marks, f"started-{{ctx.job_id}}"), "w").close()
        time.sleep({task_s})  # the work, longer than the test waits

    async def main():
        run = asyncio.create_task(AsyncWorker(data_dir, slow, queue=queue, grace_s=30).run_async())
        while not os.listdir(marks):  # a poll: the job has started
            await asyncio.sleep(0.01)
        run.cancel()  # as a TaskGroup or a web app's lifespan does
        try:
            await run
        except asyncio.CancelledError:
            print("run_async cancelled", flush=True)

    asyncio.run(main())
    print("asyncio.run returned", flush=True)
""")

_queues = itertools.count()


@pytest.fixture(scope="module")
def svc():
    with Service(shards=1) as s:
        yield s


@pytest.fixture
def tmp():
    path = short_tmpdir()
    os.mkdir(os.path.join(path, "marks"))
    with open(os.path.join(path, "graceapp.py"), "w") as f:
        f.write(APP)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _enqueue(svc: Service, queue: str, task: str) -> int:
    with svc.connect() as q:
        return q.enqueue(encode(task, [TASK_S], {}), queue=queue)


def _started(marks: str, job_id: int) -> bool:
    return os.path.exists(os.path.join(marks, f"started-{job_id}"))


def _worker(svc: Service, tmp: str, queue: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, REPO, os.environ.get("PYTHONPATH", "")]),
               SHARDQ_DATA_DIR=svc.data_dir, GRACE_QUEUE=queue, GRACE_MARKS=os.path.join(tmp, "marks"))
    with open(os.path.join(tmp, "worker.log"), "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "shardq", "worker", "graceapp", "--queue", queue, "--data-dir", svc.data_dir,
             "--grace", str(GRACE_S), "--concurrency", "2", *extra],
            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _end(proc: subprocess.Popen) -> None:
    """Whatever happened, the process is gone (by its PID)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _sigterm_while_running(svc: Service, tmp: str, task: str, *extra: str) -> tuple[int | None, dict, str]:
    """Start a worker, let it start ``task``, SIGTERM it: its exit status (None: still running
    ``EXIT_BOUND_S`` after the signal), the job as the service then has it, the worker's log."""
    queue = f"grace{os.getpid()}_{next(_queues)}"
    job_id = _enqueue(svc, queue, task)
    proc = _worker(svc, tmp, queue, *extra)
    try:
        marks = os.path.join(tmp, "marks")
        wait_until(lambda: _started(marks, job_id) or proc.poll() is not None, 30, what="the task's start")
        assert proc.poll() is None, open(os.path.join(tmp, "worker.log")).read()
        proc.send_signal(signal.SIGTERM)
        rc = wait_exit(proc, EXIT_BOUND_S)
    finally:
        _end(proc)
    with svc.connect() as q:
        job = q.job(job_id)
    with open(os.path.join(tmp, "worker.log")) as f:
        return rc, job, f.read()


@pytest.mark.parametrize("store", [False, True], ids=["no-store", "idempotency"])
def test_sigterm_exits_after_the_grace_period_while_a_plain_task_runs(svc, tmp, store):
    extra = ("--idempotency", os.path.join(tmp, "effects.sqlite")) if store else ()
    rc, job, log = _sigterm_while_running(svc, tmp, "grace.slow", *extra)
    assert rc == 0, f"the worker was still up {EXIT_BOUND_S} s after SIGTERM (--grace {GRACE_S}):\n{log}"
    assert "1 abandoned (running when the grace period ended)" in log, log
    assert not any(m.startswith("returned-") for m in os.listdir(os.path.join(tmp, "marks")))  # it exited mid-task
    assert (job["state"], job["attempts"], job["error"]) == ("ready", 1, None)  # released, for another worker


def test_an_async_task_abandoned_at_the_grace_periods_end_is_not_logged_as_failed(svc, tmp):
    rc, job, log = _sigterm_while_running(svc, tmp, "grace.asleep", "--idempotency",
                                          os.path.join(tmp, "effects.sqlite"))
    assert rc == 0, log
    assert re.search(r"0 failed, .*; 1 abandoned \(running when the grace period ended\)", log), log
    failures = [line for line in log.splitlines() if re.search(r"\bfailed\b", line) and "0 failed" not in line]
    assert failures == [], log
    assert "CancelledError" not in log and "Traceback" not in log, log
    assert (job["state"], job["attempts"], job["error"]) == ("ready", 1, None)


def test_asyncio_run_returns_once_run_async_is_cancelled_while_a_plain_task_runs(svc, tmp):
    """An app that embeds the worker: cancelling ``run_async`` releases the job at once, and
    the app's ``asyncio.run`` returns without waiting for the task's thread."""
    queue = f"grace{os.getpid()}_{next(_queues)}"
    marks = os.path.join(tmp, "marks")
    job_id = _enqueue(svc, queue, "any")  # a plain handler: the body is its own business
    script = EMBEDDED.format(repo=REPO, task_s=TASK_S)
    proc = subprocess.Popen([sys.executable, "-c", script, svc.data_dir, queue, marks],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: _started(marks, job_id) or proc.poll() is not None, 30, what="the task's start")
        rc = wait_exit(proc, EXIT_BOUND_S)  # it cancels run_async as soon as the task starts
    finally:
        _end(proc)
    out = proc.stdout.read() if proc.stdout else ""
    assert rc == 0, f"asyncio.run had not returned {EXIT_BOUND_S} s after the cancel:\n{out}"
    assert "run_async cancelled" in out and "asyncio.run returned" in out, out
    with svc.connect() as q:
        job = q.job(job_id)
    assert (job["state"], job["attempts"]) == ("ready", 1), job
