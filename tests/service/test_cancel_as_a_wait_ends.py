"""A cancel that comes in the loop turn a timed wait ends is kept, not lost.

``asyncio.wait_for`` of Python 3.11 returns, instead of raising CancelledError, when the
awaitable it waits for is done by the time the cancel is seen: the caller carries on as if
never cancelled (and an ``asyncio.timeout()`` around it never fires). The listener's close
(shardq/service/aio_listener.py) and a message move task's pause between rounds
(shardq/sqs_api/moves.py) wait with ``asyncio.timeout`` instead, as consume() and the asyncio
worker do (tests/client/test_aio.py)."""
from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace
from typing import Any

from shardq.clock import FakeClock
from shardq.service.aio_listener import AioListener, AioRequest, AioResponse
from shardq.service.http_listener import bind
from shardq.sqs_api.moves import MoveTasks

from support.service import wait_until


async def _cancelled_as_the_event_is_set(task: asyncio.Task[Any], event: asyncio.Event) -> asyncio.Task[Any]:
    """Wait until ``task`` waits on ``event``; then set the event and cancel the task in the
    same turn, and wait for the task to end."""
    while not event._waiters:  # (private; wait_for's inner task takes a turn to start waiting)
        assert not task.done(), task
        await asyncio.sleep(0)
    event.set()      # what it waits for comes ...
    task.cancel()    # ... in the turn the cancel does
    await asyncio.wait([task], timeout=10)
    assert task.done()
    return task


def test_the_listeners_close_is_cancelled_even_when_its_last_connection_goes_in_the_same_turn():
    gate_holder: dict[str, asyncio.Event] = {}

    async def hold(req: AioRequest) -> AioResponse:
        await gate_holder.setdefault("gate", asyncio.Event()).wait()
        return AioResponse(200, b"done")

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(20)

    lst = AioListener(bind(("127.0.0.1", 0), socket.AF_INET), hold, lambda *a: True)
    call(lst.start())
    conn = socket.create_connection(lst.address, timeout=10)
    try:
        conn.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: lst.answering == 1, 5, what="the request answered")

        async def race() -> asyncio.Task[Any]:
            closing = asyncio.ensure_future(lst.close(30.0))  # waits for the held connection
            while lst._emptied is None:
                await asyncio.sleep(0)
            return await _cancelled_as_the_event_is_set(closing, lst._emptied)

        closing = call(race())
        # Before: wait_for returned, and close went on to its end as if never cancelled.
        assert closing.cancelled(), "the cancel of close() was lost"
    finally:
        conn.close()
        call(lst.close(0.1))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class _Catalog:
    """The move task's record, in memory."""

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []

    def tasks(self) -> dict[str, Any]:
        return {}

    def get(self, name: str) -> dict[str, Any]:
        return {"name": name}

    def update_task(self, handle: str, **fields: Any) -> None:
        self.updates.append(fields)


class _Queue:
    """One message in the source, moved at the first round."""

    def __init__(self) -> None:
        self.left = [SimpleNamespace(job_id=1, key=None, body=b"moved", token=1)]
        self.enqueued: list[bytes] = []

    async def dequeue_many(self, queue: str, **kw: Any) -> list[Any]:
        leases, self.left = self.left, []
        return leases

    async def enqueue(self, body: bytes, **kw: Any) -> int:
        self.enqueued.append(body)
        return 2

    async def ack(self, lease: Any) -> None:
        return None


def test_a_move_task_pausing_for_its_rate_is_cancelled_even_when_it_is_stopped_in_the_same_turn():
    """The pause between two rounds of a task with MaxNumberOfMessagesPerSecond."""
    catalog, q = _Catalog(), _Queue()
    moves = MoveTasks.__new__(MoveTasks)  # (no catalog dir nor owner lock: only _run is run)
    moves.api = SimpleNamespace(q=q, catalog=catalog, clock=FakeClock(1_800_000_000.0))
    moves._cancel, moves._tasks = {"h": asyncio.Event()}, []
    dest = "arn:aws:sqs:us-east-1:000000000000:dest"

    async def race() -> asyncio.Task[Any]:
        run = asyncio.ensure_future(moves._run("h", "dlq", dest, 1))  # a round, then a 1 s pause
        return await _cancelled_as_the_event_is_set(run, moves._cancel["h"])

    run = asyncio.run(race())
    assert q.enqueued == [b"moved"] and catalog.updates[0] == {"ApproximateNumberOfMessagesMoved": 1}
    # Before: wait_for returned, and the task ended as if only stopped (its record CANCELLED).
    assert run.cancelled(), f"the cancel of the move task was lost: {catalog.updates}"
