"""Which client calls each action makes, in process, with a spy for the router: the
shortest paths the listener relies on for its speed (docs/performance.md, the SQS API)."""
from __future__ import annotations

from typing import Any

import pytest

from shardq.clock import FakeClock
from shardq.config import SqsApiConfig
from shardq.sqs_api import attributes
from shardq.sqs_api.api import SqsApi
from shardq.sqs_api.catalog import Catalog
from shardq.sqs_api.messages import WAITED_S
from shardq.types import Lease

HOST = "127.0.0.1:9324"


class SpyRouter:
    """The router calls a send makes, recorded; each job gets the next id."""

    service_id = "spy"

    def __init__(self, clock: FakeClock) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.next_id = 100
        self.clock, self.takes_s = clock, 0.0

    def queue_config(self, name: str) -> dict[str, Any]:
        return {}

    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                priority: int = 0, dedup_id: str | None = None) -> int:
        self.calls.append(("enqueue", queue, key, delay, dedup_id))
        self.next_id += 1
        return self.next_id

    def dequeue_many(self, queue: str, max_jobs: int = 100, wait: float = 0.0,
                     visibility: float | None = None) -> list[Lease]:
        self.calls.append(("dequeue_many", queue, max_jobs))
        self.clock.advance(self.takes_s)  # how long the shard took to answer (a wait)
        return [Lease(i, None, f"m{i}".encode(), queue, 1, 7, 0.0) for i in range(max_jobs)]

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *, delivered: bool = True) -> None:
        self.calls.append(("nack", lease.job_id, delivered))

    def enqueue_many(self, jobs: list[dict[str, Any]], queue: str | None = None) -> list[int]:
        self.calls.append(("enqueue_many", len(jobs)))
        self.next_id += len(jobs)
        return list(range(self.next_id - len(jobs) + 1, self.next_id + 1))


@pytest.fixture
def api(tmp_path):
    clock = FakeClock()
    catalog = Catalog(str(tmp_path), clock)
    catalog.create("plain", attributes.defaults(False), {}, {})
    group_scoped = dict(attributes.defaults(True), DeduplicationScope="messageGroup")
    catalog.create("grouped.fifo", group_scoped, {}, {})
    spy = SpyRouter(clock)
    sqs = SqsApi(spy, catalog, SqsApiConfig(), clock)  # type: ignore[arg-type]
    yield sqs, spy
    sqs.close()


def test_a_lone_send_is_the_routers_enqueue_and_a_batch_one_enqueue_many(api):
    """A SendMessage with no queue-wide dedup claim is one ``enqueue``: the router's lone-call
    path (sent and read in the request's thread), not ``enqueue_many``'s general one."""
    sqs, spy = api
    got = sqs.send_message({"QueueUrl": f"http://{HOST}/000000000000/plain", "MessageBody": "hi",
                            "DelaySeconds": 5}, HOST)
    assert spy.calls == [("enqueue", "plain", None, 5, None)]
    assert got["MD5OfMessageBody"] == "49f68a5c8493ec2c0bf489821c21fc3b" and got["MessageId"]
    spy.calls.clear()
    sqs.send_message({"QueueUrl": f"http://{HOST}/000000000000/grouped.fifo", "MessageBody": "hi",
                      "MessageGroupId": "g", "MessageDeduplicationId": "d1"}, HOST)
    assert spy.calls == [("enqueue", "grouped.fifo", "g", 0, "d1")]  # the group is the key, the id the dedup id
    spy.calls.clear()
    out = sqs.send_message_batch({"QueueUrl": f"http://{HOST}/000000000000/plain", "Entries": [
        {"Id": "a", "MessageBody": "x"}, {"Id": "b", "MessageBody": "y"}]}, HOST)
    assert spy.calls == [("enqueue_many", 2)] and [e["Id"] for e in out["Successful"]] == ["a", "b"]


def test_a_receive_looks_at_its_client_only_after_a_dequeue_that_waited(api):
    """A receive whose dequeue came back at once hands its messages out without looking at
    the connection (its client sent the request a moment ago); one whose dequeue waited
    (WAITED_S or more) looks, and hands back what it got when the client has gone."""
    sqs, spy = api
    looked: list[bool] = []

    def gone() -> bool:
        looked.append(True)
        return True
    sqs.caller.gone = gone
    params = {"QueueUrl": f"http://{HOST}/000000000000/plain", "MaxNumberOfMessages": 2, "WaitTimeSeconds": 20}
    got = sqs.receive_message(dict(params), HOST)
    assert [m["Body"] for m in got["Messages"]] == ["m0", "m1"] and not looked
    spy.calls.clear()
    spy.takes_s = WAITED_S
    assert sqs.receive_message(dict(params), HOST) == {} and looked == [True]
    assert spy.calls == [("dequeue_many", "plain", 2), ("nack", 0, False), ("nack", 1, False)]  # not deliveries
