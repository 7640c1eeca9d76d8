"""``limits.max_pending_jobs`` counts the jobs a request would add (a real one-shard service
at its limit of 2): a resend of a dedup id still held, or a repeat within the batch, adds
none and is answered as ever with the first job's id (docs/design.md, docs/operations.md);
a request that would add one job too many is refused whole and changes nothing; dead
letters count towards the limit (the operations.md row says so)."""
from __future__ import annotations

import pytest
from support.service import Service

from shardq.errors import QueueFull

PENDING_MAX = 2


@pytest.fixture
def q():
    with Service(shards=1, config={"limits": {"max_pending_jobs": PENDING_MAX}}) as s:
        with s.connect() as r:
            yield r


def held(q) -> int:
    return q.stats()["shards"][0]["jobs"]


def test_a_resend_of_a_held_dedup_id_is_answered_on_a_full_shard(q):
    """The tester's repro: the third enqueue raised ``QueueFull: shard 0 holds 2 jobs; limit 2``."""
    first = q.enqueue(b"a", key="k1", dedup_id="order-1")
    q.enqueue(b"b", key="k2")
    assert held(q) == PENDING_MAX
    assert q.enqueue(b"a", key="k1", dedup_id="order-1") == first
    assert q.enqueue_many([{"body": b"a", "key": "k1", "dedup_id": "order-1"}] * 3) == [first] * 3
    with pytest.raises(QueueFull, match="holds 2 jobs; limit 2"):
        q.enqueue(b"c", key="k3")
    # all or nothing: a resend beside one new job is refused whole, its new dedup id not kept
    with pytest.raises(QueueFull):
        q.enqueue_many([{"body": b"a", "key": "k1", "dedup_id": "order-1"},
                        {"body": b"c", "key": "k3", "dedup_id": "order-3"}])
    assert held(q) == PENDING_MAX
    q.ack(q.dequeue(wait=2))
    third = q.enqueue(b"c", key="k3", dedup_id="order-3")  # a new job: order-3 was not kept
    assert third != first and held(q) == PENDING_MAX


def test_repeats_within_a_batch_add_one_job_so_the_batch_reaches_the_limit_exactly(q):
    items = [{"body": b"x", "key": "k1", "dedup_id": "order-1"}] * 3 + [{"body": b"y", "key": "k2"}]
    ids = q.enqueue_many(items)  # four items, two jobs: refused whole before the fix
    assert ids[0] == ids[1] == ids[2] != ids[3]
    assert held(q) == PENDING_MAX
    with pytest.raises(QueueFull):  # one job past the limit (one repeat, one new id)
        q.enqueue_many([{"body": b"x", "key": "k1", "dedup_id": "order-1"},
                        {"body": b"z", "key": "k3", "dedup_id": "order-2"},
                        {"body": b"z", "key": "k3", "dedup_id": "order-2"}])
    assert held(q) == PENDING_MAX


def test_dead_letters_count_towards_the_limit(q):
    q.enqueue(b"dies", key="k1")
    q.bury(q.dequeue(wait=2), error="no")
    q.enqueue(b"ready", key="k2")
    st = q.stats()
    assert st["queues"]["default"]["dead"] == 1 and st["queues"]["default"]["ready"] == 1
    with pytest.raises(QueueFull, match="holds 2 jobs; limit 2"):
        q.enqueue(b"one more", key="k3")
    assert q.purge_dead_letters() == 1  # gone from the shard: room again
    q.enqueue(b"one more", key="k3")
    assert held(q) == PENDING_MAX
