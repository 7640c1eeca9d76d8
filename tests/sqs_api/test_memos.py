"""What the SQS API remembers beside its messages is shared by every process that serves it
(two SqsApi objects on one data dir, each with its own router and catalog, as two listener
processes have) and durable across a SIGKILL of the whole service: the catalog, PurgeQueue's
60 s rule, FIFO dedup across groups, ReceiveRequestAttemptId answers, first receive times,
message move tasks (docs/sqs-api.md, "Shared and durable")."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import shardq
from shardq.clock import FakeClock
from shardq.errors import SqsApiError
from shardq.sqs_api import memos
from shardq.sqs_api.catalog import Catalog, Owner, alive
from tests.support.service import Service, short_tmpdir, wait_until
from tests.support.sqs_inproc import InProcessApi
from tests.support.sqs_listener import QUEUE_DEFAULTS, client, sqs_service, sqs_url

HOST = "127.0.0.1:9324"
FIRST = "ApproximateFirstReceiveTimestamp"


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config={"http": {"listen": ""}, "queue_defaults": dict(QUEUE_DEFAULTS)}) as s:
        yield s


@pytest.fixture
def pair(svc, tmp_path):
    """Two SQS API processes of one data dir (one clock, so their times can be told apart),
    each with its own client and event loop."""
    clock = FakeClock(1_800_000_000.0)
    apis = []
    for _ in range(2):
        apis.append(InProcessApi(svc.data_dir, Catalog(str(tmp_path), clock), clock=clock))
    yield apis
    for a in apis:
        a.close()


def url(api, name, **attrs):
    return api.call("CreateQueue", {"QueueName": name, "Attributes": attrs}, HOST)["QueueUrl"]


def send(api, q, body, group=None, dedup=None):
    params = {"QueueUrl": q, "MessageBody": body}
    if group is not None:
        params.update(MessageGroupId=group, MessageDeduplicationId=dedup)
    return api.call("SendMessage", params, HOST)


def receive(api, q, **params):
    return api.call("ReceiveMessage", dict({"QueueUrl": q, "MaxNumberOfMessages": 10}, **params), HOST)


def test_a_queue_made_or_changed_by_one_process_is_seen_by_the_other(pair):
    a, b = pair
    q = url(a, "seen")
    assert b.call("GetQueueUrl", {"QueueName": "seen"}, HOST)["QueueUrl"] == q
    b.call("SetQueueAttributes", {"QueueUrl": q, "Attributes": {"VisibilityTimeout": "77"}}, HOST)
    got = a.call("GetQueueAttributes", {"QueueUrl": q, "AttributeNames": ["VisibilityTimeout"]}, HOST)
    assert got["Attributes"]["VisibilityTimeout"] == "77"
    b.call("TagQueue", {"QueueUrl": q, "Tags": {"k": "v"}}, HOST)
    a.call("TagQueue", {"QueueUrl": q, "Tags": {"k2": "v2"}}, HOST)  # neither overwrites the other's change
    assert b.call("ListQueueTags", {"QueueUrl": q}, HOST)["Tags"] == {"k": "v", "k2": "v2"}
    assert a.catalog.key == b.catalog.key  # receipt handles of one are good in the other


def test_purge_queue_once_a_minute_holds_across_processes(pair):
    a, b = pair
    q = url(a, "purged")
    a.call("PurgeQueue", {"QueueUrl": q}, HOST)
    with pytest.raises(SqsApiError) as e:
        b.call("PurgeQueue", {"QueueUrl": q}, HOST)
    assert "PurgeQueueInProgress" in e.value.code
    a.clock.advance(61)
    b.call("PurgeQueue", {"QueueUrl": q}, HOST)


def test_a_dedup_id_spans_the_groups_of_a_queue_across_processes(pair):
    a, b = pair
    q = url(a, "across.fifo", FifoQueue="true")
    first = send(a, q, "one", "g1", "same")
    again = send(b, q, "two", "g2", "same")
    batch = b.call("SendMessageBatch", {"QueueUrl": q, "Entries": [
        {"Id": "x", "MessageBody": "three", "MessageGroupId": "g3", "MessageDeduplicationId": "same"},
        {"Id": "y", "MessageBody": "four", "MessageGroupId": "g4", "MessageDeduplicationId": "other"}]}, HOST)
    assert again["MessageId"] == first["MessageId"] == batch["Successful"][0]["MessageId"]
    assert again["SequenceNumber"] == first["SequenceNumber"]
    got = receive(a, q)["Messages"]
    assert sorted(m["Body"] for m in got) == ["four", "one"]  # the duplicates of g2 and g3 were cancelled


@pytest.mark.parametrize("written", ["the message", "the claim"])
def test_a_send_cut_between_its_two_writes_is_answered_by_its_retry_with_one_message(pair, written):
    """A send's message and its dedup claim are two writes (to two shards): whichever one a
    crash leaves alone, nothing answered is lost, and the sender's retry answers the one
    message there is, which a send of the id in another group answers too."""
    a, b = pair
    q = url(a, f"cut-{written[4:8]}.fifo", FifoQueue="true")
    real = a.memos.enqueue_and_claim

    async def cut(jobs, claims):  # one write done, then the crash
        if written == "the message":
            await a.q.enqueue_many(jobs)
        else:
            await real([], claims)
        raise shardq.ShardUnavailable("the other write's shard is down")
    a.memos.enqueue_and_claim = cut
    with pytest.raises(shardq.ShardUnavailable):
        send(a, q, "body", "g", "d")
    a.memos.enqueue_and_claim = real
    retried = send(b, q, "body", "g", "d")
    assert send(a, q, "body", "other", "d")["MessageId"] == retried["MessageId"]
    got = receive(a, q)["Messages"]
    assert [m["Body"] for m in got] == ["body"] and got[0]["MessageId"] == retried["MessageId"]


def test_a_receive_attempt_is_answered_again_by_the_other_process(pair):
    a, b = pair
    q = url(a, "attempts.fifo", FifoQueue="true", ContentBasedDeduplication="true")
    for g in ("a", "b", "c"):
        send(a, q, g, g, g)
    first = receive(a, q, MaxNumberOfMessages=2, ReceiveRequestAttemptId="try-1", AttributeNames=["All"])
    again = receive(b, q, MaxNumberOfMessages=2, ReceiveRequestAttemptId="try-1", AttributeNames=["All"])
    assert again == first and len(first["Messages"]) == 2
    other = receive(b, q, ReceiveRequestAttemptId="try-2")["Messages"]  # the third group only
    assert [m["Body"] for m in other] == sorted({"a", "b", "c"} - {m["Body"] for m in first["Messages"]})
    assert receive(a, q, MaxNumberOfMessages=2, ReceiveRequestAttemptId="try-1") == {
        "Messages": [{k: v for k, v in m.items() if k != "Attributes"} for m in first["Messages"]]}
    for msg in first["Messages"]:  # deleted: a retry no longer answers them
        b.call("DeleteMessage", {"QueueUrl": q, "ReceiptHandle": msg["ReceiptHandle"]}, HOST)
    assert "Messages" not in receive(a, q, ReceiveRequestAttemptId="try-1")


def test_the_first_receive_time_is_the_same_whichever_process_receives_again(pair):
    a, b = pair
    q = url(a, "firsts")
    a.call("SendMessage", {"QueueUrl": q, "MessageBody": "m", "MessageAttributes": {  # its sent time: the API's
        "k": {"DataType": "String", "StringValue": "v"}}}, HOST)
    a.clock.advance(5)  # the first receive is 5 s after the send
    (m1,) = receive(a, q, AttributeNames=[FIRST, "SentTimestamp"], VisibilityTimeout=0)["Messages"]
    a.clock.advance(5)
    m2 = wait_until(lambda: receive(b, q, AttributeNames=["All"]).get("Messages"), 10, what="the message again")[0]
    assert m1["Attributes"][FIRST] == m2["Attributes"][FIRST] == str(int(m1["Attributes"]["SentTimestamp"]) + 5000)
    assert m2["Attributes"]["ApproximateReceiveCount"] == "2"


def test_lapsed_memos_are_swept(pair, svc):
    a, _ = pair
    q = url(a, "swept.fifo", FifoQueue="true", ContentBasedDeduplication="true")
    send(a, q, "x", "g", "x")
    claims = [memos.Claim("t", f"sweep-{i}", i, 0.0) for i in range(3)]  # lapse at once (due in 1 s)
    assert [m.mine for m in a.run(a.memos.claim_many(claims))] == [True, True, True]
    with shardq.connect(svc.data_dir) as r:
        wait_until(lambda: r.stats()["queues"].get(memos.QUEUE, {}).get("ready", 0) >= 3, 10, what="memos due")
        assert a.run(a.memos.sweep()) >= 3
        assert r.stats()["queues"][memos.QUEUE].get("ready", 0) == 0
    assert a.call("ListQueues", {}, HOST)["QueueUrls"] == [q]  # the memo queue is no SQS queue


def test_a_move_task_runs_on_when_another_process_starts_and_stops_when_another_cancels_it(pair, svc, tmp_path):
    a, b = pair
    def arn_of(q):
        return a.call("GetQueueAttributes", {"QueueUrl": q, "AttributeNames": ["QueueArn"]}, HOST)["Attributes"]
    dlq = url(a, "mv-dlq")
    arn = arn_of(dlq)["QueueArn"]
    src_arn = {"Attributes": arn_of(url(a, "mv-src", RedrivePolicy=f'{{"deadLetterTargetArn": "{arn}", '
                                                                   f'"maxReceiveCount": 3}}'))}
    a.call("SendMessageBatch", {"QueueUrl": dlq, "Entries": [{"Id": str(i), "MessageBody": str(i)}
                                                            for i in range(10)]}, HOST)
    a.call("StartMessageMoveTask", {"SourceArn": arn, "DestinationArn": src_arn["Attributes"]["QueueArn"],
                                    "MaxNumberOfMessagesPerSecond": 1}, HOST)
    late = InProcessApi(svc.data_dir, Catalog(str(tmp_path), a.clock), clock=a.clock)
    try:  # a process that starts later: the task of a live one is not its to fail
        (task,) = late.call("ListMessageMoveTasks", {"SourceArn": arn}, HOST)["Results"]
        assert task["Status"] == "RUNNING" and not any(k.startswith("_") for k in task)
        with pytest.raises(SqsApiError) as e:  # one task per source, whichever process asks
            b.call("StartMessageMoveTask", {"SourceArn": arn}, HOST)
        assert e.value.code == "UnsupportedOperation"
        b.call("CancelMessageMoveTask", {"TaskHandle": task["TaskHandle"]}, HOST)
        wait_until(lambda: late.call("ListMessageMoveTasks", {"SourceArn": arn}, HOST)["Results"][0]["Status"]
                   == "CANCELLED", 10, 0.05, what="the task, cancelled by another process, to stop")
    finally:
        late.close()


def test_a_process_holds_its_owner_lock_until_it_is_gone(tmp_path):
    cat = Catalog(str(tmp_path))
    owner = Owner(cat.dir)
    assert alive(cat.dir, owner.id) and not alive(cat.dir, "0123456789abcdef") and not alive(cat.dir, None)
    owner.close()
    assert not alive(cat.dir, owner.id)


def test_memos_cancel_and_purges_survive_a_kill_9_of_the_service():
    data_dir = os.path.join(short_tmpdir(), "data")
    try:
        with sqs_service(data_dir=data_dir) as svc:
            c = client(sqs_url(svc))
            fifo = c.create_queue(QueueName="kept.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
            std = c.create_queue(QueueName="kept")["QueueUrl"]
            sent = c.send_message(QueueUrl=fifo, MessageBody="one", MessageGroupId="a", MessageDeduplicationId="d")
            c.send_message(QueueUrl=fifo, MessageBody="two", MessageGroupId="b", MessageDeduplicationId="e")
            first = c.receive_message(QueueUrl=fifo, MaxNumberOfMessages=1, ReceiveRequestAttemptId="k",
                                      VisibilityTimeout=600, AttributeNames=["All"])
            dlq = c.create_queue(QueueName="kept-dlq")["QueueUrl"]
            dlq_arn = c.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
            c.create_queue(QueueName="kept-src", Attributes={"RedrivePolicy": json.dumps(
                {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 3})})
            c.send_message_batch(QueueUrl=dlq, Entries=[{"Id": str(i), "MessageBody": str(i)} for i in range(10)])
            c.start_message_move_task(SourceArn=dlq_arn, DestinationArn=dlq_arn.replace("-dlq", "-src"),
                                      MaxNumberOfMessagesPerSecond=1)  # still running at the kill
            c.purge_queue(QueueUrl=std)  # also makes the leases above durable (a logged op on every shard)
            svc.kill_all()
            svc.start()
            c = client(sqs_url(svc))
            again = c.send_message(QueueUrl=fifo, MessageBody="three", MessageGroupId="c", MessageDeduplicationId="d")
            assert again["MessageId"] == sent["MessageId"]
            retry = c.receive_message(QueueUrl=fifo, MaxNumberOfMessages=1, ReceiveRequestAttemptId="k",
                                      VisibilityTimeout=600, AttributeNames=["All"])
            assert retry["Messages"] == first["Messages"]
            with pytest.raises(c.exceptions.PurgeQueueInProgress):
                c.purge_queue(QueueUrl=std)
            (m,) = first["Messages"]
            c.change_message_visibility(QueueUrl=fifo, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
            back = c.receive_message(QueueUrl=fifo, MaxNumberOfMessages=10, AttributeNames=["All"])["Messages"]
            mine = [x for x in back if x["MessageId"] == m["MessageId"]]
            assert mine and mine[0]["Attributes"][FIRST] == m["Attributes"][FIRST]
            assert mine[0]["Attributes"]["ApproximateReceiveCount"] == "2"
            assert sorted(x["Body"] for x in back) == ["one", "two"]  # "three" was a duplicate of "one"
            (task,) = c.list_message_move_tasks(SourceArn=dlq_arn)["Results"]  # its process is gone
            assert task["Status"] == "FAILED" and task["ApproximateNumberOfMessagesMoved"] < 10
    finally:
        shutil.rmtree(os.path.dirname(data_dir), ignore_errors=True)


def test_a_service_of_declared_queues_without_the_memo_queue_is_named_in_the_error(tmp_path):
    with Service(shards=1, config={"http": {"listen": ""}, "service": {"declare_queues": True},
                                   "queues": {"d.fifo": {}}}) as svc:
        api = InProcessApi(svc.data_dir, Catalog(str(tmp_path)))
        try:
            q = url(api, "d.fifo", FifoQueue="true")
            with pytest.raises(SqsApiError) as e:
                send(api, q, "x", "g", "d")
            assert memos.QUEUE in e.value.message and "declare_queues" in e.value.message
        finally:
            api.close()
