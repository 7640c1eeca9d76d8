"""The outbox relay across outages of the queue, against a real PostgreSQL and a real
``shardq serve``: rows a relay never got into the queue are safe at any age (a mark of an
attempt that no request carried is dropped), rows a shard that is up took leave at once,
and attempt marks whose rows were deleted by hand are neither counted nor kept.

An outage longer than the dedup window is made by ageing the attempt marks in SQL (the
relay reads ages from the database's clock), not by waiting."""
from __future__ import annotations

import contextlib
import os
import signal

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from support.service import Service, alive, restarted, wait_until
from shardq import limits, outbox
from shardq.outbox import sending
from shardq.client.routing import cut_requests, job_item, shard_for_key, shard_of_job
from shardq.clock import FakeClock
from shardq.errors import OutboxBehind, OutcomeUnknown, ShardUnavailable

psycopg = pytest.importorskip("psycopg")

WINDOW = {"queue_defaults": {"dedup_window": 60}}  # the relay resends a row first sent up to 50 s ago
OUTAGE = "65 seconds"                              # longer than that


@pytest.fixture
def dsn(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    outbox.install(pg_dsn)
    return pg_dsn


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def _age_marks(dsn: str, by: str) -> None:
    """Every attempt mark ``by`` older: what an outage of that length does to them."""
    with psycopg.connect(dsn) as conn:
        conn.execute(f"UPDATE shardq_outbox_attempts SET first_at = first_at - interval '{by}'")


def _enqueue(dsn: str, rows: list[tuple[bytes, str | None]]) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [outbox.enqueue(conn, body, key=key) for body, key in rows]


def _drain(q) -> list[bytes]:
    got = []
    while leases := q.dequeue_many(max_jobs=1000):
        got += [lease.body for lease in leases]
        q.ack_many(leases)
    return got


def _keys_on(shard: int, n: int, shards: int = 2) -> list[str]:
    return [k for k in (f"key{i}" for i in range(1000)) if shard_for_key(k, shards) == shard][:n]


def test_rows_never_sent_during_a_queue_outage_longer_than_the_window_are_sent_after_it(dsn):
    """The service stopped for longer than the dedup window while rows waited, over both
    shards and keyless ones: each try fails before anything is written, its marks are
    dropped, and the rows go once the service is back (a relay used to stop with
    OutboxBehind, naming rows it had never sent)."""
    with Service(shards=2, config=WINDOW) as svc, svc.connect(retry_s=0.5, request_timeout_s=2) as q:
        relay = outbox.Relay(dsn, q)
        _enqueue(dsn, [(b"before", "k")])
        assert relay.relay_batch() == 1  # connected, and the queue's placement learnt
        svc.stop()
        rows = [(f"r{i}".encode(), key) for i, key in enumerate(["a", "b", "c", "d", None, None])]
        _enqueue(dsn, rows)
        for _ in range(2):  # the tries of the relay's loop
            with pytest.raises(ShardUnavailable) as info:
                relay.relay_batch()
            assert not isinstance(info.value, OutcomeUnknown)
            assert _count(dsn, "shardq_outbox_attempts") == 0  # nothing was sent: nothing counts as sent
        _age_marks(dsn, OUTAGE)
        assert outbox.status(dsn)["attempted"] == 0
        svc.start()
        stats = relay.run(until_idle=True)
        relay.close()
        assert (stats.moved, stats.resent) == (1 + 6, 0)  # (counted since the relay was made)
        assert sorted(_drain(q)) == sorted([b"before"] + [body for body, _ in rows])  # each once
    assert _count(dsn, "shardq_outbox") == 0 and _count(dsn, "shardq_outbox_attempts") == 0


@contextlib.contextmanager
def _shard_down(svc: Service, shard: int):
    """Shard ``shard`` killed and kept down (its supervisor stopped) for the block: its
    socket refuses connections, the other shard answers. Restarted after it."""
    pid = svc.shard_pids()[shard]
    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not alive(pid), 10, 0.01, f"shard {shard} dead")
        yield
    finally:
        os.kill(svc.proc.pid, signal.SIGCONT)
    restarted(svc, shard, pid)


def test_one_shard_down_moves_the_other_shards_rows_and_marks_none_of_its_own(dsn):
    """A batch over two shards, one of them down: the rows of the shard that is up are
    deleted as it takes them, those of the one that is down are left unmarked, and go once
    it is back, however long that took."""
    up, down = _keys_on(0, 3), _keys_on(1, 3)
    with Service(shards=2, config=WINDOW) as svc, svc.connect(retry_s=0.5, request_timeout_s=2) as q:
        relay = outbox.Relay(dsn, q)
        _enqueue(dsn, [(b"before", up[0])])
        assert relay.relay_batch() == 1
        first = _enqueue(dsn, [(f"up{i}".encode(), k) for i, k in enumerate(up)])
        second = _enqueue(dsn, [(f"down{i}".encode(), k) for i, k in enumerate(down)])
        with _shard_down(svc, 1):
            with pytest.raises(ShardUnavailable) as info:
                relay.relay_batch()
            assert not isinstance(info.value, OutcomeUnknown)
            with psycopg.connect(dsn) as conn:
                left = [r[0] for r in conn.execute("SELECT id FROM shardq_outbox ORDER BY id")]
            assert left == second                                # shard 0 took its rows: deleted
            assert _count(dsn, "shardq_outbox_attempts") == 0    # shard 1 took none: none marked
            assert relay.stats.moved == 1 + 3
            _age_marks(dsn, OUTAGE)
        stats = relay.run(until_idle=True)
        relay.close()
        assert (stats.moved, stats.resent) == (1 + 3 + 3, 0)
        got = _drain(q)
        assert sorted(got) == sorted([b"before"] + [f"up{i}".encode() for i in range(3)]
                                     + [f"down{i}".encode() for i in range(3)])
    assert first and _count(dsn, "shardq_outbox") == 0


def test_a_send_that_may_have_landed_still_counts_as_sent(dsn):
    """OutcomeUnknown (the request was written, no reply came) proves nothing: the mark
    stays, and a resend past the window stops the relay as before."""
    class _Lost:
        def __init__(self, q):
            self._q = q

        def enqueue_many(self, jobs, queue="default"):
            self._q.enqueue_many(jobs, queue)
            raise OutcomeUnknown("shard 0: enqueue was sent but the connection broke before its reply")

        def __getattr__(self, name):
            return getattr(self._q, name)

    with Service(shards=1, config=WINDOW) as svc, svc.connect() as q:
        _enqueue(dsn, [(b"landed", "k")])
        lossy = outbox.Relay(dsn, _Lost(q))
        with pytest.raises(OutcomeUnknown):
            lossy.relay_batch()
        lossy.close()
        assert _count(dsn, "shardq_outbox_attempts") == 1
        _age_marks(dsn, OUTAGE)
        relay = outbox.Relay(dsn, q)
        with pytest.raises(OutboxBehind):
            relay.relay_batch()
        relay.close()
        assert _drain(q) == [b"landed"]  # once: the first send's


def test_a_relay_batch_is_one_request_per_shard_at_the_limits():
    """A shard's part of the largest batch the relay sends, with the longest names, fits
    one enqueue request: one request's error is that group's outcome (sending.py)."""
    n, body = outbox.relay.BATCH_ROWS_MAX, outbox.relay.BATCH_BYTES_MAX // outbox.relay.BATCH_ROWS_MAX
    key, queue = "k" * limits.KEY_BYTES_MAX, "q" * limits.QUEUE_NAME_BYTES_MAX
    dedup = f"outbox:{'0' * 32}:{2**63 - 1}"
    items = [job_item(b"x" * body, key, queue, 0, 0, dedup) for _ in range(n)]
    assert len(list(cut_requests(items))) == 1


# ---------------------------------------------------------------------------- attempt marks of rows deleted by hand
def test_rows_dropped_after_outbox_behind_leave_no_marks_counted_or_kept(dsn):
    """The documented recovery deleted the outbox rows: their marks are not counted by
    status (they used to be, for good, with a growing oldest_attempt_s) and a relay removes
    them, at its first batch and, running, every ORPHANS_S."""
    with Service(shards=1, config=WINDOW) as svc, svc.connect() as q:
        ids = _enqueue(dsn, [(b"r0", "k"), (b"r1", "k")])
        with psycopg.connect(dsn) as conn:  # as a relay that died after its send, 100 s ago
            conn.execute("INSERT INTO shardq_outbox_attempts SELECT unnest(%s::bigint[]), "
                         "clock_timestamp() - interval '100 s'", (ids,))
        clock = FakeClock()
        relay = outbox.Relay(dsn, q, clock=clock)  # in a process that keeps it after the error
        with pytest.raises(OutboxBehind):
            relay.relay_batch()
        with psycopg.connect(dsn) as conn:  # "yes: drop them", as it was documented
            conn.execute("DELETE FROM shardq_outbox WHERE id = ANY(%s)", (ids,))
        st = outbox.status(dsn)
        assert (st["pending"], st["attempted"], st["oldest_attempt_s"]) == (0, 0, None)
        clock.advance(outbox.relay.ORPHANS_S)
        _enqueue(dsn, [(b"later", "k")])
        assert relay.relay_batch() == 1
        relay.close()
        assert _count(dsn, "shardq_outbox_attempts") == 0
        assert _drain(q) == [b"later"]


def test_a_new_relay_removes_marks_of_deleted_rows_at_its_first_batch(dsn):
    ids = _enqueue(dsn, [(b"r0", None)])
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO shardq_outbox_attempts SELECT unnest(%s::bigint[]), clock_timestamp()", (ids,))
        conn.execute("DELETE FROM shardq_outbox")
    with Service(shards=1) as svc, svc.connect() as q:
        relay = outbox.Relay(dsn, q)
        assert relay.relay_batch() == 0
        relay.close()
    assert _count(dsn, "shardq_outbox_attempts") == 0


def test_the_relays_groups_are_where_the_router_places_the_jobs(dsn):
    """The relay groups a batch by shard with the router's ``route`` (keyless rows by their
    dedup id); the ids that come back say where the jobs went."""
    with Service(shards=3) as svc, svc.connect() as q:
        jobs = [{"body": b"x", "queue": "default", "key": key, "dedup_id": f"outbox:t:{i}"}
                for i, key in enumerate(["a", "b", None, "c", None, None, "a", None])]
        groups = sending.placement(q, jobs)
        assert len(groups) == 3 and all(shard is not None for shard, _ in groups)
        for shard, idx in groups:
            assert {shard_of_job(j) for j in q.enqueue_many([jobs[i] for i in idx])} == {shard}
        _drain(q)
