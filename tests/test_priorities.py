"""Priorities are queue-wide, not per shard (issue 15, item 1).

With two shards, keyless jobs of priorities 0, 5, 5, 9 came out as [5, 9, 0, 5]: each shard
served its own highest first. Now a dequeue leases from one shard while it asks the others
which priorities they have ready, and keeps the highest over all of them.
"""
from __future__ import annotations

import pytest

from shardq.client.priority import plan
from shardq.client.router import shard_of_job

from service import Service


@pytest.fixture(scope="module")
def svc():
    with Service(shards=3) as s:
        yield s


def test_the_reported_case_comes_out_highest_first(svc):
    with svc.connect() as q:
        for prio in (0, 5, 5, 9):
            q.enqueue(f"p{prio}".encode(), priority=prio, queue="reported")
        got = []
        while (lease := q.dequeue("reported")) is not None:
            got.append(int(lease.body[1:]))
            q.ack(lease)
        assert got == [9, 5, 5, 0]


@pytest.mark.parametrize("max_jobs", [1, 3, 7, 50])
def test_many_priorities_on_every_shard(svc, max_jobs):
    queue = f"mixed{max_jobs}"
    with svc.connect() as q:
        prios = [(i * 7) % 11 - 3 for i in range(60)]  # negative, zero and positive
        ids = q.enqueue_many([{"body": str(p).encode(), "priority": p, "queue": queue} for p in prios])
        assert len({shard_of_job(j) for j in ids}) == 3
        got = []
        while leases := q.dequeue_many(queue, max_jobs=max_jobs):
            batch = [int(l.body) for l in leases]
            assert batch == sorted(batch, reverse=True)  # each call highest first
            got += batch
            assert q.ack_many(leases) == [None] * len(leases)
        assert got == sorted(prios, reverse=True)


def test_a_released_lower_lease_does_not_count_as_a_delivery(svc):
    """The low job's shard leases it while other shards still hold high ones: that lease
    is handed back unstarted, so the low job still comes out at attempt 1, last."""
    with svc.connect() as q:
        q.enqueue_many([{"body": b"low", "queue": "rel"}]
                       + [{"body": b"high", "priority": 9, "queue": "rel"}] * 5)
        got = []
        while (lease := q.dequeue("rel")) is not None:
            got.append((lease.body, lease.attempt))
            q.ack(lease)
        assert got == [(b"high", 1)] * 5 + [(b"low", 1)]


def test_the_plan_keeps_leases_in_hand_on_ties_and_releases_only_losers():
    assert plan([(0, "a"), (0, "b")], {1: [[0, 9]]}, [0, 1], 2) == (["a", "b"], [], {})
    assert plan([(5, "a"), (0, "b")], {1: [[9, 1], [0, 9]]}, [0, 1], 2) == (["a"], ["b"], {1: 1})
    assert plan([], {1: [[3, 2]], 2: [[7, 1], [3, 5]]}, [0, 2, 1], 3) == ([], [], {2: 3})
    assert plan([(1, "a")], {}, [0], 5) == (["a"], [], {})


def test_the_asyncio_client_serves_queue_wide_priorities_too(svc):
    import asyncio

    import shardq.client.aio as aio

    async def main():
        q = await aio.connect(svc.data_dir)
        try:
            await q.enqueue_many([{"body": str(p).encode(), "priority": p, "queue": "aioprio"}
                                  for p in (0, 5, 5, 9, -2, 7)])
            got = []
            while leases := await q.dequeue_many("aioprio", max_jobs=2):
                got += [int(l.body) for l in leases]
                await q.ack_many(leases)
            return got
        finally:
            await q.close()

    assert asyncio.run(main()) == [9, 7, 5, 5, 0, -2]
