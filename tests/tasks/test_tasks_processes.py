"""Tasks end to end with real processes: ``shardq serve``, the example app's producer and
``shardq worker examples.tasks_app.tasks`` (a thread worker for the plain task, an asyncio
worker for the async one), SIGKILLed mid-task: every effect exactly once."""
from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys

import msgpack
import pytest

from support.service import REPO, Service, short_tmpdir, wait_until

USERS = 60


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(svc, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SHARDQ_DATA_DIR=svc.data_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _produce(svc, db: str) -> None:
    out = subprocess.run([sys.executable, "-m", "examples.tasks_app.produce", "--users", str(USERS), "--db", db],
                         cwd=REPO, env=_env(svc), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"sent {USERS} signups and {USERS} notifications"


def _worker(svc, tmp: str, db: str, **env) -> subprocess.Popen:
    log = open(os.path.join(tmp, "worker.log"), "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "shardq.cli", "worker", "examples.tasks_app.tasks", "--data-dir", svc.data_dir,
         "--idempotency", db, "--concurrency", "4", "--grace", "10", "--log-level", "WARNING"],
        cwd=REPO, env=_env(svc, **env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _rows(db: str, table: str) -> list[tuple]:
    con = sqlite3.connect(db, timeout=10)
    try:
        return con.execute(f"SELECT job_id, user_id, attempt FROM {table}").fetchall()
    finally:
        con.close()


def _drained(svc) -> bool:
    with svc.connect() as q:
        qs = q.stats()["queues"]
    return all(qs.get(name, {}).get(k, 0) == 0 for name in ("signups", "notify")
               for k in ("ready", "in_flight", "delayed", "waiting"))


def _assert_once(db: str) -> None:
    for table in ("signups", "notifications"):
        rows = _rows(db, table)
        assert len(rows) == USERS, table                      # nothing lost, nothing twice
        assert len({r[0] for r in rows}) == USERS and sorted(r[1] for r in rows) == list(range(USERS))


def test_example_app_runs_end_to_end_and_stops_cleanly(tmp):
    db = os.path.join(tmp, "effects.sqlite")
    with Service(shards=2) as svc:
        _produce(svc, db)
        w = _worker(svc, tmp, db)
        try:
            wait_until(lambda: len(_rows(db, "signups")) == USERS and len(_rows(db, "notifications")) == USERS,
                       60, 0.05, "every effect")
            wait_until(lambda: _drained(svc), 20, 0.05, "every job acked")
            w.send_signal(signal.SIGTERM)
            assert w.wait(20) == 0
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
    _assert_once(db)


def test_sigkilled_workers_keep_every_sync_and_async_effect_once(tmp):
    rng = random.Random(20261130)
    db = os.path.join(tmp, "effects.sqlite")
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 1, "max_deliveries": 100}}) as svc:
        _produce(svc, db)
        work = dict(EXAMPLE_WORK_S=0.03)
        w = _worker(svc, tmp, db, **work)
        kills = 0
        try:
            while kills < 5 and not _drained(svc):
                done = len(_rows(db, "signups")) + len(_rows(db, "notifications"))
                wait_until(lambda: len(_rows(db, "signups")) + len(_rows(db, "notifications"))
                           >= min(2 * USERS, done + rng.randint(3, 12)), 30, 0.01, "progress between kills")
                w.send_signal(signal.SIGKILL)               # mid-task: 4 + 4 jobs are running
                w.wait()
                kills += 1
                w = _worker(svc, tmp, db, **work)
            wait_until(lambda: _drained(svc), 60, 0.05, "every job acked")
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert kills >= 3
    _assert_once(db)
    # The kills landed mid-task: some effects come from a redelivery, in both worker kinds.
    assert any(r[2] > 1 for r in _rows(db, "signups")) and any(r[2] > 1 for r in _rows(db, "notifications"))


def test_unknown_task_names_are_dead_lettered_and_the_worker_goes_on(tmp):
    db = os.path.join(tmp, "effects.sqlite")
    with Service(shards=1) as svc:
        with svc.connect() as q:
            q.enqueue(msgpack.packb({"t": "examples.tasks_app.tasks.removed", "a": [], "k": {}, "v": 1}),
                      queue="notify")
            q.enqueue(b"plain bytes", queue="signups")
        _produce(svc, db)
        w = _worker(svc, tmp, db)
        try:
            wait_until(lambda: _drained(svc), 60, 0.05, "every job settled")
            with svc.connect() as q:
                [unknown] = q.dead_letters("notify")
                [foreign] = q.dead_letters("signups")
            assert unknown.attempts == 1 and "unknown task 'examples.tasks_app.tasks.removed'" in unknown.error
            assert "send_notification" in unknown.error            # names what it knows
            assert foreign.attempts == 1 and "not a task" in foreign.error
            assert w.poll() is None                                 # no crash loop
        finally:
            w.send_signal(signal.SIGTERM)
            w.wait(20)
    _assert_once(db)
