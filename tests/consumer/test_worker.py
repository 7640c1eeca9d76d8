"""The thread runner's own tests (its prefetch, ``run(max_jobs)``, signals, the CLI, a seeded
chaos run, the real service), against the in-memory FakeQueue (tests/support/fakes.py) on a
FakeClock. What every runner does is tested once for all in test_worker_drivers.py.

Synchronisation is by events and by polls with a deadline, never by sleeping.
"""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from support.service import wait_until
from support.fakes import ACKED, DEAD, READY, FakeQueue
from shardq.clock import FakeClock, SystemClock
from shardq.errors import InvalidConfig
from shardq.consumer.idempotency import MemoryStore, SqliteStore
from shardq.consumer.handling import backoff_delay, error_text, execute
from shardq.consumer.worker import Worker
from shardq.cli.worker import main

REPO = Path(__file__).resolve().parents[2]
FAST = {"poll_s": 0.005, "idle_wait_s": 0.01}



def in_background(worker: Worker, **run_kw):
    out: dict = {}

    def target():
        out["stats"] = worker.run(**run_kw)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def make(clock=None, vis=30.0, max_deliveries=5):
    clock = clock or FakeClock()
    return clock, FakeQueue(clock, visibility_timeout=vis, max_deliveries=max_deliveries)


class TopRng:
    """Full jitter at its upper bound, so delays are predictable."""

    def uniform(self, a, b):
        return b


# ---------------------------------------------------------------------------- basics
def test_max_jobs():
    clock, q = make()
    for _i in range(5):
        q.enqueue(b"x")
    stats = Worker(q, lambda ctx: None, concurrency=2, clock=clock, **FAST).run(max_jobs=3)
    assert stats.leased == 3 and stats.succeeded == 3
    assert sum(j.state == READY for j in q.jobs.values()) == 2


def test_bad_settings():
    _, q = make()
    for kw in ({"concurrency": 0}, {"heartbeat_fraction": 1.0}, {"mode": "fork"},
               {"backoff_base_s": 5, "backoff_cap_s": 1}, {"prefetch": -1}, {"log_every": 0}):
        with pytest.raises(InvalidConfig):
            Worker(q, lambda ctx: None, **kw)
    with pytest.raises(InvalidConfig):  # a lambda cannot be sent to a pool process
        Worker(q, lambda ctx: None, mode="process")
    with pytest.raises(InvalidConfig):  # nor can a MemoryStore
        Worker(q, process_handler, mode="process", idempotency=MemoryStore())


# ---------------------------------------------------------------------------- idempotency
def test_crash_after_commit_before_ack_is_skipped_on_redelivery():
    clock, q = make()
    store = MemoryStore(clock=clock)
    job_id = q.enqueue(b"a")
    calls = []

    def handler(ctx):
        calls.append(ctx.attempt)
        ctx.db["effect"] = ctx.attempt

    lease = q.dequeue_many("default", max_jobs=1, wait=0)[0]
    assert execute(handler, lease, store) == ("done", None, None)  # committed; then the worker "dies"
    clock.advance(31)                                           # lease expires: redelivered
    stats = Worker(q, handler, idempotency=store, clock=clock, **FAST).run(until_idle=True)
    assert calls == [1] and store.data == {"effect": 1}
    assert q.state(job_id) == ACKED and q.job(job_id).attempts == 2
    assert stats.duplicates == 1


def test_sqlite_handler_error_leaves_no_effect_and_no_mark(tmp_path):
    clock, q = make()
    path = tmp_path / "effects.sqlite"
    store = SqliteStore(path, clock=clock)
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, attempt INTEGER)")
    job_id = q.enqueue(b"a")

    def handler(ctx):
        ctx.db.execute("INSERT INTO effect VALUES (?, ?)", (ctx.job_id, ctx.attempt))
        if ctx.attempt == 1:
            raise RuntimeError("after the write")

    worker = Worker(q, handler, idempotency=store, clock=clock, rng=TopRng(),
                    concurrency=2, **FAST)
    worker.run(until_idle=True)
    rows = lambda: sqlite3.connect(path).execute("SELECT * FROM effect").fetchall()  # noqa: E731 - a one-line local helper
    assert rows() == [] and not store.seen(job_id)
    assert q.ops("nack")[-1][3] == "RuntimeError: after the write"
    clock.advance(1.0)  # the backoff
    worker.run(until_idle=True)
    assert rows() == [(job_id, 2)] and store.seen(job_id) and q.state(job_id) == ACKED
    store.close()


# ---------------------------------------------------------------------------- leases
def test_prefetched_lease_is_heartbeated_too():
    clock, q = make(vis=30)
    a, b = q.enqueue(b"a"), q.enqueue(b"b")
    started, release = threading.Event(), threading.Event()

    def handler(ctx):
        started.set()
        release.wait(5)

    worker = Worker(q, handler, concurrency=1, prefetch=1, clock=clock, **FAST)
    t, _ = in_background(worker, max_jobs=2)
    assert started.wait(5)
    wait_until(lambda: q.max_leased == 2, what="a running, b prefetched")
    for step in (1, 2):  # 16 s, then 32 s: past the first deadline (30)
        clock.advance(16)
        wait_until(lambda: len(q.ops("extend")) == 2 * step, what="both leases extended")
    assert {op[1] for op in q.ops("extend")} == {a, b} and all(op[3] for op in q.ops("extend"))
    release.set()
    t.join(5)
    assert q.state(a) == ACKED and q.state(b) == ACKED
    assert q.job(b).attempts == 1  # waiting for a runner did not burn a delivery


# ---------------------------------------------------------------------------- failures
def test_backoff_delay_is_full_jitter_capped():
    top = TopRng()
    assert [backoff_delay(a, 1.0, 10.0, top) for a in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(10_000, 1.0, 300.0, top) == 300.0
    rng = random.Random(1)
    samples = [backoff_delay(3, 1.0, 300.0, rng) for _ in range(200)]
    assert all(0 <= s <= 4 for s in samples) and min(samples) < 1 and max(samples) > 3


def test_error_text():
    assert error_text(ValueError("boom")) == "ValueError: boom"
    assert len(error_text(ValueError("é" * 5000)).encode()) <= 2048


def test_handler_error_nacks_with_growing_backoff_then_dead_letter():
    clock, q = make(max_deliveries=4)
    job_id = q.enqueue(b"poison")

    def handler(ctx):
        raise ValueError(f"boom {ctx.attempt}")

    worker = Worker(q, handler, clock=clock, rng=TopRng(), backoff_base_s=1.0,
                    backoff_cap_s=3.0, **FAST)
    delays = []
    for attempt in range(1, 5):
        worker.run(until_idle=True)
        _, jid, delay, error = q.ops("nack")[-1]
        assert (jid, error) == (job_id, f"ValueError: boom {attempt}")
        delays.append(delay)
        if delay:
            worker.run(until_idle=True)  # delayed, not a long lease: nothing runs early
            assert len(q.ops("nack")) == attempt
            clock.advance(delay)
    assert delays == [1.0, 2.0, 3.0, 0.0]  # doubling, capped; the last failure is not delayed
    assert q.state(job_id) == DEAD
    assert q.dead[0].attempts == 4 and q.dead[0].error == "ValueError: boom 4"
    assert worker.stats.failed == 4


# ---------------------------------------------------------------------------- shutdown
def test_stop_finishes_running_releases_pending():
    clock, q = make()
    ids = [q.enqueue(b"%d" % i) for i in range(4)]
    release = threading.Event()
    running = []

    def handler(ctx):
        running.append(ctx.job_id)
        release.wait(5)

    worker = Worker(q, handler, concurrency=2, prefetch=1, clock=clock, **FAST)
    t, out = in_background(worker)
    wait_until(lambda: len(running) == 2 and q.max_leased == 3, what="2 running, 1 prefetched")
    worker.stop()
    wait_until(lambda: q.ops("nack"), what="the pending lease released")
    assert q.ops("nack") == [("nack", ids[2], 0.0, None)]
    assert t.is_alive()  # still waiting for the running handlers
    release.set()
    t.join(5)
    assert not t.is_alive()
    assert [q.state(i) for i in ids] == [ACKED, ACKED, READY, READY]
    # the released prefetch never reached a handler: its lease is not counted
    assert q.job(ids[2]).attempts == 0 and q.job(ids[3]).attempts == 0
    assert out["stats"].succeeded == 2 and out["stats"].released == 1


def test_grace_period_over_releases_running_and_rolls_back():
    clock, q = make()
    store = MemoryStore(clock=clock)
    job_id = q.enqueue(b"a")
    started, release = threading.Event(), threading.Event()

    def handler(ctx):
        ctx.db["effect"] = 1
        started.set()
        release.wait(5)

    worker = Worker(q, handler, concurrency=1, grace_s=5, idempotency=store, clock=clock, **FAST)
    t, out = in_background(worker)
    assert started.wait(5)
    worker.stop()
    clock.advance(6)  # grace over, handler still running
    t.join(5)
    assert not t.is_alive() and out["stats"].abandoned == 1
    assert q.ops("nack") == [("nack", job_id, 0.0, None)] and q.state(job_id) == READY
    release.set()  # the abandoned handler ends: its transaction must not commit
    wait_until(lambda: not any(th.name.startswith("shardq-runner") for th in threading.enumerate()),
               what="runner exit")
    assert store.data == {} and not store.seen(job_id)


def test_sigterm_in_main_thread_stops_gracefully():
    clock, q = make()
    ids = [q.enqueue(b"x") for _ in range(3)]
    before = signal.getsignal(signal.SIGTERM)

    def handler(ctx):
        if ctx.job_id == ids[0]:  # once: a second signal would exit the process at once
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread: the loop

    stats = Worker(q, handler, concurrency=1, prefetch=1, clock=clock, **FAST).run()
    assert q.state(ids[0]) == ACKED and stats.succeeded >= 1
    assert signal.getsignal(signal.SIGTERM) is before


SCRIPT = textwrap.dedent("""
    import sys, threading
    sys.path[:0] = [{repo!r}, {tests!r}]
    from support.fakes import FakeQueue
    from shardq.clock import SystemClock
    from shardq.consumer.worker import Worker
    q = FakeQueue(SystemClock())
    q.enqueue(b"x")
    def handler(ctx):
        print("started", flush=True)
        threading.Event().wait()
    Worker(q, handler, concurrency=1, grace_s=0.2, poll_s=0.01, idle_wait_s=0.01).run()
    print("returned", q.ops("nack"), flush=True)
""")


def _spawn_blocked_worker():
    script = SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def test_sigterm_then_grace_exits_0_and_releases():
    proc = _spawn_blocked_worker()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "returned [('nack', 1, 0.0, None)]" in out


def test_second_signal_exits_at_once():
    proc = _spawn_blocked_worker()
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 1 and "second signal" in err and "returned" not in out


# ---------------------------------------------------------------------------- process mode
def process_handler(ctx):
    if ctx.body == b"fail":
        raise ValueError("bad body")
    ctx.db.execute("INSERT INTO effect VALUES (?, ?)", (ctx.job_id, os.getpid()))


def test_process_mode_commits_in_the_child(tmp_path):
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


# ---------------------------------------------------------------------------- CLI
CLI_SEEN: list = []


def cli_handler(ctx):
    CLI_SEEN.append(ctx.job_id)
    os.kill(os.getpid(), signal.SIGTERM)


def test_main_runs_the_named_handler(tmp_path):
    q = FakeQueue(SystemClock())
    job_id = q.enqueue(b"x")
    CLI_SEEN.clear()
    rc = main(["test_worker:cli_handler", "--connect", str(tmp_path), "--concurrency", "1",
               "--idempotency", str(tmp_path / "idem.sqlite"), "--log-level", "WARNING"],
              connect=lambda data_dir, **kw: q)
    assert rc == 0 and CLI_SEEN == [job_id] and q.state(job_id) == ACKED and q.closed
    assert SqliteStore(tmp_path / "idem.sqlite").seen(job_id)


@pytest.mark.parametrize("spec", ["no_colon", "no_such_module_zz:f", "test_worker:nothing_here"])
def test_main_bad_handler(spec, capsys):
    assert main([spec], connect=lambda d: pytest.fail("must not connect")) == 2
    assert "cannot load" in capsys.readouterr().err


# ---------------------------------------------------------------------------- simulation
@pytest.mark.parametrize("seed", range(6))
def test_seeded_chaos_keeps_effects_exactly_once(seed, monkeypatch):
    """Random handler failures, pauses that outlive the lease (the fence must roll back),
    duplicate deliveries and shard outages: every job ends acked or dead, no effect is
    committed twice, and every acked job's effect is there. Outcomes are a function of
    (seed, job id, attempt); thread timing still varies, so the seed narrows, not replays."""
    import shardq.consumer.policy as policy_mod

    monkeypatch.setattr(policy_mod, "UNAVAILABLE_BACKOFF_S_MIN", 0.001)
    monkeypatch.setattr(policy_mod, "UNAVAILABLE_BACKOFF_S_MAX", 0.004)
    clock, q = make(vis=30, max_deliveries=4)
    store = MemoryStore(clock=clock)
    rng = random.Random(seed)
    ids = [q.enqueue(b"x") for _ in range(30)]
    for job_id in rng.sample(ids, 8):
        q.enqueue(b"x", job_id=job_id)  # delivered twice

    def handler(ctx):
        roll = random.Random(f"{seed}/{ctx.job_id}/{ctx.attempt}").random()
        ctx.db[("n", ctx.job_id)] = ctx.db.get(("n", ctx.job_id), 0) + 1
        if roll < 0.3:
            raise RuntimeError(f"roll {roll:.2f}")
        if roll < 0.4:
            clock.advance(31)  # a pause longer than the lease: it is lost before the commit

    worker = Worker(q, handler, concurrency=4, idempotency=store, clock=clock, rng=rng,
                    backoff_cap_s=5.0, **FAST)
    for _ in range(60):
        if all(j.state in (ACKED, DEAD) for j in q.jobs.values()):
            break
        q.unavailable = {op: rng.randrange(2) for op in ("dequeue_many", "ack_many", "extend", "nack")}
        worker.run(until_idle=True)
        clock.advance(rng.choice([1, 5, 31]))
    states = {j.uid: j.state for j in q.jobs.values()}
    assert set(states.values()) <= {ACKED, DEAD}, f"seed {seed}: {states}"
    effects = {k[1]: v for k, v in store.data.items()}
    assert all(v == 1 for v in effects.values()), f"seed {seed}: an effect committed twice"
    assert set(effects) == set(store.processed), f"seed {seed}: effect and mark disagree"
    acked = {j.job_id for j in q.jobs.values() if j.state == ACKED}
    assert acked <= set(effects), f"seed {seed}: acked without its effect"


# ---------------------------------------------------------------------------- the real service
def test_against_the_real_service(tmp_path):
    """The duck-typed API the worker uses, against shardq.open (shard processes)."""
    import shardq

    q = shardq.open(tmp_path / "q", shards=2,
                    config={"queue_defaults": {"max_deliveries": 2, "visibility_timeout": 10}})
    store = SqliteStore(tmp_path / "effects.sqlite")
    try:
        with store.transaction() as txn:
            txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, body BLOB)")
        ids = [q.enqueue(b"%d" % i, key=f"k{i % 4}") for i in range(20)]

        def handler(ctx):
            if ctx.body == b"7":
                raise ValueError("seven")
            ctx.db.execute("INSERT INTO effect VALUES (?, ?)", (ctx.job_id, ctx.body))

        worker = Worker(q, handler, concurrency=4, idempotency=store, backoff_base_s=0.001,
                        backoff_cap_s=0.002, prune_every_s=None, poll_s=0.005, idle_wait_s=0.05)
        for _ in range(50):
            worker.run(until_idle=True)
            if q.stats()["queues"]["default"]["dead"] == 1:
                break
        rows = sqlite3.connect(tmp_path / "effects.sqlite").execute("SELECT job_id FROM effect")
        assert sorted(r[0] for r in rows) == sorted(i for i in ids if i != ids[7])
        dead = q.dead_letters("default")
        assert [(d.job_id, d.attempts, d.error) for d in dead] == [(ids[7], 2, "ValueError: seven")]
        assert worker.stats.succeeded == 19 and worker.stats.failed == 2
    finally:
        q.close()
        store.close()
