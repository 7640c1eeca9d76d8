"""``shardq worker`` processes against a real service: SIGKILLed at random points they keep
every effect exactly once and in per-key order; SIGTERM lets running jobs finish."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from support.service import REPO, Service, short_tmpdir, wait_until
from support.worker_effects import (_setup, _effects)


def _worker(svc: Service, tmp: str, db: str, env: dict, concurrency: int = 4) -> subprocess.Popen:
    log = open(os.path.join(tmp, "workers.log"), "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "shardq.cli", "worker", "handler_mod:handle", "--connect", svc.data_dir,
         "--idempotency", db, "--concurrency", str(concurrency), "--grace", "10", "--log-level", "WARNING"],
        cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sigkilled_workers_keep_every_effect_once_and_in_key_order(tmp):
    rng = random.Random(20261130)
    db = _setup(tmp)
    config = {"queue_defaults": {"visibility_timeout": 1, "max_deliveries": 1000}}
    with Service(shards=2, config=config) as svc:
        keys, per_key = 40, 40
        with svc.connect() as q:
            ids = q.enqueue_many([{"body": f"k{k}:{s}".encode(), "key": f"k{k}"}
                                  for s in range(per_key) for k in range(keys)])
        env = _env(CRASH_P=0.002)
        workers = [_worker(svc, tmp, db, env) for _ in range(3)]
        kills = 0
        try:
            # Kill a random worker at random moments while work is under way, and restart
            # whatever died (killed, or crashed by the handler itself).
            while kills < 12 and len(_effects(db)) < len(ids):
                done = len(_effects(db))
                wait_until(lambda: len(_effects(db)) >= min(len(ids), done + rng.randint(20, 120)),
                           30, 0.02, "progress between kills")
                victim = rng.randrange(len(workers))
                workers[victim].send_signal(signal.SIGKILL)
                workers[victim].wait()
                kills += 1
                workers = [w if w.poll() is None else _worker(svc, tmp, db, env) for w in workers]
            # Let the rest finish, restarting workers the handler crashes.
            def finished():
                nonlocal workers
                workers = [w if w.poll() is None else _worker(svc, tmp, db, env) for w in workers]
                return len(_effects(db)) >= len(ids)
            wait_until(finished, 120, 0.05, "every job's effect")
            with svc.connect() as q:
                wait_until(lambda: q.stats()["queues"]["default"]["in_flight"] == 0
                           and q.stats()["queues"]["default"]["ready"] == 0, 30, 0.05, "all acked")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
    rows = _effects(db)
    assert kills >= 5
    assert sorted(r[1] for r in rows) == sorted(ids)            # every job, exactly once
    by_key: dict[str, list[int]] = {}
    for _, _, key, seq in rows:                                  # rows are in commit order
        by_key.setdefault(key, []).append(seq)
    assert all(seqs == sorted(seqs) for seqs in by_key.values())  # per-key order
    assert len(by_key) == keys


def test_sigterm_lets_running_jobs_finish_and_loses_nothing(tmp):
    db = _setup(tmp)
    with Service(shards=1, config={"queue_defaults": {"visibility_timeout": 30}}) as svc:
        with svc.connect() as q:
            ids = q.enqueue_many([{"body": f"k{i}:0".encode(), "key": f"k{i}"} for i in range(12)])
        worker = _worker(svc, tmp, db, _env(SLOW_S=0.4), concurrency=3)
        with svc.connect() as q:
            wait_until(lambda: q.stats()["queues"]["default"]["in_flight"] >= 3, 20, 0.01, "jobs running")
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(20) == 0
            done = {r[1] for r in _effects(db)}
            st = q.stats()["queues"]["default"]
            # Running jobs finished and were acked; the rest were released, none in flight.
            assert len(done) >= 3
            assert st["in_flight"] == 0
            assert st["ready"] + st["waiting"] + st["delayed"] + len(done) == len(ids)
            left = q.dequeue_many("default", max_jobs=100)
            assert {l.job_id for l in left} | done == set(ids)
            assert all(l.attempt == 1 for l in left)  # released unstarted: not a delivery


def test_a_sigkilled_worker_in_process_mode_leaves_no_pool_process_behind(tmp):
    """Its pool processes waited for work for ever once their parent was SIGKILLed (a
    container or OOM kill, a supervisor's last resort): each kill leaked a process per
    unit of concurrency. Now they notice the parent gone and end within a second."""
    import psutil
    db = _setup(tmp)
    with Service(shards=1) as svc:
        log = open(os.path.join(tmp, "workers.log"), "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardq.cli", "worker", "handler_mod:handle", "--connect", svc.data_dir,
             "--idempotency", db, "--concurrency", "3", "--mode", "process", "--log-level", "WARNING"],
            cwd=tmp, env=_env(SLOW_S=0.05), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            with svc.connect() as q:
                q.enqueue_many([{"body": f"k{i % 3}:{i}".encode(), "key": f"k{i % 3}"} for i in range(30)])
            wait_until(lambda: len(_effects(db)) >= 3, 60.0, 0.05, "the pool to run jobs")
            children = psutil.Process(proc.pid).children(recursive=True)
            assert len(children) >= 3, [c.cmdline() for c in children]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            gone, alive = psutil.wait_procs(children, timeout=10)
            assert not alive, [(c.pid, c.cmdline()) for c in alive]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for c in psutil.process_iter(["pid", "cmdline"]):
                if any(tmp in part for part in (c.info["cmdline"] or ())) and c.pid != os.getpid():
                    c.kill()
