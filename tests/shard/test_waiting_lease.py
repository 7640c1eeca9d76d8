"""A waiting dequeue is answered by the shard with the lease (``dequeue_wait``), against real
shard processes: the router, and the asyncio client, wait at every shard at once, take the
first lease, withdraw the other waits, and release unstarted any lease a withdrawn wait
made anyway; a wait that ends answers []; a shard killed under a waiting consumer costs it
nothing but the wait.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
from multiprocessing.connection import Client

import msgpack
import pytest

import shardq
from support.service import Service, restarted, wait_until
from shardq.client.core import Call
from shardq.client.effects import Abandon, Send, Submit
from shardq.client.router import shard_for_key
from shardq.datadir import DataDir
from shardq.protocol.sockio import connect_unix

KEYS = {}  # shard -> a key that lands there (2 shards)
for i in range(100):
    KEYS.setdefault(shard_for_key(f"k{i}", 2), f"k{i}")


@pytest.fixture
def svc():
    with Service(config={"queue_defaults": {"visibility_timeout": 30}}) as s:
        yield s


def waiting(svc) -> list[int]:
    """Waiting dequeues parked at each shard."""
    with svc.connect() as q:
        return [sh.get("waiting_dequeues", 0) for sh in q.stats()["shards"]]


def dequeue_in_thread(q, **kw):
    out: dict = {}

    def run():
        try:
            out["lease"] = q.dequeue(**kw)
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("shard", [0, 1])
def test_a_waiting_consumer_gets_the_lease_of_a_job_enqueued_later_on_either_shard(svc, shard):
    with svc.connect() as consumer, svc.connect() as producer:
        t, out = dequeue_in_thread(consumer, wait=20)
        wait_until(lambda: waiting(svc) == [1, 1], what="a waiting dequeue at both shards")
        job = producer.enqueue(b"late", key=KEYS[shard])
        t.join(20)
        assert not t.is_alive() and "error" not in out, out
        lease = out["lease"]
        assert (lease.job_id, lease.body, lease.attempt) == (job, b"late", 1)
        # the other shard's wait was withdrawn, not left to lease a later job to nobody
        wait_until(lambda: waiting(svc) == [0, 0], what="both waits gone")
        consumer.ack(lease)
        assert consumer.dequeue(wait=0) is None


def test_a_wait_that_ends_answers_nothing_and_leaves_no_waiter(svc):
    with svc.connect() as q:
        assert q.dequeue(wait=0.3) is None
        assert q.dequeue_many(max_jobs=5, wait=0.2) == []
        wait_until(lambda: waiting(svc) == [0, 0], what="no waiter left")


def test_jobs_arriving_at_both_shards_at_once_reach_a_one_job_wait_and_the_next_dequeue(svc):
    """One wait for one job while both shards get one: the shard that answers second (its
    wait withdrawn too late, or not at all) must not strand its job behind a lease nobody
    holds: it is released unstarted and the next dequeue takes it at once, first delivery."""
    with svc.connect() as consumer, svc.connect() as producer:
        for round_ in range(10):
            t, out = dequeue_in_thread(consumer, wait=20)
            wait_until(lambda: waiting(svc) == [1, 1], what="a waiting dequeue at both shards")
            ids = producer.enqueue_many([{"body": f"{round_}-{s}".encode(), "key": KEYS[s]} for s in (0, 1)])
            t.join(20)
            assert "error" not in out, out
            first = out["lease"]
            assert first.job_id in ids and first.attempt == 1
            # far sooner than the 30 s visibility timeout a stranded lease would take
            second = wait_until(lambda: consumer.dequeue(wait=0), timeout=10, what="the other job")
            assert {first.job_id, second.job_id} == set(ids) and second.attempt == 1
            consumer.ack_many([first, second])
            wait_until(lambda: waiting(svc) == [0, 0], what="both waits gone")


def test_a_lease_a_withdrawn_wait_made_is_released_unstarted(svc):
    with svc.connect() as q:
        job = q.enqueue(b"x", key=KEYS[0])
        [(rows, _)] = q._do_send(Send([Call(0, "dequeue_wait", ["default", None, 1, 5.0])]))
        assert rows[0][0] == job
        q._release_rows(rows)  # the engine's Release of a wait that lost to another shard's lease
        lease = wait_until(lambda: q.dequeue(wait=0), timeout=10, what="the released job")
        assert (lease.job_id, lease.attempt) == (job, 1)  # its first delivery, not its second


def test_a_router_closed_just_after_a_withdrawal_still_releases_its_lease(svc):
    """close() right after withdrawing a wait the shard had already answered: the lease
    on its way is released before the connections close, not left to expire with its
    delivery counted (far sooner than the 30 s visibility timeout)."""
    with svc.connect() as producer:
        job = producer.enqueue(b"x", key=KEYS[0])
    q = svc.connect()
    args = ["default", None, 1, 5.0]
    calls = [Call(0, "dequeue_wait", args)]
    handles = q._submit(Submit(calls, q._now() + 5))  # the shared way: the I/O thread's connection
    (got,) = q._abandon(Abandon(None, calls, handles))  # most often before the reply is read
    if type(got) is list:  # answered first: the lease is the caller's to release (as the engine's wait_any does)
        q._release_rows(got)
    q.close()
    with svc.connect() as q2:
        lease = wait_until(lambda: q2.dequeue(wait=0), timeout=10, what="the released job")
        assert (lease.job_id, lease.attempt) == (job, 1)
        q2.ack(lease)


def raw(svc, shard: int) -> Client:
    dd = DataDir(svc.data_dir)
    return connect_unix(dd.socket_path(shard), dd.authkey())


def replies(conn: Client, timeout: float) -> list:
    out = []
    while conn.poll(timeout):
        out += msgpack.unpackb(conn.recv_bytes(), raw=False)
        timeout = 0.2
    return out


def test_the_shard_answers_a_wait_with_the_lease_and_a_withdrawn_wait_with_nothing(svc):
    conn = raw(svc, 0)
    try:
        conn.send_bytes(msgpack.packb([[1, "dequeue_wait", ["default", None, 1, 30.0]]]))
        conn.send_bytes(msgpack.packb([[2, "cancel_wait", [1]]]))
        assert replies(conn, 5) == [[2, 0, True]]  # withdrawn: rid 1 gets no reply
        conn.send_bytes(msgpack.packb([[3, "dequeue_wait", ["default", None, 1, 30.0]]]))
        wait_until(lambda: waiting(svc)[0] == 1, what="the second wait parked")
        with svc.connect() as q:
            job = q.enqueue(b"for-the-wait", key=KEYS[0])
            got = replies(conn, 10)
            assert len(got) == 1 and got[0][:2] == [3, 0], got
            assert got[0][2][0][:3] == [job, KEYS[0], b"for-the-wait"]
            conn.send_bytes(msgpack.packb([[4, "cancel_wait", [3]]]))
            assert replies(conn, 5) == [[4, 0, False]]  # answered already: nothing to withdraw
            assert q.dequeue(wait=0) is None  # the raw client holds that lease
    finally:
        conn.close()
    wait_until(lambda: waiting(svc) == [0, 0], what="no waiter left")


def test_a_waiting_consumer_outlives_a_sigkilled_shard(svc):
    with svc.connect(retry_s=20) as consumer, svc.connect(retry_s=20) as producer:
        t, out = dequeue_in_thread(consumer, wait=30)
        wait_until(lambda: waiting(svc) == [1, 1], what="a waiting dequeue at both shards")
        old = producer.ping()[0]
        os.kill(old, signal.SIGKILL)
        restarted(svc, 0, old)
        job = producer.enqueue(b"after-restart", key=KEYS[0])
        t.join(30)
        assert "error" not in out, out
        assert out["lease"].job_id == job


def test_a_delayed_job_coming_due_reaches_a_waiting_consumer(svc):
    with svc.connect() as consumer, svc.connect() as producer:
        job = producer.enqueue(b"later", key=KEYS[1], delay=0.5)
        t, out = dequeue_in_thread(consumer, wait=20)
        t.join(20)  # the shard wakes for the job's due time: nothing enqueues meanwhile
        assert "error" not in out and out["lease"] is not None, out
        assert out["lease"].job_id == job


def test_a_wait_at_its_limits_takes_a_whole_batch(svc):
    """The longest wait and the largest batch: the waiting dequeue is answered as soon as
    a batch of BATCH_JOBS_MAX jobs lands, with as many leases as one reply holds."""
    from shardq import limits
    with svc.connect() as consumer, svc.connect() as producer:
        t, out = dequeue_in_thread(consumer, wait=limits.WAIT_S_MAX)
        # dequeue_in_thread leases one; the batch form below is the limit under test
        wait_until(lambda: waiting(svc) == [1, 1], what="a waiting dequeue at both shards")
        producer.enqueue(b"one", key=KEYS[0])
        t.join(20)
        assert out["lease"].body == b"one"
        consumer.ack(out["lease"])
        got: dict = {}

        def wait_batch():
            got["leases"] = consumer.dequeue_many(max_jobs=limits.BATCH_JOBS_MAX, wait=limits.WAIT_S_MAX)
        t = threading.Thread(target=wait_batch, daemon=True)
        t.start()
        wait_until(lambda: waiting(svc) == [1, 1], what="a waiting batch dequeue at both shards")
        ids = producer.enqueue_many([{"body": b"b", "key": f"bk{i}"} for i in range(limits.BATCH_JOBS_MAX)])
        t.join(30)
        assert not t.is_alive(), "the waiting batch dequeue was not answered"
        leases = got["leases"]
        assert 0 < len(leases) <= limits.BATCH_JOBS_MAX and {l.job_id for l in leases} <= set(ids)
        assert len({l.job_id for l in leases}) == len(leases)
        wait_until(lambda: waiting(svc) == [0, 0], what="both waits gone")


# --------------------------------------------------------------- the asyncio client
def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def polled(predicate, what: str, timeout: float = 20.0):
    """wait_until in a thread, so the event loop keeps serving the client under test."""
    return await asyncio.to_thread(wait_until, predicate, timeout, 0.01, what)


def held_by(q) -> int:
    """Requests the asyncio client still keeps for a caller or a withdrawal."""
    return sum(len(c.chan.pending) + len(c.chan.outbox) for c in q.conns)


async def next_lease(q):
    """The next lease ``q`` can take now, polled for up to 10 s: far sooner than the 30 s
    visibility timeout a stranded lease would need."""
    for _ in range(1000):
        lease = await q.dequeue(wait=0)
        if lease is not None:
            return lease
        await asyncio.sleep(0.01)
    raise AssertionError("no job became ready within 10 s")


async def no_waiter_left(svc, q) -> None:
    await polled(lambda: waiting(svc) == [0, 0], "no waiting dequeue at the shards")
    for _ in range(500):  # the withdrawals' replies come back through the loop
        if held_by(q) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the client still holds {held_by(q)} requests")


@pytest.mark.parametrize("shard, request_timeout_s, pause_s", [(0, 30.0, 0.0), (1, 30.0, 0.0), (1, 0.5, 1.0)],
                         ids=["shard-0", "shard-1", "past-the-request-timeout"])
def test_an_asyncio_consumer_waits_at_every_shard_and_gets_the_lease(svc, shard, request_timeout_s, pause_s):
    """The job reaches the wait from either shard, and the other wait is withdrawn. A wait
    is timed by its caller, not by ``request_timeout_s``: a job enqueued 1 s into the wait
    of a client whose requests time out after 0.5 s reaches it too (a wait cut short at
    0.5 s would stay parked at the shard and take the job to nobody)."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir, request_timeout_s=request_timeout_s) as q:
            with svc.connect() as producer:
                task = asyncio.create_task(q.dequeue(wait=20))
                await polled(lambda: waiting(svc) == [1, 1], "a waiting dequeue at both shards")
                if pause_s:
                    await asyncio.sleep(pause_s)  # past the request timeout: what is being tested
                    assert not task.done()
                job = producer.enqueue(b"late", key=KEYS[shard])
                lease = await asyncio.wait_for(task, 10)
                assert (lease.job_id, lease.body, lease.attempt) == (job, b"late", 1)
                await no_waiter_left(svc, q)  # the other shard's wait was withdrawn
                await q.ack(lease)
                assert await q.dequeue_many(max_jobs=5, wait=0.2) == []
                await no_waiter_left(svc, q)
    arun(main())


def test_an_asyncio_one_job_wait_with_jobs_at_both_shards_strands_neither(svc):
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            with svc.connect() as producer:
                for round_ in range(10):
                    task = asyncio.create_task(q.dequeue(wait=20))
                    await polled(lambda: waiting(svc) == [1, 1], "a waiting dequeue at both shards")
                    ids = producer.enqueue_many([{"body": f"{round_}-{s}".encode(), "key": KEYS[s]} for s in (0, 1)])
                    first = await task
                    assert first.job_id in ids and first.attempt == 1
                    second = await next_lease(q)
                    assert second is not None and {first.job_id, second.job_id} == set(ids)
                    assert second.attempt == 1
                    await q.ack_many([first, second])
                await no_waiter_left(svc, q)
    arun(main())


@pytest.mark.parametrize("answered", [True, False], ids=["answered-first", "still-waiting"])
def test_an_asyncio_withdrawal_releases_what_the_wait_leased(svc, answered):
    """``ShardConn.abandon`` of a waiting dequeue while the wait's reply is in flight (the shard answered it
    before the withdrawal arrived: its lease is released unstarted), and while it waits
    (the shard withdraws it: no reply, nothing kept)."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            job = await q.enqueue(b"x", key=KEYS[0]) if answered else None
            conn, req, fut = q._request(0, "dequeue_wait", ["default", None, 1, 20.0], retry_s=0)
            await asyncio.sleep(0)  # the flush writes it; its reply cannot have been read yet
            assert req.sent and conn.chan.pending.get(req.rid) is req and not fut.done()
            if not answered:
                await polled(lambda: waiting(svc)[0] == 1, "the wait parked")
            conn.abandon(req, fut)
            await no_waiter_left(svc, q)
            assert not fut.done()  # its caller is gone: nothing is delivered to it
            if answered:
                lease = await next_lease(q)
                assert lease is not None and (lease.job_id, lease.attempt) == (job, 1)
                await q.ack(lease)
            assert await q.dequeue(wait=0) is None
    arun(main())


def test_an_asyncio_waiting_consumer_outlives_a_sigkilled_shard(svc):
    async def main():
        async with await shardq.aio.connect(svc.data_dir, retry_s=20) as q:
            with svc.connect(retry_s=20) as producer:
                task = asyncio.create_task(q.dequeue(wait=30))
                await polled(lambda: waiting(svc) == [1, 1], "a waiting dequeue at both shards")
                old = producer.ping()[0]
                os.kill(old, signal.SIGKILL)
                await asyncio.to_thread(restarted, svc, 0, old)
                job = producer.enqueue(b"after-restart", key=KEYS[0])
                lease = await task
                assert lease is not None and lease.job_id == job
    arun(main())


def test_an_asyncio_client_closed_just_after_a_withdrawal_still_releases_its_lease(svc):
    async def main():
        q = await shardq.aio.connect(svc.data_dir)
        job = await q.enqueue(b"x", key=KEYS[0])
        conn, req, fut = q._request(0, "dequeue_wait", ["default", None, 1, 20.0], retry_s=0)
        await asyncio.sleep(0)  # written; its reply, the lease, not yet read
        assert conn.chan.pending.get(req.rid) is req and not fut.done()
        conn.abandon(req, fut)
        await q.close()
        async with await shardq.aio.connect(svc.data_dir) as q2:
            lease = await next_lease(q2)
            assert lease is not None and (lease.job_id, lease.attempt) == (job, 1)
            await q2.ack(lease)
    arun(main())


def test_an_asyncio_wait_at_its_limits_takes_a_whole_batch(svc):
    from shardq import limits

    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            with svc.connect() as producer:
                task = asyncio.create_task(q.dequeue_many(max_jobs=limits.BATCH_JOBS_MAX, wait=limits.WAIT_S_MAX))
                await polled(lambda: waiting(svc) == [1, 1], "a waiting batch dequeue at both shards")
                ids = producer.enqueue_many([{"body": b"b", "key": f"ak{i}"} for i in range(limits.BATCH_JOBS_MAX)])
                leases = await asyncio.wait_for(task, 30)
                assert 0 < len(leases) <= limits.BATCH_JOBS_MAX
                assert len({l.job_id for l in leases}) == len(leases) and {l.job_id for l in leases} <= set(ids)
                await no_waiter_left(svc, q)
                await q.ack_many(leases)
                rest = await q.dequeue_many(max_jobs=limits.BATCH_JOBS_MAX)
                rest += await q.dequeue_many(max_jobs=limits.BATCH_JOBS_MAX)
                assert {l.job_id for l in leases + rest} == set(ids)  # nothing stranded
                await q.ack_many(rest)
    arun(main())
