"""Replay never depends on today's config (issue 9, item 2).

A queue removed from the config (with ``declare_queues``) while it still holds jobs, or a
changed ``max_body_bytes``, ``dedup_window`` or ``max_deliveries``: the shard starts, what
was accepted replays as it was, and what is left stays reachable. Each case failed before:
replay looked queues up in today's config and raised UnknownQueue, so the shard never
started again.
"""
from __future__ import annotations

import logging

import pytest

import shardq
from shardq.clock import FakeClock
from shardq.shard.durable import Engine

from conftest import config_from
from support.service import Service

DECLARED = {"a": {}, "b": {"max_deliveries": 1}}


def test_a_queue_removed_from_the_config_still_replays_and_can_be_drained(tmp_path, caplog):
    clock = FakeClock()
    e = Engine(str(tmp_path), config_from(declare_queues=True, queues=DECLARED), clock=clock)
    e.enqueue(b"in a", queue="a")
    poison = e.enqueue(b"poison", queue="b")
    (lease,) = e.dequeue("b")
    e.nack(lease.job_id, lease.token)  # max_deliveries 1: a dead letter
    kept = e.enqueue(b"still in b", key="k", queue="b")
    behind = e.enqueue(b"behind it", key="k", queue="b")
    e.close()

    with caplog.at_level(logging.WARNING, logger="shardq.shard"):
        e = Engine(str(tmp_path), config_from(declare_queues=True, queues={"a": {}}), clock=clock)
    assert "queue 'b' is not declared in the config" in caplog.text and "3 jobs" in caplog.text
    st = e.stats()
    assert st["b"]["undeclared"] is True and (st["b"]["ready"], st["b"]["waiting"], st["b"]["dead"]) == (1, 1, 1)
    assert [d.job_id for d in e.dead_letters("b")] == [poison]
    with pytest.raises(shardq.UnknownQueue, match="no longer declared"):
        e.enqueue(b"new", queue="b")
    with pytest.raises(shardq.UnknownQueue):
        e.enqueue(b"never declared", queue="c")
    got = []
    for _ in range(2):
        (l,) = e.dequeue("b")
        got.append(l.job_id)
        e.ack(l.job_id, l.token)
    assert got == [kept, behind]
    assert e.redrive("b") == 1 and e.dequeue("b")[0].job_id == poison
    e.compact()
    e.close()
    Engine(str(tmp_path), config_from(declare_queues=True, queues={"a": {}}), clock=clock).close()


def test_records_accepted_under_another_config_replay_as_they_were(tmp_path):
    clock = FakeClock()
    e = Engine(str(tmp_path), config_from(dedup_window=300, max_body_bytes=4096), clock=clock)
    big = e.enqueue(b"x" * 4096, key="big")
    first = e.enqueue(b"once", dedup_id="order-7")
    e.close()
    # Smaller bodies allowed now, a 1 s dedup window: nothing already accepted changes.
    e = Engine(str(tmp_path), config_from(dedup_window=1, max_body_bytes=100), clock=clock)
    clock.advance(100)
    assert e.enqueue(b"again", dedup_id="order-7") == first  # the window it was accepted with
    leases = e.dequeue("default", max_jobs=10)
    assert {l.job_id: len(l.body) for l in leases}[big] == 4096
    with pytest.raises(shardq.InvalidJob):
        e.enqueue(b"x" * 101)  # new jobs follow today's limit
    e.compact()  # and a checkpoint keeps the logged expiry too
    e.close()
    e = Engine(str(tmp_path), config_from(dedup_window=1, max_body_bytes=100), clock=clock)
    clock.advance(150)
    assert e.enqueue(b"again", dedup_id="order-7") == first
    clock.advance(100)  # past the 300 s it was accepted with
    assert e.enqueue(b"again", dedup_id="order-7") != first
    e.close()


def test_a_service_starts_after_a_queue_with_jobs_left_its_config():
    cfg = {"service": {"declare_queues": True}, "queues": {"default": {}, "reports": {}}}
    with Service(shards=2, config=cfg) as svc:
        with svc.connect() as q:
            ids = q.enqueue_many([{"body": f"r{i}".encode(), "queue": "reports", "key": f"k{i}"} for i in range(6)])
        svc.stop()
        svc.config = {"service": {"declare_queues": True}, "queues": {"default": {}}}
        svc.log.close()
        svc.start()
        assert "queue 'reports' is not declared in the config" in svc.tail(200)
        with svc.connect() as q:
            st = q.stats()["queues"]["reports"]
            assert st["ready"] == 6 and st["undeclared"] is True
            with pytest.raises(shardq.UnknownQueue):
                q.enqueue(b"new", queue="reports")
            leases = q.dequeue_many("reports", max_jobs=10, wait=2)
            assert sorted(l.job_id for l in leases) == sorted(ids)
            assert q.ack_many(leases) == [None] * 6
