"""Exact limits with real processes (docs/limits.md): ``shardq serve`` with several shards,
``shardq worker`` processes and routers. The shards report the most leases they saw in flight
(``max_in_flight_seen``), which must never pass the cap: with 50 worker threads, across a
SIGKILLed shard and a SIGKILLed worker; the rate over any 1-s window of lease starts (the
shard's own clock: deadline - visibility) is at most rate + burst; limits change at run
time from the command line; bad values are refused naming the key."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from support.service import REPO, Service, restarted, short_tmpdir, wait_until
from shardq.config import owner_shard, parse
from shardq.errors import InvalidConfig, Unsupported

HANDLER = textwrap.dedent("""
    import os, time

    def handle(ctx):
        time.sleep(float(os.environ.get("SLOW_S", "0.02")))
""")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _worker(svc: Service, tmp: str, queue: str, threads: int, **env) -> subprocess.Popen:
    with open(os.path.join(tmp, "handler_mod.py"), "w") as f:
        f.write(HANDLER)
    log = open(os.path.join(tmp, "worker.log"), "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "shardq.cli", "worker", "handler_mod:handle", "--connect", svc.data_dir,
         "--queue", queue, "--concurrency", str(threads), "--grace", "5", "--log-level", "WARNING"],
        cwd=tmp, env=_env(**env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _limits(q, queue: str) -> dict:
    owner = owner_shard(queue, q.shards)
    return q.stats()["shards"][owner]["queues"].get(queue, {}).get("limits", {})


CONFIG = {"queues": {
    "default": {},
    "api": {"concurrency": 10, "visibility_timeout": 30},
    "held": {"concurrency": 5, "visibility_timeout": 2},
    "paced": {"rate": "50/s", "burst": 10, "visibility_timeout": 30},
    "plain": {},
}}


@pytest.fixture(scope="module")
def svc():
    with Service(shards=3, config=CONFIG) as s:
        yield s


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_fifty_worker_threads_never_pass_a_concurrency_of_ten(svc, tmp):
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(400)], queue="api")
        worker = _worker(svc, tmp, "api", 50, SLOW_S=0.02)
        try:
            wait_until(lambda: q.stats()["queues"]["api"]["ready"] + q.stats()["queues"]["api"]["in_flight"] == 0,
                       60, 0.1, "the worker to run every job")
        finally:
            _stop(worker)
        fig = _limits(q, "api")
    assert fig["max_in_flight_seen"] == 10     # reached, never passed


def test_sigkill_of_the_shard_and_of_a_worker_never_passes_the_cap(svc, tmp):
    cap = 5
    with svc.connect(retry_s=20) as q:
        owner = owner_shard("held", q.shards)
        q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(40)], queue="held")
        mine = q.dequeue_many("held", max_jobs=40, visibility=60)
        assert len(mine) == cap
        old = q.ping()[owner]
        os.kill(old, signal.SIGKILL)
        restarted(svc, owner, old)
        fig = _limits(q, "held")
        assert fig["in_flight"] == cap             # replay rebuilt every live lease
        assert q.dequeue_many("held", max_jobs=40) == []
        q.ack_many(mine)
        # a worker takes the slots with jobs that outlive it; SIGKILLed, its leases run out
        worker = _worker(svc, tmp, "held", 20, SLOW_S=600)
        try:
            wait_until(lambda: _limits(q, "held")["in_flight"] == cap, 20, 0.05, "the worker's leases")
        finally:
            _stop(worker, signal.SIGKILL)
        assert q.dequeue_many("held", max_jobs=40) == []
        back = q.dequeue_many("held", max_jobs=40, wait=10)   # woken when the expired slots come back
        assert len(back) == cap
        q.ack_many(back)
        assert _limits(q, "held")["max_in_flight_seen"] <= cap


def test_rate_over_any_one_second_window_of_lease_starts(svc):
    rate, burst, vis = 50, 10, 30.0
    starts: list[float] = []
    lock = threading.Lock()
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(400)], queue="paced")
        end = time.monotonic() + 2.5

        def consume():
            with svc.connect() as c:
                while time.monotonic() < end:
                    got = c.dequeue_many("paced", max_jobs=20, wait=0.5)
                    with lock:
                        starts.extend(le.deadline - vis for le in got)   # the shard's clock
                    if got:
                        c.ack_many(got)
        threads = [threading.Thread(target=consume) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    starts.sort()
    assert len(starts) >= rate                     # it leased for more than a second
    j = 0
    for i, t in enumerate(starts):
        while starts[j] < t - 1.0 + 1e-6:
            j += 1
        assert i - j + 1 <= rate + burst, (i - j + 1, t)


def _cli(svc, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args, "--connect", svc.data_dir],
                          env=_env(), capture_output=True, text=True, timeout=60)


def test_limits_change_at_run_time_from_the_command_line(svc):
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "key": f"r{i}"} for i in range(30)], queue="api")
        out = _cli(svc, "queue", "limit", "api", "--concurrency", "3")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["limits"]["concurrency"] == 3
        got = q.dequeue_many("api", max_jobs=30)
        assert len(got) == 3
        bad = _cli(svc, "queue", "limit", "api", "--rate", "fast")
        assert bad.returncode == 2 and "argument --rate" in bad.stderr  # a bad command line (issue 44)
        plain = _cli(svc, "queue", "limit", "plain", "--concurrency", "3")
        assert plain.returncode == 2 and "declares no limit" in plain.stderr  # a command the config cannot take
        reset = _cli(svc, "queue", "limit", "api", "--reset")
        assert reset.returncode == 0 and json.loads(reset.stdout)["limits"]["concurrency"] == 10
        assert len(q.dequeue_many("api", max_jobs=30)) == 7
        q.ack_many(got)
        while leases := q.dequeue_many("api", max_jobs=30):
            q.ack_many(leases)


def test_serve_refuses_bad_limits_naming_the_key(tmp):
    for bad, key in (('rate = "fast"', "rate"), ("concurrency = 0", "concurrency"),
                     ('group_separator = 1\ngroup_concurrency = 2', "group_separator")):
        path = os.path.join(tmp, "bad.toml")
        with open(path, "w") as f:
            f.write(f"[queues.stripe]\n{bad}\n")
        out = subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--config", path,
                              "--data-dir", os.path.join(tmp, "data")],
                             env=_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 5 and f"queues.stripe.{key}" in out.stderr, out.stderr


def test_the_sqs_backend_refuses_limits_naming_the_key():
    from shardq.backends.sqs_admin import queue_attributes
    cfg = parse({"queues": {"stripe": {"rate": "25/s"}, "plain": {}}})
    assert queue_attributes("plain", cfg.queues["plain"], False)
    with pytest.raises(Unsupported, match=r"queues\.stripe\.rate.*sqs backend"):
        queue_attributes("stripe", cfg.queues["stripe"], False)
    with pytest.raises(InvalidConfig):
        parse({"queues": {"stripe": {"rate": "fast"}}})
