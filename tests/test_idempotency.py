"""Idempotency stores: one contract suite for MemoryStore and SqliteStore, then SQLite specifics."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from shardq.consumer import idempotency
from shardq.clock import FakeClock
from shardq.errors import Closed, InvalidConfig, InvalidJob
from shardq.consumer.idempotency import MemoryStore, SqliteStore

DAY = 86400.0


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    stores = []

    def make(**kw):
        if request.param == "memory":
            store = MemoryStore(**kw)
        else:
            store = SqliteStore(tmp_path / "idem.sqlite", **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


# ---------------------------------------------------------------------------- contract
def test_claim_once_then_seen(make_store):
    store = make_store()
    assert not store.seen(7)
    with store.transaction() as txn:
        assert txn.claim(7)
        assert not txn.claim(7)  # twice in one transaction: the second is a duplicate
    assert store.seen(7)
    with store.transaction() as txn:
        assert not txn.claim(7)
        assert txn.claim(8)
    assert store.seen(8)


def test_exception_rolls_back_the_claim(make_store):
    store = make_store()
    with pytest.raises(ZeroDivisionError):
        with store.transaction() as txn:
            assert txn.claim(1)
            1 / 0
    assert not store.seen(1)
    with store.transaction() as txn:
        assert txn.claim(1)  # free again
    assert store.seen(1)


def test_abort_rolls_back_the_claim(make_store):
    store = make_store()
    with store.transaction() as txn:
        assert txn.claim(2)
        txn.abort()
    assert not store.seen(2)


def test_prune_after_retention(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)  # default retention: 7 days
    for job_id in (1, 2):
        with store.transaction() as txn:
            txn.claim(job_id)
        clock.advance(DAY)
    assert store.prune(clock.now()) == 0          # 2 days and 1 day old
    clock.advance(5.5 * DAY)
    assert store.prune(clock.now()) == 1          # job 1 is 7.5 days old, job 2 6.5
    assert not store.seen(1) and store.seen(2)
    clock.advance(DAY)
    assert store.prune(clock.now()) == 1
    assert not store.seen(2)


def test_retention_is_configurable(make_store):
    clock = FakeClock()
    store = make_store(clock=clock, retention_s=60.0)
    with store.transaction() as txn:
        txn.claim(3)
    clock.advance(59)
    assert store.prune(clock.now()) == 0
    clock.advance(2)
    assert store.prune(clock.now()) == 1


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, "", "x" * 1025, b"1", None, True])
def test_bad_job_ids(make_store, bad):
    store = make_store()
    with pytest.raises(InvalidJob):
        store.seen(bad)
    with store.transaction() as txn, pytest.raises(InvalidJob):
        txn.claim(bad)


def test_concurrent_claims_of_one_id_one_wins(make_store):
    store = make_store()
    barrier = threading.Barrier(8)
    wins = []

    def claim():
        barrier.wait(5)
        with store.transaction() as txn:
            if txn.claim(42):
                wins.append(threading.get_ident())

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wins) == 1


def test_claim_waits_for_an_open_claim_and_wins_after_its_rollback(make_store):
    store = make_store()
    claimed, release, got = threading.Event(), threading.Event(), []

    def first():
        with store.transaction() as txn:
            txn.claim(5)
            claimed.set()
            release.wait(5)
            txn.abort()

    def second():
        with store.transaction() as txn:
            got.append(txn.claim(5))

    t1 = threading.Thread(target=first)
    t1.start()
    assert claimed.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join(0.05)
    assert t2.is_alive() and got == []  # blocked behind the open claim
    release.set()
    t1.join(5)
    t2.join(5)
    assert got == [True]
    assert store.seen(5)


def test_closed_store_refuses(make_store):
    store = make_store()
    store.close()
    with pytest.raises(Closed):
        store.seen(1)
    with pytest.raises(Closed):
        with store.transaction():
            pass


# ---------------------------------------------------------------------------- memory
def test_memory_db_is_staged_until_commit():
    store = MemoryStore()
    store.data["old"] = 1
    with store.transaction() as txn:
        txn.db["a"] = 1
        del txn.db["old"]
        assert dict(txn.db) == {"a": 1}
        assert store.data == {"old": 1}  # nothing visible outside yet
    assert store.data == {"a": 1}
    with pytest.raises(RuntimeError):
        with store.transaction() as txn:
            txn.db["b"] = 2
            txn.claim(1)
            raise RuntimeError
    assert store.data == {"a": 1} and not store.seen(1)


def test_memory_store_cannot_cross_processes():
    with pytest.raises(TypeError):
        MemoryStore().reopen_spec()


# ---------------------------------------------------------------------------- sqlite
@pytest.fixture
def sqlite_store(tmp_path):
    store = SqliteStore(tmp_path / "idem.sqlite")
    yield store
    store.close()


def test_sqlite_settings(sqlite_store):
    with sqlite_store.transaction() as txn:
        assert txn.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert txn.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_sqlite_unique_constraint(sqlite_store):
    with sqlite_store.transaction() as txn:
        txn.claim(9)
    with pytest.raises(sqlite3.IntegrityError):
        with sqlite_store.transaction() as txn:
            txn.db.execute("INSERT INTO shardq_processed(job_id, processed_at) VALUES (9, 0)")


def _effects(path) -> list[tuple]:
    conn = sqlite3.connect(path)  # a separate connection: only committed data is visible
    try:
        return conn.execute("SELECT job_id, what FROM effect ORDER BY job_id").fetchall()
    finally:
        conn.close()


def test_sqlite_effect_and_mark_commit_together_or_not_at_all(tmp_path):
    path = tmp_path / "idem.sqlite"
    store = SqliteStore(path)
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, what TEXT)")
    with pytest.raises(ValueError):
        with store.transaction() as txn:
            txn.db.execute("INSERT INTO effect VALUES (1, 'x')")
            txn.claim(1)
            raise ValueError("handler failed after writing")
    assert _effects(path) == [] and not store.seen(1)
    with store.transaction() as txn:
        txn.db.execute("INSERT INTO effect VALUES (1, 'y')")
        assert txn.claim(1)
    store.close()
    reopened = SqliteStore(path)  # durable: a new store (and connection) sees both
    assert reopened.seen(1) and _effects(path) == [(1, "y")]
    reopened.close()


def test_sqlite_commit_inside_handler_is_refused(sqlite_store):
    with pytest.raises(RuntimeError, match="do not COMMIT"):
        with sqlite_store.transaction() as txn:
            txn.db.execute("COMMIT")
            txn.claim(1)


def test_sqlite_nested_transaction_refused(sqlite_store):
    with sqlite_store.transaction():
        with pytest.raises(RuntimeError, match="nested"):
            with sqlite_store.transaction():
                pass


def test_sqlite_one_connection_per_thread(sqlite_store):
    conns = []

    def grab():
        with sqlite_store.transaction() as txn:
            conns.append(txn.db.connection)

    for _ in range(2):
        grab()
    t = threading.Thread(target=grab)
    t.start()
    t.join()
    assert conns[0] is conns[1] and conns[2] is not conns[0]


def test_sqlite_prune_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(idempotency, "PRUNE_BATCH_ROWS", 3)
    clock = FakeClock()
    store = SqliteStore(tmp_path / "idem.sqlite", clock=clock, retention_s=10)
    with store.transaction() as txn:
        for job_id in range(10):
            txn.claim(job_id)
    clock.advance(11)
    assert store.prune(clock.now()) == 10
    store.close()


def test_sqlite_needs_a_file():
    with pytest.raises(InvalidConfig):
        SqliteStore(":memory:")


def test_sqlite_reopen_spec(sqlite_store):
    with sqlite_store.transaction() as txn:
        txn.claim(11)
    factory, args, kwargs = sqlite_store.reopen_spec()
    other = factory(*args, **kwargs)
    assert other.seen(11) and other.retention_s == sqlite_store.retention_s
    other.close()
