"""Idempotency stores: one contract suite for MemoryStore and SqliteStore, then SQLite specifics."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from shardq.consumer import idempotency
from shardq.clock import FakeClock
from shardq.errors import Fail, InvalidConfig
from shardq.consumer.idempotency import MemoryStore, SqliteStore
from support.store_contract import stores
from support.store_contract import (DAY, test_claim_once_then_seen, test_exception_rolls_back_the_claim,  # noqa: F401 - the store contract's tests, run here against this module's make_store
                                    test_abort_rolls_back_the_claim, test_prune_after_retention,
                                    test_retention_is_configurable,
                                    test_concurrent_claims_of_one_id_one_wins,
                                    test_claim_waits_for_an_open_claim_and_wins_after_its_rollback,
                                    test_closed_store_refuses, test_bad_job_ids,
                                    test_int_and_string_job_ids_up_to_the_limit,
                                    test_a_thread_that_releases_its_connection_leaves_none_behind)


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    with stores(request.param, request, tmp_path) as make:
        yield make


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
    with pytest.raises(Fail, match="ended the job's transaction .* dead-lettered, not retried"):
        with sqlite_store.transaction() as txn:
            txn.db.execute("COMMIT")
            txn.claim(1)


@pytest.mark.parametrize("how", ["commit", "executescript"])
def test_a_handler_that_ends_its_transaction_writes_its_effect_at_most_once(tmp_path, how):
    """``ctx.db.executescript`` (sqlite3 COMMITs first) or a COMMIT through the connection
    put the handler's writes outside the job's transaction: the claim refused it, as a
    failed attempt, and each retry committed the effect again: 4 rows a job at
    max_deliveries 4, then a dead letter (a walkthrough). executescript is refused before
    it runs; a COMMIT dead-letters the job at once (its effect there once)."""
    from shardq.consumer.handling import BURY, FAILED, execute
    from shardq.types import Lease
    path = tmp_path / "idem.sqlite"
    store = SqliteStore(path)
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER, what TEXT)")

    def handler(ctx):
        if how == "executescript":
            ctx.db.executescript(f"INSERT INTO effect VALUES ({ctx.job_id}, 'x');")
        else:
            ctx.db.execute("INSERT INTO effect VALUES (?, 'x')", (ctx.job_id,))
            ctx.db.connection.commit()

    for attempt in (1, 2, 3):
        outcome, error = execute(handler, Lease(7, None, b"", "default", attempt, 1, 9e9), store,
                                 max_deliveries=4)[:2]
        if how == "executescript":
            assert outcome == FAILED and "executescript commits the job's transaction" in error, error
        else:
            assert outcome == BURY and "dead-lettered, not retried" in error, error
            break  # (a bury: never run again)
    assert len(_effects(path)) == (0 if how == "executescript" else 1) and not store.seen(7)
    store.close()


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


# ---------------------------------------------------------------------------- sqlite: the write lock
def test_sqlite_read_then_write_holds_the_write_lock_from_its_first_statement(tmp_path):
    # Issue 36: with a deferred BEGIN another writer could commit between a handler's SELECT
    # and its INSERT, and the INSERT then failed at once with "database is locked".
    path = tmp_path / "idem.sqlite"
    store = SqliteStore(path)
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, what TEXT)")
    other = sqlite3.connect(path, timeout=0, isolation_level=None)  # another process's writer
    try:
        with store.transaction() as txn:
            assert txn.db.execute("SELECT count(*) FROM effect").fetchone() == (0,)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("INSERT INTO effect VALUES (2, 'other')")  # we are the writer
            txn.db.execute("INSERT INTO effect VALUES (1, 'x')")
            assert txn.claim(1)
        other.execute("INSERT INTO effect VALUES (2, 'other')")  # free after our commit
    finally:
        other.close()
        store.close()
    assert _effects(path) == [(1, "x"), (2, "other")]


def test_sqlite_threads_reading_then_writing_never_fail(tmp_path):
    store = SqliteStore(tmp_path / "idem.sqlite")
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE effect (job_id INTEGER PRIMARY KEY, what TEXT)")
    barrier, errors = threading.Barrier(8), []

    def work(t: int) -> None:
        barrier.wait(5)
        for i in range(25):
            job_id = t * 100 + i
            try:
                with store.transaction() as txn:
                    n = txn.db.execute("SELECT count(*) FROM effect").fetchone()[0]
                    txn.db.execute("INSERT INTO effect VALUES (?, ?)", (job_id, str(n)))
                    assert txn.claim(job_id)
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = sorted(int(what) for _, what in _effects(tmp_path / "idem.sqlite"))
    store.close()
    assert errors == []
    assert counts == list(range(200))  # each saw every earlier commit: one writer at a time


def test_sqlite_handlers_run_in_parallel_until_they_use_the_db(sqlite_store):
    opened, done = threading.Event(), threading.Event()

    def idle_handler():
        with sqlite_store.transaction():
            opened.set()
            done.wait(5)  # a slow handler that has not touched txn.db yet holds no lock

    t = threading.Thread(target=idle_handler)
    t.start()
    try:
        assert opened.wait(5)
        with sqlite_store.transaction() as txn:  # would wait busy_timeout_s if it were locked
            assert txn.claim(1)
        assert sqlite_store.seen(1)
    finally:
        done.set()
        t.join(5)


def test_sqlite_write_lock_wait_is_bounded_by_the_busy_timeout(tmp_path):
    store = SqliteStore(tmp_path / "idem.sqlite", busy_timeout_s=0)
    holding, release = threading.Event(), threading.Event()

    def writer():
        with store.transaction() as txn:
            txn.claim(1)
            holding.set()
            release.wait(5)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert holding.wait(5)
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            with store.transaction() as txn:
                txn.claim(2)
    finally:
        release.set()
        t.join(5)
    with store.transaction() as txn:  # the failed one left the lock free
        assert txn.claim(2)
    store.close()


def test_a_step_refused_as_locked_is_tried_again_until_it_passes():
    tries = []

    def step():
        tries.append(1)
        if len(tries) < 3:
            raise sqlite3.OperationalError("database is locked")
        return "wal"

    assert idempotency._while_locked(step, 5.0) == "wal"
    assert len(tries) == 3


def test_a_step_still_locked_at_its_deadline_raises_and_other_errors_at_once():
    tries = []

    def locked():
        tries.append(1)
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        idempotency._while_locked(locked, 0.0)
    assert len(tries) == 1

    def broken():
        tries.append(1)
        raise sqlite3.OperationalError("no such table: x")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        idempotency._while_locked(broken, 5.0)
    assert len(tries) == 2


def test_sqlite_store_in_a_directory_that_does_not_exist_is_a_typed_error_naming_it(tmp_path):
    """Found running the tasks docs' example from an empty directory: a bare
    ``sqlite3.OperationalError: unable to open database file``, where ``shardq worker
    --idempotency`` names the missing directory."""
    missing = tmp_path / "nodir"
    with pytest.raises(InvalidConfig, match=f"directory {missing} does not exist"):
        SqliteStore(str(missing / "x.sqlite"))
    assert not missing.exists()
