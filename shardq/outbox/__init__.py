"""Transactional enqueue: jobs that exist if and only if your PostgreSQL transaction commits.

::

    with psycopg.connect(dsn) as conn:                  # or an SQLAlchemy session
        conn.execute("INSERT INTO orders ...")
        shardq.outbox.enqueue(conn, b"send receipt 42", key="order-42")
    # committed: the row is in the outbox; a relay moves it into the queue

* :func:`enqueue` (``enqueue.py``) inserts into the outbox table in the caller's transaction.
* :class:`Relay` (``relay.py``; CLI ``shardq outbox relay``) moves committed rows into the
  queue in batches, with the row id as ``dedup_id``, and deletes them only once the queue
  has them: exactly once within the queue's dedup window, per-key order kept, several
  relays at once (``FOR UPDATE SKIP LOCKED``), woken by LISTEN/NOTIFY. ``sending.py``
  sends a batch one shard at a time and says which rows the queue never took.
* :func:`install` / :func:`schema_sql` (``schema.py``) create the tables.

This package sits beside ``consumer/``: it uses the queue through the
:class:`~shardq.client.queue.Queue` protocol only. psycopg is imported when first used.
"""
from __future__ import annotations

from .enqueue import enqueue
from .relay import Relay, RelayStats, status
from .schema import TABLE_DEFAULT, install, schema_sql

__all__ = ["enqueue", "Relay", "RelayStats", "status", "install", "schema_sql", "TABLE_DEFAULT"]
