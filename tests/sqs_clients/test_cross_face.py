"""One engine, two faces (issue 46): what a boto3 producer sends to a queue, shardq's own client
leases from the queue of the same name, and what shardq's client enqueues, an SQS consumer
receives. Envelope rules: docs/sqs-api.md (a plain message is its body, UTF-8; one with
attributes is an envelope that ``unwrap`` opens; a native job whose body is not SQS text is
received base64-encoded, flagged by the ``shardq.body-encoding`` attribute)."""
from __future__ import annotations

import base64

import pytest

from shardq.sqs_api.message import BODY_ENCODING_ATTRIBUTE, unwrap
from support.sqs_listener import client, sqs_service, sqs_url


@pytest.fixture(scope="module")
def svc():
    with sqs_service() as s:
        s.sqs = client(sqs_url(s))
        yield s


def test_a_message_sent_by_boto3_is_leased_by_the_native_client(svc):
    sqs = svc.sqs
    url = sqs.create_queue(QueueName="from-sqs")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="plain ✓ body")
    sqs.send_message(QueueUrl=url, MessageBody="with attributes",
                     MessageAttributes={"Kind": {"DataType": "String", "StringValue": "order"}})
    with svc.connect() as q:
        got = [q.dequeue("from-sqs", wait=5) for _ in range(2)]
        assert all(got), got
        bodies = {le.body: le for le in got}
        assert "plain ✓ body".encode() in bodies  # a plain message is its body, byte for byte
        wrapped = next(le for le in got if le.body != "plain ✓ body".encode())
        body, carried = unwrap(wrapped.body)
        assert body == b"with attributes" and carried["a"]["Kind"]["StringValue"] == "order"
        assert q.ack_many(got) == [None, None]
    # Acked natively: gone for the SQS face too.
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)


def test_a_fifo_message_group_is_the_native_key(svc):
    sqs = svc.sqs
    url = sqs.create_queue(QueueName="groups.fifo", Attributes={"FifoQueue": "true",
                                                               "ContentBasedDeduplication": "true"})["QueueUrl"]
    for i in range(3):
        sqs.send_message(QueueUrl=url, MessageBody=f"g1-{i}", MessageGroupId="g1")
    with svc.connect() as q:
        first = q.dequeue("groups.fifo", wait=5)
        assert (first.body, first.key) == (b"g1-0", "g1")
        # The group's head is in flight: nothing more of it, on either face.
        assert q.dequeue("groups.fifo", wait=0) is None
        assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)
        q.ack(first)
        second = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5, MessageSystemAttributeNames=["All"])
        (m,) = second["Messages"]
        assert m["Body"] == "g1-1" and m["Attributes"]["MessageGroupId"] == "g1"


def test_a_job_enqueued_natively_is_received_by_an_sqs_consumer(svc):
    sqs = svc.sqs
    url = sqs.create_queue(QueueName="from-native")["QueueUrl"]
    with svc.connect() as q:
        text_id = q.enqueue("native ✓ text".encode(), queue="from-native")
        q.enqueue(b"\x00\xffbinary", queue="from-native")
    got = []
    for _ in range(20):
        got += sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                   MessageAttributeNames=["All"]).get("Messages", [])
        if len(got) >= 2:
            break
    by_body = {m["Body"]: m for m in got}
    assert set(by_body) == {"native ✓ text", base64.b64encode(b"\x00\xffbinary").decode()}
    assert "MessageAttributes" not in by_body["native ✓ text"]
    flagged = by_body[base64.b64encode(b"\x00\xffbinary").decode()]
    assert flagged["MessageAttributes"][BODY_ENCODING_ATTRIBUTE] == {"DataType": "String", "StringValue": "base64"}
    assert text_id  # the job id is the native face's; the SQS face names it by its MessageId
    sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                    for i, m in enumerate(got)])
    with svc.connect() as q:
        assert q.dequeue("from-native", wait=0) is None  # deleted through SQS: gone natively too
