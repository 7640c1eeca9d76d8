"""Results kept with processed marks (issue 34): ``txn.claim(job_id, result)`` and
``store.kept_result(job_id)``, on MemoryStore, SqliteStore and PostgresStore (a real
server through support.pg; those cases skip with the reason where there is none), then
stores written by the previous version, then an async task's transaction in its thread."""
from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name below
from shardq import limits
from shardq.clock import FakeClock
from shardq.consumer.aiotxn import run_async
from shardq.consumer.handling import DONE, DUPLICATE, FAILED, Context, Runs
from shardq.types import Lease
from shardq.consumer.idempotency import SqliteStore
from support.store_contract import stores
from shardq.errors import Closed, InvalidJob

DAY = 86400.0
SQS_ID = "6f1c2d3e-0000-4a5b-8c9d-0123456789ab"  # a string job id, as SQS gives


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def make_store(request, tmp_path):
    with stores(request.param, request, tmp_path) as make:
        yield make


@pytest.fixture
def store(make_store):
    return make_store()


# ---------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("job_id", [7, 2**63 - 1, SQS_ID])
def test_claim_with_a_result_keeps_it(store, job_id):
    assert store.kept_result(job_id) is None  # not marked
    with store.transaction() as txn:
        assert txn.claim(job_id, b"\x92\x01\xa2ok")
    assert store.seen(job_id)
    assert store.kept_result(job_id) == b"\x92\x01\xa2ok"


@pytest.mark.parametrize("job_id", [8, SQS_ID])
def test_claim_without_a_result_keeps_none(store, job_id):
    with store.transaction() as txn:
        assert txn.claim(job_id)
    assert store.seen(job_id) and store.kept_result(job_id) is None


def test_an_empty_result_is_kept_as_empty_bytes(store):
    with store.transaction() as txn:
        assert txn.claim(9, b"")
    assert store.kept_result(9) == b""


def test_int_and_string_ids_keep_separate_results(store):
    with store.transaction() as txn:
        assert txn.claim(5, b"int")
        assert txn.claim(SQS_ID, b"str")
    assert store.kept_result(5) == b"int" and store.kept_result(SQS_ID) == b"str"


@pytest.mark.parametrize("job_id", [1, SQS_ID])
def test_abort_keeps_no_result(store, job_id):
    with store.transaction() as txn:
        assert txn.claim(job_id, b"effect rolled back")
        txn.abort()
    assert not store.seen(job_id) and store.kept_result(job_id) is None
    with store.transaction() as txn:
        assert txn.claim(job_id)  # free again: claimed now without a result
    assert store.kept_result(job_id) is None


def test_exception_keeps_no_result(store):
    with pytest.raises(ZeroDivisionError):
        with store.transaction() as txn:
            assert txn.claim(2, b"lost")
            1 / 0  # noqa: B018 - raises inside the transaction on purpose
    assert not store.seen(2) and store.kept_result(2) is None


def test_a_duplicate_claim_keeps_the_first_result(store):
    with store.transaction() as txn:
        assert txn.claim(3, b"first")
        assert not txn.claim(3, b"same transaction")
    with store.transaction() as txn:
        assert not txn.claim(3, b"second delivery")
    assert store.kept_result(3) == b"first"


@pytest.mark.parametrize("job_id", [4, SQS_ID])
def test_result_at_the_limit_is_kept(store, job_id):
    result = bytes(range(256)) * (limits.RESULT_BYTES_MAX // 256)
    assert len(result) == limits.RESULT_BYTES_MAX
    with store.transaction() as txn:
        assert txn.claim(job_id, result)
    assert store.kept_result(job_id) == result


@pytest.mark.parametrize("job_id", [4, SQS_ID])
@pytest.mark.parametrize("bad", [b"x" * (limits.RESULT_BYTES_MAX + 1), "text", bytearray(b"x"),
                                 memoryview(b"x"), 1])
def test_a_bad_result_is_refused_before_anything_is_written(store, job_id, bad):
    with store.transaction() as txn:
        with pytest.raises(InvalidJob):
            txn.claim(job_id, bad)
        # The transaction goes on and commits: the refused claim left nothing in it.
    assert not store.seen(job_id) and store.kept_result(job_id) is None
    with store.transaction() as txn:
        assert txn.claim(job_id, b"ok")
    assert store.kept_result(job_id) == b"ok"


def test_bad_job_ids_are_refused_by_kept_result(store):
    for bad in (-1, 2**63, 1.5, None, True, "", b"1"):
        with pytest.raises(InvalidJob):
            store.kept_result(bad)


def test_prune_drops_results_with_their_marks(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)  # default retention: 7 days
    with store.transaction() as txn:
        assert txn.claim(1, b"old") and txn.claim(SQS_ID, b"old text")
    clock.advance(2 * DAY)
    with store.transaction() as txn:
        assert txn.claim(2, b"new")
    clock.advance(5.5 * DAY)
    assert store.prune(clock.now()) == 2  # marks, as before: 1 and SQS_ID are 7.5 days old
    assert store.kept_result(1) is None and store.kept_result(SQS_ID) is None
    assert store.kept_result(2) == b"new"
    clock.advance(2 * DAY)
    assert store.prune(clock.now()) == 1
    assert store.kept_result(2) is None and not store.seen(2)


def test_kept_result_waits_for_no_open_transaction(store):
    """Like seen(): another thread's open claim neither blocks nor shows until it commits."""
    claimed, release = threading.Event(), threading.Event()

    def hold():
        with store.transaction() as txn:
            txn.claim(6, b"pending")
            claimed.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert claimed.wait(10)
        assert store.kept_result(6) is None
    finally:
        release.set()
        t.join(10)
    assert store.kept_result(6) == b"pending"


def test_closed_store_refuses_kept_result(store):
    store.close()
    with pytest.raises(Closed):
        store.kept_result(1)


# ---------------------------------------------------------------------------- SQLite on disk
# The schema of the previous version, written out: what a store file of it holds.
OLD_SQLITE_SCHEMA = """
CREATE TABLE shardq_processed (job_id INTEGER PRIMARY KEY, processed_at REAL NOT NULL);
CREATE INDEX shardq_processed_at ON shardq_processed(processed_at);
CREATE TABLE shardq_processed_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE shardq_processed_text (job_id TEXT PRIMARY KEY, processed_at REAL NOT NULL);
CREATE INDEX shardq_processed_text_at ON shardq_processed_text(processed_at);
INSERT INTO shardq_processed VALUES (1, 1000.0);
INSERT INTO shardq_processed_text VALUES ('old-text', 1000.0);
INSERT INTO shardq_processed_meta VALUES ('service', 'svc-1');
"""


def _sqlite_tables(path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_sqlite_store_of_the_previous_version_is_used_as_it_is(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SQLITE_SCHEMA)
    store = SqliteStore(path)
    try:
        store.bind("svc-1")  # the same service: its marks are still honoured
        assert store.seen(1) and store.seen("old-text")
        assert store.kept_result(1) is None and store.kept_result("old-text") is None
        assert "shardq_results" in _sqlite_tables(path)  # created on open
        with store.transaction() as txn:
            assert not txn.claim(1, b"again")  # the old mark still wins
            assert txn.claim(2, b"two") and txn.claim("new-text", b"text")
        assert store.kept_result(2) == b"two" and store.kept_result("new-text") == b"text"
        assert store.kept_result(1) is None
    finally:
        store.close()
    with sqlite3.connect(path) as conn:  # the old mark is untouched, no result beside it
        assert conn.execute("SELECT processed_at FROM shardq_processed WHERE job_id = 1").fetchone() == (1000.0,)
        assert conn.execute("SELECT job_id FROM shardq_results").fetchall() == [(2,)]


def test_sqlite_text_results_table_is_made_on_first_use(tmp_path):
    store = SqliteStore(tmp_path / "idem.sqlite")
    try:
        assert store.kept_result(SQS_ID) is None  # reading needs no table
        with store.transaction() as txn:
            assert txn.claim(SQS_ID)  # no result: no results table either
        assert "shardq_results_text" not in _sqlite_tables(tmp_path / "idem.sqlite")
        with store.transaction() as txn:
            assert txn.claim("other", b"r")
        assert "shardq_results_text" in _sqlite_tables(tmp_path / "idem.sqlite")
        assert store.kept_result("other") == b"r" and store.kept_result(SQS_ID) is None
    finally:
        store.close()


def test_sqlite_prune_deletes_the_result_rows(tmp_path):
    clock = FakeClock()
    store = SqliteStore(tmp_path / "idem.sqlite", clock=clock, retention_s=60.0)
    try:
        with store.transaction() as txn:
            assert txn.claim(1, b"a") and txn.claim("s", b"b")
        clock.advance(61)
        assert store.prune(clock.now()) == 2
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "idem.sqlite") as conn:
        assert conn.execute("SELECT count(*) FROM shardq_results").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM shardq_results_text").fetchone() == (0,)


def test_sqlite_a_result_row_without_its_mark_is_not_taken_for_a_later_claim(tmp_path):
    """A version that kept no results pruned the mark and left the row: the next claim of
    the same id, without a result, must not report the old one."""
    clock = FakeClock()
    path = tmp_path / "idem.sqlite"
    store = SqliteStore(path, clock=clock)
    try:
        with store.transaction() as txn:
            assert txn.claim(1, b"stale")
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM shardq_processed WHERE job_id = 1")  # the old prune
        clock.advance(DAY)
        with store.transaction() as txn:
            assert txn.claim(1)
        assert store.kept_result(1) is None
        clock.advance(DAY)
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM shardq_processed WHERE job_id = 1")
        with store.transaction() as txn:
            assert txn.claim(1, b"fresh")  # replaces the stale row
        assert store.kept_result(1) == b"fresh"
    finally:
        store.close()


# ---------------------------------------------------------------------------- PostgreSQL
OLD_PG_SCHEMA = [
    "CREATE TABLE shardq_processed (job_id text PRIMARY KEY, processed_at timestamptz NOT NULL)",
    "CREATE INDEX shardq_processed_at ON shardq_processed (processed_at)",
    "CREATE TABLE shardq_processed_meta (name text PRIMARY KEY, value text NOT NULL)",
    "INSERT INTO shardq_processed VALUES ('1', now()), ('old-text', now())",
    "INSERT INTO shardq_processed_meta VALUES ('service', 'svc-1')",
]


def _pg_query(dsn: str, sql: str, params=()):
    import psycopg
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else None


def test_postgres_store_of_the_previous_version_is_used_as_it_is(pg_dsn):  # noqa: F811 - the fixture imported from support.pg
    from shardq.consumer.postgres import PostgresStore
    for stmt in OLD_PG_SCHEMA:
        _pg_query(pg_dsn, stmt)
    store = PostgresStore(pg_dsn)
    try:
        store.bind("svc-1")
        assert store.seen(1) and store.seen("old-text") and store.kept_result(1) is None
        with store.transaction() as txn:
            assert not txn.claim(1, b"again")
            assert txn.claim(2, b"two") and txn.claim("new-text", b"text")
        assert store.kept_result(2) == b"two" and store.kept_result("new-text") == b"text"
        assert store.kept_result(1) is None
    finally:
        store.close()
    assert _pg_query(pg_dsn, "SELECT job_id FROM shardq_processed_results ORDER BY job_id") \
        == [("2",), ("new-text",)]


def test_postgres_results_table_follows_the_marks_table(pg_dsn):  # noqa: F811 - the fixture imported from support.pg
    from shardq.consumer.postgres import PostgresStore
    name = "m" * 54  # the longest table name: its results index must still fit 63 characters
    clock = FakeClock()
    store = PostgresStore(pg_dsn, table=name, clock=clock, retention_s=60.0)
    try:
        with store.transaction() as txn:
            assert txn.claim(1, b"r")
        assert store.kept_result(1) == b"r"
        assert _pg_query(pg_dsn, f'SELECT count(*) FROM "{name}_results"') == [(1,)]
        indexes = _pg_query(pg_dsn, "SELECT indexname FROM pg_indexes WHERE tablename = %s",
                            (f"{name}_results",))
        assert (f"{name}_res_at",) in indexes
        clock.advance(61)
        assert store.prune(clock.now()) == 1
        assert _pg_query(pg_dsn, f'SELECT count(*) FROM "{name}_results"') == [(0,)]
    finally:
        store.close()


def test_postgres_a_result_row_without_its_mark_is_not_taken_for_a_later_claim(pg_dsn):  # noqa: F811 - the fixture imported from support.pg
    from shardq.consumer.postgres import PostgresStore
    clock = FakeClock()
    store = PostgresStore(pg_dsn, clock=clock)
    try:
        with store.transaction() as txn:
            assert txn.claim(1, b"stale")
        _pg_query(pg_dsn, "DELETE FROM shardq_processed WHERE job_id = '1'")  # an old version's prune
        clock.advance(DAY)
        with store.transaction() as txn:
            assert txn.claim(1)
        assert store.kept_result(1) is None
        _pg_query(pg_dsn, "DELETE FROM shardq_processed WHERE job_id = '1'")
        clock.advance(DAY)
        with store.transaction() as txn:
            assert txn.claim(1, b"fresh")
        assert store.kept_result(1) == b"fresh"
    finally:
        store.close()


def test_postgres_result_with_an_sqlalchemy_session(pg, pg_dsn):  # noqa: F811 - the fixtures imported from support.pg
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from shardq.consumer.postgres import PostgresStore
    name = pg_dsn.rsplit("dbname=", 1)[1]
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/{name}?host={pg.dir}&port={pg.port}")
    store = PostgresStore(engine)
    try:
        with store.transaction() as txn:
            txn.session.execute(sqlalchemy.text("CREATE TABLE effect (n int)"))
            assert txn.claim(1, b"orm")
        with store.transaction() as txn:
            txn.session.execute(sqlalchemy.text("INSERT INTO effect VALUES (2)"))
            assert txn.claim(2, b"rolled back")
            txn.abort()
        assert store.kept_result(1) == b"orm" and store.kept_result(2) is None
        assert _pg_query(pg_dsn, "SELECT count(*) FROM effect") == [(0,)]
    finally:
        store.close()
        engine.dispose()


# ---------------------------------------------------------------------------- asyncio
def _run_async(store, job_id: int, body):
    """One job of an ``async def`` task through the asyncio runner's path with a store:
    ``body(ctx)`` runs on the loop after a statement in the transaction's thread. Returns
    the outcome and what a skipped delivery was given back (``finish_duplicate``)."""
    lease = Lease(job_id, None, b"", "default", 1, 1, 10.0**12)
    given_back = []

    async def run(ctx):
        assert await ctx.db.run(lambda cur: threading.current_thread().name) != threading.current_thread().name
        body(ctx)

    class Handler:  # a task handler's hook (FinishesDuplicates); the task itself is ``run``
        def __call__(self, ctx):
            raise AssertionError("the async path awaits the task instead")

        def finish_duplicate(self, ctx, kept):
            given_back.append(kept)

    async def main():
        return await run_async(Runs(Handler(), store), run, lease, Context, None, None, None)

    return asyncio.run(main())[0], given_back


def test_an_async_task_keeps_its_result_and_a_skipped_delivery_gets_it_back(store):
    assert _run_async(store, 11, lambda ctx: ctx.keep(b"first")) == (DONE, [])
    assert store.kept_result(11) == b"first"
    assert _run_async(store, 11, lambda ctx: ctx.keep(b"again")) == (DUPLICATE, [b"first"])


def test_an_async_task_without_a_result_claims_as_before(store):
    assert _run_async(store, 13, lambda ctx: None) == (DONE, [])
    assert store.seen(13) and store.kept_result(13) is None


def test_an_async_task_that_fails_rolls_back_its_mark(store):
    def fail(ctx):
        ctx.keep(b"never")
        raise ValueError("no")

    assert _run_async(store, 14, fail) == (FAILED, [])
    assert not store.seen(14) and store.kept_result(14) is None
