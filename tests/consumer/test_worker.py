"""What is the process runner's own (a pool process: what it must be able to pickle, where
its transaction commits) and ``shardq worker module:function``'s loading of a handler,
against the in-memory FakeQueue (tests/support/fakes.py). What every runner does
(prefetch, ``run(max_jobs)``, signals, a seeded chaos run, the real service...) is tested
once for all in test_worker_drivers.py.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3

import pytest

from support.fakes import ACKED, FakeQueue
from shardq.clock import SystemClock
from shardq.errors import InvalidConfig
from shardq.consumer.idempotency import MemoryStore, SqliteStore
from shardq.consumer.worker import Worker
from shardq.cli.worker import main

FAST = {"poll_s": 0.005, "idle_wait_s": 0.01}


# ---------------------------------------------------------------------------- the process runner's own
def test_process_mode_refuses_what_a_pool_process_cannot_get():
    """Process-runner-specific: the handler and the idempotency store cross into spawned
    pool processes, so they must pickle (a module-level function, a store that says how
    to reopen itself); the other settings are checked for every runner in
    test_worker_drivers.py."""
    q = FakeQueue(SystemClock())
    with pytest.raises(InvalidConfig, match="module-level handler"):
        Worker(q, lambda ctx: None, mode="process")
    with pytest.raises(InvalidConfig, match="process mode"):
        Worker(q, process_handler, mode="process", idempotency=MemoryStore())


def process_handler(ctx):
    if ctx.body == b"fail":
        raise ValueError("bad body")
    ctx.db.execute("INSERT INTO effect VALUES (?, ?)", (ctx.job_id, os.getpid()))


def test_process_mode_commits_in_the_child(tmp_path):
    """Process-runner-specific: the task and its transaction run in a pool process (the
    effect's row carries that process's pid), which reopens the SQLite store there."""
    path = tmp_path / "effects.sqlite"
    store = SqliteStore(path)
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, pid INTEGER)")
    q = FakeQueue(SystemClock())
    ok = [q.enqueue(b"ok") for _ in range(3)]
    bad = q.enqueue(b"fail")
    worker = Worker(q, process_handler, mode="process", concurrency=2, idempotency=store,
                    prune_every_s=None, **FAST)
    stats = worker.run(max_jobs=4)
    rows = sqlite3.connect(path).execute("SELECT job_id, pid FROM effect").fetchall()
    assert sorted(r[0] for r in rows) == ok and all(r[1] != os.getpid() for r in rows)
    assert all(store.seen(i) for i in ok) and not store.seen(bad)
    assert q.ops("nack")[0][1] == bad and q.ops("nack")[0][3] == "ValueError: bad body"
    assert stats.succeeded == 3 and stats.failed == 1
    store.close()


def crash_or_sleep(ctx):
    if ctx.body == b"abort":
        os.abort()  # the pool process dies (SIGABRT), as a segfault in an extension would
    import time
    time.sleep(1.0)  # the job's own work, under way when its neighbour dies


def test_a_pool_process_that_dies_fails_its_own_job_only():
    """Process-runner-specific: one child dying (os.abort, a segfault) broke the one
    executor of all: every job running beside it was failed ('BrokenProcessPool') while
    its process ran it on, so it ran again at once beside itself, past the queue's caps,
    and could be dead-lettered for a crash not its own (walkthrough: 1 ok, 11 failed). Each
    runner has a process of its own now: the others finish and are acked, once."""
    q = FakeQueue(SystemClock())
    sleepers = [q.enqueue(b"sleep") for _ in range(2)]
    crashed = q.enqueue(b"abort")
    worker = Worker(q, crash_or_sleep, mode="process", concurrency=3, prune_every_s=None, **FAST)
    stats = worker.run(max_jobs=3)
    assert (stats.succeeded, stats.failed) == (2, 1), stats
    assert [state for state in map(q.state, sleepers)] == [ACKED, ACKED]
    (nack,) = q.ops("nack")
    assert nack[1] == crashed and nack[3].startswith("BrokenProcessPool")
    assert all(q.job(i).attempts == 1 for i in sleepers)


def log_config_to_file(ctx):
    """Writes what logging the pool process has (its root's level and format) to ``ctx.body``."""
    import json
    import logging
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    logging.getLogger("shardq.worker").info("from the pool process")
    with open(ctx.body, "w") as f:
        json.dump({"level": root.level, "format": fmt}, f)


def test_a_pool_process_logs_at_the_workers_level_and_in_its_format(tmp_path):
    """Process-runner-specific: a spawned child started with no logging set up, so its INFO
    lines (a task's progress, a retry) were lost and the rest printed bare, without time,
    level or logger (walkthrough). It takes the worker's level and format."""
    import json
    import logging
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    old_level = root.level
    root.handlers.insert(0, handler)  # the first one's format (the CLI's basicConfig has one; pytest adds more)
    root.setLevel(logging.INFO)
    try:
        out = tmp_path / "child-logging.json"
        q = FakeQueue(SystemClock())
        q.enqueue(str(out).encode())
        Worker(q, log_config_to_file, mode="process", concurrency=1, prune_every_s=None, **FAST).run(max_jobs=1)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    got = json.loads(out.read_text())
    assert got == {"level": logging.INFO, "format": "%(asctime)s %(name)s %(levelname)s %(message)s"}


# ---------------------------------------------------------------------------- CLI
def cli_handler(ctx):
    """Logs its job id to the file its body names, then stops the worker's process (this
    one, or a pool process's parent)."""
    with open(ctx.body, "a") as f:
        f.write(f"{ctx.job_id}\n")
    parent = multiprocessing.parent_process()
    os.kill(parent.pid if parent is not None else os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_main_runs_the_named_handler(tmp_path, mode):
    """``shardq worker module:function``: the thread or process runner (task modules reach
    the asyncio runner too: tests/cli/test_worker_cli.py runs the command on all three)."""
    q = FakeQueue(SystemClock())
    seen = tmp_path / "seen"
    job_id = q.enqueue(str(seen).encode())
    rc = main(["test_worker:cli_handler", "--connect", str(tmp_path), "--concurrency", "1", "--mode", mode,
               "--idempotency", str(tmp_path / "idem.sqlite"), "--log-level", "WARNING"],
              connect=lambda data_dir, **kw: q)
    assert rc == 0 and seen.read_text() == f"{job_id}\n" and q.state(job_id) == ACKED and q.closed
    assert SqliteStore(tmp_path / "idem.sqlite").seen(job_id)


@pytest.mark.parametrize("spec", ["no_colon", "no_such_module_zz:f", "test_worker:nothing_here"])
def test_main_bad_handler(spec, capsys):
    assert main([spec], connect=lambda d: pytest.fail("must not connect")) == 2
    assert "cannot load" in capsys.readouterr().err


def write_then_sleep(ctx):
    """Notes that it runs (a file named by the body), then works longer than any test."""
    import time
    open(ctx.body, "w").close()
    time.sleep(60)


def test_a_job_killed_at_the_end_of_the_grace_period_is_counted_abandoned_without_a_runner_error(
        tmp_path, caplog):
    """Found by an operator's walkthrough: SIGTERM to a process-mode worker whose job ran
    past the grace period logged 'runner error' with a ValueError traceback per job: the
    pool's close() had killed the job's process and emptied its list, and the runner's
    BrokenProcessPool handler removed the executor from it again."""
    import threading
    from support.service import wait_until
    marker = str(tmp_path / "running")
    q = FakeQueue(SystemClock())
    q.enqueue(marker.encode())
    worker = Worker(q, write_then_sleep, mode="process", concurrency=1, grace_s=0.2, prune_every_s=None, **FAST)
    got = []
    runner = threading.Thread(target=lambda: got.append(worker.run()))
    runner.start()
    wait_until(lambda: os.path.exists(marker), 60, 0.05, "the job to start in its process")
    worker.stop()
    runner.join(60)
    assert got and (got[0].abandoned, got[0].failed) == (1, 0), got
    assert "runner error" not in caplog.text and "ValueError" not in caplog.text
