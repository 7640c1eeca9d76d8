"""Which client calls each action makes, in process, with a spy for the asyncio client:
the shortest paths the listener relies on for its speed (docs/performance.md, the SQS API),
and what a cancelled request (its client has gone) leaves behind."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shardq.clock import FakeClock
from shardq.config import SqsApiConfig
from shardq.sqs_api import attributes
from shardq.sqs_api.api import SqsApi
from shardq.sqs_api.catalog import Catalog
from shardq.types import Lease

HOST = "127.0.0.1:9324"


class SpyQueue:
    """The client calls an action makes, recorded; each job gets the next id. An
    ``enqueue_many`` waits for ``hold`` when it is set (a write the test interrupts)."""

    service_id = "spy"

    def __init__(self, clock: FakeClock) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.next_id = 100
        self.clock = clock
        self.hold: asyncio.Event | None = None
        self.held = asyncio.Event()

    async def queue_config(self, name: str) -> dict[str, Any]:
        return {}

    async def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                      priority: int = 0, dedup_id: str | None = None) -> int:
        self.calls.append(("enqueue", queue, key, delay, dedup_id))
        self.next_id += 1
        return self.next_id

    async def dequeue_many(self, queue: str, max_jobs: int = 100, wait: float = 0.0,
                           visibility: float | None = None) -> list[Lease]:
        self.calls.append(("dequeue_many", queue, max_jobs))
        return [Lease(i, "g", f"m{i}".encode(), queue, 1, 7, 0.0) for i in range(max_jobs)]

    async def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
                   delivered: bool = True) -> None:
        self.calls.append(("nack", lease.job_id, delivered))

    async def enqueue_many(self, jobs: list[dict[str, Any]], queue: str | None = None) -> list[int]:
        self.calls.append(("enqueue_many", len(jobs)))
        if self.hold is not None:
            self.held.set()
            await self.hold.wait()
        self.next_id += len(jobs)
        return list(range(self.next_id - len(jobs) + 1, self.next_id + 1))


def _api(tmp_path):
    clock = FakeClock()
    catalog = Catalog(str(tmp_path), clock)
    catalog.create("plain", attributes.defaults(False), {}, {})
    group_scoped = dict(attributes.defaults(True), DeduplicationScope="messageGroup")
    catalog.create("grouped.fifo", group_scoped, {}, {})
    spy = SpyQueue(clock)
    return SqsApi(spy, catalog, SqsApiConfig(), clock), spy  # type: ignore[arg-type]


def test_a_lone_send_is_the_clients_enqueue_and_a_batch_one_enqueue_many(tmp_path):
    """A SendMessage with no queue-wide dedup claim is one ``enqueue`` (the client merges the
    lone enqueues of a loop turn into one request per shard), not ``enqueue_many``."""
    async def main() -> None:
        sqs, spy = _api(tmp_path)
        got = await sqs.send_message({"QueueUrl": f"http://{HOST}/000000000000/plain", "MessageBody": "hi",
                                      "DelaySeconds": 5}, HOST)
        assert spy.calls == [("enqueue", "plain", None, 5, None)]
        assert got["MD5OfMessageBody"] == "49f68a5c8493ec2c0bf489821c21fc3b" and got["MessageId"]
        spy.calls.clear()
        await sqs.send_message({"QueueUrl": f"http://{HOST}/000000000000/grouped.fifo", "MessageBody": "hi",
                                "MessageGroupId": "g", "MessageDeduplicationId": "d1"}, HOST)
        # the group is the key, the id (scoped to this queue's incarnation) the dedup id
        scoped = f"{sqs.catalog.get('grouped.fifo')['incarnation']}:d1"
        assert spy.calls == [("enqueue", "grouped.fifo", "g", 0, scoped)]
        spy.calls.clear()
        out = await sqs.send_message_batch({"QueueUrl": f"http://{HOST}/000000000000/plain", "Entries": [
            {"Id": "a", "MessageBody": "x"}, {"Id": "b", "MessageBody": "y"}]}, HOST)
        assert spy.calls == [("enqueue_many", 2)] and [e["Id"] for e in out["Successful"]] == ["a", "b"]
        await sqs.close()
    asyncio.run(main())


def test_a_receive_cancelled_after_its_dequeue_hands_every_lease_back(tmp_path):
    """A receive hands its messages out when it runs to its end; one cancelled after its
    dequeue returned (the listener cancels a request whose client has gone), here while it
    writes its ReceiveRequestAttemptId memo, answers nothing and gives back every lease it
    took, none counted as a delivery; the hand-back outlives the cancelled request."""
    async def main() -> None:
        sqs, spy = _api(tmp_path)
        params = {"QueueUrl": f"http://{HOST}/000000000000/grouped.fifo", "MaxNumberOfMessages": 2,
                  "WaitTimeSeconds": 20}
        got = await sqs.receive_message(dict(params), HOST)
        assert [m["Body"] for m in got["Messages"]] == ["m0", "m1"]
        assert not [c for c in spy.calls if c[0] == "nack"]
        spy.calls.clear()
        spy.hold = asyncio.Event()
        task = asyncio.ensure_future(sqs.receive_message(dict(params, ReceiveRequestAttemptId="a1"), HOST))
        await asyncio.wait_for(spy.held.wait(), 5)  # leased, and writing the attempt's memo
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(sqs.released(), 5)
        assert spy.calls == [("dequeue_many", "grouped.fifo", 2), ("enqueue_many", 1),
                             ("nack", 0, False), ("nack", 1, False)]  # not deliveries
        spy.hold.set()
        await sqs.close()
    asyncio.run(main())


def test_a_listener_holds_one_service_connection_per_shard_whatever_its_requests(tmp_path):
    """The listener's requests share one asyncio client, connected as a part of serve
    (role ``service``: a shard does not busy-poll after answering it): while a long poll
    waits and eight clients send at once, each shard holds one more service connection
    and no more client connections than before, and the sends are not held up by the poll.
    With more listener processes than SERVICE_ROLE_PROCESSES_MAX (a shard holds 16 service
    connections), each connects as a client instead."""
    import concurrent.futures
    import time

    import shardq
    from shardq.sqs_api.server import SERVICE_ROLE_PROCESSES_MAX, SqsService
    from tests.support.service import Service, wait_until
    from tests.support.sqs_listener import client

    def held(r: Any) -> list[tuple[int, int]]:
        return [(s["service_connections"], s["clients"]) for s in r.stats()["shards"]]
    with Service(shards=2, config={"http": {"listen": ""}}) as svc, shardq.connect(svc.data_dir) as r:
        before = held(r)
        # as many processes as connect as a part of serve (each a listener like this one)
        most = SqsApiConfig(listen="127.0.0.1:0", processes=SERVICE_ROLE_PROCESSES_MAX)
        sqs = SqsService(svc.data_dir, most).start()
        try:
            c = client(sqs.url)
            url = c.create_queue(QueueName="shared")["QueueUrl"]
            with concurrent.futures.ThreadPoolExecutor(9) as pool:
                poll = pool.submit(lambda: client(sqs.url).receive_message(QueueUrl=url, WaitTimeSeconds=20))
                began = time.monotonic()
                sends = [pool.submit(lambda n=n: client(sqs.url).send_message(QueueUrl=url, MessageBody=f"m{n}"))
                         for n in range(8)]
                assert all(f.result(10)["MessageId"] for f in sends) and time.monotonic() - began < 10
                assert held(r) == [(s + 1, n) for s, n in before]
                assert len(poll.result(20)["Messages"]) == 1
        finally:
            sqs.stop()
        wait_until(lambda: held(r) == before, 10, what="the listener's connections closed")
        many = SqsApiConfig(listen="127.0.0.1:0", processes=SERVICE_ROLE_PROCESSES_MAX + 1)
        sqs = SqsService(svc.data_dir, many).start()
        try:
            assert held(r) == [(s, n + 1) for s, n in before]
        finally:
            sqs.stop()
