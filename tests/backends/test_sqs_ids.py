"""String job ids (an SQS MessageId) in the idempotency stores: a second table, created on
first use, so a store holding integer marks is read as it is."""
from __future__ import annotations

import sqlite3

import pytest

from shardq.consumer.idempotency import TABLE, TEXT_TABLE, MemoryStore, SqliteStore

SQS_ID = "8a1d2c6e-8e0b-4b38-9c4e-6f2b7f0f0c11"


def _tables(path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def test_an_int_store_is_untouched_until_a_string_id_is_claimed(tmp_path, clock):
    path = tmp_path / "effects.sqlite"
    store = SqliteStore(path, clock=clock)
    try:
        with store.transaction() as txn:
            assert txn.claim(7)
        assert not store.seen(SQS_ID)  # reading needs no text table
        assert TEXT_TABLE not in _tables(path)
        with store.transaction() as txn:
            txn.abort()
            assert txn.claim(SQS_ID)
        assert TEXT_TABLE not in _tables(path)  # created inside the aborted transaction: gone
        with store.transaction() as txn:
            assert txn.claim(SQS_ID)
        assert {TABLE, TEXT_TABLE} <= _tables(path)
        assert store.seen(SQS_ID) and store.seen(7) and not store.seen("7") and not store.seen(8)
        with store.transaction() as txn:
            assert not txn.claim(SQS_ID)  # UNIQUE, as for ints
    finally:
        store.close()


def test_prune_covers_both_tables(tmp_path, clock):
    store = SqliteStore(tmp_path / "effects.sqlite", retention_s=10, clock=clock)
    try:
        with store.transaction() as txn:
            txn.claim(1)
            txn.claim(SQS_ID)
        clock.advance(11)
        assert store.prune(clock.now()) == 2
        assert not store.seen(SQS_ID) and not store.seen(1)
    finally:
        store.close()


def test_memory_store_takes_string_ids(clock):
    store = MemoryStore(clock=clock)
    with store.transaction() as txn:
        assert txn.claim(SQS_ID)
    assert store.seen(SQS_ID)
    with store.transaction() as txn:
        assert not txn.claim(SQS_ID)


@pytest.mark.parametrize("job_id", ["x" * 1024, "x"])
def test_string_ids_up_to_the_limit(tmp_path, job_id):
    store = SqliteStore(tmp_path / "e.sqlite")
    try:
        with store.transaction() as txn:
            assert txn.claim(job_id)
        assert store.seen(job_id)
    finally:
        store.close()
