"""``enqueue(conn, body, ...)``: add a job to the outbox table in the caller's transaction.

The row exists if and only if the caller's transaction commits, so the job exists if and
only if the order (or whatever else that transaction wrote) does. The relay moves it into
the queue afterwards. Everything the queue would refuse regardless of its configuration is
refused here, in the caller's transaction, with :class:`~shardq.errors.InvalidJob`; a
body over the queue's own ``max_body_bytes`` (or a queue the service does not declare) can
only be known by the service, and such a row ends in ``<table>_rejected``.

A delay or a priority is refused here with :class:`~shardq.errors.Unsupported` when the
queue behind the outbox cannot hold it (SQS FIFO has neither). The caller names no queue
target, only a connection and a table, so the target is known here only through the
relay: each relay records at start, in ``<table>_meta``, what its queue refuses; this reads
it (one more statement, only for a job with a delay or a priority). Rows written before a
relay ever ran, or by a user that may not read ``<table>_meta``, are checked by the relay
instead, which moves a refused row to ``<table>_rejected``.

This is the generic entry point, taking the body as bytes. A task layer could build on it
(encode a task's body, then call it); none does yet: ``Task.send`` and its kin enqueue
through the queue client, not into an outbox table.
"""
from __future__ import annotations

from typing import Any

from .. import limits, pgconn
from ..config import check_queue_name
from ..errors import InvalidConfig, InvalidJob, Unsupported
from ..protocol import validate
from .schema import TABLE_DEFAULT


def _insert_sql(table: str) -> str:
    return (f"INSERT INTO {pgconn.TableName(table).q()} (queue, key, body, priority, run_at) "
            "VALUES (%s, %s, %s, %s, clock_timestamp() + %s::float8 * interval '1 second') RETURNING id")


def driver_connection(conn: Any) -> Any:
    """The psycopg (3) connection or cursor under ``conn``: a psycopg ``Connection`` or
    ``Cursor`` as is; an SQLAlchemy ``Session`` or ``Connection`` -> its psycopg connection
    in the same transaction (a session's transaction begins here if it had not). Anything
    else (a ``sqlite3`` connection, psycopg2, an asyncio ``AsyncConnection``, an SQLAlchemy
    engine on another driver) is InvalidConfig: the SQL is PostgreSQL's, in psycopg's
    placeholders, and an object that merely has an ``execute`` method would run it."""
    if hasattr(conn, "get_bind") and hasattr(conn, "connection"):  # sqlalchemy.orm.Session
        conn = conn.connection()
    pooled = getattr(conn, "connection", None)
    driver = getattr(pooled, "driver_connection", None)  # sqlalchemy Connection
    if driver is not None:
        conn = driver
    try:
        pg = pgconn.psycopg()
    except InvalidConfig:  # no psycopg here: conn cannot be one of its connections
        pg = None
    if pg is None or not isinstance(conn, (pg.Connection, pg.Cursor)):
        kind = type(conn)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise InvalidConfig(f"outbox: need a psycopg connection or cursor, or an SQLAlchemy "
                            f"session or connection on psycopg (postgresql+psycopg://), got {name}")
    return conn


def _cursor(db: Any) -> Any:
    """A plain cursor on ``db``'s connection, in its transaction: the SQL here is written
    for it (``%s`` placeholders, rows as tuples), whatever cursor or ``row_factory`` the
    caller's connection makes (a RawCursor takes ``$1``; ``dict_row`` has no ``row[0]``)."""
    pg = pgconn.psycopg()
    from psycopg.rows import tuple_row
    return pg.Cursor(db if isinstance(db, pg.Connection) else db.connection, row_factory=tuple_row)


def enqueue(conn: Any, body: bytes, *, key: str | None = None, queue: str = "default",
            delay: float = 0, priority: int = 0, table: str = TABLE_DEFAULT) -> int:
    """Insert a job into the outbox in ``conn``'s current transaction; returns the row id.

    ``conn``: see :func:`driver_connection`. ``delay`` counts from now (the insert), not
    from when the relay moves the row. Jobs of one ``key`` reach the queue in the order of
    their rows (per-key FIFO, as with ``Queue.enqueue``)."""
    body = validate.body(body, limits.BODY_BYTES_MAX_CEILING)
    key = validate.key(key)
    check_queue_name(queue, InvalidJob)
    delay = validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
    priority = validate.priority(priority)
    db = driver_connection(conn)
    pg = pgconn.psycopg()
    try:
        with _cursor(db) as cur:
            if delay or priority:
                _check_target(cur, table, delay, priority)
            row = cur.execute(_insert_sql(table), (queue, key, body, priority, delay or None)).fetchone()
    except pg.errors.UndefinedTable:
        raise InvalidConfig(f"outbox table {table} does not exist: create it with "
                            f"shardq.outbox.install(dsn) or `shardq outbox init --dsn ...` "
                            "(the relay creates it too when it starts)") from None
    row_id: int = row[0]
    return row_id


def _check_target(db: Any, table: str, delay: float, priority: int) -> None:
    """Unsupported if the relays' queue refuses this job's delay or priority (recorded by
    each relay at start as ``<backend>:<field>,...``; nothing recorded, or no right to read
    it: the relay checks)."""
    meta = pgconn.TableName(table).q("_meta")
    # A SELECT the user may not run would abort the caller's transaction: ask first.
    if not db.execute("SELECT has_table_privilege(%s, 'SELECT')", (meta,)).fetchone()[0]:
        return
    row = db.execute(f"SELECT value FROM {meta} WHERE name = 'refuses'").fetchone()
    backend, _, fields = (row[0] if row else "").partition(":")
    refused = set(fields.split(","))
    if delay and "delay" in refused:
        raise Unsupported(f"outbox {table}: per-job delay is not supported by the {backend} backend its "
                          "relay sends to; enqueue without delay")
    if priority and "priority" in refused:
        raise Unsupported(f"outbox {table}: priority is not supported by the {backend} backend its relay "
                          "sends to; enqueue with priority 0")
