"""The outbox against a real PostgreSQL and a real ``shardq serve``: enqueue in the caller's
transaction, the relay's exactly-once hand-over, per-key order across relays, the dedup
window, rejected rows, LISTEN/NOTIFY wake-ups."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from support.service import REPO, Service, wait_until
from shardq import limits, outbox
from shardq.errors import InvalidConfig, InvalidJob, OutboxBehind

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 30}}) as s:
        yield s


@pytest.fixture
def q(svc):
    with svc.connect() as client:
        _drain(client, "default")
        yield client


@pytest.fixture
def dsn(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    outbox.install(pg_dsn)
    return pg_dsn


def _drain(q, queue="default") -> list:
    """Lease and ack everything in ``queue``: leases in delivery order (per key: FIFO)."""
    got = []
    while True:
        leases = q.dequeue_many(queue, max_jobs=1000, wait=0.0)
        if not leases:
            return got
        got += leases
        q.ack_many(leases)


@contextlib.contextmanager
def _running(relay: outbox.Relay):
    """``relay.run()`` in a thread for the ``with`` block; then stopped, joined, closed.
    Yields a dict that holds the final counters (``"stats"``) once the block is left."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(stats=relay.run()))
    t.start()
    try:
        yield out
    finally:
        relay.stop()
        t.join(30)
        relay.close()


def _rows(dsn: str, table: str = "shardq_outbox") -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# ---------------------------------------------------------------------------- enqueue
def test_a_job_exists_if_and_only_if_the_transaction_commits(dsn, q):
    with psycopg.connect(dsn) as conn:
        row_id = outbox.enqueue(conn, b"receipt 1", key="order-1", priority=3)
        conn.commit()
        outbox.enqueue(conn, b"receipt 2 (rolled back)", key="order-2")
        conn.rollback()
    with psycopg.connect(dsn) as conn:
        with pytest.raises(ZeroDivisionError), conn.transaction():
            outbox.enqueue(conn, b"receipt 3 (rolled back)", key="order-3")
            1 / 0  # noqa: B018 - raises ZeroDivisionError inside the transaction on purpose
    relay = outbox.Relay(dsn, q)
    assert relay.run(until_idle=True).moved == 1
    relay.close()
    (lease,) = _drain(q)
    assert (lease.body, lease.key, lease.queue) == (b"receipt 1", "order-1", "default")
    assert _rows(dsn) == 0 and isinstance(row_id, int)


def test_delay_counts_from_the_insert_and_priority_and_queue_are_kept(dsn, q):
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"later", queue="mail", delay=1.5, priority=-7)
    t0 = time.monotonic()
    relay = outbox.Relay(dsn, q)
    relay.run(until_idle=True)
    relay.close()
    assert q.dequeue("mail") is None  # still delayed
    lease = q.dequeue("mail", wait=5.0)
    assert lease is not None and lease.body == b"later" and time.monotonic() - t0 < 5
    q.ack(lease)


@pytest.mark.parametrize("kwargs, match", [
    ({"body": b""}, "empty"),
    ({"body": "text"}, "bytes"),
    ({"body": b"x" * (limits.BODY_BYTES_MAX_CEILING + 1)}, "limit"),
    ({"key": ""}, "empty"),
    ({"key": "k" * (limits.KEY_BYTES_MAX + 1)}, "key"),
    ({"queue": ""}, "queue"),
    ({"queue": "q" * (limits.QUEUE_NAME_BYTES_MAX + 1)}, "queue"),
    ({"delay": -1}, "delay"),
    ({"delay": limits.DELAY_S_MAX + 1}, "delay"),
    ({"priority": limits.PRIORITY_MAX + 1}, "priority"),
])
def test_bad_jobs_are_refused_in_the_callers_transaction(dsn, kwargs, match):
    args = {"body": b"ok", **kwargs}
    with psycopg.connect(dsn) as conn:
        with pytest.raises(InvalidJob, match=match):
            outbox.enqueue(conn, args.pop("body"), **args)
        outbox.enqueue(conn, b"still usable")  # the transaction is intact
    assert _rows(dsn) == 1


def test_a_missing_table_is_a_clear_error(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    with psycopg.connect(pg_dsn) as conn, pytest.raises(InvalidConfig, match="outbox init"):
        outbox.enqueue(conn, b"x")


def test_sqlalchemy_session_and_connection(dsn, q, pg):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session
    name = dsn.rsplit("dbname=", 1)[1]
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/{name}?host={pg.dir}&port={pg.port}")
    try:
        with Session(engine) as session:
            outbox.enqueue(session, b"via session", key="s")
            session.commit()
            outbox.enqueue(session, b"rolled back", key="s")
            session.rollback()
        with engine.begin() as conn:
            outbox.enqueue(conn, b"via connection", key="s")
    finally:
        engine.dispose()
    relay = outbox.Relay(dsn, q)
    relay.run(until_idle=True)
    relay.close()
    assert [lease.body for lease in _drain(q)] == [b"via session", b"via connection"]


# ---------------------------------------------------------------------------- relay
class _Crash(BaseException):
    """The relay process 'dies' here (BaseException: nothing catches it)."""


class _CrashAfterSend:
    """A queue that enqueues, then kills the relay before it can commit its deletes."""

    def __init__(self, q):
        self._q = q

    def enqueue_many(self, jobs, queue="default"):
        self._q.enqueue_many(jobs, queue)
        raise _Crash()

    def __getattr__(self, name):
        return getattr(self._q, name)


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_a_relay_dying_after_the_send_is_deduplicated_by_the_next(dsn, q, keyed):
    """The resend meets the first send's dedup ids on two shards, keyless rows too (their
    dedup ids place them, not a turn of the router that happens to send them)."""
    with psycopg.connect(dsn) as conn:
        for i in range(5):
            outbox.enqueue(conn, f"job {i}".encode(), key=f"k{i % 2}" if keyed else None)
    dying = outbox.Relay(dsn, _CrashAfterSend(q), batch_rows=3)
    with pytest.raises(_Crash):
        dying.relay_batch()
    dying.close()  # its connection drops: the server rolls its transaction back
    assert _rows(dsn) == 5 and _rows(dsn, "shardq_outbox_attempts") == 3
    relay = outbox.Relay(dsn, q, batch_rows=3)
    stats = relay.run(until_idle=True)
    relay.close()
    assert stats.moved == 5 and stats.resent == 3
    bodies = sorted(lease.body for lease in _drain(q))
    assert bodies == [f"job {i}".encode() for i in range(5)]  # none twice
    assert _rows(dsn) == 0 and _rows(dsn, "shardq_outbox_attempts") == 0


def test_a_resend_older_than_the_dedup_window_stops_the_relay_loudly(dsn, q):
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"sent, then the relay died", key="k")
    dying = outbox.Relay(dsn, _CrashAfterSend(q))
    with pytest.raises(_Crash):
        dying.relay_batch()
    dying.close()
    with psycopg.connect(dsn) as conn:  # ... and stayed down for longer than the window (300 s)
        conn.execute("UPDATE shardq_outbox_attempts SET first_at = first_at - interval '271 seconds'")
    relay = outbox.Relay(dsn, q)
    with pytest.raises(OutboxBehind, match="dedup window") as info:
        relay.run(until_idle=True)
    relay.close()
    assert "shardq_outbox_attempts" in str(info.value)
    assert _rows(dsn) == 1  # nothing was sent again
    r = subprocess.run([sys.executable, "-m", "shardq.cli", "outbox", "relay", "--dsn", dsn,
                        "--connect", q.data_dir], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "error: OutboxBehind:" in r.stderr and "Traceback" not in r.stderr
    _drain(q)


class _Window:
    """The queue, with its dedup window as the service says it now (a reload changes it)."""

    def __init__(self, q, window: float):
        self._q, self.window = q, window

    def queue_config(self, queue="default"):
        return dict(self._q.queue_config(queue), dedup_window=self.window)

    def __getattr__(self, name):
        return getattr(self._q, name)


def _sent_then_died(dsn, q, body: bytes, age_s: int) -> None:
    """A row sent by a relay that died before it deleted it, ``age_s`` seconds ago."""
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, body, key="k")
    dying = outbox.Relay(dsn, _CrashAfterSend(q))
    with pytest.raises(_Crash):
        dying.relay_batch()
    dying.close()
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE shardq_outbox_attempts SET first_at = first_at - make_interval(secs => %s)",
                     (age_s,))


def test_a_relay_sees_a_dedup_window_lowered_while_it_runs(dsn, q):
    """A long-lived relay asks the queue for its window at each resend: one lowered by a
    reload since its last resend stops it, where the window it saw first would let it send
    a row the queue may no longer deduplicate."""
    windowed = _Window(q, 300)
    relay = outbox.Relay(dsn, windowed)
    _sent_then_died(dsn, q, b"first", 0)
    assert relay.relay_batch() == 1 and relay.stats.resent == 1    # young: sent again, deduplicated
    _sent_then_died(dsn, q, b"second", 200)                         # 200 s: within 300 - 30
    windowed.window = 120                                           # the reload: 120 - 12 covers 108 s
    with pytest.raises(OutboxBehind, match="dedup window"):
        relay.relay_batch()
    relay.close()
    assert _rows(dsn) == 1  # the old row was not sent again
    assert [lease.body for lease in _drain(q)] == [b"first", b"second"]  # each once: the crashed sends


def test_a_queue_whose_dedup_window_is_too_short_is_refused(pg_dsn, tmp_path):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    outbox.install(pg_dsn)
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, b"x", queue="short")
    dying = None
    with Service(shards=1, config={"queues": {"short": {"dedup_window": 20}}}) as svc, svc.connect() as q:
        dying = outbox.Relay(pg_dsn, _CrashAfterSend(q))
        with pytest.raises(_Crash):
            dying.relay_batch()
        dying.close()
        relay = outbox.Relay(pg_dsn, q)
        with pytest.raises(InvalidConfig, match="dedup_window"):
            relay.relay_batch()
        relay.close()


def test_rows_the_queue_refuses_go_to_the_rejected_table_and_the_rest_flow(dsn, q):
    limit = q.queue_config("default")["max_body_bytes"]
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"a" * limit, key="k")           # at the queue's limit: fine
        outbox.enqueue(conn, b"b" * (limit + 1), key="k")     # over it: only the service knows
        outbox.enqueue(conn, b"c", key="k")
    relay = outbox.Relay(dsn, q)
    stats = relay.run(until_idle=True)
    relay.close()
    assert (stats.moved, stats.rejected) == (2, 1)
    assert [lease.body for lease in _drain(q)] == [b"a" * limit, b"c"]
    with psycopg.connect(dsn) as conn:
        (err,) = conn.execute("SELECT error FROM shardq_outbox_rejected").fetchone()
    assert err.startswith("InvalidJob") and _rows(dsn) == 0


def test_batches_are_cut_by_body_bytes_too(dsn, q, monkeypatch):
    monkeypatch.setattr(outbox.relay, "BATCH_BYTES_MAX", 2500)
    with psycopg.connect(dsn) as conn:
        for i in range(6):
            outbox.enqueue(conn, bytes([65 + i]) * 1000)  # keyless
    relay = outbox.Relay(dsn, q)
    assert [relay.relay_batch() for _ in range(4)] == [2, 2, 2, 0]
    relay.close()
    assert len(_drain(q)) == 6


class _Held:
    """A queue whose enqueue_many waits until released: a relay paused mid-batch."""

    def __init__(self, q):
        self._q, self.entered, self.release = q, threading.Event(), threading.Event()

    def enqueue_many(self, jobs, queue="default"):
        self.entered.set()
        assert self.release.wait(20)
        return self._q.enqueue_many(jobs, queue)

    def __getattr__(self, name):
        return getattr(self._q, name)


def test_two_relays_keep_per_key_order(dsn, q):
    with psycopg.connect(dsn) as conn:
        for i in range(6):
            outbox.enqueue(conn, f"a{i}".encode(), key="a")
        outbox.enqueue(conn, b"b0", key="b")
    held = _Held(q)
    first = outbox.Relay(dsn, held, batch_rows=3)  # holds a0..a2 mid-batch
    t = threading.Thread(target=first.relay_batch)
    t.start()
    try:
        assert held.entered.wait(20)
        second = outbox.Relay(dsn, q)
        assert second.relay_batch() == 1  # b0 only: a3.. wait behind a0..a2
        assert [lease.body for lease in _drain(q)] == [b"b0"]
    finally:
        held.release.set()
        t.join(20)
    first.close()
    assert second.run(until_idle=True).moved == 1 + 3  # counters add up over calls
    second.close()
    order = [lease.body for lease in _drain(q)]
    assert order == [f"a{i}".encode() for i in range(6)]


def test_a_row_held_by_another_relay_cuts_the_key_there(dsn, q):
    with psycopg.connect(dsn) as conn:
        for i in range(3):
            outbox.enqueue(conn, f"a{i}".encode(), key="a")
    # Another relay holds a1 (it took a1 while a0's transaction had not committed yet).
    other = psycopg.connect(dsn)
    try:
        other.execute("SELECT 1 FROM shardq_outbox WHERE body = 'a1' FOR UPDATE")
        relay = outbox.Relay(dsn, q)
        assert relay.relay_batch() == 1  # a0; not a2, which must wait for a1
        assert [lease.body for lease in _drain(q)] == [b"a0"]
    finally:
        other.close()
    assert relay.run(until_idle=True).moved == 1 + 2
    relay.close()
    assert [lease.body for lease in _drain(q)] == [b"a1", b"a2"]


def test_a_notification_wakes_the_relay_without_polling(dsn, svc):
    with svc.connect() as rq, svc.connect() as q:
        relay = outbox.Relay(dsn, rq, poll_s=600)
        with _running(relay) as out:
            wait_until(lambda: relay.waiting, 20, 0.005, "the relay asleep on the channel")
            t0 = time.monotonic()
            with psycopg.connect(dsn) as conn:
                outbox.enqueue(conn, b"wake up", key="w")
            lease = q.dequeue(wait=10)
            assert lease is not None and lease.body == b"wake up"
            assert time.monotonic() - t0 < 5  # far under poll_s
            q.ack(lease)
    assert out["stats"].moved == 1


def test_status_and_init_commands(dsn, q):
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"x")
    run = lambda *a: subprocess.run([sys.executable, "-m", "shardq.cli", "outbox", *a, "--dsn", dsn],  # noqa: E731 - a one-line local helper
                                    capture_output=True, text=True, timeout=60, cwd=REPO)
    r = run("init")
    assert r.returncode == 0 and '"scope"' in r.stdout
    r = run("status")
    assert r.returncode == 0 and '"pending": 1' in r.stdout
    r = run("status", "--table", "Bad-Name")
    assert r.returncode == 5 and "error: InvalidConfig" in r.stderr
    relay = outbox.Relay(dsn, q)
    relay.run(until_idle=True)
    relay.close()
    _drain(q)


def test_bad_dsn_for_the_relay_is_a_clear_error(q, pg):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    base = [sys.executable, "-m", "shardq.cli", "outbox", "relay", "--connect", q.data_dir, "--dsn"]
    for dsn, code, what in [("host=/tmp port=x y", 5, "InvalidConfig: outbox relay"),
                            (pg.dsn("no_such_db"), 1, "StoreUnavailable")]:
        r = subprocess.run(base + [dsn], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == code and f"error: {what}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------- limits at their maximum
def test_key_and_queue_name_at_their_limits_go_through(dsn, q):
    key, queue = "k" * limits.KEY_BYTES_MAX, "q" * limits.QUEUE_NAME_BYTES_MAX
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"long names", key=key, queue=queue, priority=limits.PRIORITY_MAX)
    relay = outbox.Relay(dsn, q)
    assert relay.run(until_idle=True).moved == 1
    relay.close()
    lease = q.dequeue(queue)
    assert (lease.key, lease.queue, lease.body) == (key, queue, b"long names")
    q.ack(lease)


def test_a_full_batch_of_the_maximum_size_moves_in_one_transaction(dsn, q):
    n = outbox.relay.BATCH_ROWS_MAX
    with psycopg.connect(dsn) as conn:  # rows as enqueue writes them, 200 keys
        conn.execute("INSERT INTO shardq_outbox (queue, key, body) SELECT 'default', 'k' || (g %% 200), "
                     "convert_to(g::text, 'UTF8') FROM generate_series(1, %s) g", (n,))
    relay = outbox.Relay(dsn, q, batch_rows=n)
    assert relay.relay_batch() == n
    relay.close()
    got = _drain(q)
    assert sorted(int(lease.body) for lease in got) == list(range(1, n + 1))
    by_key: dict[str, list[int]] = {}
    for lease in got:
        by_key.setdefault(lease.key, []).append(int(lease.body))
    assert all(v == sorted(v) for v in by_key.values()) and len(by_key) == 200
    with pytest.raises(InvalidConfig, match="batch_rows"):
        outbox.Relay(dsn, q, batch_rows=n + 1)


def test_rows_held_back_by_a_brief_lock_go_soon_without_a_notification(dsn, svc):
    """Another relay's empty batch can lock rows briefly and commits without a NOTIFY; a
    relay whose batch had to hold rows back looks again soon, not after poll_s."""
    with psycopg.connect(dsn) as conn:
        for i in range(3):
            outbox.enqueue(conn, f"h{i}".encode(), key="h")
    other = psycopg.connect(dsn)
    other.execute("SELECT 1 FROM shardq_outbox WHERE body = 'h0' FOR UPDATE")  # like a relay's batch
    try:
        with svc.connect() as rq, svc.connect() as q:
            relay = outbox.Relay(dsn, rq, poll_s=600)
            with _running(relay) as out:
                wait_until(lambda: relay._held > 0, 20, 0.01, "h1, h2 held back behind h0")
                other.rollback()  # the lock goes away, and nothing is notified
                t0 = time.monotonic()
                got = []
                wait_until(lambda: got.extend(_drain(q)) or len(got) == 3, 10, 0.01, "all three")
                assert time.monotonic() - t0 < 5
                assert [lease.body for lease in got] == [b"h0", b"h1", b"h2"]
    finally:
        other.close()
    assert out["stats"].moved == 3


def test_a_shard_killed_under_the_relay_loses_and_duplicates_nothing(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    import os
    import signal
    from support.service import restarted
    outbox.install(pg_dsn)
    with Service(shards=2) as svc, svc.connect(retry_s=1.0) as rq, svc.connect() as q:
        got = []
        with _running(outbox.Relay(pg_dsn, rq, batch_rows=50)):
            with psycopg.connect(pg_dsn) as conn:
                for round_ in range(3):
                    for i in range(100):
                        outbox.enqueue(conn, f"{round_}:{i}".encode(), key=f"k{i % 7}")
                        conn.commit()
                    pid = svc.shard_pids()[round_ % 2]
                    os.kill(pid, signal.SIGKILL)  # mid-stream: sends fail or land, unanswered
                    restarted(svc, round_ % 2, pid)
            wait_until(lambda: got.extend(_drain(q)) or len(got) >= 300, 60, 0.02, "every row")
        got += _drain(q)  # anything sent twice would be here
        assert _rows(pg_dsn) == 0
    bodies = [lease.body.decode() for lease in got]
    assert sorted(bodies) == sorted(f"{r}:{i}" for r in range(3) for i in range(100))
    by_key: dict[str, list[tuple[int, int]]] = {}
    for lease in got:
        r, i = map(int, lease.body.decode().split(":"))
        by_key.setdefault(lease.key, []).append((r, i))
    assert all(v == sorted(v) for v in by_key.values())


# ---------------------------------------------------------------------------- refusals (issue 32 §4)
SQS_CONFIG = {"queues": {"default": {"visibility_timeout": 30, "max_deliveries": 5}}}


def test_rows_the_sqs_backend_refuses_are_rejected_and_the_rows_behind_them_move(dsn, moto):
    """On SQS a delay or a priority is Unsupported; the relay used to stop on it, and meet
    the same row first again after every restart."""
    from support.sqs_server import fresh_target
    import shardq
    with psycopg.connect(dsn) as conn:  # no relay ran yet: enqueue cannot know the target
        outbox.enqueue(conn, b"urgent", key="k", priority=5)
        outbox.enqueue(conn, b"later", key="k", delay=600)
        outbox.enqueue(conn, b"after", key="k")
        outbox.enqueue(conn, b"other", key="j")
    with shardq.connect(fresh_target(moto, SQS_CONFIG)) as sqs:
        relay = outbox.Relay(dsn, sqs)
        stats = relay.run(until_idle=True)
        relay.close()
        assert (stats.moved, stats.rejected) == (2, 2)
        got = []
        while len(got) < 2:
            for lease in sqs.dequeue_many(max_jobs=10, wait=1):
                got.append(lease.body)
                sqs.ack(lease)
        assert sorted(got) == [b"after", b"other"]
    with psycopg.connect(dsn) as conn:
        errors = dict(conn.execute("SELECT body, error FROM shardq_outbox_rejected").fetchall())
    assert sorted(errors) == [b"later", b"urgent"] and _rows(dsn) == 0
    assert errors[b"urgent"].startswith("Unsupported") and "priority" in errors[b"urgent"]
    assert errors[b"later"].startswith("Unsupported") and "delay" in errors[b"later"]


def test_enqueue_refuses_what_the_relays_queue_cannot_hold(dsn, q, moto):
    from support.sqs_server import fresh_target
    import shardq
    with shardq.connect(fresh_target(moto, SQS_CONFIG)) as sqs:
        relay = outbox.Relay(dsn, sqs)
        relay.run(until_idle=True)  # records what SQS refuses
        relay.close()
    with psycopg.connect(dsn) as conn:
        for kwargs, match in (({"priority": 1}, "priority.*sqs backend"), ({"delay": 5}, "delay.*sqs backend")):
            with pytest.raises(shardq.Unsupported, match=match):
                outbox.enqueue(conn, b"x", key="k", **kwargs)
        outbox.enqueue(conn, b"plain", key="k")  # the transaction is intact
    assert _rows(dsn) == 1
    relay = outbox.Relay(dsn, q)  # a relay to the shards, which hold both
    relay.run(until_idle=True)
    relay.close()
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, b"prioritised", priority=3, delay=0.1)
    assert _rows(dsn) == 1
    _drain(q)


def test_a_user_who_may_not_read_the_meta_table_enqueues_and_the_relay_checks(dsn, moto, pg):  # noqa: F811
    """The target's refusals are read from <table>_meta; an application user who may only
    insert into the outbox is not refused there (nor is its transaction broken), and the
    relay rejects the row instead."""
    from support.sqs_server import fresh_target
    import shardq
    role = "app_" + dsn.rsplit("dbname=", 1)[1]  # roles are per server: one per test database
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}"')
        admin.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        admin.execute(f'GRANT INSERT, SELECT (id) ON shardq_outbox TO "{role}"')  # SELECT: RETURNING id
    with shardq.connect(fresh_target(moto, SQS_CONFIG)) as sqs:
        relay = outbox.Relay(dsn, sqs)
        relay.run(until_idle=True)
        with psycopg.connect(dsn) as conn:
            conn.execute(f'SET ROLE "{role}"')
            outbox.enqueue(conn, b"urgent", key="k", priority=5)
            outbox.enqueue(conn, b"plain", key="k")
        stats = relay.run(until_idle=True)
        relay.close()
        assert (stats.moved, stats.rejected) == (1, 1)
