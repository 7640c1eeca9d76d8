"""Priorities are queue-wide, not per shard (issue 15, item 1).

With two shards, keyless jobs of priorities 0, 5, 5, 9 came out as [5, 9, 0, 5]: each shard
served its own highest first. Now a dequeue leases from one shard while it asks the others
which priorities they have ready, and keeps the highest over all of them.
"""
from __future__ import annotations

import os
import signal

import pytest

import shardq
from shardq.client.priority import plan
from shardq.client.effects import Collect
from shardq.client.router import Router, shard_for_key, shard_of_job
from shardq.shard.durable import DurableShard

from conftest import config_from
from support.service import Service, restarted


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


def _key_on(shard: int, shards: int = 3) -> str:
    return next(k for k in (f"k{i}" for i in range(1000)) if shard_for_key(k, shards) == shard)


def _spy_collect(router: Router, see) -> None:
    """Wrap the router's multi-request path (the handler of the engine's ``Collect`` effect of
    the asyncio client on its I/O thread): ``see(effect, outcomes)`` may change the outcomes."""
    io = router._shared()
    collect = io._handlers[Collect]

    async def spy(effect):
        out = await collect(effect)
        see(effect, out)
        return out
    io._handlers[Collect] = spy


def _peeks_seen(router: Router) -> list:
    """Record every op the router's multi-request path sends (:func:`_spy_collect`)."""
    sent = []
    _spy_collect(router, lambda effect, out: sent.extend(op for _, op, _ in effect.calls))
    return sent


def test_a_queue_without_priorities_is_leased_without_peeks(svc):
    """The peek round costs about 30% of single-job lease throughput with 2 shards: a
    plain queue never pays it."""
    with svc.connect() as q:
        q.enqueue_many([{"body": b"x", "queue": "plainq"} for _ in range(12)])
        sent = _peeks_seen(q)
        got = 0
        while (lease := q.dequeue("plainq")) is not None:
            q.ack(lease)
            got += 1
        assert got == 12 and "peek" not in sent


def test_a_fresh_consumer_learns_from_its_first_lease_that_the_queue_uses_priorities(svc):
    """The producer's router tells every shard before its first prioritized enqueue, so a
    consumer's router that never enqueued anything (it starts at shard 0) leases the high
    job from shard 2 on its first call, and the low one it had in hand is not a delivery."""
    with svc.connect() as producer:
        producer.enqueue(b"low", key=_key_on(0), queue="learn")
        producer.enqueue(b"high", key=_key_on(2), queue="learn", priority=9)
    with svc.connect() as consumer:
        assert "learn" not in consumer._prioritized
        sent = _peeks_seen(consumer)
        first = consumer.dequeue("learn")
        assert first.body == b"high" and "peek" in sent and "learn" in consumer._prioritized
        second = consumer.dequeue("learn")
        assert (second.body, second.attempt) == (b"low", 1)
        assert consumer.ack_many([first, second]) == [None, None]


def test_a_shard_that_misses_the_note_is_told_with_the_next_prioritized_enqueue(svc):
    with svc.connect() as q:
        refused = []

        def one_shard_down(effect, out):
            for i, (shard, op, _) in enumerate(effect.calls):
                if op == "note_priorities" and shard == 1 and not refused:
                    refused.append(shard)
                    out[i] = shardq.ShardUnavailable("shard 1 is down (test)")
        _spy_collect(q, one_shard_down)
        sent = _peeks_seen(q)
        q.enqueue(b"a", queue="missed", priority=3)  # goes ahead
        assert refused == [1] and "missed" not in q._noted and "missed" in q._prioritized
        q.enqueue(b"b", queue="missed", priority=3)
        assert sent.count("note_priorities") == 2 * 3 and "missed" in q._noted
        q.enqueue(b"c", queue="missed", priority=3)
        assert sent.count("note_priorities") == 2 * 3  # told once for good
        assert len(q.ack_many(q.dequeue_many("missed", max_jobs=3))) == 3


def test_the_flag_is_durable_through_replay_and_checkpoints(tmp_path):
    cfg = config_from()
    shard = DurableShard(str(tmp_path), 0, cfg)
    shard.open()
    shard.state.note_priorities("told")           # logged, holds no job
    shard.state.enqueue(b"x", 1.0, queue="took", priority=2)
    shard.state.enqueue(b"x", 1.0, queue="plain")
    shard.commit()
    shard.close()
    replayed = DurableShard(str(tmp_path), 0, cfg)
    replayed.open()
    flags = {n: q.prioritized for n, q in replayed.state.queues.items()}
    assert flags == {"told": True, "took": True, "plain": False}
    (lease,) = replayed.state.dequeue("took", 2.0)
    replayed.state.ack(lease.job_id, lease.token, 2.0)  # its prioritized job is gone
    replayed.commit()
    replayed.compact()
    replayed.close()
    again = DurableShard(str(tmp_path), 0, cfg)
    again.open()
    assert {n: q.prioritized for n, q in again.state.queues.items()} == flags


def test_a_peek_after_replay_counts_no_job_leased_or_acked_before_it(tmp_path):
    """Replay left each job it leased in its ready line, and each one acked since: a peek
    counted them, so a router released the best lease of another shard and took a lower
    priority here (a walkthrough: after a restart a priority 0 job, then its key's 9,
    came out before a ready 5 of another shard, 6 of 8 runs)."""
    cfg = config_from()
    shard = DurableShard(str(tmp_path), 0, cfg)
    shard.open()
    for prio in (9, 5, 5):
        shard.state.enqueue(b"x", 1.0, queue="q", priority=prio)
    shard.state.enqueue(b"held", 1.0, queue="q", priority=7)
    shard.commit()
    for _ in range(3):
        (lease,) = shard.state.dequeue("q", 2.0)
        if lease.body == b"x":
            shard.state.ack(lease.job_id, lease.token, 2.0)
    shard.commit()
    assert shard.state.ready_priorities("q", 100) == [[5, 1]]  # the 7 leased, the 9 and a 5 acked
    shard.close()
    replayed = DurableShard(str(tmp_path), 0, cfg)
    replayed.open(now=3.0)
    assert replayed.state.ready_priorities("q", 100) == [[5, 1]]
    (lease,) = replayed.state.dequeue("q", 3.0)
    assert lease.body == b"x" and replayed.state.ready_priorities("q", 100) == []
    replayed.state.ack(lease.job_id, lease.token, 3.0)
    (expired,) = replayed.state.dequeue("q", 1e9)  # the 7's lease runs out: ready again, once
    assert expired.body == b"held" and replayed.state.ready_priorities("q", 100) == []


def test_the_flag_survives_a_sigkilled_shard(tmp_path):
    """A consumer that connects after the restart still learns it from the first lease."""
    with Service(shards=2) as svc2:
        with svc2.connect() as producer:
            producer.enqueue(b"low", key=_key_on(0, 2), queue="kept")
            producer.enqueue(b"high", key=_key_on(1, 2), queue="kept", priority=5)
            pids = producer.ping()
        os.kill(pids[0], signal.SIGKILL)
        restarted(svc2, 0, pids[0])
        with svc2.connect(retry_s=20) as consumer:
            assert [l.body for l in consumer.dequeue_many("kept", max_jobs=1)] == [b"high"]


def test_the_asyncio_client_learns_the_flag_and_skips_peeks_on_plain_queues(svc):
    import asyncio

    import shardq.client.aio as aio

    with svc.connect() as producer:
        producer.enqueue(b"low", key=_key_on(0), queue="aiolearn")
        producer.enqueue(b"high", key=_key_on(1), queue="aiolearn", priority=4)
        producer.enqueue_many([{"body": b"p", "queue": "aioplain"} for _ in range(6)])

    async def main():
        q = await aio.connect(svc.data_dir)
        sent = []
        request = q._request  # every request of the asyncio client starts here

        def spy(shard, op, args, retry_s=None):
            sent.append(op)
            return request(shard, op, args, retry_s)
        q._request = spy
        try:
            plain = 0
            while (lease := await q.dequeue("aioplain")) is not None:
                await q.ack(lease)
                plain += 1
            assert plain == 6 and "peek" not in sent
            first = await q.dequeue("aiolearn")
            second = await q.dequeue("aiolearn")
            await q.ack_many([first, second])
            return first.body, (second.body, second.attempt), "peek" in sent
        finally:
            await q.close()

    assert asyncio.run(main()) == (b"high", (b"low", 1), True)


def test_merge_puts_kept_and_taken_leases_highest_first_and_stays_stable():
    from shardq.client.priority import merge
    held = [(5, "a"), (1, "b")]
    assert merge(["a"], held, [[(7, "x"), (5, "y")], [(9, "z")]]) == ["z", "x", "a", "y"]
    assert merge(["a", "b"], held, []) == ["a", "b"]
