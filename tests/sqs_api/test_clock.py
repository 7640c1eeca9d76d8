"""What depends on time, with the API's clock faked (in process, over a real service's
shards): retention, the 12-hour visibility total, ReceiveRequestAttemptId's retry, and a
lease that ends before the receive that holds it has moved or deleted its message."""
from __future__ import annotations

import contextlib
import json

import pytest

import shardq
from shardq.clock import FakeClock
from shardq.errors import SqsApiError
from shardq.sqs_api.catalog import Catalog
from tests.support.service import Service, wait_until
from tests.support.sqs_inproc import InProcessApi
from tests.support.sqs_listener import QUEUE_DEFAULTS

HOST = "127.0.0.1:9324"


@pytest.fixture(scope="module")
def svc():
    with Service(shards=1, config={"http": {"listen": ""}, "queue_defaults": dict(QUEUE_DEFAULTS),
                                   "queues": {"five": {"max_deliveries": 5}}}) as s:
        yield s


@pytest.fixture
def api(svc, tmp_path):
    clock = FakeClock(1_800_000_000.0)
    a = InProcessApi(svc.data_dir, Catalog(str(tmp_path), clock), clock=clock)
    yield a
    a.close()


def url(api, name, **attrs):
    return api.call("CreateQueue", {"QueueName": name, "Attributes": attrs}, HOST)["QueueUrl"]


def test_a_message_past_its_retention_is_deleted_by_the_receive_that_finds_it(api):
    q = url(api, "retained", MessageRetentionPeriod="60")
    api.call("SendMessage", {"QueueUrl": q, "MessageBody": "old", "MessageAttributes": {
        "k": {"DataType": "String", "StringValue": "v"}}}, HOST)
    api.clock.advance(61)
    api.call("SendMessage", {"QueueUrl": q, "MessageBody": "new", "MessageAttributes": {
        "k": {"DataType": "String", "StringValue": "v"}}}, HOST)
    got = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert [m["Body"] for m in got] == ["new"]
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": q, "VisibilityTimeout": 0}, HOST)


class AcksAfterTheLease:
    """The API's client, whose acks reach the shard only after their lease has ended there,
    as a move's ack does after a receive with VisibilityTimeout 0 (a 1 ms lease: less than
    a move takes). The lease is ended by a release, as its deadline would. ``acked``: the
    job ids it was asked to ack."""

    def __init__(self, real):
        self.real, self.acked = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def ack(self, lease):
        self.acked.append(lease.job_id)
        with contextlib.suppress(shardq.LeaseLost):  # (ended by its deadline already)
            await self.real.nack(lease, 0.0, delivered=False)
        return await self.real.ack(lease)


def gone(api, job_id) -> bool:
    """Whether the job is no more: deleted, never to be delivered again."""
    try:
        api.run(getattr(api.sqs.q, "real", api.sqs.q).job(job_id))
    except shardq.NotFound:
        return True
    return False


def none_in_flight(api, q) -> None:
    """Wait until the 1-ms leases of ``q``'s receives have ended at the shard."""
    wait_until(lambda: api.call("GetQueueAttributes", {"QueueUrl": q, "AttributeNames": ["All"]}, HOST)[
        "Attributes"]["ApproximateNumberOfMessagesNotVisible"] == "0", 10, what="the leases to end")


def redriven(api, name, dlq_name, **attrs):
    fifo = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
    dlq = url(api, dlq_name, **fifo)
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)
    policy = json.dumps({"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": 1})
    return url(api, name, VisibilityTimeout="0", RedrivePolicy=policy, **fifo, **attrs), dlq


def test_a_message_moved_after_its_lease_ended_leaves_its_fifo_source_and_its_group_goes_on(api):
    src, dlq = redriven(api, "fs.fifo", "fd.fifo", ContentBasedDeduplication="true")
    for body in ("poison", "next"):
        api.call("SendMessage", {"QueueUrl": src, "MessageBody": body, "MessageGroupId": "G"}, HOST)
    (first,) = api.call("ReceiveMessage", {"QueueUrl": src}, HOST)["Messages"]
    assert first["Body"] == "poison"
    none_in_flight(api, src)
    api.sqs.q = late = AcksAfterTheLease(api.sqs.q)
    bodies = [m["Body"] for _ in range(6) for m in api.call("ReceiveMessage", {"QueueUrl": src}, HOST).get(
        "Messages", [])]
    assert bodies[:1] == ["next"] and "poison" not in bodies  # moved by the first receive, never handed again
    assert gone(api, late.acked[0])
    moved = api.call("ReceiveMessage", {"QueueUrl": dlq, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert [m["Body"] for m in moved] == ["poison"]


def test_a_message_moved_after_its_lease_ended_is_in_the_dead_letter_queue_only(api):
    src, dlq = redriven(api, "s0", "d0")
    api.call("SendMessage", {"QueueUrl": src, "MessageBody": "poison"}, HOST)
    assert api.call("ReceiveMessage", {"QueueUrl": src}, HOST)["Messages"][0]["Body"] == "poison"
    none_in_flight(api, src)
    api.sqs.q = late = AcksAfterTheLease(api.sqs.q)
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": src}, HOST)  # moved
    (job_id,) = late.acked
    assert gone(api, job_id)
    api.sqs.q = late.real
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": src, "MaxNumberOfMessages": 10}, HOST)
    moved = api.call("ReceiveMessage", {"QueueUrl": dlq, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert [m["Body"] for m in moved] == ["poison"]


def test_a_message_past_its_retention_whose_lease_ended_first_is_deleted_all_the_same(api):
    q = url(api, "retained0", MessageRetentionPeriod="60", VisibilityTimeout="0")
    api.call("SendMessage", {"QueueUrl": q, "MessageBody": "old", "MessageAttributes": {
        "k": {"DataType": "String", "StringValue": "v"}}}, HOST)
    api.clock.advance(61)
    api.sqs.q = late = AcksAfterTheLease(api.sqs.q)
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": q}, HOST)
    (job_id,) = late.acked
    assert gone(api, job_id)


def test_a_move_task_whose_lease_ended_before_its_ack_leaves_nothing_behind(api):
    src, dlq = redriven(api, "ms", "md")
    api.call("SendMessage", {"QueueUrl": src, "MessageBody": "poison"}, HOST)
    api.call("ReceiveMessage", {"QueueUrl": src}, HOST)
    none_in_flight(api, src)
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": src}, HOST)  # moved
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)["Attributes"][
        "QueueArn"]
    api.sqs.q = late = AcksAfterTheLease(api.sqs.q)
    api.call("StartMessageMoveTask", {"SourceArn": arn}, HOST)

    def ended():
        (task,) = api.call("ListMessageMoveTasks", {"SourceArn": arn}, HOST)["Results"]
        return task if task["Status"] != "RUNNING" else None
    task = wait_until(ended, 10, what="the move task")
    assert task["Status"] == "COMPLETED" and task["ApproximateNumberOfMessagesMoved"] == 1
    (job_id,) = late.acked
    assert gone(api, job_id)
    api.sqs.q = late.real
    back = api.call("ReceiveMessage", {"QueueUrl": src, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert [m["Body"] for m in back] == ["poison"]


def test_visibility_adds_up_to_12_hours_from_the_receive(api):
    q = url(api, "vis")
    api.call("SendMessage", {"QueueUrl": q, "MessageBody": "x"}, HOST)
    (m,) = api.call("ReceiveMessage", {"QueueUrl": q, "VisibilityTimeout": 600}, HOST)["Messages"]
    api.clock.advance(43200 - 500)
    api.call("ChangeMessageVisibility", {"QueueUrl": q, "ReceiptHandle": m["ReceiptHandle"],
                                         "VisibilityTimeout": 500}, HOST)  # 12 h exactly: allowed
    with pytest.raises(SqsApiError) as e:
        api.call("ChangeMessageVisibility", {"QueueUrl": q, "ReceiptHandle": m["ReceiptHandle"],
                                             "VisibilityTimeout": 501}, HOST)
    assert e.value.code == "InvalidParameterValue" and "43200" in e.value.message


def test_a_receive_retried_with_its_attempt_id_gets_the_same_messages(api):
    q = url(api, "attempt.fifo", FifoQueue="true", ContentBasedDeduplication="true")
    for g in ("a", "b"):
        api.call("SendMessage", {"QueueUrl": q, "MessageBody": g, "MessageGroupId": g}, HOST)
    first = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10,
                                        "ReceiveRequestAttemptId": "try-1"}, HOST)
    again = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10,
                                        "ReceiveRequestAttemptId": "try-1"}, HOST)
    assert again == first and len(first["Messages"]) == 2
    assert "Messages" not in api.call("ReceiveMessage", {"QueueUrl": q, "ReceiveRequestAttemptId": "try-2"}, HOST)


def test_a_max_receive_count_that_shardq_would_dead_letter_first_is_refused(api):
    dlq = url(api, "dlq5")
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)
    policy = f'{{"deadLetterTargetArn": "{arn["Attributes"]["QueueArn"]}", "maxReceiveCount": %d}}'
    url(api, "five", RedrivePolicy=policy % 4)  # the 5th receive moves it: shardq's 5th lease
    with pytest.raises(SqsApiError) as e:
        api.call("SetQueueAttributes", {"QueueUrl": url(api, "five"), "Attributes": {
            "RedrivePolicy": policy % 5}}, HOST)
    assert e.value.code == "InvalidAttributeValue" and "max_deliveries" in e.value.message


def test_create_queue_on_a_service_of_declared_queues_names_the_config(tmp_path):
    with Service(shards=1, config={"http": {"listen": ""}, "service": {"declare_queues": True},
                                   "queues": {"declared": {}}}) as svc:
        api = InProcessApi(svc.data_dir, Catalog(str(tmp_path)))
        assert url(api, "declared").endswith("/declared")
        with pytest.raises(SqsApiError) as e:
            url(api, "undeclared")
        assert e.value.code == "InvalidParameterValue" and "declare_queues" in e.value.message
        api.close()


def test_a_receive_that_cannot_move_its_messages_answers_and_hands_them_back(api):
    dlq = url(api, "dlq-down")
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)
    q = url(api, "half", RedrivePolicy=f'{{"deadLetterTargetArn": "{arn["Attributes"]["QueueArn"]}", '
                                       f'"maxReceiveCount": 1}}')
    api.call("SendMessageBatch", {"QueueUrl": q, "Entries": [{"Id": str(i), "MessageBody": str(i)}
                                                            for i in range(3)]}, HOST)
    got = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10, "VisibilityTimeout": 0}, HOST)
    assert len(got["Messages"]) == 3  # each received once: the next receive moves them
    real = api.q

    tried: list[str] = []

    class DlqDown:  # the dead-letter queue's shard is unreachable
        def __getattr__(self, name):
            return getattr(real, name)

        async def enqueue(self, *a, **kw):
            tried.append(kw["queue"])
            raise shardq.ShardUnavailable("the dead-letter queue's shard is down")
    api.sqs.q = DlqDown()

    def found() -> bool:  # once the shard has taken back the 0-second leases
        got = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10}, HOST)
        assert "Messages" not in got  # answered (no failure), none of them handed out
        return len(tried) >= 3
    wait_until(found, 10, what="a receive that finds the messages and cannot move them")
    api.sqs.q = real
    counts = api.call("GetQueueAttributes", {"QueueUrl": q, "AttributeNames": ["All"]}, HOST)["Attributes"]
    assert counts["ApproximateNumberOfMessagesNotVisible"] == "0"  # none held for nobody
    api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10}, HOST)  # moves them now
    moved = api.call("ReceiveMessage", {"QueueUrl": dlq, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert sorted(m["Body"] for m in moved) == ["0", "1", "2"]


def drain(api, q) -> list[dict]:
    """Receive and delete every message of FIFO ``q`` (one per group in flight at a time)."""
    out: list[dict] = []
    while True:
        got = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10, "AttributeNames": ["All"]},
                       HOST).get("Messages", [])
        if not got:
            return out
        for m in got:
            api.call("DeleteMessage", {"QueueUrl": q, "ReceiptHandle": m["ReceiptHandle"]}, HOST)
        out += got


@pytest.mark.parametrize("attrs", [{}, {"ContentBasedDeduplication": "true"},
                                   {"DeduplicationScope": "messageGroup"}], ids=["queue", "content", "group"])
def test_a_fifo_queue_created_again_after_delete_remembers_no_dedup_id_of_the_one_before(api, attrs):
    """AWS: a queue created after DeleteQueue (and its 60 s) is a new queue, with no dedup
    history; within one incarnation a duplicate still answers the first send."""
    name = f"again-{len(attrs)}-{attrs.get('DeduplicationScope', 'q')}.fifo"
    content = bool(attrs.get("ContentBasedDeduplication"))

    def sends(q, groups):
        out = {}
        for body, dedup, group in (("one", "id-1", groups[0]), ("two", "id-2", groups[1]),
                                   ("long", "x" * 128, groups[0])):  # 128: scoped, it is hashed
            params = {"QueueUrl": q, "MessageBody": body, "MessageGroupId": group}
            if not content:
                params["MessageDeduplicationId"] = dedup
            out[body] = api.call("SendMessage", params, HOST)["MessageId"]
        return out

    q = url(api, name, FifoQueue="true", **attrs)
    old = sends(q, ("G", "H"))
    api.call("DeleteQueue", {"QueueUrl": q}, HOST)
    api.clock.advance(61)
    q = url(api, name, FifoQueue="true", **attrs)
    new = sends(q, ("G", "K"))  # "two" in another group: the queue-wide claim of the old queue is not its
    assert all(new[b] != old[b] for b in new), (old, new)
    again = sends(q, ("G", "L"))  # the same incarnation: duplicates, answered with the first sends
    if attrs.get("DeduplicationScope") == "messageGroup":
        again.pop("two")  # another group: not a duplicate in this scope
    assert all(again[b] == new[b] for b in again), (new, again)
    got = drain(api, q)
    expected = ["long", "one", "two", "two"] if attrs.get("DeduplicationScope") == "messageGroup" else [
        "long", "one", "two"]
    assert sorted(m["Body"] for m in got) == expected
    assert {m["MessageId"] for m in got} >= set(new.values())
    if not content:  # given back as sent, not as shardq keeps it
        assert {m["Body"]: m["Attributes"]["MessageDeduplicationId"] for m in got if m["Body"] != "two"} == {
            "one": "id-1", "long": "x" * 128}


class FullAfter:
    """The API's client, whose enqueues to ``queue`` are refused (QueueFull) after the
    first ``n``."""

    def __init__(self, real, queue, n):
        self.real, self.queue, self.left = real, queue, n

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def enqueue(self, *args, **kwargs):
        if kwargs.get("queue") == self.queue:
            if self.left <= 0:
                raise shardq.QueueFull("the destination is full")
            self.left -= 1
        return await self.real.enqueue(*args, **kwargs)


def test_a_move_task_whose_enqueue_fails_mid_round_leaves_the_rest_of_its_round_visible(api):
    src, dlq = redriven(api, "full-src", "full-dlq")
    for i in range(10):
        api.call("SendMessage", {"QueueUrl": src, "MessageBody": f"m{i}"}, HOST)
    for _ in range(2):  # each receive of ten: the second moves them to the dead-letter queue
        got = api.call("ReceiveMessage", {"QueueUrl": src, "MaxNumberOfMessages": 10}, HOST).get("Messages", [])
        none_in_flight(api, src)
    assert not got
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)["Attributes"][
        "QueueArn"]
    api.sqs.q = full = FullAfter(api.sqs.q, "full-src", 3)
    api.call("StartMessageMoveTask", {"SourceArn": arn}, HOST)

    def ended():
        (task,) = api.call("ListMessageMoveTasks", {"SourceArn": arn}, HOST)["Results"]
        return task if task["Status"] != "RUNNING" else None
    task = wait_until(ended, 10, what="the move task")
    assert task["Status"] == "FAILED" and task["ApproximateNumberOfMessagesMoved"] == 3
    api.sqs.q = full.real
    counts = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["All"]}, HOST)["Attributes"]
    assert (counts["ApproximateNumberOfMessages"], counts["ApproximateNumberOfMessagesNotVisible"]) == ("7", "0")
    left = api.call("ReceiveMessage", {"QueueUrl": dlq, "MaxNumberOfMessages": 10,
                                       "AttributeNames": ["ApproximateReceiveCount"]}, HOST)["Messages"]
    assert len(left) == 7 and {m["Attributes"]["ApproximateReceiveCount"] for m in left} == {"1"}
