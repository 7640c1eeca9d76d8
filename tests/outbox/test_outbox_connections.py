"""What ``shardq.outbox.enqueue`` takes as its connection. The check meant to refuse anything
but psycopg and SQLAlchemy let through any object with an ``execute`` method: a ``sqlite3``
connection ran the PostgreSQL insert and failed with ``near "%": syntax error`` (or, on a
table of that name, would have written the job into SQLite, where no relay reads). Now
anything but a psycopg (3) connection or cursor, or an SQLAlchemy session or connection on
psycopg, is ``InvalidConfig``; and every psycopg cursor or connection it takes works, its
cursor class and row factory aside."""
from __future__ import annotations

import sqlite3

import pytest

from support.pg import pg, pg_dsn  # noqa: F401 - pytest fixtures, requested by name in the tests below
from shardq import outbox
from shardq.errors import InvalidConfig

REFUSED = r"^outbox: need a psycopg connection or cursor, or an SQLAlchemy session or connection"


class HasExecute:
    """Anything with an execute(): it must never be called."""

    def __init__(self):
        self.calls: list = []

    def execute(self, *args):
        self.calls.append(args)
        raise AssertionError("execute() called")


def test_a_sqlite3_connection_is_refused_and_nothing_runs_in_it():
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE shardq_outbox (queue, key, body, priority, run_at)")  # would take the insert
    with pytest.raises(InvalidConfig, match=REFUSED + r".*, got sqlite3\.Connection$"):
        outbox.enqueue(conn, b"send receipt 42", key="order-42")
    with pytest.raises(InvalidConfig, match=r"got sqlite3\.Cursor$"):
        outbox.enqueue(conn.cursor(), b"send receipt 42")
    assert conn.execute("SELECT count(*) FROM shardq_outbox").fetchone() == (0,)
    conn.close()


@pytest.mark.parametrize("conn", [HasExecute(), object(), None, "postgresql://app@db/shop"],
                         ids=["has-execute", "object", "none", "a-dsn"])
def test_anything_else_is_refused_before_it_is_used(conn):
    with pytest.raises(InvalidConfig, match=REFUSED):
        outbox.enqueue(conn, b"x")
    assert getattr(conn, "calls", []) == []


def test_an_sqlalchemy_session_on_another_driver_is_refused():
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session
    engine = sqlalchemy.create_engine("sqlite://")
    try:
        with Session(engine) as session:
            with pytest.raises(InvalidConfig, match=REFUSED + r".*got sqlite3\.Connection$"):
                outbox.enqueue(session, b"x")
        with engine.connect() as conn:
            with pytest.raises(InvalidConfig, match=r"got sqlite3\.Connection$"):
                outbox.enqueue(conn, b"x")
    finally:
        engine.dispose()


def test_a_psycopg_async_connection_is_refused(pg_dsn):  # noqa: F811 - the fixture imported from pg
    import asyncio

    psycopg = pytest.importorskip("psycopg")

    async def main():
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            with pytest.raises(InvalidConfig, match=r"got psycopg\.AsyncConnection$"):
                outbox.enqueue(conn, b"x")
    asyncio.run(main())


def _rows(dsn: str) -> list[tuple]:
    import psycopg
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT queue, key, body FROM shardq_outbox ORDER BY id").fetchall()


@pytest.mark.parametrize("how", ["connection", "cursor", "client-cursor", "raw-cursor", "server-cursor",
                                 "dict-rows"])
def test_every_psycopg_connection_or_cursor_inserts_in_its_transaction(pg_dsn, how):  # noqa: F811
    psycopg = pytest.importorskip("psycopg")
    from psycopg.rows import dict_row
    outbox.install(pg_dsn)
    factory = {"client-cursor": psycopg.ClientCursor, "raw-cursor": psycopg.RawCursor}.get(how)
    with psycopg.connect(pg_dsn, **({"cursor_factory": factory} if factory else {}),
                         **({"row_factory": dict_row} if how == "dict-rows" else {})) as conn:
        target = (conn.cursor("named") if how == "server-cursor" else
                  conn.cursor() if how != "connection" else conn)
        first = outbox.enqueue(target, b"one", key="k", queue="mail")
        second = outbox.enqueue(target, b"two", key="k", queue="mail", delay=5, priority=1)
        assert isinstance(first, int) and second > first
        conn.rollback()                                  # in the caller's transaction: gone with it
        outbox.enqueue(target, b"kept", key="k", queue="mail")
    assert _rows(pg_dsn) == [("mail", "k", b"kept")]    # committed on leaving the block
