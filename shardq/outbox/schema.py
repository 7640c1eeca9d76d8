"""The outbox tables in the application's PostgreSQL database, and how to create them.

``<table>`` (default ``shardq_outbox``) holds one row per job not yet in the queue::

    id          bigint identity   the relay's dedup id is "outbox:<scope>:<id>"
    queue, key, body, priority    the job
    run_at      timestamptz       not before (enqueue's delay, counted from the insert); NULL: now
    created_at  timestamptz

Beside it: ``<table>_attempts`` (row id -> when the relay first sent it; written and
committed *before* the send, so a later relay knows how old a possible earlier enqueue
is; dropped again for a row the queue provably never took, see ``sending.py``; a mark
whose row is gone, deleted by hand, is not counted and the relay removes it. No foreign
key: its check would need a share lock on the row the relay's batch holds FOR UPDATE, from
the relay's other session), ``<table>_rejected`` (rows the queue refused, with the error), ``<table>_meta`` (the
table's random ``scope``, which keeps its dedup ids apart from every other outbox table's,
and ``refuses``: ``<backend>:<field>,...``, what the last relay started can not send).
A statement trigger ``NOTIFY``s the channel named like the table on every insert, so a
waiting relay wakes when the inserting transaction commits (and not before).
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from .. import pgconn

if TYPE_CHECKING:
    from psycopg import Connection

TABLE_DEFAULT = "shardq_outbox"


def channel(table: pgconn.TableName) -> str:
    """The LISTEN/NOTIFY channel of an outbox table: its name."""
    return table.name


def schema_sql(table: str | pgconn.TableName) -> list[str]:
    """The statements that create the outbox tables (idempotent; the trigger is created by
    :func:`install`, which checks for it first). For migration tools too."""
    table = pgconn.TableName.of(table)
    t = table.q()
    fn = table.q("_notify")
    return [
        f"CREATE TABLE IF NOT EXISTS {t} ("
        " id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " queue text NOT NULL,"
        " key text,"
        " body bytea NOT NULL,"
        " priority integer NOT NULL DEFAULT 0,"
        " run_at timestamptz,"
        " created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        # The relay's per-key order check: is there an older row of this key? O(log n).
        f"CREATE INDEX IF NOT EXISTS {table.ident('_key')} ON {t} (queue, key, id) WHERE key IS NOT NULL",
        f"CREATE TABLE IF NOT EXISTS {table.q('_attempts')} ("
        " id bigint PRIMARY KEY, first_at timestamptz NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {table.q('_rejected')} ("
        " id bigint PRIMARY KEY, queue text NOT NULL, key text, body bytea NOT NULL,"
        " priority integer NOT NULL, run_at timestamptz, created_at timestamptz NOT NULL,"
        " rejected_at timestamptz NOT NULL DEFAULT clock_timestamp(), error text NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {table.q('_meta')} (name text PRIMARY KEY, value text NOT NULL)",
        f"CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"PERFORM pg_notify('{channel(table)}', ''); RETURN NULL; END $$",
    ]


def install(db: str | Connection[Any], table: str | pgconn.TableName = TABLE_DEFAULT) -> str:
    """Create the outbox tables if missing and return the table's dedup scope. ``db``: a
    psycopg connection in autocommit mode (or a DSN). Safe to run from many processes at
    once (an advisory lock serialises it)."""
    table = pgconn.TableName.of(table)
    if isinstance(db, str):
        with pgconn.connect(db, what="outbox") as conn:
            return install(conn, table)
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"shardq:{table}",))
        for stmt in schema_sql(table):
            db.execute(stmt)
        if db.execute("SELECT 1 FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname = %s",
                      (table.q(), f"{table.base}_notify")).fetchone() is None:
            db.execute(f"CREATE TRIGGER {table.ident('_notify')} AFTER INSERT ON {table.q()} "
                       f"FOR EACH STATEMENT EXECUTE FUNCTION {table.q('_notify')}()")
        db.execute(f"INSERT INTO {table.q('_meta')} (name, value) VALUES ('scope', %s) "
                   "ON CONFLICT (name) DO NOTHING", (uuid.uuid4().hex,))
        scope: str = pgconn.one_row(db.execute(f"SELECT value FROM {table.q('_meta')} WHERE name = 'scope'"))[0]
        return scope
