"""Workflows with real processes (``shardq serve`` and ``shardq worker`` subprocesses, an
SQLite idempotency store), SIGKILLed while they run:

* a chord of 1,000 members whose workers are SIGKILLed again and again, with a shard
  SIGKILLed twice: the callback runs exactly once, with the 1,000 results in member order;
* a 20-step chain under worker kills: each step's effect once, in order;
* ``result()`` across a restart of the job's shard.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from shardq import chain, chord, group, limits

from support.service import REPO, Service, restarted, short_tmpdir, wait_until

MEMBERS = 1000
STEPS = 20

APP = textwrap.dedent("""
    import json, os
    import shardq

    app = shardq.App(os.environ["SHARDQ_DATA_DIR"])

    @app.task(name="wf.member")
    def member(ctx, i: int) -> int:
        ctx.db.execute("INSERT INTO members(job_id, i) VALUES (?, ?)", (ctx.job_id, i))
        return i * i

    @app.task(name="wf.callback")
    def callback(ctx, results: list, label: str) -> int:
        ctx.db.execute("INSERT INTO callbacks(job_id, label, results) VALUES (?, ?, ?)",
                       (ctx.job_id, label, json.dumps(results)))
        return len(results)

    @app.task(name="wf.step")
    def step(ctx, n: int) -> int:
        ctx.db.execute("INSERT INTO steps(job_id, n) VALUES (?, ?)", (ctx.job_id, n))
        return n + 1

    @app.task(name="wf.kept", keep_result=600)
    def kept(ctx, x: int) -> dict:
        return {"x": x}
""")


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _setup(tmp: str) -> str:
    with open(os.path.join(tmp, "wf_app.py"), "w") as f:
        f.write(APP)
    db = os.path.join(tmp, "effects.sqlite")
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE members (job_id INTEGER, i INTEGER);"
                      "CREATE TABLE callbacks (job_id INTEGER, label TEXT, results TEXT);"
                      "CREATE TABLE steps (job_id INTEGER, n INTEGER);")
    con.close()
    return db


def _count(db: str, sql: str) -> int:
    con = sqlite3.connect(db, timeout=30)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


class Workers:
    """``shardq worker wf_app`` processes, SIGKILLed and replaced on demand."""

    def __init__(self, svc: Service, tmp: str, db: str, count: int):
        self.svc, self.tmp, self.db = svc, tmp, db
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, tmp, os.environ.get("PYTHONPATH", "")]),
                        SHARDQ_DATA_DIR=svc.data_dir)
        self.log = open(os.path.join(tmp, "workers.log"), "ab")
        self.procs = [self._start() for _ in range(count)]
        self.kills = 0

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "shardq.cli", "worker", "wf_app", "--data-dir", self.svc.data_dir,
             "--idempotency", self.db, "--concurrency", "4", "--log-level", "ERROR"],
            cwd=self.tmp, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def kill_one(self, i: int) -> None:
        p = self.procs[i % len(self.procs)]
        p.kill()
        p.wait()
        self.kills += 1
        self.procs[i % len(self.procs)] = self._start()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.log.close()

    def tail(self) -> str:
        with open(os.path.join(self.tmp, "workers.log"), encoding="utf-8", errors="replace") as f:
            return f.read()[-3000:]


def _app(svc: Service, tmp: str):
    """The workers' app module, imported here too (the producer), on this service."""
    import importlib
    sys.path.insert(0, tmp)
    before = os.environ.get("SHARDQ_DATA_DIR")
    os.environ["SHARDQ_DATA_DIR"] = svc.data_dir
    try:
        if "wf_app" in sys.modules:
            return importlib.reload(sys.modules["wf_app"]).app
        return importlib.import_module("wf_app").app
    finally:
        sys.path.remove(tmp)
        if before is None:
            del os.environ["SHARDQ_DATA_DIR"]
        else:
            os.environ["SHARDQ_DATA_DIR"] = before


def test_a_1000_member_chord_under_worker_and_shard_kills_calls_back_once_in_member_order(tmp):
    db = _setup(tmp)
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 3, "max_deliveries": 100}}) as svc:
        app = _app(svc, tmp)
        wf_app = sys.modules["wf_app"]
        wf = chord(group(wf_app.member.s(i) for i in range(MEMBERS)), wf_app.callback.s("squares")).send()
        workers = Workers(svc, tmp, db, 2)
        try:
            shard_kills = 0
            for n in range(1, 8):
                # a worker SIGKILLed each time another 120 member effects have committed
                target = min(MEMBERS, 120 * n)
                wait_until(lambda: _count(db, "SELECT count(DISTINCT i) FROM members") >= target, 120, 0.02,
                           f"{target} member effects ({workers.tail()})")
                workers.kill_one(n)
                if n in (2, 5):  # and one shard, twice
                    pid = svc.shard_pids()[n % 2]
                    os.kill(pid, signal.SIGKILL)
                    restarted(svc, n % 2, pid)
                    shard_kills += 1
            assert wf.result(timeout=180) == MEMBERS
        finally:
            workers.close()
            app.close()
        rows = sqlite3.connect(db).execute("SELECT label, results FROM callbacks").fetchall()
    assert shard_kills == 2 and workers.kills == 7
    assert len(rows) == 1, rows                                          # the callback ran once
    assert rows[0][0] == "squares" and json.loads(rows[0][1]) == [i * i for i in range(MEMBERS)]
    assert _count(db, "SELECT count(*) FROM members") == MEMBERS         # each member's effect once


def test_a_20_step_chain_under_worker_kills_runs_each_step_once_in_order(tmp):
    db = _setup(tmp)
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 2, "max_deliveries": 100}}) as svc:
        app = _app(svc, tmp)
        wf_app = sys.modules["wf_app"]
        wf = chain(*[wf_app.step.s(0) if i == 0 else wf_app.step.s() for i in range(STEPS)]).send()
        workers = Workers(svc, tmp, db, 1)
        try:
            for n in (3, 7, 11, 15):
                wait_until(lambda: _count(db, "SELECT count(*) FROM steps") >= n, 120, 0.01,
                           f"step {n} ({workers.tail()})")
                workers.kill_one(0)
            assert wf.result(timeout=120) == STEPS
        finally:
            workers.close()
            app.close()
        steps = [n for (n,) in sqlite3.connect(db).execute("SELECT n FROM steps ORDER BY rowid")]
    assert steps == list(range(STEPS))                                   # once each, in order


def test_a_result_is_read_across_a_restart_of_its_shard(tmp):
    db = _setup(tmp)
    with Service(shards=2) as svc:
        app = _app(svc, tmp)
        wf_app = sys.modules["wf_app"]
        job_id = wf_app.kept.send(41)
        workers = Workers(svc, tmp, db, 1)
        try:
            assert app.result(job_id, timeout=60) == {"x": 41}
        finally:
            workers.close()
        shard = job_id & (2 ** limits.JOB_ID_SHARD_BITS - 1)
        pid = svc.shard_pids()[shard]
        os.kill(pid, signal.SIGKILL)
        restarted(svc, shard, pid)
        try:
            assert app.result(job_id, timeout=60) == {"x": 41}
            assert app.status(job_id)["state"] == "succeeded"
        finally:
            app.close()
