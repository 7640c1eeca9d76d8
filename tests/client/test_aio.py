"""The asyncio client against real shards (and a scripted fake shard for the exact moment a
connection breaks): parity with the router, coalescing, cancellation, retry rules, limits."""
from __future__ import annotations

import asyncio

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.client import channel
from shardq.protocol import wire

from support.service import Service


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 3}}) as s:
        yield s


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def pending_waiters(q) -> int:
    """Requests still held for a caller, and single calls waiting to be merged."""
    return sum(len(c.chan.pending) + len(c.chan.outbox) + len(c.chan.enq_parts) + len(c.chan.ack_parts)
               for c in q.conns)


def test_single_calls_of_one_turn_are_merged_into_one_request_per_shard(svc, monkeypatch):
    frames = []
    real = channel.Channel.flush

    def spy(self, now):
        out, done = real(self, now)
        for data in out:
            frame = msgpack.unpackb(data[4:], raw=False)
            frames.append([(op, len(args[0]) if op in ("enqueue", "ack") else 1) for _, op, args in frame])
        return out, done

    monkeypatch.setattr(channel.Channel, "flush", spy)

    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            for name in ("merge", "merge2"):  # their placement, asked once before a first enqueue
                await q.queue_config(name)
            frames.clear()
            ids = await asyncio.gather(*(q.enqueue(b"m%d" % i, key="same", queue="merge") for i in range(200)))
            assert len(set(ids)) == 200
            assert frames == [[("enqueue", 200)]]
            leases = await q.dequeue_many("merge", max_jobs=200)
            assert [l.job_id for l in leases] == ids[:1]  # one key: one lease at a time
            frames.clear()
            ids2 = await asyncio.gather(*(q.enqueue(b"x", queue="merge2") for _ in range(300)))
            assert sorted(n for f in frames for op, n in f) == [150, 150]  # round robin, 2 shards
            got = await q.dequeue_many("merge2", max_jobs=300)
            frames.clear()
            await asyncio.gather(*(q.ack(l) for l in got))
            assert sorted(n for f in frames for op, n in f if op == "ack") == [150, 150]
            assert len(ids2) == 300 and pending_waiters(q) == 0
    run(main())


def test_a_merged_batch_refused_as_a_whole_is_resent_call_by_call():
    with Service(shards=1, config={"service": {"declare_queues": True},
                                   "queues": {"default": {}, "ok": {}}}) as s:
        async def main():
            async with await shardq.aio.connect(s.data_dir) as q:
                res = await asyncio.gather(q.enqueue(b"1", queue="ok"), q.enqueue(b"2", queue="nope"),
                                           q.enqueue(b"3", queue="ok"), return_exceptions=True)
                assert isinstance(res[1], shardq.UnknownQueue)
                assert isinstance(res[0], int) and isinstance(res[2], int)
                assert (await q.stats())["queues"]["ok"]["ready"] == 2
        run(main())


def test_batch_limits_hold_at_their_maximum(svc):
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            n = limits.BATCH_JOBS_MAX + 1
            ids = await q.enqueue_many([{"body": b"j", "key": "one"} for _ in range(n)], queue="big")
            assert len(set(ids)) == n
            ids = await asyncio.gather(*(q.enqueue(b"k", key="one", queue="big2") for _ in range(n)))
            assert len(set(ids)) == n
            with pytest.raises(shardq.InvalidJob):
                await q.dequeue_many("big", max_jobs=limits.BATCH_JOBS_MAX + 1)
            body = b"b" * limits.BODY_BYTES_MAX_DEFAULT
            await asyncio.gather(*(q.enqueue(body, queue="big3") for _ in range(40)))  # > MERGE_BYTES_MAX
            with pytest.raises(shardq.InvalidJob):
                await q.enqueue(body + b"!", queue="big3")
            assert (await q.stats())["queues"]["big3"]["ready"] == 40
    run(main())


def waiting_at_shards(svc) -> list[int]:
    with svc.connect() as q:
        return [sh.get("waiting_dequeues", 0) for sh in q.stats()["shards"]]


async def until(predicate, what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("phase", ["waiting", "watching", "dequeue in flight"])
def test_cancelling_a_waiting_dequeue_leaves_no_lease_behind(svc, phase):
    """Cancelled while it waits at the shards (a waiting dequeue, withdrawn), while it
    watches (a queue that uses priorities), or with a dequeue written: no lease is left."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            queue = f"cancel-{phase[0]}"
            if phase in ("waiting", "watching"):
                if phase == "watching":  # a lease with a priority: the client compares shards now
                    await q.enqueue(b"p", queue=queue, priority=5)
                    await q.ack(await q.dequeue(queue))
                    assert queue in q._prioritized
                t = asyncio.create_task(q.dequeue(queue, wait=30))
                if phase == "waiting":
                    await until(lambda: waiting_at_shards(svc) == [1, 1], "a waiting dequeue at both shards")
                else:
                    await until(lambda: sum(r.op == "watch" for c in q.conns for r in c.chan.pending.values()) == 2,
                                "a watch at both shards")
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
                # watches are forgotten; waiting dequeues are withdrawn, and let go once
                # the shards say so
                await until(lambda: pending_waiters(q) == 0, "no request held")
                assert waiting_at_shards(svc) == [0, 0]
                jids = [await q.enqueue(b"after", queue=queue)]
            else:
                # jobs on every shard, so the dequeue in flight leases one whichever it asks
                jids = await q.enqueue_many([{"body": b"job"} for _ in range(4)], queue=queue)
                t = asyncio.create_task(q.dequeue(queue))
                for _ in range(20):                     # until its request is written
                    await asyncio.sleep(0)
                    written = [r for c in q.conns for r in c.chan.pending.values() if r.op == "dequeue"]
                    if written:
                        break
                assert written and not t.done()
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
            for _ in range(200):
                st = (await q.stats())["queues"].get(queue, {})
                if st.get("in_flight", 0) == 0 and st.get("ready") == len(jids):
                    break
                await asyncio.sleep(0.02)
            assert st["in_flight"] == 0 and st["ready"] == len(jids)
            leases = await q.dequeue_many(queue, max_jobs=10)
            assert sorted(l.job_id for l in leases) == sorted(jids)
            assert all(l.attempt == 1 for l in leases)  # a release is not a delivery
            await q.ack_many(leases)
            assert pending_waiters(q) == 0
    run(main())


def test_consume_holds_at_most_concurrency_leases(svc):
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            await q.enqueue_many([{"body": b"%d" % i} for i in range(30)], queue="cons")
            held = []
            async for lease in q.consume("cons", concurrency=7, wait=0.1):
                held.append(lease)
                if len(held) == 7:
                    break
            st = (await q.stats())["queues"]["cons"]
            assert st["in_flight"] == 7                # the rest of the batch went back
            seen = []

            async def work(lease):
                await asyncio.sleep(0.01)
                await q.ack(lease)

            async with asyncio.TaskGroup() as tg:
                async for lease in q.consume("cons", concurrency=5, wait=0.2):
                    st = (await q.stats())["queues"]["cons"]
                    assert st["in_flight"] <= 7 + 5
                    seen.append(lease.job_id)
                    tg.create_task(work(lease))
                    if len(seen) == 23:
                        break
            assert len(set(seen)) == 23
            await q.ack_many(held)
    run(main())


def test_consume_waiting_for_room_is_cancelled_even_when_room_comes_in_the_same_turn(svc):
    """consume() waited for room with asyncio.wait_for, which in Python 3.11 returns, not
    raises, when its inner future is done as the cancel comes: the cancellation was lost, the
    loop went on leasing, and an asyncio.timeout() around it never fired."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            await q.enqueue_many([{"body": b"%d" % i} for i in range(3)], queue="cons-cancel")
            loop = q.consume("cons-cancel", concurrency=1, wait=0.1)
            first = await loop.__anext__()
            waiting = asyncio.ensure_future(loop.__anext__())  # no room: it waits for some
            for _ in range(3):
                await asyncio.sleep(0)
            await q.ack(first)  # room comes ...
            waiting.cancel()    # ... in the turn the cancel does
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await loop.aclose()
            assert (await q.stats())["queues"]["cons-cancel"]["in_flight"] == 0
    run(main())


def test_close_with_a_consume_loop_running_releases_the_leases_it_had_not_handed_out(svc):
    """Found by a walkthrough: an app's shutdown closed the client while a consume() loop
    ran; the leases it had fetched and not yet handed out stayed leased until their
    visibility timeout, then counted a delivery each (leaving the loop by break, an error
    or a cancel released them; a close did not)."""
    async def main():
        q = await shardq.aio.connect(svc.data_dir)
        await q.enqueue_many([{"body": b"%d" % i} for i in range(40)], queue="cons-close")
        loop = q.consume("cons-close", concurrency=20, wait=0.1, visibility=60)
        first = await loop.__anext__()  # the loop fetched up to 20 and handed out one
        await q.ack(first)
        await q.close()
        with pytest.raises(shardq.errors.Closed):
            await loop.__anext__()
        async with await shardq.aio.connect(svc.data_dir) as other:
            st = (await other.stats())["queues"]["cons-close"]
            assert (st["ready"], st["in_flight"]) == (39, 0), st
            leases = await other.dequeue_many("cons-close", max_jobs=100)
            assert len(leases) == 39 and {lease.attempt for lease in leases} == {1}  # released unstarted
            await other.ack_many(leases)
    run(main())


def test_the_wire_frames_are_multiprocessing_connection_frames():
    frame = [[1, "ping", []]]
    chan = channel.Channel(0, 7, 5.0)
    chan.connected()
    chan.submit("ping", [], object(), 0.0)
    out, _ = chan.flush(0.0)
    assert out[0][:4] == len(msgpack.packb(frame)).to_bytes(4, "big") and msgpack.unpackb(out[0][4:]) == frame
    assert wire.RETRY["bury"] is wire.UNKNOWN


def test_a_caller_leaving_a_merged_enqueue_leaves_the_others_their_own_ids(svc):
    """Three single enqueues merged into one request; the first caller is cancelled after
    it was written. The others get their own jobs' ids: the leaving part used to be taken
    out of the request, so each later caller got the id before its own."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            await q.queue_config("leave")  # its placement, asked before the first enqueue
            tasks = [asyncio.ensure_future(q.enqueue(b"b%d" % i, key="same", queue="leave")) for i in range(3)]
            while not any(r.op == "enqueue" for c in q.conns for r in getattr(c, "chan", c).pending.values()):
                await asyncio.sleep(0)  # until the merged request is written
            tasks[0].cancel()
            ids = await asyncio.gather(*tasks[1:])
            assert [(await q.job(job_id))["body"] for job_id in ids] == [b"b1", b"b2"]
    run(main())
