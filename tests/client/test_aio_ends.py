"""How the asyncio client's calls end when their caller or the client does: a cancel that
lands after the reply came, a close with calls written and unanswered, a call from another
event loop, and a ``consume()`` loop whose leases are extended."""
from __future__ import annotations

import asyncio

import pytest

import shardq
from shardq.client.aioconsume import Consumer
from shardq.clock import SystemClock

from support.fake_shard import FakeShards
from support.service import Service


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2) as s:
        yield s


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` on the loop until it holds, or fail after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- a cancel after the reply
def cancel_once_answered(q, op: str, before: bool = False) -> tuple[list, list]:
    """Cancel the task put in the first list from inside the callback that resolves the
    first non-empty reply to an ``op`` request of ``q``: its future is resolved, and the
    task awaiting it has not run again, so the cancel is what that task meets. The second
    list gets, per cancel, whether the future was resolved (not cancelled) when it came.
    ``before``: the cancel comes in that callback just before the reply is read (the loop
    turn of a ``wait_for`` timeout that ran first): the future is cancelled, its task not
    yet resumed to abandon the request, when the reply comes."""
    box: list = []
    landed: list = []
    for conn in q.conns:
        def on_replies(replies, conn=conn, real=conn.on_replies):
            answered = [conn.chan.pending.get(rid) for rid, _, payload in replies if payload]
            ours = [req for req in answered if box and req is not None and req.op == op and req.waiters]
            if before and ours:
                box.pop().cancel()
                landed.append(False)
            real(replies)
            for req in ours:
                if box:
                    fut = req.waiters[0]
                    landed.append(fut.done() and not fut.cancelled())
                    box.pop().cancel()
        conn.on_replies = on_replies
    return box, landed


@pytest.mark.parametrize("before", [False, True], ids=["cancel-after-reply", "cancel-just-before-reply"])
@pytest.mark.parametrize("call", ["dequeue", "dequeue_many", "consume", "waiting dequeue"])
def test_a_cancel_that_lands_after_the_reply_came_releases_what_it_leased(svc, call, before):
    """The reply of the cancelled call's dequeue is in (its future resolved) when the cancel
    lands. Its leases were neither returned nor released: the jobs stayed invisible for their
    60 s visibility. They are released at once (not counted as deliveries), so the next
    dequeue gets them. ("waiting dequeue": the same through a waiting dequeue, which
    released them before too.) ``before``: the cancel lands in the same loop turn just
    before the reply is read (its future cancelled, its task not yet back to abandon the
    request): the reply's leases went to nobody, invisible for 60 s."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            queue = "after-reply-" + call.replace(" ", "-")
            if call == "waiting dequeue":
                assert await q.dequeue(queue) is None  # an empty queue: the next dequeue waits first
                box, landed = cancel_once_answered(q, "dequeue_wait", before)
                t = asyncio.ensure_future(q.dequeue(queue, wait=30, visibility=60))
                await until(lambda: sum(r.op == "dequeue_wait" for c in q.conns for r in c.chan.pending.values())
                            == 2, "a waiting dequeue at both shards")
                box.append(t)
                ids = [await q.enqueue(b"job", queue=queue)]
            else:
                ids = await q.enqueue_many([{"body": b"job-%d" % i} for i in range(3)], queue=queue)
                box, landed = cancel_once_answered(q, "dequeue", before)
                if call == "dequeue":
                    t = asyncio.ensure_future(q.dequeue(queue, visibility=60))
                elif call == "dequeue_many":
                    t = asyncio.ensure_future(q.dequeue_many(queue, max_jobs=10, visibility=60))
                else:
                    t = asyncio.ensure_future(anext(q.consume(queue, concurrency=10, wait=0.1, visibility=60)))
                box.append(t)
            with pytest.raises(asyncio.CancelledError):
                await t
            assert landed == [not before]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3.0  # far below the 60 s visibility a stranded lease keeps
            leases: list = []
            while len(leases) < len(ids) and (left := deadline - loop.time()) > 0:
                leases += await q.dequeue_many(queue, max_jobs=10, wait=left)
            assert sorted(lease.job_id for lease in leases) == sorted(ids)
            assert all(lease.attempt == 1 for lease in leases)  # a release is not a delivery
            await q.ack_many(leases)
    run(main())


# ---------------------------------------------------------------------- close with calls out
def test_close_fails_a_call_written_and_unanswered_with_outcome_unknown():
    """The shard reads the frame of two enqueues (a single one, merged, and a batch) and never
    answers; close() fails them. They failed with Closed, which says nothing was done, although
    the shard may have fsynced them: a caller enqueuing again made a duplicate."""
    f = FakeShards(script=["hang"])

    async def main():
        q = await shardq.aio.connect(f.dd.path, retry_s=30, request_timeout_s=30)
        await q.queue_config("q")  # its placement, asked before the first enqueue
        single = asyncio.ensure_future(q.enqueue(b"one", queue="q"))
        batch = asyncio.ensure_future(q.enqueue_many([{"body": b"two"}], queue="q"))
        await until(lambda: len(f.sent("enqueue")) == 2, "both enqueues read by the shard")
        await q.close()
        for t in (single, batch):
            with pytest.raises(shardq.OutcomeUnknown, match="may or may not have been applied"):
                await t
    try:
        run(main())
    finally:
        f.close()


def test_close_fails_a_call_written_before_a_break_with_outcome_unknown_and_one_never_written_with_closed():
    """The shard reads the frame of two enqueues and drops the connection; no new one is
    admitted. Both wait to be sent again (the merged one in its connection, the batch in the
    engine) with a third made after the break, never written, when close() comes: the two
    written once fail with OutcomeUnknown, the third with Closed."""
    f = FakeShards(script=["drop"])

    async def main():
        q = await shardq.aio.connect(f.dd.path, retry_s=30, request_timeout_s=30)
        await q.queue_config("q")
        single = asyncio.ensure_future(q.enqueue(b"one", queue="q"))
        batch = asyncio.ensure_future(q.enqueue_many([{"body": b"two"}], queue="q"))
        await until(lambda: f.dropped.is_set() and q.conns[0].proto is None, "the break")
        never = asyncio.ensure_future(q.enqueue(b"three", queue="q"))
        await until(lambda: len(q.conns[0].chan.outbox) == 3, "three enqueues waiting for a connection")
        await q.close()
        for t in (single, batch):
            with pytest.raises(shardq.OutcomeUnknown, match="may or may not have been applied"):
                await t
        with pytest.raises(shardq.Closed):
            await never
        assert len(f.sent("enqueue")) == 2  # (the third was never written)
        # its listener closed, the handshake the client was still trying ends now, not after
        # its 5 s timeout (asyncio.run waits for the thread it runs in)
        await asyncio.to_thread(f.close)
    try:
        run(main())
    finally:
        f.close()


# ---------------------------------------------------------------------- another event loop
def test_a_client_used_from_another_event_loop_says_so_at_once(svc):
    """Connected in one ``asyncio.run`` and used in the next, a client hung or failed with an
    unrelated RuntimeError (a future of another loop, or a closed loop). Each call raises
    UsageError at once."""
    async def first():
        q = await shardq.aio.connect(svc.data_dir)
        await q.enqueue(b"job", queue="loops")
        return q, await q.dequeue("loops")

    q, lease = asyncio.run(first())
    assert lease is not None

    async def second():
        calls = {"enqueue": lambda: q.enqueue(b"x", queue="loops"), "ack": lambda: q.ack(lease),
                 "extend": lambda: q.extend(lease, 10), "dequeue": lambda: q.dequeue("loops", wait=1),
                 "stats": q.stats, "consume": lambda: anext(q.consume("loops")), "close": q.close}
        for what, call in calls.items():
            # (its loop has closed: the message says so, and where to connect: a FastAPI app that
            # connected at import time met "Event loop is closed" deep in aioconn)
            with pytest.raises(shardq.UsageError, match="event loop has closed.*lifespan handler"):
                await asyncio.wait_for(call(), 5)  # (not a hang: fails the test with TimeoutError)
            assert not q._consumers, what

    asyncio.run(second())


def test_a_client_whose_loop_still_runs_refuses_a_call_from_another_loop(svc):
    """The client's loop is alive (as another thread's would be): a call from a second loop
    is refused, and the client still works on its own."""
    with asyncio.Runner() as runner:
        q = runner.run(shardq.aio.connect(svc.data_dir))
        try:
            async def elsewhere():
                with pytest.raises(shardq.UsageError, match="another event loop"):
                    await asyncio.wait_for(q.enqueue(b"x", queue="loops2"), 5)
                with pytest.raises(shardq.UsageError, match="another event loop"):
                    await asyncio.wait_for(q.dequeue("loops2", wait=1), 5)

            asyncio.run(elsewhere())
            job_id = runner.run(q.enqueue(b"y", queue="loops2"))
            lease = runner.run(q.dequeue("loops2"))
            assert lease is not None and lease.job_id == job_id
            runner.run(q.ack(lease))
        finally:
            runner.run(q.close())


# ---------------------------------------------------------------------- consume and extend
def test_consume_counts_an_extended_lease_until_its_new_deadline(svc):
    """concurrency=2: both leases (3 s visibility) are extended to 60 s. consume() counted a
    lease until its first deadline, so past it a third came while both were still held."""
    async def main():
        async with await shardq.aio.connect(svc.data_dir) as q:
            queue = "cons-extend"
            await q.enqueue_many([{"body": b"%d" % i} for i in range(3)], queue=queue)
            leases = q.consume(queue, concurrency=2, wait=0.1, visibility=3)
            held = [await anext(leases), await anext(leases)]
            first_deadline = max(lease.deadline for lease in held)
            held = [await q.extend(lease, 60) for lease in held]
            assert SystemClock.now() < first_deadline - 0.5, "too slow to extend in time: the test proves nothing"
            third = asyncio.ensure_future(anext(leases))
            # until well past the first deadlines: a third lease handed out by then is the bug
            done, _ = await asyncio.wait({third}, timeout=first_deadline + 1.0 - SystemClock.now())
            assert not done
            assert (await q.stats())["queues"][queue]["in_flight"] == 2
            await q.ack(held[0])  # room for one
            got = await asyncio.wait_for(third, 10)
            await q.ack_many([held[1], got])
            await leases.aclose()
    run(main())


def test_a_lease_being_extended_counts_until_its_extend_ends():
    """An extend still out when the lease's deadline passes may move it: the lease counts
    until its reply, then until the deadline it set (or the one it had, if it failed)."""
    c = Consumer(None, "q", 2, 1.0, None)  # type: ignore[arg-type]  # no client: its state only
    now = SystemClock.now()
    c.held = {(1, 1): now - 1.0, (2, 2): now - 1.0, (3, 3): now + 100}
    assert c.extending_one((1, 1)) and c.extending_one((2, 2)) and not c.extending_one((9, 9))
    assert c._expire() == now + 100 and set(c.held) == {(1, 1), (2, 2), (3, 3)}
    c.extended((1, 1), now + 50)
    c.extended((2, 2), None)  # failed: its deadline stands (passed)
    assert c._expire() == now + 50 and c.held == {(1, 1): now + 50, (3, 3): now + 100}
    assert not c.extending
