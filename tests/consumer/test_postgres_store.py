"""The PostgreSQL idempotency store against a real server: the store contract suite, then
what only PostgreSQL has (text job ids, SQLAlchemy sessions, lost connections, bad DSNs)."""
from __future__ import annotations

import pickle
import threading

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from shardq.clock import FakeClock
from shardq.consumer import postgres as pgstore
from shardq.consumer.handling import BURY, DONE, DUPLICATE, FAILED, execute
from shardq.errors import Fail, InvalidConfig, StoreUnavailable
from shardq.types import Lease
from support.store_contract import stores
# The contract every store keeps, run here against PostgresStore (make_store below).
from support.store_contract import (test_abort_rolls_back_the_claim, test_bad_job_ids, test_claim_once_then_seen,  # noqa: F401 - the imported contract tests run here against PostgresStore
                              test_claim_waits_for_an_open_claim_and_wins_after_its_rollback,
                              test_closed_store_refuses, test_concurrent_claims_of_one_id_one_wins,
                              test_exception_rolls_back_the_claim, test_prune_after_retention,
                              test_retention_is_configurable, test_int_and_string_job_ids_up_to_the_limit,
                              test_a_thread_that_releases_its_connection_leaves_none_behind)

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def make_store(request, tmp_path):
    with stores("postgres", request, tmp_path) as make:
        yield make


@pytest.fixture
def store(make_store):
    return make_store()


def _query(dsn: str, sql: str, params=()):
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else None


# execute() returns (outcome, error, ...): compare the first two.
def _lease(job_id, body=b"x") -> Lease:
    return Lease(job_id, None, body, "default", 1, 1, 1e18)


# ---------------------------------------------------------------------------- atomicity
def test_effect_and_mark_commit_together_or_not_at_all(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE TABLE effect (job_id bigint PRIMARY KEY, what text)")

    def handler(what, fail=False):
        def run(ctx):
            ctx.db.execute("INSERT INTO effect VALUES (%s, %s)", (ctx.job_id, what))
            if fail:
                raise ValueError("handler failed after writing")
        return run

    assert execute(handler("x", fail=True), _lease(1), store)[0] == FAILED
    assert _query(pg_dsn, "SELECT * FROM effect") == [] and not store.seen(1)
    assert execute(handler("y"), _lease(1), store)[:2] == (DONE, None)
    assert execute(handler("z"), _lease(1), store)[:2] == (DUPLICATE, None)  # seen: skipped
    assert _query(pg_dsn, "SELECT * FROM effect") == [(1, "y")]
    assert _query(pg_dsn, "SELECT job_id FROM shardq_processed") == [("1",)]


def test_savepoints_inside_the_handler(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE TABLE effect (n int)")

    def handler(ctx):
        ctx.db.execute("INSERT INTO effect VALUES (1)")
        with pytest.raises(ZeroDivisionError):
            with ctx.db.connection.transaction():  # a savepoint: only this part rolls back
                ctx.db.execute("INSERT INTO effect VALUES (2)")
                1 / 0  # noqa: B018 - raises ZeroDivisionError inside the transaction on purpose
    assert execute(handler, _lease(1), store)[:2] == (DONE, None)
    assert _query(pg_dsn, "SELECT n FROM effect") == [(1,)]


def test_commit_inside_the_handler_is_refused(store):
    with pytest.raises(Fail, match="ended the job's transaction"):
        with store.transaction() as txn:
            txn.db.execute("COMMIT")
            txn.claim(1)
    with pytest.raises(Fail, match="ended the job's transaction"):  # COMMIT, then a new BEGIN
        with store.transaction() as txn:
            txn.db.execute("COMMIT")
            txn.db.execute("BEGIN")
            txn.claim(2)
    assert not store.seen(1) and not store.seen(2)


def test_lock_timeout_bounds_the_wait_for_an_open_claim(make_store):
    store = make_store(lock_timeout_s=0.2)
    claimed, release = threading.Event(), threading.Event()

    def first():
        with store.transaction() as txn:
            txn.claim(5)
            claimed.set()
            release.wait(10)
            txn.abort()

    t = threading.Thread(target=first)
    t.start()
    try:
        assert claimed.wait(10)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            with store.transaction() as txn:
                txn.claim(5)
    finally:
        release.set()
        t.join(10)


def test_prune_in_batches(make_store, pg_dsn, monkeypatch):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    monkeypatch.setattr(pgstore, "PRUNE_BATCH_ROWS", 1000)
    clock = FakeClock()
    store = make_store(clock=clock, retention_s=10)
    # 2,500 old marks and one fresh one, written directly (as 2,500 claims would).
    _query(pg_dsn, "INSERT INTO shardq_processed SELECT g::text, to_timestamp(%s) "
                   "FROM generate_series(1, 2500) g", (clock.now() - 60,))
    with store.transaction() as txn:
        txn.claim("fresh")
    assert store.prune(clock.now()) == 2500
    assert _query(pg_dsn, "SELECT job_id FROM shardq_processed") == [("fresh",)]


def test_the_claim_uses_the_primary_key_index(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "INSERT INTO shardq_processed SELECT g::text, now() FROM generate_series(1, 20000) g")
    _query(pg_dsn, "ANALYZE shardq_processed")
    plan = _query(pg_dsn, "EXPLAIN SELECT 1 FROM shardq_processed WHERE job_id = '777'")
    assert "shardq_processed_pkey" in " ".join(r[0] for r in plan)


# ---------------------------------------------------------------------------- schema, binding
def test_table_name_is_configurable_and_schema_created_once(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE SCHEMA app")
    stores = []
    errors = []

    def build():
        try:
            stores.append(pgstore.PostgresStore(pg_dsn, table="app.marks"))
        except Exception as exc:  # noqa: BLE001 - collected and checked by the test below
            errors.append(exc)
    threads = [threading.Thread(target=build) for _ in range(6)]  # many workers start at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(stores) == 6
    with stores[0].transaction() as txn:
        txn.claim(1)
    assert stores[1].seen(1)
    assert _query(pg_dsn, "SELECT job_id FROM app.marks") == [("1",)]
    for s in stores:
        s.close()


@pytest.mark.parametrize("name", ["", "Marks", "a-b", "x;drop", "a.b.c", "x" * 55, 'q"'])
def test_bad_table_names(pg_dsn, name):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    with pytest.raises(InvalidConfig, match="table"):
        pgstore.PostgresStore(pg_dsn, table=name)


def test_binds_to_one_service(make_store):
    store = make_store()
    store.bind("svc-1")
    store.bind("svc-1")
    with pytest.raises(InvalidConfig, match="svc-1"):
        store.bind("svc-2")
    with pytest.raises(InvalidConfig):
        make_store().bind("svc-2")  # durable: another store on the same table refuses too


def test_other_tables_bind_on_their_own(make_store):
    make_store(table="a_marks").bind("svc-1")
    make_store(table="b_marks").bind("svc-2")


# ---------------------------------------------------------------------------- bad DSN
def test_bad_dsn_is_a_clear_typed_error(pg):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    with pytest.raises(InvalidConfig, match="bad PostgreSQL DSN"):
        pgstore.PostgresStore("host=/tmp port=notanumber x")
    with pytest.raises(StoreUnavailable, match="does not exist"):
        pgstore.PostgresStore(pg.dsn("no_such_db"))
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        pgstore.PostgresStore(f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres")
    with pytest.raises(InvalidConfig, match="retention_s"):
        pgstore.PostgresStore(pg.dsn(), retention_s=0)


def _closed_port() -> int:
    from support.pg import free_port
    return free_port()  # nothing listens there once the probe socket is closed


# ---------------------------------------------------------------------------- lost connections
def _terminate(dsn: str, pid: int) -> None:
    _query(dsn, "SELECT pg_terminate_backend(%s)", (pid,))


def test_connection_lost_inside_the_transaction_rolls_back_and_the_next_one_reconnects(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE TABLE effect (job_id bigint PRIMARY KEY)")

    def dies(ctx):
        ctx.db.execute("INSERT INTO effect VALUES (%s)", (ctx.job_id,))
        _terminate(pg_dsn, ctx.db.connection.info.backend_pid)  # the server drops us mid-transaction
        ctx.db.execute("SELECT 1")

    outcome, error = execute(dies, _lease(1), store)[:2]
    assert outcome == FAILED and "terminating connection" in error
    assert _query(pg_dsn, "SELECT * FROM effect") == [] and not store.seen(1)

    def ok(ctx):
        ctx.db.execute("INSERT INTO effect VALUES (%s)", (ctx.job_id,))
    assert execute(ok, _lease(1), store)[:2] == (DONE, None)  # retried: a new connection
    assert _query(pg_dsn, "SELECT * FROM effect") == [(1,)]


def test_a_connection_dropped_between_jobs_is_replaced_before_the_next(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    with store.transaction() as txn:
        pid = txn.db.connection.info.backend_pid
    _terminate(pg_dsn, pid)
    assert not store.seen(3)  # found dead, reopened, answered
    with store.transaction() as txn:
        assert txn.db.connection.info.backend_pid != pid
        assert txn.claim(3)


def test_reopen_spec_pickles_and_opens_the_same_table(make_store):
    store = make_store(table="spec_marks", retention_s=99)
    with store.transaction() as txn:
        txn.claim(11)
    factory, args, kwargs = pickle.loads(pickle.dumps(store.reopen_spec()))
    other = factory(*args, **kwargs)
    try:
        assert other.seen(11) and other.retention_s == 99 and other.table.name == "spec_marks"
    finally:
        other.close()


# ---------------------------------------------------------------------------- SQLAlchemy
sqlalchemy = pytest.importorskip("sqlalchemy")


@pytest.fixture
def engine(pg, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    name = pg_dsn.rsplit("dbname=", 1)[1]
    eng = sqlalchemy.create_engine(f"postgresql+psycopg://postgres@/{name}?host={pg.dir}&port={pg.port}")
    yield eng
    eng.dispose()


def _orm(engine):
    from sqlalchemy import BigInteger, Column, Integer
    from sqlalchemy.orm import declarative_base

    Base = declarative_base()

    class Payment(Base):
        __tablename__ = "payments"
        job_id = Column(BigInteger, primary_key=True)
        amount = Column(Integer, nullable=False)

    Base.metadata.create_all(engine)
    return Payment


@pytest.mark.parametrize("via", ["engine", "sessionmaker"])
def test_orm_handler_writes_in_the_same_transaction(engine, via):
    from sqlalchemy.orm import sessionmaker
    Payment = _orm(engine)
    store = pgstore.PostgresStore(engine if via == "engine" else sessionmaker(bind=engine))

    def handler(ctx):
        ctx.session.add(Payment(job_id=ctx.job_id, amount=int(ctx.body)))
        assert ctx.db.connection is ctx.session.connection().connection.driver_connection
        if int(ctx.body) < 0:
            raise ValueError("refund not allowed")

    try:
        assert execute(handler, _lease(1, b"-5"), store)[0] == FAILED
        assert execute(handler, _lease(2, b"7"), store)[:2] == (DONE, None)
        assert execute(handler, _lease(2, b"7"), store)[:2] == (DUPLICATE, None)
        with engine.connect() as c:
            rows = c.execute(sqlalchemy.text("SELECT job_id, amount FROM payments")).all()
        assert rows == [(2, 7)] and store.seen(2) and not store.seen(1)
        factory, args, kwargs = store.reopen_spec()  # process mode: rebuilt from the URL
        other = factory(*args, **pickle.loads(pickle.dumps(kwargs)))
        assert other.seen(2)
        other.close()
    finally:
        store.close()


def test_orm_commit_inside_the_handler_is_refused(engine):
    store = pgstore.PostgresStore(engine)
    Payment = _orm(engine)

    def handler(ctx):
        ctx.session.add(Payment(job_id=ctx.job_id, amount=1))
        ctx.session.commit()  # breaks atomicity: refused, and nothing after it commits
        ctx.session.add(Payment(job_id=ctx.job_id + 100, amount=1))

    outcome, error = execute(handler, _lease(1), store)[:2]
    assert outcome == BURY and "ended the job's transaction" in error  # dead-lettered: a retry would write again
    assert not store.seen(1)
    with engine.connect() as c:
        assert c.execute(sqlalchemy.text("SELECT job_id FROM payments")).all() == [(1,)]
    store.close()


def test_engines_that_are_not_postgresql_through_psycopg_are_refused(tmp_path):
    from sqlalchemy.orm import sessionmaker
    with pytest.raises(InvalidConfig, match="postgresql\\+psycopg"):
        pgstore.PostgresStore(sqlalchemy.create_engine(f"sqlite:///{tmp_path}/x.db"))
    with pytest.raises(InvalidConfig, match="bound"):
        pgstore.PostgresStore(sessionmaker())
    with pytest.raises(InvalidConfig, match="DSN"):
        pgstore.PostgresStore(42)


def test_process_mode_worker_reopens_the_store_in_each_child(pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    from support.service import Service
    from shardq.consumer.worker import Worker
    from support import pg_effects_handler
    _query(pg_dsn, "CREATE TABLE effects (job_id bigint, n int)")
    store = pgstore.PostgresStore(pg_dsn)
    try:
        with Service(shards=1) as svc, svc.connect() as q:
            ids = q.enqueue_many([{"body": str(i).encode()} for i in range(20)])
            stats = Worker(q, pg_effects_handler.handle, mode="process", concurrency=2,
                           idempotency=store).run(until_idle=True)
        assert stats.succeeded == 20
        assert sorted(r[0] for r in _query(pg_dsn, "SELECT job_id FROM effects")) == sorted(ids)
        assert len(_query(pg_dsn, "SELECT 1 FROM shardq_processed")) == 20
    finally:
        store.close()


def test_close_leaves_a_connection_in_use_to_its_thread(store):
    from shardq.errors import Closed
    inside, release, result = threading.Event(), threading.Event(), []

    def handler_thread():
        with store.transaction() as txn:
            inside.set()
            release.wait(10)
            txn.db.execute("SELECT 1")  # still usable: close() did not pull it away
            result.append(txn.claim(1))
        result.append(txn.db.connection.closed)  # closed by its thread once the transaction ended

    t = threading.Thread(target=handler_thread)
    t.start()
    assert inside.wait(10)
    store.close()
    release.set()
    t.join(10)
    assert result == [True, True]
    with pytest.raises(Closed):
        store.seen(1)


def test_a_transaction_left_open_on_the_connection_is_rolled_back_first(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE TABLE effect (n int)")
    with store.transaction() as txn:
        conn = txn.db.connection
    conn.execute("BEGIN")
    conn.execute("INSERT INTO effect VALUES (1)")  # stray, never committed
    with store.transaction() as txn:
        assert txn.db.connection is conn and txn.claim(1)
    assert _query(pg_dsn, "SELECT * FROM effect") == [] and store.seen(1)


def test_ctx_db_is_a_dbapi_cursor_like_sqlites(store, pg_dsn):  # noqa: F811 - the pytest fixture imported from pg, requested by name
    _query(pg_dsn, "CREATE TABLE effect (n int)")
    seen = []

    def handler(ctx):
        ctx.db.execute("INSERT INTO effect VALUES (1), (2)")
        ctx.db.execute("SELECT n FROM effect ORDER BY n")  # its own writes, in the transaction
        seen.extend(ctx.db.fetchall())
        ctx.db.executemany("INSERT INTO effect VALUES (%s)", [(3,), (4,)])
    assert execute(handler, _lease(1), store)[:2] == (DONE, None)
    assert seen == [(1,), (2,)] and len(_query(pg_dsn, "SELECT n FROM effect")) == 4
