"""Real processes, real SIGKILLs, a real PostgreSQL: ``shardq worker`` with the PostgreSQL
store killed at every step keeps each effect once; ``shardq outbox relay`` processes killed
mid-batch deliver every committed row exactly once in per-key order; a PostgreSQL crash and
restart under load loses and duplicates nothing."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from support.service import REPO, Service, short_tmpdir, wait_until
from shardq import outbox

psycopg = pytest.importorskip("psycopg")

CONFIG = {"queue_defaults": {"visibility_timeout": 1, "max_deliveries": 1000}}

# The worker's handler. One job of each key kills the worker process, once, at one of three
# steps: before the handler writes, inside its transaction, or after the commit and before
# the ack (by wrapping the worker core's acks effect: a failpoint in the test's own module). The crash log
# says which jobs have crashed already (a kill also takes down the other jobs in flight).
HANDLER = textwrap.dedent("""
    import os, signal
    from shardq.consumer import core as _core

    def _crash_mode(lease):
        log = os.environ.get("CRASH_LOG")
        key, seq = lease.body.decode().split(":")
        k = int(key[1:])
        if not log or (int(seq) + k) % 10 != 9:
            return None
        if os.path.exists(log):
            with open(log) as f:
                if any(line.split()[1] == str(lease.job_id) for line in f):
                    return None
        return ("before", "inside", "after_commit")[k % 3]

    def _die(mode, lease):
        with open(os.environ["CRASH_LOG"], "a") as f:
            f.write(f"{mode} {lease.job_id}\\n")
        os.kill(os.getpid(), signal.SIGKILL)

    _acks = _core.SettleMany.call

    def _ack_or_die(self, q):
        for lease in self.acks:
            if _crash_mode(lease) == "after_commit":
                _die("after_commit", lease)
        return _acks(self, q)

    _core.SettleMany.call = _ack_or_die

    def handle(ctx):
        mode = _crash_mode(ctx.lease)
        if mode == "before":
            _die(mode, ctx.lease)
        key, seq = ctx.body.decode().split(":")
        ctx.db.execute("INSERT INTO effects (job_id, key, seq) VALUES (%s, %s, %s)",
                       (ctx.job_id, key, int(seq)))
        if mode == "inside":
            _die(mode, ctx.lease)
""")


@pytest.fixture
def tmp():
    path = short_tmpdir()
    with open(os.path.join(path, "pg_handler.py"), "w") as f:
        f.write(HANDLER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _spawn(tmp: str, args: list[str], env: dict, log: str) -> subprocess.Popen:
    with open(os.path.join(tmp, log), "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "shardq.cli", *args], cwd=tmp, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _worker(svc, tmp, url, env) -> subprocess.Popen:
    return _spawn(tmp, ["worker", "pg_handler:handle", "--connect", svc.data_dir, "--idempotency", url,
                        "--concurrency", "4", "--grace", "10", "--log-level", "WARNING"], env, "worker.log")


def _relay(svc, tmp, url) -> subprocess.Popen:
    return _spawn(tmp, ["outbox", "relay", "--connect", svc.data_dir, "--dsn", url, "--batch", "20",
                        "--poll", "1", "--log-level", "WARNING"], _env(), "relay.log")


def _wait_connected(dsn: str, procs: list[subprocess.Popen], what: str) -> None:
    """Until each process has a PostgreSQL connection (its store or relay is up)."""
    def connected():
        with psycopg.connect(dsn) as conn:
            names = " ".join(r[0] for r in conn.execute("SELECT application_name FROM pg_stat_activity"))
        return all(f"pid={p.pid}" in names for p in procs)
    wait_until(connected, 30, 0.02, what)


def _mid_batch(dsn: str, relays: list[subprocess.Popen], within_s: float = 2.0) -> int | None:
    """The index of a relay caught in the middle of a batch: its transaction has fetched
    the bodies (its last statement), so it is recording the attempt or sending to the queue.
    None if no relay was caught within ``within_s``."""
    pids = {f"shardq outbox relay pid={p.pid}": i for i, p in enumerate(relays)}
    deadline = time.monotonic() + within_s
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            for (name,) in conn.execute("SELECT application_name FROM pg_stat_activity "
                                        "WHERE state = 'idle in transaction' "
                                        "AND query LIKE 'SELECT id, body FROM%'"):
                if name in pids:
                    return pids[name]
    return None


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(20)


def _url(pg, dsn: str) -> str:  # noqa: F811 - the pytest fixture imported from pg, requested by name
    return pg.url(dsn.rsplit("dbname=", 1)[1])


def _create_effects(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (seqno bigserial PRIMARY KEY, job_id bigint, key text, seq int)")


def _effects(dsn: str) -> list[tuple[int, str, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT job_id, key, seq FROM effects ORDER BY seqno").fetchall()


def _check_once_and_in_key_order(rows: list[tuple[int, str, int]]) -> dict[str, list[int]]:
    job_ids = [r[0] for r in rows]
    assert len(job_ids) == len(set(job_ids)), "an effect committed twice"
    by_key: dict[str, list[int]] = {}
    for _, key, seq in rows:  # in commit order
        by_key.setdefault(key, []).append(seq)
    for key, seqs in by_key.items():
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)), f"key {key}: {seqs}"
    return by_key


def test_worker_killed_at_every_step_keeps_each_effect_once(pg, pg_dsn, tmp):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _create_effects(pg_dsn)
    url = _url(pg, pg_dsn)
    crash_log = os.path.join(tmp, "crashes.log")
    env = _env(CRASH_LOG=crash_log)
    with Service(shards=2, config=CONFIG) as svc:
        keys, per_key = 6, 10
        with svc.connect() as q:
            ids = q.enqueue_many([{"body": f"k{k}:{s}".encode(), "key": f"k{k}"}
                                  for s in range(per_key) for k in range(keys)])
        workers = [_worker(svc, tmp, url, env)]
        try:
            def done():
                workers[:] = [w if w.poll() is None else _worker(svc, tmp, url, env) for w in workers]
                return len(_effects(pg_dsn)) >= len(ids)
            wait_until(done, 120, 0.05, "every job's effect")
            with svc.connect() as q:
                wait_until(lambda: q.stats()["queues"]["default"]["in_flight"] == 0
                           and q.stats()["queues"]["default"]["ready"] == 0, 30, 0.05, "all acked")
        finally:
            _kill(workers)
    rows = _effects(pg_dsn)
    assert sorted(r[0] for r in rows) == sorted(ids)  # every job, exactly once
    assert all(len(seqs) == per_key for seqs in _check_once_and_in_key_order(rows).values())
    with open(crash_log) as f:
        modes = [line.split()[0] for line in f]
    assert sorted(modes) == sorted(["before", "inside", "after_commit"] * (keys // 3))
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM shardq_processed").fetchone()[0] == len(ids)


class _Producer(threading.Thread):
    """Commits outbox rows (1-3 per transaction, per-key sequence numbers), rolls back one
    transaction in five, and records what committed, what rolled back and what is unknown
    (the connection died during COMMIT)."""

    def __init__(self, dsn: str, keys: int, seed: int):
        super().__init__(daemon=True)
        self.dsn, self.keys, self.rng = dsn, keys, random.Random(seed)
        self.committed: list[tuple[str, int]] = []
        self.rolled_back: list[tuple[str, int]] = []
        self.unknown: list[tuple[str, int]] = []
        self.stop = threading.Event()
        self.next_seq = [0] * keys
        self.errors = 0

    def run(self) -> None:
        conn = None
        while not self.stop.is_set():
            rows: list[tuple[str, int]] = []
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn)
                rows = []
                for _ in range(self.rng.randint(1, 3)):
                    k = self.rng.randrange(self.keys)
                    rows.append((f"k{k}", self.next_seq[k]))
                    self.next_seq[k] += 1
                for key, seq in rows:
                    outbox.enqueue(conn, f"{key}:{seq}".encode(), key=key)
                if self.rng.random() < 0.2:
                    conn.rollback()
                    self.rolled_back += rows
                    continue
                try:
                    conn.commit()
                except psycopg.OperationalError:
                    self.unknown += rows
                    continue
                self.committed += rows
            except psycopg.OperationalError:  # the server went away before COMMIT: not committed
                self.errors += 1
                self.rolled_back += rows
                self.stop.wait(0.05)
            self.stop.wait(0.002)
        if conn is not None:
            conn.close()


class _Consumer(threading.Thread):
    """Drains the queue, recording each delivered body in delivery order."""

    def __init__(self, svc):
        super().__init__(daemon=True)
        self.svc, self.got, self.stop = svc, [], threading.Event()

    def run(self) -> None:
        with self.svc.connect() as q:
            while not self.stop.is_set():
                leases = q.dequeue_many("default", max_jobs=200, wait=0.2)
                if leases:
                    self.got += [lease.body.decode() for lease in leases]
                    q.ack_many(leases)


def test_relays_killed_mid_batch_deliver_every_committed_row_once_in_key_order(pg, pg_dsn, tmp):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    rng = random.Random(20261201)
    url = _url(pg, pg_dsn)
    outbox.install(pg_dsn)
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 30}}) as svc:
        producer, consumer = _Producer(pg_dsn, keys=8, seed=7), _Consumer(svc)
        relays = [_relay(svc, tmp, url) for _ in range(3)]
        kills = 0
        try:
            producer.start()
            consumer.start()
            while kills < 15:
                seen = len(consumer.got)
                wait_until(lambda: len(consumer.got) >= seen + rng.randint(5, 40), 60, 0.005,
                           "progress between kills")
                victim = _mid_batch(pg_dsn, relays) or rng.randrange(len(relays))
                relays[victim].send_signal(signal.SIGKILL)
                relays[victim].wait(20)
                kills += 1
                relays[victim] = _relay(svc, tmp, url)
            producer.stop.set()
            producer.join(20)
            wanted = len(producer.committed)
            wait_until(lambda: len(consumer.got) >= wanted, 60, 0.02, "every committed row")
            with psycopg.connect(pg_dsn) as conn:
                wait_until(lambda: conn.execute("SELECT count(*) FROM shardq_outbox").fetchone()[0] == 0,
                           30, 0.02, "an empty outbox")
            _wait_connected(pg_dsn, relays, "relays running")  # past their start: signals set
            for r in relays:  # SIGTERM: finish the batch, exit 0
                r.send_signal(signal.SIGTERM)
            assert [r.wait(20) for r in relays] == [0, 0, 0]
            consumer.stop.set()
            consumer.join(20)
        finally:
            producer.stop.set()
            consumer.stop.set()
            _kill(relays)
    got = consumer.got
    assert len(got) == len(set(got)), "a row delivered twice"
    assert sorted(got) == sorted(f"{k}:{s}" for k, s in producer.committed)
    assert not set(got) & {f"{k}:{s}" for k, s in producer.rolled_back}
    by_key: dict[str, list[int]] = {}
    for body in got:
        key, seq = body.split(":")
        by_key.setdefault(key, []).append(int(seq))
    assert all(seqs == sorted(seqs) for seqs in by_key.values())
    assert len(producer.rolled_back) > 0 and kills == 15
    with open(os.path.join(tmp, "relay.log")) as f:  # kills did land between send and commit
        assert f.read().count("row(s) again") >= 1


def test_postgresql_restarted_under_load_loses_and_duplicates_nothing(pg, pg_dsn, tmp):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _create_effects(pg_dsn)
    outbox.install(pg_dsn)
    url = _url(pg, pg_dsn)
    with Service(shards=2, config=CONFIG) as svc:
        producer = _Producer(pg_dsn, keys=6, seed=11)
        relays = [_relay(svc, tmp, url) for _ in range(2)]
        workers = [_worker(svc, tmp, url, _env()) for _ in range(2)]
        try:
            _wait_connected(pg_dsn, relays + workers, "relays and workers running")
            producer.start()
            for _ in range(2):
                done = len(_effects(pg_dsn))
                wait_until(lambda: len(_effects(pg_dsn)) >= done + 30, 60, 0.02, "work under way")
                pg.restart()  # SIGKILL the postmaster and start it again: crash recovery
            wait_until(lambda: len(producer.committed) > 0 and len(_effects(pg_dsn)) > done + 30,
                       60, 0.05, "work after the restart")
            producer.stop.set()
            producer.join(20)
            wanted = {f"{k}:{s}" for k, s in producer.committed}
            maybe = {f"{k}:{s}" for k, s in producer.unknown}

            def finished():
                have = {f"{k}:{s}" for _, k, s in _effects(pg_dsn)}
                return wanted <= have
            wait_until(finished, 90, 0.1, "every committed row's effect")
            with svc.connect() as q:
                wait_until(lambda: q.stats()["queues"]["default"]["in_flight"] == 0
                           and q.stats()["queues"]["default"]["ready"] == 0, 30, 0.05, "all acked")
            assert [p.poll() for p in relays + workers] == [None] * 4  # none gave up
        finally:
            producer.stop.set()
            _kill(relays + workers)
    rows = _effects(pg_dsn)
    _check_once_and_in_key_order(rows)
    have = [f"{k}:{s}" for _, k, s in rows]
    assert len(have) == len(set(have)), "a row became two jobs"
    assert wanted <= set(have) <= wanted | maybe
    assert not set(have) & {f"{k}:{s}" for k, s in producer.rolled_back}


def test_worker_with_a_bad_dsn_exits_with_a_clear_error(pg, tmp):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    with Service(shards=1) as svc:
        for url, code, what in [(pg.url("no_such_db"), 1, "StoreUnavailable"),
                                ("postgresql://postgres@127.0.0.1/x?nosuch=1", 5, "InvalidConfig")]:
            r = subprocess.run([sys.executable, "-m", "shardq.cli", "worker", "pg_handler:handle",
                                "--connect", svc.data_dir, "--idempotency", url], cwd=tmp, env=_env(),
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == code and f"error: {what}:" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
