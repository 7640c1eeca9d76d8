"""The PostgreSQL idempotency store: processed marks in *your* database, so the exactly-once
effect reaches the data that matters.

The handler's writes and the mark commit in one PostgreSQL transaction, exactly as with
:class:`~shardq.consumer.idempotency.SqliteStore`::

    BEGIN                                   -- lock_timeout for this transaction only
    handler(ctx)                            -- writes through ctx.db (and ctx.session)
    INSERT INTO shardq_processed ... ON CONFLICT (job_id) DO NOTHING   -- the claim, UNIQUE
    (lease check in the worker)
    COMMIT                                  -- then the worker acks

* ``PostgresStore(dsn)``: ``ctx.db`` is a psycopg 3 ``Cursor`` inside the transaction, a
  DB-API cursor as with SQLite (``ctx.db.execute(sql, params)``, ``ctx.db.fetchall()``;
  ``with ctx.db.connection.transaction():`` makes a savepoint).
* ``PostgresStore(engine)`` or ``PostgresStore(sessionmaker)`` (SQLAlchemy, driver
  ``postgresql+psycopg``): ``ctx.session`` is an ORM ``Session`` in that same transaction
  and ``ctx.db`` a cursor of its psycopg connection. The session is flushed before the claim.
* The marks table (``table=``, default ``shardq_processed``) is created when the store is
  built, under an advisory lock so many workers may start at once. ``job_id`` is ``text``
  (the id's decimal digits for local shards, the id itself for string ids): the store is
  bound to one service, whose ids are all of one type, so ``5`` and ``"5"`` never meet.
  The primary key's B-tree keeps the claim O(log n).
* A connection found dead before a transaction starts (a server restart) is reopened and
  retried for ``reconnect_s``; one lost inside a transaction rolls that transaction back on
  the server and the job is retried by the queue. Never half-applied.
* ``txn.claim(job_id, result)`` keeps the result (``bytea``) in ``<table>_results``, in the
  same statement as the mark; :meth:`kept_result` reads it back for a skipped redelivery.
  That table is created IF NOT EXISTS with the others: a store of an earlier version is
  used as it is. A result row carries its mark's ``processed_at`` and counts only beside
  that very mark, so a row left behind by a version that pruned marks alone never passes
  for the result of a later claim.
* :meth:`prune` deletes old results, then old marks, in batches of ``PRUNE_BATCH_ROWS``,
  each its own short transaction: no table lock, no long row locks.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any
from collections.abc import Callable, Iterator

from .. import pgconn
from ..clock import Clock, SystemClock
from ..errors import Closed, InvalidConfig
from .idempotency import (BUSY_TIMEOUT_S_DEFAULT, check_job_id, PRUNE_BATCH_ROWS, RETENTION_S_DEFAULT,
                          IdempotencyStore, Txn, check_result, transaction_ended)

TABLE_DEFAULT = "shardq_processed"
WHAT = "idempotency store"
#: A transaction begun: (cursor's connection, ORM session or None, its start time, end(commit))
_Begun = tuple[Any, Any, Any, Callable[[bool], None]]


def job_key(job_id: Any) -> str:
    """The text a job id is stored as: an int (:func:`~.idempotency.check_job_id`) as its
    digits, a string as is."""
    return str(check_job_id(job_id))


def schema_sql(table: str | pgconn.TableName) -> list[str]:
    """The statements that create the marks table (idempotent), for migration tools too."""
    table = pgconn.TableName.of(table)
    t = table.q()
    return [
        f"CREATE TABLE IF NOT EXISTS {t} ("
        " job_id text PRIMARY KEY,"          # UNIQUE: a job is marked at most once
        " processed_at timestamptz NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS {table.ident('_at')} ON {t} (processed_at)",  # prune()
        f"CREATE TABLE IF NOT EXISTS {table.q('_meta')} (name text PRIMARY KEY, value text NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {table.q('_results')} ("
        " job_id text PRIMARY KEY,"
        " processed_at timestamptz NOT NULL,"  # its mark's: the result belongs to that mark only
        " value bytea NOT NULL)",
        # '_res_at', not '_results_at': a table name of 54 characters leaves 9 for a suffix.
        f"CREATE INDEX IF NOT EXISTS {table.ident('_res_at')} ON {table.q('_results')} (processed_at)",
    ]


class _PgTxn(Txn):
    def __init__(self, conn: Any, session: Any, started_at: Any, sql: dict[str, str], clock: Clock):
        super().__init__()
        self.db, self.session = conn.cursor(), session  # a DB-API cursor, as with SQLite
        self._conn, self._started_at, self._sql, self._clock = conn, started_at, sql, clock

    def claim(self, job_id: Any, result: bytes | None = None) -> bool:
        result = check_result(result)
        key = job_key(job_id)
        pq = pgconn.psycopg().pq
        if self.session is not None:
            self.session.flush()  # the ORM's pending writes, before the mark
        elif self._conn.info.transaction_status not in (pq.TransactionStatus.INTRANS,
                                                     pq.TransactionStatus.INERROR):
            raise transaction_ended("a COMMIT or ROLLBACK through ctx.db")
        params: tuple[Any, ...]
        if result is None:
            sql, params = self._sql["claim"], (key, self._clock.now())
        else:
            sql, params = self._sql["claim_result"], (key, self._clock.now(), result)
        inserted, started_at = self._conn.execute(sql, params).fetchone()
        if started_at != self._started_at:  # now() is the transaction's start: a new one began
            raise transaction_ended("a COMMIT or ROLLBACK through ctx.db or ctx.session")
        return bool(inserted == 1)


class PostgresStore(IdempotencyStore):
    """Processed job ids in a PostgreSQL table of the handler's own database. See the
    module docstring. ``target``: a DSN (``postgresql://...`` or ``key=value``), an
    SQLAlchemy ``Engine`` or a ``sessionmaker`` bound to one."""

    def __init__(self, target: Any, *, table: str = TABLE_DEFAULT,
                 retention_s: float = RETENTION_S_DEFAULT,
                 lock_timeout_s: float = BUSY_TIMEOUT_S_DEFAULT,
                 reconnect_s: float = pgconn.RECONNECT_S_DEFAULT, clock: Clock | None = None,
                 _owns_engine: bool = False):
        if not retention_s > 0:
            raise InvalidConfig(f"retention_s must be > 0, got {retention_s!r}")
        if not 0 < lock_timeout_s <= 24 * 3600:
            raise InvalidConfig(f"lock_timeout_s must be in (0, 86400], got {lock_timeout_s!r}")
        if not reconnect_s >= 0:
            raise InvalidConfig(f"reconnect_s must be >= 0, got {reconnect_s!r}")
        pgconn.psycopg()
        self.table = pgconn.TableName(table)
        self.retention_s = float(retention_s)
        self.lock_timeout_s = float(lock_timeout_s)
        self.reconnect_s = float(reconnect_s)
        self._clock = clock or SystemClock()
        self._sessionmaker: Any = None  # sqlalchemy's sessionmaker and Engine (an optional import)
        self._engine: Any = None
        self._owns_engine = _owns_engine
        if isinstance(target, str):
            self.dsn: str | None = target
        else:
            self.dsn = None
            self._sessionmaker, self._engine = _sqlalchemy(target)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[tuple[Any, threading.RLock]] = []
        self._closed = False
        t, r = self.table.q(), self.table.q("_results")
        self._sql = {
            "begin": (f"BEGIN; SELECT set_config('lock_timeout', '{int(self.lock_timeout_s * 1000)}', "
                      "true), now()"),
            "local_timeout": "SELECT set_config('lock_timeout', %s, true), now()",
            "claim": (f"WITH ins AS (INSERT INTO {t} (job_id, processed_at) VALUES (%s, to_timestamp(%s)) "
                      "ON CONFLICT (job_id) DO NOTHING RETURNING 1) SELECT (SELECT count(*) FROM ins), now()"),
            # One statement: the result is written only if the mark is, with its processed_at.
            # DO UPDATE: a row of an earlier mark of this id (pruned by a version that kept no
            # results) gives way.
            "claim_result": (
                f"WITH ins AS (INSERT INTO {t} (job_id, processed_at) VALUES (%s, to_timestamp(%s)) "
                "ON CONFLICT (job_id) DO NOTHING RETURNING job_id, processed_at), "
                f"res AS (INSERT INTO {r} (job_id, processed_at, value) "
                "SELECT job_id, processed_at, %s FROM ins ON CONFLICT (job_id) DO UPDATE "
                "SET processed_at = EXCLUDED.processed_at, value = EXCLUDED.value) "
                "SELECT (SELECT count(*) FROM ins), now()"),
            "seen": f"SELECT 1 FROM {t} WHERE job_id = %s",
            "kept_result": (f"SELECT r.value FROM {r} AS r JOIN {t} AS m ON m.job_id = r.job_id "
                            "AND m.processed_at = r.processed_at WHERE r.job_id = %s"),
            "prune_results": (f"DELETE FROM {r} WHERE job_id IN (SELECT job_id FROM {r} "
                              "WHERE processed_at < to_timestamp(%s) LIMIT %s)"),
            "prune": (f"DELETE FROM {t} WHERE job_id IN (SELECT job_id FROM {t} "
                      "WHERE processed_at < to_timestamp(%s) LIMIT %s)"),
            "bind": (f"INSERT INTO {self.table.q('_meta')} (name, value) VALUES ('service', %s) "
                     f"ON CONFLICT (name) DO NOTHING"),
            "bound": f"SELECT value FROM {self.table.q('_meta')} WHERE name = 'service'",
        }
        self._create_schema()

    # ------------------------------------------------------------------ connections
    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"{WHAT} ({self.table}) is closed")

    def _thread_lock(self) -> threading.RLock:
        """Held by this thread while it uses its connection: close() never closes a
        connection in the middle of a call."""
        lock: threading.RLock | None = getattr(self._local, "lock", None)
        if lock is None:
            lock = self._local.lock = threading.RLock()
        return lock

    def _thread_conn(self) -> Any:
        """This thread's autocommit connection (DSN mode), opened on first use."""
        self._check_open()
        conn = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        dsn = self.dsn
        if dsn is None:  # no engine means a DSN (__init__)
            raise InvalidConfig(f"{WHAT}: no DSN to connect with")
        conn = pgconn.connect(dsn, what=WHAT, application_name=f"shardq worker pid={os.getpid()}")
        with self._lock:
            if self._closed:
                conn.close()
                self._check_open()
            self._conns.append((conn, self._thread_lock()))
        self._local.conn = conn
        return conn

    def release_thread(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            return
        with self._lock:
            self._conns = [(c, lock) for c, lock in self._conns if c is not conn]
        with self._thread_lock():
            self._drop_thread_conn()

    def _drop_thread_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.contextmanager
    def _autocommit(self) -> Iterator[Any]:
        """A psycopg connection outside any handler transaction; what runs on it commits."""
        self._check_open()
        if self._engine is None:
            with self._thread_lock():
                yield self._thread_conn()
            return
        with self._engine.connect() as sa_conn:
            db = sa_conn.connection.driver_connection
            try:
                yield db
                db.commit()
            except BaseException as exc:
                if pgconn.is_disconnect(exc, db):
                    sa_conn.invalidate()  # not back into the pool
                raise

    def _retrying(self, fn: Callable[[Any], Any], retry_s: float | None = None) -> Any:
        """``fn(conn)`` on an autocommit connection; after a lost connection, again on a new
        one for up to ``reconnect_s`` (``fn`` did nothing on the dead one)."""
        def once() -> Any:
            with self._autocommit() as db:
                return fn(db)
        return pgconn.retry_disconnects(
            once, self.reconnect_s if retry_s is None else retry_s, clock=self._clock, what=WHAT,
            on_disconnect=self._drop_thread_conn if self._engine is None else None,
            stop=lambda: self._closed)

    def _create_schema(self) -> None:
        def create(db: Any) -> None:
            # CREATE ... IF NOT EXISTS races with itself; workers starting together take turns.
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"shardq:{self.table}",))
                for stmt in schema_sql(self.table):
                    db.execute(stmt)
        self._retrying(create, retry_s=0)  # a bad DSN fails now, clearly, without waiting

    # ------------------------------------------------------------------ the interface
    def _bound_service(self, service_id: str) -> str:
        def bind(db: Any) -> str:
            with db.transaction():
                db.execute(self._sql["bind"], (service_id,))
                return str(db.execute(self._sql["bound"]).fetchone()[0])
        return str(self._retrying(bind))

    def seen(self, job_id: Any) -> bool:
        key = job_key(job_id)
        return bool(self._retrying(lambda db: db.execute(self._sql["seen"], (key,)).fetchone() is not None))

    def kept_result(self, job_id: Any) -> bytes | None:
        key = job_key(job_id)
        row = self._retrying(lambda db: db.execute(self._sql["kept_result"], (key,)).fetchone())
        return None if row is None else bytes(row[0])

    def prune(self, now: float) -> int:
        """Results, then marks, older than the retention (a result has its mark's
        processed_at: one cutoff for both); returns how many marks."""
        cutoff = now - self.retention_s
        self._delete_older("prune_results", cutoff)
        return self._delete_older("prune", cutoff)

    def _delete_older(self, sql: str, cutoff: float) -> int:
        total = 0
        while True:  # each batch is its own short transaction
            n: int = self._retrying(lambda db: db.execute(self._sql[sql], (cutoff, PRUNE_BATCH_ROWS)).rowcount)
            total += n
            if n < PRUNE_BATCH_ROWS:
                return total

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn]:
        if getattr(self._local, "in_txn", False):
            raise RuntimeError("nested idempotency transaction in one thread")
        begin: Callable[[], _Begun]
        lock: contextlib.AbstractContextManager[Any]
        if self._engine is not None:
            begin, lock = self._begin_session, contextlib.nullcontext()
        else:
            begin, lock = self._begin_conn, self._thread_lock()
        with lock:
            db, session, started_at, end = begin()
            txn = _PgTxn(db, session, started_at, self._sql, self._clock)
            self._local.in_txn = True
            try:
                try:
                    yield txn
                except BaseException:
                    end(False)
                    raise
                end(not txn.aborted)
            finally:
                self._local.in_txn = False
                txn.db.close()
                if self._closed and self._engine is None:
                    self._drop_thread_conn()  # close() left it to us

    def _begin_conn(self) -> _Begun:
        idle = pgconn.psycopg().pq.TransactionStatus.IDLE

        def begin(db: Any) -> tuple[Any, Any]:
            if db.info.transaction_status != idle:  # left open by a failure: start clean
                db.execute("ROLLBACK")
            cur = db.execute(self._sql["begin"])
            cur.nextset()
            return db, cur.fetchone()[1]
        db, started_at = self._retrying(begin)

        def end(commit: bool) -> None:
            if commit:
                try:
                    db.execute("COMMIT")
                except Exception as exc:
                    if pgconn.is_disconnect(exc, db):  # the outcome is unknown; the queue retries
                        raise pgconn.unavailable(exc, f"{WHAT} (outcome of COMMIT unknown)") from None
                    raise
            elif not db.closed:
                try:
                    db.execute("ROLLBACK")
                except Exception:  # a dead connection rolled back on the server already
                    if not db.closed:
                        raise
        return db, None, started_at, end

    def _begin_session(self) -> _Begun:
        ms = str(int(self.lock_timeout_s * 1000))

        def begin() -> tuple[Any, Any, Any]:
            session = self._sessionmaker()
            try:
                db = session.connection().connection.driver_connection
                started_at = db.execute(self._sql["local_timeout"], (ms,)).fetchone()[1]
            except BaseException as exc:
                if pgconn.is_disconnect(_orig(exc)):
                    with contextlib.suppress(Exception):
                        session.connection().invalidate()  # a dead pooled connection: drop it
                session.close()
                raise
            return session, db, started_at
        session, db, started_at = pgconn.retry_disconnects(
            begin, self.reconnect_s, clock=self._clock, what=WHAT, stop=lambda: self._closed)

        def end(commit: bool) -> None:
            try:
                if commit:
                    session.commit()
                else:
                    session.rollback()
            except Exception as exc:
                if not pgconn.is_disconnect(_orig(exc)):
                    raise
                with contextlib.suppress(Exception):
                    session.connection().invalidate()
                if commit:  # the queue retries the job; the mark tells whether it committed
                    raise pgconn.unavailable(_orig(exc), f"{WHAT} (outcome of COMMIT unknown)") from None
            finally:
                session.close()
        return db, session, started_at, end

    def close(self) -> None:
        """Refuse further use and close the connections this store opened. A connection in
        use right now (a handler still running) is left to its thread, which ends its
        transaction as usual and then closes it."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn, lock in conns:
            if lock.acquire(blocking=False):
                try:
                    conn.close()
                finally:
                    lock.release()
        if self._owns_engine and self._engine is not None:
            self._engine.dispose()

    def reopen_spec(self) -> tuple[Callable[..., IdempotencyStore], tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {"table": self.table.name, "retention_s": self.retention_s,
                  "lock_timeout_s": self.lock_timeout_s, "reconnect_s": self.reconnect_s}
        if self._engine is None:
            return (PostgresStore, (self.dsn,), kwargs)
        # An engine cannot be pickled: the child builds one from the same URL (default options).
        return (_from_sqlalchemy_url, (self._engine.url.render_as_string(hide_password=False),), kwargs)


# ---------------------------------------------------------------------------- SQLAlchemy
def _sqlalchemy(target: Any) -> tuple[Any, Any]:
    """(sessionmaker, engine) from an Engine or a sessionmaker; InvalidConfig otherwise."""
    try:
        import sqlalchemy
        from sqlalchemy.orm import sessionmaker
    except ImportError:
        raise InvalidConfig(f"{WHAT}: target must be a PostgreSQL DSN (a string), got "
                            f"{type(target).__name__}") from None
    if isinstance(target, sqlalchemy.engine.Engine):
        engine, maker = target, sessionmaker(bind=target)
    elif isinstance(target, sessionmaker):
        engine, maker = target.kw.get("bind"), target  # type: ignore[assignment]  # checked on the next line
        if not isinstance(engine, sqlalchemy.engine.Engine):
            raise InvalidConfig(f"{WHAT}: the sessionmaker must be bound to an Engine (bind=engine)")
    else:
        raise InvalidConfig(f"{WHAT}: target must be a DSN, an SQLAlchemy Engine or a sessionmaker, "
                            f"got {type(target).__name__}")
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        raise InvalidConfig(f"{WHAT}: the engine must use PostgreSQL through psycopg 3 "
                            f"(postgresql+psycopg://...), got {engine.dialect.name}+{engine.dialect.driver}")
    return maker, engine


def _from_sqlalchemy_url(url: str, **kwargs: Any) -> PostgresStore:
    import sqlalchemy
    return PostgresStore(sqlalchemy.create_engine(url), _owns_engine=True, **kwargs)


def _orig(exc: BaseException) -> BaseException:
    """The driver's exception under an SQLAlchemy wrapper (``DBAPIError.orig``)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc
