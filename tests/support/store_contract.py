"""The contract every idempotency store keeps, as tests taking a ``make_store`` fixture.

Imported by tests/consumer/test_idempotency.py (memory, SQLite) and
tests/consumer/test_postgres_store.py (PostgreSQL), whose ``make_store`` fixtures, and
test_store_results.py's, are :func:`stores` of their kinds."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from shardq import limits
from shardq.clock import FakeClock
from shardq.errors import Closed, InvalidJob


DAY = 86400.0


@contextlib.contextmanager
def stores(kind: str, request, tmp_path) -> Iterator:
    """``make(**kw)``: a new idempotency store of ``kind`` (memory, sqlite: one file in
    ``tmp_path``, postgres: the ``pg_dsn`` fixture's server), each closed at the end."""
    from shardq.consumer.idempotency import MemoryStore, SqliteStore
    made = []

    def make(**kw):
        if kind == "memory":
            store = MemoryStore(**kw)
        elif kind == "sqlite":
            store = SqliteStore(tmp_path / "idem.sqlite", **kw)
        else:
            from shardq.consumer.postgres import PostgresStore
            store = PostgresStore(request.getfixturevalue("pg_dsn"), **kw)
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            store.close()


# ---------------------------------------------------------------------------- contract
# A string id is measured in UTF-8 bytes by every store: 1,024 "é" are 2,048 bytes.
@pytest.mark.parametrize("job_id", [0, 2**63 - 1, "a", "x" * limits.JOB_ID_STR_BYTES_MAX,
                                    "\u00e9" * (limits.JOB_ID_STR_BYTES_MAX // 2)])
def test_int_and_string_job_ids_up_to_the_limit(make_store, job_id):
    store = make_store()
    assert not store.seen(job_id)
    with store.transaction() as txn:
        assert txn.claim(job_id)
    assert store.seen(job_id)


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, None, True, "", b"1", "\ud800",
                                 "x" * (limits.JOB_ID_STR_BYTES_MAX + 1),
                                 "\u00e9" * (limits.JOB_ID_STR_BYTES_MAX // 2 + 1)])
def test_bad_job_ids(make_store, bad):
    store = make_store()
    with pytest.raises(InvalidJob):
        store.seen(bad)
    with store.transaction() as txn, pytest.raises(InvalidJob):
        txn.claim(bad)


def test_claim_once_then_seen(make_store):
    store = make_store()
    assert not store.seen(7)
    with store.transaction() as txn:
        assert txn.claim(7)
        assert not txn.claim(7)  # twice in one transaction: the second is a duplicate
    assert store.seen(7)
    with store.transaction() as txn:
        assert not txn.claim(7)
        assert txn.claim(8)
    assert store.seen(8)


def test_exception_rolls_back_the_claim(make_store):
    store = make_store()
    with pytest.raises(ZeroDivisionError):
        with store.transaction() as txn:
            assert txn.claim(1)
            1 / 0  # noqa: B018 - raises ZeroDivisionError inside the transaction on purpose
    assert not store.seen(1)
    with store.transaction() as txn:
        assert txn.claim(1)  # free again
    assert store.seen(1)


def test_abort_rolls_back_the_claim(make_store):
    store = make_store()
    with store.transaction() as txn:
        assert txn.claim(2)
        txn.abort()
    assert not store.seen(2)


def test_prune_after_retention(make_store):
    clock = FakeClock()
    store = make_store(clock=clock)  # default retention: 7 days
    for job_id in (1, 2):
        with store.transaction() as txn:
            txn.claim(job_id)
        clock.advance(DAY)
    assert store.prune(clock.now()) == 0          # 2 days and 1 day old
    clock.advance(5.5 * DAY)
    assert store.prune(clock.now()) == 1          # job 1 is 7.5 days old, job 2 6.5
    assert not store.seen(1) and store.seen(2)
    clock.advance(DAY)
    assert store.prune(clock.now()) == 1
    assert not store.seen(2)


def test_retention_is_configurable(make_store):
    clock = FakeClock()
    store = make_store(clock=clock, retention_s=60.0)
    with store.transaction() as txn:
        txn.claim(3)
    clock.advance(59)
    assert store.prune(clock.now()) == 0
    clock.advance(2)
    assert store.prune(clock.now()) == 1


def test_concurrent_claims_of_one_id_one_wins(make_store):
    store = make_store()
    barrier = threading.Barrier(8)
    wins = []

    def claim():
        barrier.wait(5)
        with store.transaction() as txn:
            if txn.claim(42):
                wins.append(threading.get_ident())

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wins) == 1


def test_claim_waits_for_an_open_claim_and_wins_after_its_rollback(make_store):
    store = make_store()
    claimed, release, got = threading.Event(), threading.Event(), []

    def first():
        with store.transaction() as txn:
            txn.claim(5)
            claimed.set()
            release.wait(5)
            txn.abort()

    def second():
        with store.transaction() as txn:
            got.append(txn.claim(5))

    t1 = threading.Thread(target=first)
    t1.start()
    assert claimed.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join(0.05)
    assert t2.is_alive() and got == []  # blocked behind the open claim
    release.set()
    t1.join(5)
    t2.join(5)
    assert got == [True]
    assert store.seen(5)


def test_closed_store_refuses(make_store):
    store = make_store()
    store.close()
    with pytest.raises(Closed):
        store.seen(1)
    with pytest.raises(Closed):
        with store.transaction():
            pass


def test_a_thread_that_releases_its_connection_leaves_none_behind(make_store):
    """The asyncio worker runs each job's transaction in a thread of its own, which releases
    its per-thread store connection as it ends (``release_thread``): after 30 such threads
    the store holds no more connections than before them (it kept one a thread until
    close(): a walkthrough ran out of files, and of PostgreSQL's connection slots), and
    every claim they made stands."""
    store = make_store()
    store.seen(1)  # this thread's own connection, kept
    before = len(getattr(store, "_conns", ()))

    def job(i: int) -> None:
        with store.transaction() as txn:
            assert txn.claim(100 + i)
        store.release_thread()

    for i in range(30):
        t = threading.Thread(target=job, args=(i,))
        t.start()
        t.join()
    assert len(getattr(store, "_conns", ())) == before
    assert all(store.seen(100 + i) for i in range(30))
