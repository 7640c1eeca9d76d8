"""``shardq worker --mode process`` and the jobs it cannot finish: one that keeps its result
or is a workflow step needs the job's client, which a pool process has not. Such a job is
dead-lettered with the reason *before its task runs*: no effect, no idempotency mark, so a
redrive to a thread worker runs it once. (It used to run, commit its effect and mark, and
only then be dead-lettered at its report: the redrive ran the effect a second time.) A real
``shardq serve`` and real ``shardq worker`` processes."""
from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import textwrap

import pytest

import shardq
from shardq import chain
from shardq.consumer.handling import Context
from shardq.consumer.idempotency import SqliteStore
from shardq.tasks.body import Steps, encode
from shardq.tasks.dispatch import TaskHandler
from shardq.tasks.reading import FANOUT
from shardq.types import Lease

from support.service import Service, run_worker, short_tmpdir

TASKS = textwrap.dedent("""
    import os
    import shardq

    app = shardq.App(os.environ.get("PM_DATA", "unused"))


    def _effect(ctx, what):
        with open(os.environ["PM_RAN"], "a") as f:
            f.write(f"{what} {ctx.job_id}\\n")
        ctx.db.execute("CREATE TABLE IF NOT EXISTS effect (job_id INTEGER, what TEXT)")
        ctx.db.execute("INSERT INTO effect VALUES (?, ?)", (ctx.job_id, what))


    @app.task(queue="pm", name="pm.kept", keep_result=60)
    def kept(ctx, n: int) -> int:
        _effect(ctx, "kept")
        return n


    @app.task(queue="pm", name="pm.plain")
    def plain(ctx, n: int) -> int:
        _effect(ctx, "plain")
        return n
""")


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ran(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()[::2]
    except FileNotFoundError:
        return []


def _effects(db: str) -> list[tuple[int, str]]:
    con = sqlite3.connect(db)
    try:
        return sorted(con.execute("SELECT job_id, what FROM effect").fetchall())
    except sqlite3.OperationalError:  # no table: no task wrote
        return []
    finally:
        con.close()


def test_a_job_that_needs_the_client_is_refused_in_process_mode_before_its_task_runs(tmp, monkeypatch):
    with open(os.path.join(tmp, "pm_tasks.py"), "w") as f:
        f.write(TASKS)
    ran, db = os.path.join(tmp, "ran.txt"), os.path.join(tmp, "effects.sqlite")
    monkeypatch.setenv("PM_RAN", ran)  # the workers inherit it (run_worker copies os.environ)
    with Service(shards=1) as svc, svc.connect() as q:
        app = shardq.App(router=q)  # the same task names as pm_tasks.py: bodies name tasks

        @app.task(queue="pm", name="pm.kept", keep_result=60)
        def kept(ctx, n: int) -> int: ...

        @app.task(queue="pm", name="pm.plain")
        def plain(ctx, n: int) -> int: ...

        kept_id = kept.send(1)
        wf = chain(plain.s(2), plain.s()).send()    # step 0: a workflow step (it reports)
        plain_id = plain.send(4)                    # neither: runs in process mode
        (step_id,) = wf.first_ids

        out = run_worker(svc, tmp, "pm_tasks", "--queue", "pm", "--mode", "process", "--burst",
                         "--idempotency", db, "--concurrency", "1", "--log-level", "WARNING")
        assert out.returncode == 0, out.stderr
        assert _ran(ran) == ["plain"] and _effects(db) == [(plain_id, "plain")]  # the refused never ran
        dead = {d.job_id: d.error for d in q.dead_letters("pm")}
        assert set(dead) == {kept_id, step_id}
        assert all("needs a worker in thread or asyncio mode" in e and "not run" in e for e in dead.values())
        store = SqliteStore(db)
        try:
            assert store.seen(plain_id) and not store.seen(kept_id) and not store.seen(step_id)
        finally:
            store.close()

        # Redriven onto a thread worker, each runs once: its first and only effect.
        assert q.redrive("pm") == 2
        out = run_worker(svc, tmp, "pm_tasks", "--queue", "pm", "--burst", "--idempotency", db,
                         "--log-level", "WARNING")
        assert out.returncode == 0, out.stderr
        assert wf.result(timeout=10) == 2 and app.result(kept_id, timeout=10) == 1
        assert sorted(_ran(ran)) == ["kept", "plain", "plain", "plain"]
        assert [w for _, w in _effects(db)].count("kept") == 1


# ---------------------------------------------------------------------------- every path of the handler
@pytest.mark.parametrize("steps", [Steps(60.0, None, None), Steps(None, ["b", 0, 0, 1, 60.0, None], None),
                                   Steps(None, None, ["b", 0, "one"])], ids=["keeps", "reports", "reads inputs"])
@pytest.mark.parametrize("path", ["thread", "asyncio"])
def test_the_handler_refuses_such_a_job_without_a_client_before_the_task_runs(steps, path):
    """Where the worker gives no client (process mode; the SQS backend), both entry points of
    the handler (``__call__``: thread and process runners; ``run_async``: the asyncio
    runner's async tasks) refuse before calling the task, and so does a fan-out job."""
    app = shardq.App(router=object())  # type: ignore[arg-type]  # declares only
    ran: list[int] = []

    @app.task(name="pm.sync")
    def sync_task(ctx, n: int) -> int:
        ran.append(n)
        return n

    @app.task(name="pm.async")
    async def async_task(ctx, n: int) -> int:
        ran.append(n)
        return n

    handler = TaskHandler(app.tasks)
    name = "pm.sync" if path == "thread" else "pm.async"
    ctx = Context(Lease(1, None, encode(name, [1], {}, steps=steps), "q", 1, 1, 0.0))
    assert ctx.client is None
    with pytest.raises(shardq.Fail, match="needs a worker in thread or asyncio mode"):
        if path == "thread":
            handler(ctx)
        else:
            task, args, kwargs = handler.resolve(ctx)
            asyncio.run(handler.run_async(task, ctx, args, kwargs))
    assert ran == [] and ctx.kept is None
    fan_out = Context(Lease(2, None, encode(FANOUT, [[], 60.0], {}, steps=Steps(None, None, ["b", 0, "one"])),
                            "q", 1, 1, 0.0))
    with pytest.raises(shardq.Fail, match="needs a worker in thread or asyncio mode"):
        handler(fan_out)
    assert handler(Context(Lease(3, None, encode("pm.sync", [3], {}), "q", 1, 1, 0.0))) == 3  # a plain job runs
