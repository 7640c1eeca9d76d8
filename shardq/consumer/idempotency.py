"""Idempotency stores: a durable record of processed job ids, for exactly-once *effects*.

A handler's writes and the "job N is processed" mark commit in one transaction, so they
land together or not at all; a redelivered job finds the mark and is skipped::

    with store.transaction() as txn:
        handler_writes(txn.db)             # the effect, in the store's own database
        if not txn.claim(job_id):          # UNIQUE: another delivery already committed it
            txn.abort()                    # roll back: the effect exists once already
    queue.ack(lease)                       # after the commit, never before

``txn.claim(job_id, result)`` keeps the job's result (bytes) with its mark, in the same
transaction; ``store.kept_result(job_id)`` gives it back to a redelivery that is skipped,
so it reports what the first delivery produced.

:class:`IdempotencyStore` is the interface; :class:`SqliteStore` is the default (stdlib
``sqlite3``, WAL, ``synchronous=FULL``) and :class:`MemoryStore` the in-memory one for tests.
See docs/guarantees.md for what this does and does not promise.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any, Self, TypeVar
from collections.abc import Callable

from .. import limits
from ..clock import Clock, SystemClock
from ..errors import Closed, Fail, InvalidConfig, InvalidJob, UsageError

log = logging.getLogger("shardq.worker")

#: How long a processed mark is kept. A delivery of the same job id after this (a redrive
#: from the dead-letter queue weeks later) runs the handler again. Bounded by time, never
#: by count: dropping marks early would silently break exactly-once effects.
RETENTION_S_DEFAULT = 7 * 86400.0
#: How long a transaction waits for another one holding the database's write lock (or the
#: same job id) before it fails.
BUSY_TIMEOUT_S_DEFAULT = 30.0
#: prune() deletes in transactions of at most this many rows, to keep the write lock short.
PRUNE_BATCH_ROWS = 10_000
JOB_ID_MAX = 2**63 - 1  # SQLite INTEGER

TABLE = "shardq_processed"
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    job_id       INTEGER PRIMARY KEY,   -- UNIQUE: a job id is marked at most once
    processed_at REAL NOT NULL          -- wall-clock seconds, for prune()
);
CREATE INDEX IF NOT EXISTS {TABLE}_at ON {TABLE}(processed_at);
CREATE TABLE IF NOT EXISTS {TABLE}_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# String job ids (backends such as SQS) get a table of their own, created on first use, so
# a store holding integer marks is read as it is, with no migration.
TEXT_TABLE = f"{TABLE}_text"
TEXT_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TEXT_TABLE} (
    job_id       TEXT PRIMARY KEY,      -- UNIQUE: a job id is marked at most once
    processed_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS {TEXT_TABLE}_at ON {TEXT_TABLE}(processed_at);
"""
# Results kept with marks (``claim(job_id, result)``) have tables of their own, created IF
# NOT EXISTS (the int one on open, the text one on first use): a store written by an
# earlier version is read as it is, with no migration. A result row carries its mark's
# processed_at and counts only beside that very mark (kept_result joins on both), so a row
# left behind by a version that pruned marks alone is never taken for a later claim's.
RESULTS_TABLE = "shardq_results"
RESULTS_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {RESULTS_TABLE} (
    job_id       INTEGER PRIMARY KEY,
    processed_at REAL NOT NULL,         -- its mark's
    value        BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS {RESULTS_TABLE}_at ON {RESULTS_TABLE}(processed_at);
"""
RESULTS_TEXT_TABLE = f"{RESULTS_TABLE}_text"
RESULTS_TEXT_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {RESULTS_TEXT_TABLE} (
    job_id       TEXT PRIMARY KEY,
    processed_at REAL NOT NULL,
    value        BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS {RESULTS_TEXT_TABLE}_at ON {RESULTS_TEXT_TABLE}(processed_at);
"""


def check_job_id(job_id: Any) -> int | str:
    """A job id as every store accepts it (SQLite, PostgreSQL, memory alike): an int in
    [0, 2**63) or a non-empty string of at most ``limits.JOB_ID_STR_BYTES_MAX`` bytes in
    UTF-8 (an SQS MessageId is 36); InvalidJob otherwise, lone surrogates included."""
    if type(job_id) is int and 0 <= job_id <= JOB_ID_MAX:
        return job_id
    if type(job_id) is str and job_id:
        try:
            if len(job_id.encode()) <= limits.JOB_ID_STR_BYTES_MAX:
                return job_id
        except UnicodeEncodeError:  # a lone surrogate: no store's text holds it
            pass
    raise InvalidJob(f"job_id must be an int in [0, 2**63) or a non-empty string of at most "
                     f"{limits.JOB_ID_STR_BYTES_MAX} bytes in UTF-8, got {job_id!r:.80}")


def transaction_ended(how: str) -> Fail:
    """The refusal of a claim in a transaction the handler ended itself (``how``): what it
    wrote before is committed without the job's mark, so a retry would write it again. A
    Fail: the job is dead-lettered at once, its effect there once."""
    return Fail(f"the handler ended the job's transaction ({how}): what it wrote before that is committed "
                "without the job's mark, and running it again would write it again, so the job is "
                "dead-lettered, not retried (docs/guarantees.md: write through ctx.db, never COMMIT)")


def check_result(result: Any) -> bytes | None:
    """A result as the stores keep it: None, or bytes of at most ``RESULT_BYTES_MAX``."""
    if result is None:
        return None
    if not isinstance(result, bytes):
        raise InvalidJob(f"a job's result must be bytes, got {type(result).__name__}")
    if len(result) > limits.RESULT_BYTES_MAX:
        raise InvalidJob(f"a job's result is {len(result)} bytes, more than RESULT_BYTES_MAX="
                         f"{limits.RESULT_BYTES_MAX}")
    return result


def _table_for(job_id: int | str) -> str:
    return TABLE if type(job_id) is int else TEXT_TABLE


def _results_table_for(job_id: int | str) -> str:
    return RESULTS_TABLE if type(job_id) is int else RESULTS_TEXT_TABLE


class Txn:
    """One open transaction. ``db`` is where the handler writes its effect; ``claim``
    marks a job processed (it commits with the transaction, or not at all). ``session``:
    an SQLAlchemy session in the same transaction, for stores that have one."""

    db: Any
    session: Any = None

    def __init__(self) -> None:
        self.aborted = False

    def claim(self, job_id: int | str, result: bytes | None = None) -> bool:
        """Mark ``job_id`` processed. False if it already is (committed by another
        transaction, or claimed earlier in this one). Waits while another open transaction
        may claim it, so two deliveries of one job never both get True.

        ``result``: bytes (at most ``limits.RESULT_BYTES_MAX``) kept with the mark, in this
        transaction: it lands with the mark or not at all (see ``kept_result``). A claim
        that returns False keeps nothing. A result that is not bytes, or is too large,
        raises InvalidJob before anything is written."""
        raise NotImplementedError

    def abort(self) -> None:
        """Roll back instead of committing when the ``with`` block ends."""
        self.aborted = True


class IdempotencyStore:
    """Interface. ``transaction()`` commits on a normal exit, rolls back on an exception
    or after ``txn.abort()``."""

    retention_s: float

    def transaction(self) -> contextlib.AbstractContextManager[Txn]:
        raise NotImplementedError

    def seen(self, job_id: int | str) -> bool:
        """True if ``job_id`` has a committed mark."""
        raise NotImplementedError

    def kept_result(self, job_id: int | str) -> bytes | None:
        """The result committed with ``job_id``'s mark (``txn.claim(job_id, result)``);
        None if it was claimed without one, or is not marked (never, rolled back, pruned)."""
        raise NotImplementedError

    def prune(self, now: float) -> int:
        """Delete marks older than ``now - retention_s``, and the results kept with them;
        returns how many marks."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def release_thread(self) -> None:
        """Close the calling thread's own connection, if the store keeps one per thread: a
        thread that ends (the asyncio worker runs each job's transaction in a thread of its
        own) would hold it until :meth:`close`. Its next use opens another. A store that
        keeps none does nothing."""

    def bind(self, service_id: str) -> None:
        """Tie this store to one shardq service (a data dir, or an SQS region/account/prefix:
        the queue's ``service_id``), or raise InvalidConfig if it holds marks of another. Job ids
        start again in every new data dir: marks left by an old one would make new jobs with the
        same ids look processed, and be skipped."""
        bound = self._bound_service(service_id)
        if bound != service_id:
            raise InvalidConfig(
                f"this idempotency store holds marks of shardq service {bound}, not {service_id}: "
                "job ids start again in every data dir, so reusing it would skip new jobs as "
                "duplicates. Use a new store (file) for this data dir.")

    def _bound_service(self, service_id: str) -> str:
        """Record ``service_id`` if none is recorded; return the recorded one."""
        raise NotImplementedError

    def reopen_spec(self) -> tuple[Callable[..., IdempotencyStore], tuple[Any, ...], dict[str, Any]]:
        """``(factory, args, kwargs)``, picklable, that opens this store in another process
        (the worker's process mode)."""
        raise TypeError(f"{type(self).__name__} cannot be opened in another process")


@contextlib.contextmanager
def pruning(store: IdempotencyStore | None, clock: Clock, every_s: float | None) -> Iterator[None]:
    """While the block runs, prune ``store`` (None: a worker without one) at its start and
    every ``every_s`` seconds (None: never) in a daemon thread of its own, so a prune
    waiting for the write lock never delays a worker's loop (or until the store is closed)."""
    stop = threading.Event()

    def prune_loop(store: IdempotencyStore) -> None:
        while True:
            try:
                n = store.prune(clock.now())
                if n:
                    log.info("idempotency store: pruned %d marks", n)
            except Closed:
                return
            except Exception:
                log.warning("idempotency store: prune failed", exc_info=True)
            if stop.wait(every_s):
                return

    if store is not None and every_s is not None:
        threading.Thread(target=prune_loop, args=(store,), daemon=True, name="shardq-pruner").start()
    try:
        yield
    finally:
        stop.set()


# ---------------------------------------------------------------------------- SQLite
_T = TypeVar("_T")
#: The longest pause between two tries of a step SQLite refused without waiting.
LOCKED_RETRY_PAUSE_S_MAX = 0.05
# The wait for another process's lock runs in real time whatever clock the store keeps its
# marks by (a test's FakeClock never moves on its own: the wait would never end).
_WAIT_CLOCK: Clock = SystemClock()


def _while_locked(step: Callable[[], _T], timeout_s: float, clock: Clock = _WAIT_CLOCK) -> _T:
    """``step()``, tried again while SQLite answers ``database is locked``, for up to
    ``timeout_s``; then that error.

    For the steps SQLite refuses at once instead of waiting through its busy handler: the
    switch of a database to WAL needs an exclusive lock, and when another process opens the
    same file in the same instant (two workers started together on a new store) one of them
    is answered ``SQLITE_BUSY`` with no wait. Nothing signals the other process's release,
    so this polls, with pauses growing to ``LOCKED_RETRY_PAUSE_S_MAX``."""
    deadline = clock.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            return step()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or clock.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, LOCKED_RETRY_PAUSE_S_MAX)


class _Cursor(sqlite3.Cursor):
    """``txn.db`` of a SqliteStore: a plain DB-API cursor whose first statement (or first
    look at ``.connection``) opens the transaction with the write lock held.

    Why not a deferred ``BEGIN``: a transaction that reads first holds a snapshot, and when
    it then writes after another transaction committed, SQLite answers ``SQLITE_BUSY`` at
    once, without waiting for the busy timeout (the snapshot is stale; waiting cannot help).
    Every read-then-write handler under concurrency failed that way. Taking the lock with
    the first statement, not at ``transaction()``, lets handlers run in parallel until they
    touch ``ctx.db``."""

    _begin: Callable[[], bool]

    def execute(self, sql: str, parameters: Any = (), /) -> Self:
        self._begin()
        return super().execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> Self:
        self._begin()
        return super().executemany(sql, seq_of_parameters)

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        # sqlite3 COMMITs the open transaction first and runs the script outside it: the
        # job's writes would land without its mark, and again at each retry
        raise UsageError("ctx.db.executescript commits the job's transaction first (sqlite3) and runs outside "
                         "it: run each statement with ctx.db.execute")

    @property
    def connection(self) -> sqlite3.Connection:
        # Statements run on the connection itself must land inside the transaction too,
        # not in autocommit before it began.
        self._begin()
        return super().connection


class _SqliteTxn(Txn):
    def __init__(self, conn: sqlite3.Connection, clock: Clock, begin: Callable[[], bool]):
        super().__init__()
        self._conn = conn
        self._clock = clock
        self._begin = begin
        cur = conn.cursor(_Cursor)
        cur._begin = begin
        self.db = cur

    def claim(self, job_id: int | str, result: bytes | None = None) -> bool:
        result = check_result(result)
        table = _table_for(check_job_id(job_id))
        if self._begin():
            if not self._conn.in_transaction:
                # The handler ran COMMIT/ROLLBACK itself: its writes and the mark would not be atomic.
                raise transaction_ended("a COMMIT or ROLLBACK through ctx.db")
        if table == TEXT_TABLE:
            # Inside this transaction: the tables commit with the mark.
            _ensure_text_tables(self._conn, with_results=result is not None)
        now = self._clock.now()
        cur = self._conn.execute(
            f"INSERT OR IGNORE INTO {table}(job_id, processed_at) VALUES (?, ?)", (job_id, now))
        if cur.rowcount != 1:
            return False
        if result is not None:
            # REPLACE: a row of an earlier mark of this id (pruned by a version that kept
            # no results) gives way.
            self._conn.execute(
                f"INSERT OR REPLACE INTO {_results_table_for(job_id)}(job_id, processed_at, value) "
                "VALUES (?, ?, ?)", (job_id, now, result))
        return True


def _ensure_text_tables(conn: sqlite3.Connection, with_results: bool) -> None:
    script = TEXT_SCHEMA + (RESULTS_TEXT_SCHEMA if with_results else "")
    for stmt in script.split(";"):
        if stmt.strip():
            conn.execute(stmt)


def _has_table(conn: sqlite3.Connection, table: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                        (table,)).fetchone() is not None


def _delete_older(conn: sqlite3.Connection, table: str, cutoff: float) -> int:
    """Delete the rows of ``table`` whose processed_at is before ``cutoff``; how many."""
    total = 0
    while True:  # each statement is its own short transaction (autocommit)
        cur = conn.execute(
            f"DELETE FROM {table} WHERE job_id IN "
            f"(SELECT job_id FROM {table} WHERE processed_at < ? LIMIT ?)",
            (cutoff, PRUNE_BATCH_ROWS))
        total += cur.rowcount
        if cur.rowcount < PRUNE_BATCH_ROWS:
            return total


class SqliteStore(IdempotencyStore):
    """Processed job ids in a SQLite table (``shardq_processed``) next to the handler's
    own tables in the same file.

    One connection per thread (created on first use, closed by :meth:`close`), so a thread
    pool can share one store. ``journal_mode=WAL`` and ``synchronous=FULL``: a committed
    effect and its mark survive power loss.

    SQLite has one writer at a time. A transaction takes the write lock (``BEGIN
    IMMEDIATE``) with its first statement through ``txn.db``, or at the claim if the
    handler wrote nothing, and holds it to its commit; so a handler that reads, then writes,
    never fails with ``database is locked`` because another transaction wrote in between.
    Handlers run in parallel until they first use ``txn.db``: use it late. Threads of one
    store queue for the lock in this process (handed over at once, no polling); other
    processes wait through SQLite's busy handler. Each wait lasts at most ``busy_timeout_s``,
    then the statement raises ``sqlite3.OperationalError`` (``database is locked``).

    Job ids are unique within one shardq data dir: use one store (file) per data dir.
    """

    def __init__(self, path: str | os.PathLike[str], retention_s: float = RETENTION_S_DEFAULT,
                 clock: Clock | None = None, busy_timeout_s: float = BUSY_TIMEOUT_S_DEFAULT):
        path = os.fspath(path)
        if not path or path == ":memory:" or "mode=memory" in path:
            raise InvalidConfig("SqliteStore needs a file (use MemoryStore in memory)")
        if not retention_s > 0:
            raise InvalidConfig(f"retention_s must be > 0, got {retention_s!r}")
        if not busy_timeout_s >= 0:
            raise InvalidConfig(f"busy_timeout_s must be >= 0, got {busy_timeout_s!r}")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):  # (sqlite3 would say only "unable to open database file")
            raise InvalidConfig(f"SqliteStore {path}: directory {parent} does not exist")
        self.path = path
        self.retention_s = float(retention_s)
        self.busy_timeout_s = float(busy_timeout_s)
        self._clock = clock or SystemClock()
        self._local = threading.local()
        self._lock = threading.Lock()
        # The write lock among this store's threads: the holder is the one thread inside
        # BEGIN IMMEDIATE..COMMIT. SQLite's busy handler polls (sleeps of up to 100 ms),
        # so threads queue here instead, and only other processes meet the busy handler.
        self._writer = threading.Lock()
        # Every connection with the lock its thread holds while using it: close() never
        # closes a connection in the middle of a call (sqlite3 would crash).
        self._conns: list[tuple[sqlite3.Connection, threading.RLock]] = []
        self._closed = False
        with self._use() as conn:
            _while_locked(lambda: conn.executescript(SCHEMA + RESULTS_SCHEMA), self.busy_timeout_s)

    def _open(self) -> tuple[sqlite3.Connection, threading.RLock]:
        """This thread's connection and its lock, opened on first use."""
        pair: tuple[sqlite3.Connection, threading.RLock] | None = getattr(self._local, "pair", None)
        if pair is not None:
            return pair
        if self._closed:
            raise Closed(f"idempotency store {self.path} is closed")
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)  # used by its thread only; closed by close()
        try:
            mode = _while_locked(lambda: conn.execute("PRAGMA journal_mode=WAL").fetchone()[0],
                                 self.busy_timeout_s)
            if str(mode).lower() != "wal":
                raise InvalidConfig(f"{self.path}: journal_mode is {mode!r}, WAL is required")
            conn.execute("PRAGMA synchronous=FULL")
        except BaseException:
            conn.close()
            raise
        pair = (conn, threading.RLock())
        with self._lock:
            if self._closed:
                conn.close()
                raise Closed(f"idempotency store {self.path} is closed")
            self._conns.append(pair)
        self._local.pair = pair
        self._local.in_txn = False
        return pair

    def release_thread(self) -> None:
        pair: tuple[sqlite3.Connection, threading.RLock] | None = getattr(self._local, "pair", None)
        if pair is None:
            return
        self._local.pair = None
        with self._lock:
            if pair in self._conns:  # (else close() took it)
                self._conns.remove(pair)
        conn, lock = pair
        with lock:
            conn.close()

    @contextlib.contextmanager
    def _use(self) -> Iterator[sqlite3.Connection]:
        conn, lock = self._open()
        with lock:
            if self._closed:
                raise Closed(f"idempotency store {self.path} is closed")
            yield conn

    def _bound_service(self, service_id: str) -> str:
        with self._use() as conn:
            conn.execute(f"INSERT OR IGNORE INTO {TABLE}_meta(name, value) VALUES ('service', ?)",
                         (service_id,))
            bound: str = conn.execute(f"SELECT value FROM {TABLE}_meta WHERE name = 'service'").fetchone()[0]
            return bound

    def _take_write_lock(self, conn: sqlite3.Connection) -> None:
        """This thread's turn as the store's writer, then ``BEGIN IMMEDIATE``."""
        if not self._writer.acquire(timeout=self.busy_timeout_s):
            raise sqlite3.OperationalError(
                f"database is locked: {self.path}: another thread held the write lock for "
                f"busy_timeout_s={self.busy_timeout_s:g} s")
        try:
            conn.execute("BEGIN IMMEDIATE")  # other processes: SQLite's busy handler waits
        except BaseException:
            self._writer.release()
            raise

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn]:
        self._open()
        if self._local.in_txn:
            raise RuntimeError("nested idempotency transaction in one thread")
        with self._use() as conn:
            begun = False

            def begin() -> bool:
                """Open the transaction if it is not open; True if it already was."""
                nonlocal begun
                if begun:
                    return True
                self._take_write_lock(conn)
                begun = True
                return False

            txn = _SqliteTxn(conn, self._clock, begin)
            self._local.in_txn = True
            try:
                yield txn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            else:
                if txn.aborted:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                elif conn.in_transaction:
                    try:
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        raise
            finally:
                self._local.in_txn = False
                txn.db.close()
                if begun:
                    self._writer.release()

    def seen(self, job_id: int | str) -> bool:
        table = _table_for(check_job_id(job_id))
        with self._use() as conn:
            if table == TEXT_TABLE and not _has_table(conn, table):
                return False
            return conn.execute(f"SELECT 1 FROM {table} WHERE job_id = ?",
                                (job_id,)).fetchone() is not None

    def kept_result(self, job_id: int | str) -> bytes | None:
        table = _table_for(check_job_id(job_id))
        results = _results_table_for(job_id)
        with self._use() as conn:
            if table == TEXT_TABLE and not _has_table(conn, results):
                return None
            row = conn.execute(
                f"SELECT r.value FROM {results} AS r JOIN {table} AS m "
                "ON m.job_id = r.job_id AND m.processed_at = r.processed_at WHERE r.job_id = ?",
                (job_id,)).fetchone()
            return None if row is None else row[0]

    def prune(self, now: float) -> int:
        """Marks and results older than the retention, in short transactions of at most
        ``PRUNE_BATCH_ROWS`` rows. A result and its mark have one processed_at, so they
        go by the same cutoff."""
        cutoff = now - self.retention_s
        with self._use() as conn:
            if self._local.in_txn:
                raise RuntimeError("prune() inside a transaction")
            for table in (RESULTS_TABLE, RESULTS_TEXT_TABLE):
                if _has_table(conn, table):
                    _delete_older(conn, table, cutoff)
            total = _delete_older(conn, TABLE, cutoff)
            if _has_table(conn, TEXT_TABLE):
                total += _delete_older(conn, TEXT_TABLE, cutoff)
            return total

    def close(self) -> None:
        """Refuse further use and close every thread's connection. A connection that is
        in use right now (a handler still running) is left to its thread: it is rolled
        back and closed when that thread or the process ends."""
        with self._lock:
            self._closed = True
            pairs, self._conns = self._conns, []
        for conn, lock in pairs:
            if lock.acquire(blocking=False):
                try:
                    conn.close()
                finally:
                    lock.release()

    def reopen_spec(self) -> tuple[Callable[..., IdempotencyStore], tuple[Any, ...], dict[str, Any]]:
        return (SqliteStore, (self.path,),
                {"retention_s": self.retention_s, "busy_timeout_s": self.busy_timeout_s})


# ---------------------------------------------------------------------------- memory
_DELETED = object()


class _Overlay(MutableMapping[Any, Any]):
    """``txn.db`` of a MemoryStore: reads see committed data plus this transaction's
    writes; writes are staged and applied at commit. Assign values, do not mutate them."""

    def __init__(self, base: dict[Any, Any], lock: threading.Condition):
        self._base = base
        self._lock = lock
        self.writes: dict[Any, Any] = {}

    def __getitem__(self, k: Any) -> Any:
        if k in self.writes:
            v = self.writes[k]
            if v is _DELETED:
                raise KeyError(k)
            return v
        with self._lock:
            return self._base[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self.writes[k] = v

    def __delitem__(self, k: Any) -> None:
        if k not in self:
            raise KeyError(k)
        self.writes[k] = _DELETED

    def _keys(self) -> list[Any]:
        with self._lock:
            keys = dict.fromkeys(self._base)
        keys.update(dict.fromkeys(self.writes))
        return [k for k in keys if self.writes.get(k, None) is not _DELETED]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


class _MemoryTxn(Txn):
    def __init__(self, store: MemoryStore):
        super().__init__()
        self._store = store
        self.claims: list[int | str] = []
        self.results: dict[int | str, bytes] = {}   # staged with the claims, kept at commit
        self.db = _Overlay(store.data, store._cond)

    def claim(self, job_id: int | str, result: bytes | None = None) -> bool:
        result = check_result(result)
        if not self._store._claim(self, check_job_id(job_id)):
            return False
        if result is not None:
            self.results[job_id] = result
        return True


class MemoryStore(IdempotencyStore):
    """In-memory store for tests (one process). ``data`` holds the committed effects
    written through ``txn.db`` (a dict-like overlay); claims behave as SQLite's UNIQUE
    does: a claim of an id another open transaction claimed waits for it to end."""

    def __init__(self, retention_s: float = RETENTION_S_DEFAULT, clock: Clock | None = None,
                 busy_timeout_s: float = BUSY_TIMEOUT_S_DEFAULT):
        if not retention_s > 0:
            raise InvalidConfig(f"retention_s must be > 0, got {retention_s!r}")
        self.retention_s = float(retention_s)
        self.busy_timeout_s = float(busy_timeout_s)
        self._clock = clock or SystemClock()
        self._cond = threading.Condition()
        self.data: dict[Any, Any] = {}
        self.processed: dict[int | str, float] = {}   # job id -> processed_at (committed marks)
        self.results: dict[int | str, bytes] = {}     # job id -> result kept with its mark
        self._open_claims: dict[int | str, _MemoryTxn] = {}
        self._closed = False
        self.service: str | None = None  # the service id bound, once bound

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("idempotency store is closed")

    def _bound_service(self, service_id: str) -> str:
        with self._cond:
            if self.service is None:
                self.service = service_id
            return self.service

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn]:
        self._check_open()
        txn = _MemoryTxn(self)
        try:
            yield txn
        except BaseException:
            self._end(txn, commit=False)
            raise
        self._end(txn, commit=not txn.aborted)

    def _claim(self, txn: _MemoryTxn, job_id: int | str) -> bool:
        with self._cond:
            if not self._cond.wait_for(
                    lambda: self._open_claims.get(job_id, txn) is txn, self.busy_timeout_s):
                raise TimeoutError(f"job {job_id} is claimed by another open transaction")
            if job_id in self.processed or self._open_claims.get(job_id) is txn:
                return False
            self._open_claims[job_id] = txn
            txn.claims.append(job_id)
            return True

    def _end(self, txn: _MemoryTxn, commit: bool) -> None:
        closed = commit and self._closed
        with self._cond:
            if commit and not closed:
                for k, v in txn.db.writes.items():
                    if v is _DELETED:
                        self.data.pop(k, None)
                    else:
                        self.data[k] = v
                now = self._clock.now()
                for job_id in txn.claims:
                    self.processed[job_id] = now
                    if job_id in txn.results:
                        self.results[job_id] = txn.results[job_id]
            for job_id in txn.claims:
                del self._open_claims[job_id]
            self._cond.notify_all()
        if closed:
            raise Closed("idempotency store is closed")

    def seen(self, job_id: int | str) -> bool:
        self._check_open()
        with self._cond:
            return check_job_id(job_id) in self.processed

    def kept_result(self, job_id: int | str) -> bytes | None:
        self._check_open()
        with self._cond:
            return self.results.get(check_job_id(job_id))

    def prune(self, now: float) -> int:
        self._check_open()
        cutoff = now - self.retention_s
        with self._cond:
            old = [j for j, at in self.processed.items() if at < cutoff]
            for j in old:
                del self.processed[j]
                self.results.pop(j, None)
        return len(old)

    def close(self) -> None:
        self._closed = True
