"""Connecting to the user's PostgreSQL (psycopg 3): typed errors, retries, table names.

Shared by the PostgreSQL idempotency store (:mod:`shardq.consumer.postgres`) and the outbox
(:mod:`shardq.outbox`). psycopg is imported only here and only when called, so shardq runs
without it (``pip install 'shardq[postgres]'`` adds it).

* A malformed DSN or table name is :class:`~shardq.errors.InvalidConfig`; a server that
  cannot be reached, refuses the login or lacks the database is
  :class:`~shardq.errors.StoreUnavailable` with the server's own words.
* :func:`retry_disconnects` waits for a server that is restarting, for a bounded time.
"""
from __future__ import annotations

import re
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from .clock import Clock
from .errors import InvalidConfig, StoreUnavailable

if TYPE_CHECKING:
    from psycopg import Connection, Cursor

CONNECT_TIMEOUT_S = 10      # libpq connect_timeout for every connection shardq opens
RECONNECT_S_DEFAULT = 30.0  # how long a lost connection is retried before StoreUnavailable
_RETRY_S_MIN, _RETRY_S_MAX = 0.05, 2.0

# Lower-case SQL identifiers only, optionally schema-qualified; short enough that the
# longest derived name (table + "_attempts") fits PostgreSQL's 63 bytes.
_TABLE = re.compile(r"^(?:([a-z_][a-z0-9_]{0,62})\.)?([a-z_][a-z0-9_]{0,53})$")


def psycopg() -> ModuleType:
    """The psycopg module, or InvalidConfig saying how to install it."""
    try:
        import psycopg as mod
    except ImportError:
        raise InvalidConfig("PostgreSQL support needs psycopg 3: pip install 'shardq[postgres]'") from None
    return mod


URL_SCHEMES = ("postgresql://", "postgres://")


def is_url(target: Any) -> bool:
    """A PostgreSQL URL (``postgresql://...``, ``postgres://...``), as the CLI tells a DSN
    from a SQLite path."""
    return isinstance(target, str) and target.startswith(URL_SCHEMES)


class TableName:
    """A checked table name and the names derived from it, quoted for SQL."""

    def __init__(self, name: str):
        m = _TABLE.match(name) if isinstance(name, str) else None
        if m is None:
            raise InvalidConfig(
                f"table must be a lower-case SQL name of at most 54 characters, optionally "
                f"'schema.name' (letters, digits, _), got {name!r}")
        self.name = name
        self.schema, self.base = m.group(1), m.group(2)

    @classmethod
    def of(cls, table: str | TableName) -> TableName:
        return table if isinstance(table, TableName) else cls(table)

    def q(self, suffix: str = "") -> str:
        """``"schema"."base<suffix>"``: the table, or a table beside it."""
        base = f'"{self.base}{suffix}"'
        return f'"{self.schema}".{base}' if self.schema else base

    def ident(self, suffix: str) -> str:
        """An unqualified name (indexes, triggers: they live in the table's schema)."""
        return f'"{self.base}{suffix}"'

    def __str__(self) -> str:
        return self.name


def _describe(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def connect(dsn: str, *, autocommit: bool = True, what: str = "database", **kwargs: Any) -> Connection[Any]:
    """Open a psycopg connection; typed errors (see the module docstring)."""
    pg = psycopg()
    try:
        conn: Connection[Any] = pg.connect(dsn, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S,
                                           **kwargs)
        return conn
    except pg.ProgrammingError as exc:  # libpq could not parse the DSN
        raise InvalidConfig(f"{what}: bad PostgreSQL DSN: {_describe(exc)}") from None
    except pg.OperationalError as exc:
        raise StoreUnavailable(f"{what}: cannot connect to PostgreSQL: {_describe(exc)}") from None


def one_row(cursor: Cursor[Any]) -> Any:
    """The row of a query that always returns one (an aggregate with no GROUP BY)."""
    row = cursor.fetchone()
    if row is None:
        raise RuntimeError("no row from a query that always returns one")
    return row


def retry_disconnects(fn: Callable[[], Any], retry_s: float, *, clock: Clock, what: str,
                      on_disconnect: Callable[[], None] | None = None,
                      stop: Callable[[], bool] | None = None) -> Any:
    """``fn()``, called again with backoff while it fails because the server cannot be
    reached or dropped the connection (a restart), for at most ``retry_s`` seconds; then
    :class:`StoreUnavailable`. Only for calls that did nothing on a dead connection, or
    whose effect is safe to repeat. ``on_disconnect()`` runs after each such failure (drop
    the dead connection); ``stop()`` returning True ends the wait early."""
    deadline = None
    delay = _RETRY_S_MIN
    while True:
        try:
            return fn()
        except Exception as exc:
            orig = getattr(exc, "orig", None) or exc  # under an SQLAlchemy wrapper
            if not (isinstance(exc, StoreUnavailable) or is_disconnect(orig)):
                raise
            if on_disconnect is not None:
                on_disconnect()
            now = clock.monotonic()
            if deadline is None:
                deadline = now + retry_s
            if now + delay > deadline or (stop is not None and stop()):
                if isinstance(exc, StoreUnavailable):
                    raise
                raise unavailable(orig, what) from None
        time.sleep(delay)
        delay = min(_RETRY_S_MAX, delay * 2)


def is_disconnect(exc: BaseException, conn: Connection[Any] | None = None) -> bool:
    """True if ``exc`` means the connection is gone (server restart, network), not that a
    statement was wrong. With ``conn``: only if that connection is now unusable."""
    pg = psycopg()
    if not isinstance(exc, pg.OperationalError):
        return False
    return conn is None or conn.closed or conn.broken


def unavailable(exc: BaseException, what: str) -> StoreUnavailable:
    return StoreUnavailable(f"{what}: lost the PostgreSQL connection: {_describe(exc)}")
