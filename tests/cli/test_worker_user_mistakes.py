"""``shardq worker`` as a real process, given what a new user gets wrong: a plain handler's
module without its ``:handle`` (the module declares no tasks: an IndexError traceback and
exit 1, where every other bad target is a one-line UsageError and exit 2), and a task that
raises ``Retry(delay_s="30s")`` (the worker died, exit 1, its finished jobs unacked)."""
from __future__ import annotations


import pytest

from shardq.tasks.body import encode
from support.service import Service, run_worker as worker

README_HANDLER = ("def handle(ctx):\n"
                  "    ctx.db.execute('CREATE TABLE IF NOT EXISTS sent (job_id TEXT PRIMARY KEY, body BLOB)')\n")


@pytest.fixture(scope="module")
def svc():
    with Service(shards=1) as s:
        yield s


@pytest.mark.parametrize("more", [[], ["--queue", "default"]])
def test_a_module_with_no_tasks_is_a_one_line_usage_error_naming_module_function(svc, tmp_path, more):
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(README_HANDLER)
    r = worker(svc, str(tmp_path), "myapp.jobs", *more, "--burst")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line == ("error: UsageError: 'myapp.jobs' declares no tasks (@app.task): to run a plain handler, "
                    "give it as module:function, e.g. 'shardq worker myapp.jobs:handle'")


def test_several_modules_with_no_tasks_are_named_together(svc, tmp_path):
    (tmp_path / "first_mod.py").write_text("def work(ctx):\n    pass\n")
    (tmp_path / "second_mod.py").write_text("X = 1\n")
    r = worker(svc, str(tmp_path), "first_mod", "second_mod", "--burst")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: UsageError: 'first_mod second_mod' declare no tasks (@app.task): ")
    assert line.endswith("e.g. 'shardq worker first_mod:work'")


RETRY_TASKS = """
import shardq
app = shardq.App({data_dir!r})


@app.task(queue="retry-str", backoff=shardq.Exponential(3600, 3600))
def flaky(ctx):
    raise shardq.Retry(delay_s="30s")


@app.task(queue="retry-str")
def other(ctx, n):
    pass
"""


def test_a_task_raising_retry_with_a_str_delay_fails_alone_and_the_worker_exits_0(svc, tmp_path):
    (tmp_path / "retry_tasks.py").write_text(RETRY_TASKS.format(data_dir=svc.data_dir))
    with svc.connect() as q:
        flaky = q.enqueue(encode("retry_tasks.flaky", [], {}), queue="retry-str")
        q.enqueue_many([{"body": encode("retry_tasks.other", [n], {}), "queue": "retry-str"} for n in range(3)])
        r = worker(svc, str(tmp_path), "retry_tasks", "--concurrency", "4", "--burst")
        assert r.returncode == 0, r.stderr
        counts = q.stats()["queues"]["retry-str"]
        assert (counts["ready"], counts["in_flight"], counts["dead"]) == (0, 0, 0), counts
        assert counts["delayed"] == 1                      # flaky, waiting out its backoff
        job = q.job(flaky)
    assert job["state"] == "delayed" and job["attempts"] == 1, job
    assert job["error"].startswith("TypeError: Retry: delay_s must be a number of seconds or None, got str '30s'")
