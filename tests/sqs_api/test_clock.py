"""What depends on time, with the API's clock faked (in process, over a real service's
shards): retention, the 12-hour visibility total, ReceiveRequestAttemptId's retry."""
from __future__ import annotations

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


def test_a_receive_that_fails_half_way_hands_every_lease_back(api):
    dlq = url(api, "dlq-down")
    arn = api.call("GetQueueAttributes", {"QueueUrl": dlq, "AttributeNames": ["QueueArn"]}, HOST)
    q = url(api, "half", RedrivePolicy=f'{{"deadLetterTargetArn": "{arn["Attributes"]["QueueArn"]}", '
                                       f'"maxReceiveCount": 1}}')
    api.call("SendMessageBatch", {"QueueUrl": q, "Entries": [{"Id": str(i), "MessageBody": str(i)}
                                                            for i in range(3)]}, HOST)
    got = api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10, "VisibilityTimeout": 0}, HOST)
    assert len(got["Messages"]) == 3  # each received once: the next receive moves them
    real = api.q

    class DlqDown:  # the dead-letter queue's shard is unreachable
        def __getattr__(self, name):
            return getattr(real, name)

        async def enqueue(self, *a, **kw):
            raise shardq.ShardUnavailable("the dead-letter queue's shard is down")
    api.sqs.q = DlqDown()

    def fails() -> bool:  # once the shard has taken back the 0-second leases
        try:
            api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10}, HOST)
        except shardq.ShardUnavailable:
            return True
        return False
    wait_until(fails, 10, what="a receive that finds the messages and cannot move them")
    api.sqs.q = real
    counts = api.call("GetQueueAttributes", {"QueueUrl": q, "AttributeNames": ["All"]}, HOST)["Attributes"]
    assert counts["ApproximateNumberOfMessagesNotVisible"] == "0"  # none held for nobody
    api.call("ReceiveMessage", {"QueueUrl": q, "MaxNumberOfMessages": 10}, HOST)  # moves them now
    moved = api.call("ReceiveMessage", {"QueueUrl": dlq, "MaxNumberOfMessages": 10}, HOST)["Messages"]
    assert sorted(m["Body"] for m in moved) == ["0", "1", "2"]
