"""The SQS API over AWS JSON 1.0 (boto3's protocol today) against a real ``shardq serve``:
every action, AWS's errors, and the limits at their maximum."""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import botocore.exceptions
import pytest

import shardq
from support.service import wait_until
from shardq.sqs_api.message import md5_of_attributes, md5_of_body, unwrap
from tests.support.sqs_listener import module_fixtures, parked, waiting_dequeues

MIB = 1024 * 1024


svc, sqs = module_fixtures()


_n = iter(range(10**6))


@pytest.fixture
def queue(sqs):
    return sqs.create_queue(QueueName=f"q{next(_n)}")["QueueUrl"]


@pytest.fixture
def fifo(sqs):
    return sqs.create_queue(QueueName=f"f{next(_n)}.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]


def code(e: botocore.exceptions.ClientError) -> str:
    return e.response["Error"]["Code"]


# ---------------------------------------------------------------------------- queues
def test_create_is_idempotent_with_the_same_attributes_and_refused_with_others(sqs):
    url = sqs.create_queue(QueueName="same", Attributes={"VisibilityTimeout": "40"})["QueueUrl"]
    assert url.endswith("/000000000000/same")
    assert sqs.create_queue(QueueName="same", Attributes={"VisibilityTimeout": "40"})["QueueUrl"] == url
    with pytest.raises(sqs.exceptions.QueueNameExists) as e:
        sqs.create_queue(QueueName="same", Attributes={"VisibilityTimeout": "41"})
    assert code(e.value) == "QueueAlreadyExists"
    assert sqs.get_queue_url(QueueName="same")["QueueUrl"] == url


def test_queue_names_and_fifo_rules(sqs):
    name = "n" * 75 + ".fifo"  # 80 characters, .fifo included: the maximum
    assert sqs.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})["QueueUrl"].endswith(name)
    for bad, attrs in (("n" * 81, {}), ("sp ace", {}), ("x.fifo", {}), ("plain", {"FifoQueue": "true"})):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.create_queue(QueueName=bad, Attributes=attrs)
        assert code(e.value) in ("InvalidParameterValue", "InvalidAttributeValue"), bad
    with pytest.raises(sqs.exceptions.InvalidAttributeName):
        sqs.create_queue(QueueName="std-dedup", Attributes={"ContentBasedDeduplication": "true"})


def test_an_unknown_queue_is_answered_as_aws_answers(sqs, svc):
    with pytest.raises(sqs.exceptions.QueueDoesNotExist) as e:
        sqs.get_queue_url(QueueName="never-made")
    err = e.value.response["Error"]
    assert err["Code"] == "AWS.SimpleQueueService.NonExistentQueue" and err["QueryErrorCode"] == "QueueDoesNotExist"
    assert e.value.response["ResponseMetadata"]["HTTPHeaders"]["x-amzn-query-error"] == \
        "AWS.SimpleQueueService.NonExistentQueue;Sender"
    with pytest.raises(sqs.exceptions.QueueDoesNotExist):
        sqs.send_message(QueueUrl=svc.url + "000000000000/never-made", MessageBody="x")


def test_list_queues_with_prefix_and_pages(sqs):
    urls = [sqs.create_queue(QueueName=f"page-{i:02d}")["QueueUrl"] for i in range(5)]
    assert sqs.list_queues(QueueNamePrefix="page-")["QueueUrls"] == urls
    seen, token = [], None
    while True:
        kw = {"NextToken": token} if token else {}
        page = sqs.list_queues(QueueNamePrefix="page-", MaxResults=2, **kw)
        seen += page["QueueUrls"]
        token = page.get("NextToken")
        if not token:
            break
    assert seen == urls
    assert "QueueUrls" not in sqs.list_queues(QueueNamePrefix="nothing-like-it")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.list_queues(MaxResults=1001)
    assert code(e.value) == "InvalidParameterValue"


def test_attributes_set_get_and_checked(sqs, queue):
    sqs.set_queue_attributes(QueueUrl=queue, Attributes={"VisibilityTimeout": "43200", "DelaySeconds": "900",
                                                         "MaximumMessageSize": "1024",
                                                         "MessageRetentionPeriod": "1209600",
                                                         "ReceiveMessageWaitTimeSeconds": "20"})
    got = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    assert got["VisibilityTimeout"] == "43200" and got["DelaySeconds"] == "900"
    assert got["QueueArn"] == "arn:aws:sqs:us-east-1:000000000000:" + queue.rsplit("/", 1)[1]
    assert {"ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed", "CreatedTimestamp", "LastModifiedTimestamp"} <= set(got)
    for name, value in (("VisibilityTimeout", "43201"), ("DelaySeconds", "901"), ("MaximumMessageSize", "1048577"),
                        ("MaximumMessageSize", "1023"), ("MessageRetentionPeriod", "59"),
                        ("ReceiveMessageWaitTimeSeconds", "21"), ("Policy", '{"Version": "2012-10-17"}')):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.set_queue_attributes(QueueUrl=queue, Attributes={name: value})
        assert code(e.value) == "InvalidAttributeValue", name
    with pytest.raises(sqs.exceptions.InvalidAttributeName):
        sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["NoSuchThing"])


def test_tags(sqs):
    url = sqs.create_queue(QueueName="tagged", tags={"team": "a"})["QueueUrl"]
    sqs.tag_queue(QueueUrl=url, Tags={"env": "test"})
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"team": "a", "env": "test"}
    sqs.untag_queue(QueueUrl=url, TagKeys=["team"])
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"env": "test"}
    with pytest.raises(botocore.exceptions.ClientError):
        sqs.tag_queue(QueueUrl=url, Tags={f"k{i}": "v" for i in range(50)})  # 51 with "env"


def test_permissions_are_refused_with_the_reason(sqs, queue):
    with pytest.raises(sqs.exceptions.UnsupportedOperation) as e:
        sqs.add_permission(QueueUrl=queue, Label="l", AWSAccountIds=["111111111111"], Actions=["SendMessage"])
    assert "one principal" in e.value.response["Error"]["Message"]
    with pytest.raises(sqs.exceptions.UnsupportedOperation):
        sqs.remove_permission(QueueUrl=queue, Label="l")


def test_delete_queue_and_the_60_second_rule(sqs):
    url = sqs.create_queue(QueueName="short-lived")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="x")
    sqs.delete_queue(QueueUrl=url)
    with pytest.raises(sqs.exceptions.QueueDoesNotExist):
        sqs.get_queue_url(QueueName="short-lived")
    with pytest.raises(sqs.exceptions.QueueDeletedRecently):
        sqs.create_queue(QueueName="short-lived")


def test_purge(sqs, queue, fifo):
    sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "MessageBody": "x"} for i in range(10)])
    sqs.purge_queue(QueueUrl=queue)
    assert "Messages" not in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)
    with pytest.raises(sqs.exceptions.PurgeQueueInProgress):
        sqs.purge_queue(QueueUrl=queue)
    for i in range(5):  # one group: each message becomes receivable as the one before goes
        sqs.send_message(QueueUrl=fifo, MessageBody=f"m{i}", MessageGroupId="g", MessageDeduplicationId=str(i))
    sqs.purge_queue(QueueUrl=fifo)
    assert "Messages" not in sqs.receive_message(QueueUrl=fifo)


def _counts(sqs, url):
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return [int(got[a]) for a in ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                                  "ApproximateNumberOfMessagesDelayed")]


def test_purge_deletes_messages_in_flight_and_delayed_too(sqs, queue, fifo):
    """AWS's PurgeQueue deletes every message; it once deleted only what could be received."""
    sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "MessageBody": f"m{i}"} for i in range(3)])
    sqs.send_message(QueueUrl=queue, MessageBody="later", DelaySeconds=900)
    held = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1, VisibilityTimeout=600)["Messages"][0]
    assert _counts(sqs, queue) == [2, 1, 1]
    sqs.purge_queue(QueueUrl=queue)
    assert _counts(sqs, queue) == [0, 0, 0]
    with pytest.raises(botocore.exceptions.ClientError):  # its handle holds nothing any more
        sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=held["ReceiptHandle"], VisibilityTimeout=0)
    sqs.delete_message(QueueUrl=queue, ReceiptHandle=held["ReceiptHandle"])  # deleted already: success
    assert "Messages" not in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)
    # a FIFO group whose head is in flight: the whole group goes, and the group is free after
    for i in range(3):
        sqs.send_message(QueueUrl=fifo, MessageBody=f"m{i}", MessageGroupId="g", MessageDeduplicationId=f"d{i}")
    assert sqs.receive_message(QueueUrl=fifo, VisibilityTimeout=600)["Messages"][0]["Body"] == "m0"
    sqs.purge_queue(QueueUrl=fifo)
    assert _counts(sqs, fifo) == [0, 0, 0]
    sqs.send_message(QueueUrl=fifo, MessageBody="after", MessageGroupId="g", MessageDeduplicationId="after")
    assert [m["Body"] for m in sqs.receive_message(QueueUrl=fifo)["Messages"]] == ["after"]


def test_delete_queue_deletes_messages_in_flight_and_delayed_too(sqs, svc):
    url = sqs.create_queue(QueueName="gone-whole")["QueueUrl"]
    sqs.send_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "MessageBody": "x"} for i in range(3)])
    sqs.send_message(QueueUrl=url, MessageBody="later", DelaySeconds=900)
    sqs.receive_message(QueueUrl=url, VisibilityTimeout=600)
    sqs.delete_queue(QueueUrl=url)
    with shardq.connect(svc.data_dir) as q:  # nothing is left to show up if it is created again
        counts = q.stats()["queues"].get("gone-whole", {})
    assert not any(counts.get(s) for s in ("ready", "waiting", "delayed", "in_flight")), counts


def test_unknown_action_and_a_bad_body_over_raw_http(svc):
    host = urlsplit(svc.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    for target, body, want in (("AmazonSQS.NoSuchAction", b"{}", "InvalidAction"),
                               ("Nope.ListQueues", b"{}", "InvalidAction"),
                               ("AmazonSQS.ListQueues", b"[1]", "InvalidParameterValue")):
        conn.request("POST", "/", body, {"X-Amz-Target": target, "Content-Type": "application/x-amz-json-1.0"})
        r = conn.getresponse()
        data = json.loads(r.read())
        assert r.status == 400 and data["__type"] == f"com.amazonaws.sqs#{want}"
        assert r.getheader("x-amzn-query-error") == f"{want};Sender"
    conn.close()


# ---------------------------------------------------------------------------- messages
def test_send_receive_delete_with_attributes_and_md5s(sqs, queue):
    attrs = {"s": {"DataType": "String", "StringValue": "héllo"}, "n": {"DataType": "Number.int", "StringValue": "42"},
             "b": {"DataType": "Binary.gz", "BinaryValue": b"\x00\xff"}}
    sent = sqs.send_message(QueueUrl=queue, MessageBody="body ✓", MessageAttributes=attrs,
                            MessageSystemAttributes={"AWSTraceHeader": {"DataType": "String",
                                                                        "StringValue": "Root=1-abc"}})
    assert sent["MD5OfMessageAttributes"] == md5_of_attributes(attrs) and "MD5OfMessageSystemAttributes" in sent
    got = sqs.receive_message(QueueUrl=queue, MessageAttributeNames=["All"], AttributeNames=["All"])["Messages"]
    (msg,) = got
    assert msg["MessageId"] == sent["MessageId"] and msg["Body"] == "body ✓"
    assert msg["MessageAttributes"] == attrs and msg["MD5OfMessageAttributes"] == sent["MD5OfMessageAttributes"]
    assert msg["MD5OfBody"] == sent["MD5OfMessageBody"] == md5_of_body("body ✓")
    a = msg["Attributes"]
    assert a["ApproximateReceiveCount"] == "1" and a["AWSTraceHeader"] == "Root=1-abc"
    assert abs(int(a["SentTimestamp"]) - time.time() * 1000) < 60_000
    sqs.delete_message(QueueUrl=queue, ReceiptHandle=msg["ReceiptHandle"])
    assert "Messages" not in sqs.receive_message(QueueUrl=queue)


def test_attribute_selection_by_name_and_prefix(sqs, queue):
    attrs = {f"{p}.{i}": {"DataType": "String", "StringValue": "v"} for p in ("a", "b") for i in range(2)}
    sqs.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=attrs)
    msg = sqs.receive_message(QueueUrl=queue, MessageAttributeNames=["a.*"])["Messages"][0]
    assert set(msg["MessageAttributes"]) == {"a.0", "a.1"}
    assert msg["MD5OfMessageAttributes"] == md5_of_attributes({k: attrs[k] for k in ("a.0", "a.1")})


def test_a_body_and_attributes_at_1_mib_pass_and_a_byte_more_is_refused(sqs, queue):
    attrs = {"k": {"DataType": "String", "StringValue": "v" * 100}}
    room = MIB - (1 + len("String") + 100)
    sqs.send_message(QueueUrl=queue, MessageBody="x" * room, MessageAttributes=attrs)
    msg = sqs.receive_message(QueueUrl=queue, MessageAttributeNames=["All"])["Messages"][0]
    assert len(msg["Body"]) == room
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=queue, MessageBody="x" * (room + 1), MessageAttributes=attrs)
    assert code(e.value) == "InvalidParameterValue"


def test_message_contents_and_attribute_rules(sqs, queue):
    for body in ("bad \x00 nul", "bad \x08", "\ufffe"):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message(QueueUrl=queue, MessageBody=body)
        assert code(e.value) == "InvalidMessageContents"
    for attrs in ({"AWS.x": {"DataType": "String", "StringValue": "v"}},
                  {"x": {"DataType": "Number", "StringValue": "nan-ish"}},
                  {"x": {"DataType": "Float", "StringValue": "1"}},
                  {f"k{i}": {"DataType": "String", "StringValue": "v"} for i in range(11)}):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=attrs)
        assert code(e.value) == "InvalidParameterValue", attrs
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=queue, MessageBody="x", MessageDeduplicationId="d")
    assert code(e.value) == "InvalidParameterValue"


def test_a_number_attribute_is_38_digits_between_1e_minus_128_and_1e126(sqs, queue):
    just_over = "1." + "0" * 36 + "1"  # 38 digits: the precision allowed, a hair past the edge
    for good in ("0", "-0.0", "1e126", "-1e126", "1e-128", "-1e-128", "9" * 38, "42", "-3.25"):
        sqs.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes={
            "n": {"DataType": "Number", "StringValue": good}})
    for bad in ("1e200", just_over + "e126", "-" + just_over + "e126", "9.9e-129", "-9.9e-129", "9" * 39, "nan",
                "inf"):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes={
                "n": {"DataType": "Number.float", "StringValue": bad}})
        assert code(e.value) == "InvalidParameterValue", bad
        assert e.value.response["Error"]["Message"] == "Can't cast the value of message (user) attribute 'n' to a " \
                                                       "number.", bad
    sqs.purge_queue(QueueUrl=queue)


def test_a_batch_of_ten_at_1_mib_passes_and_each_entry_is_answered_on_its_own(sqs, queue):
    each = MIB // 10
    entries = [{"Id": ("i" * 79) + str(i), "MessageBody": "x" * (each + (MIB % 10 if i == 0 else 0))}
               for i in range(10)]
    out = sqs.send_message_batch(QueueUrl=queue, Entries=entries)
    assert len(out["Successful"]) == 10 and not out.get("Failed")
    entries[0]["MessageBody"] += "x"
    with pytest.raises(sqs.exceptions.BatchRequestTooLong):
        sqs.send_message_batch(QueueUrl=queue, Entries=entries)
    with pytest.raises(sqs.exceptions.TooManyEntriesInBatchRequest):
        sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "MessageBody": "x"} for i in range(11)])
    with pytest.raises(sqs.exceptions.BatchEntryIdsNotDistinct):
        sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": "a", "MessageBody": "x"}] * 2)
    with pytest.raises(sqs.exceptions.InvalidBatchEntryId):
        sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": "i" * 81, "MessageBody": "x"}])
    with pytest.raises(sqs.exceptions.EmptyBatchRequest):
        sqs.send_message_batch(QueueUrl=queue, Entries=[])
    mixed = sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": "good", "MessageBody": "fine"},
                                                            {"Id": "bad", "MessageBody": "nul \x00"}])
    assert [s["Id"] for s in mixed["Successful"]] == ["good"]
    assert [(f["Id"], f["Code"], f["SenderFault"]) for f in mixed["Failed"]] == \
        [("bad", "InvalidMessageContents", True)]
    got = []
    while True:
        msgs = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10).get("Messages", [])
        if not msgs:
            break
        got += msgs
        out = sqs.delete_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                                for i, m in enumerate(msgs)])
        assert len(out["Successful"]) == len(msgs)
    assert sorted(len(m["Body"]) for m in got) == sorted([len(e["MessageBody"]) - (1 if i == 0 else 0)
                                                          for i, e in enumerate(entries)] + [4])


def test_receive_limits(sqs, queue):
    for kw in ({"MaxNumberOfMessages": 11}, {"MaxNumberOfMessages": 0}, {"WaitTimeSeconds": 21},
               {"VisibilityTimeout": 43201}):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.receive_message(QueueUrl=queue, **kw)
        assert code(e.value) == "InvalidParameterValue", kw


def test_a_receive_of_ten_gets_ten_ready_at_once_from_every_shard_and_group(sqs, queue):
    """A standard queue's messages have no key (a MessageGroupId is not one), so ten ready
    messages of one group, on whichever shards, come in one receive of 10 without waiting
    (WaitTimeSeconds 0); with none ready it answers at once; one DeleteMessageBatch deletes
    them all."""
    sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "MessageBody": f"m{i}", "MessageGroupId": "g"}
                                                    for i in range(10)])
    began = time.monotonic()
    got = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=0)["Messages"]
    assert sorted(m["Body"] for m in got) == sorted(f"m{i}" for i in range(10))
    done = sqs.delete_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                             for i, m in enumerate(got)])
    assert len(done["Successful"]) == 10 and not done.get("Failed")
    assert "Messages" not in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=0)
    assert time.monotonic() - began < 5  # neither receive waited for a second


def test_a_long_poll_wakes_when_a_message_arrives(sqs, svc, queue):
    out = {}
    before = waiting_dequeues(svc)

    def receive():
        began = time.monotonic()
        out["msgs"] = sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=20).get("Messages", [])
        out["s"] = time.monotonic() - began
    t = threading.Thread(target=receive)
    t.start()
    parked(svc, before, 1, "the long poll waiting at the shards")
    assert "msgs" not in out  # it waits: the message below is what wakes it
    sqs.send_message(QueueUrl=queue, MessageBody="wake")
    t.join(25)
    assert [m["Body"] for m in out["msgs"]] == ["wake"] and out["s"] < 10


def test_delay_per_message_and_per_queue(sqs, queue):
    sqs.send_message(QueueUrl=queue, MessageBody="later", DelaySeconds=900)
    attrs = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessagesDelayed"])
    assert attrs["Attributes"]["ApproximateNumberOfMessagesDelayed"] == "1"
    assert "Messages" not in sqs.receive_message(QueueUrl=queue)
    with pytest.raises(botocore.exceptions.ClientError):
        sqs.send_message(QueueUrl=queue, MessageBody="x", DelaySeconds=901)


def test_stale_receipt_handles_never_touch_a_newer_delivery(sqs, queue):
    sqs.send_message(QueueUrl=queue, MessageBody="fenced")
    old = sqs.receive_message(QueueUrl=queue)["Messages"][0]["ReceiptHandle"]
    sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=old, VisibilityTimeout=0)  # visible again
    new = sqs.receive_message(QueueUrl=queue, AttributeNames=["ApproximateReceiveCount"])["Messages"][0]
    assert new["Attributes"]["ApproximateReceiveCount"] == "2"
    sqs.delete_message(QueueUrl=queue, ReceiptHandle=old)  # AWS: success, and nothing is deleted
    with pytest.raises(sqs.exceptions.MessageNotInflight):
        sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=old, VisibilityTimeout=0)
    counts = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
    assert counts["Attributes"]["ApproximateNumberOfMessagesNotVisible"] == "1"  # the new delivery holds
    sqs.delete_message(QueueUrl=queue, ReceiptHandle=new["ReceiptHandle"])
    forged = old[:-4] + ("AAAA" if not old.endswith("AAAA") else "BBBB")
    with pytest.raises(sqs.exceptions.ReceiptHandleIsInvalid):
        sqs.delete_message(QueueUrl=queue, ReceiptHandle=forged)


def test_visibility_changes_up_to_12_hours_in_all(sqs, queue):
    sqs.send_message_batch(QueueUrl=queue, Entries=[{"Id": str(i), "MessageBody": str(i)} for i in range(2)])
    msgs = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=2, VisibilityTimeout=43200)["Messages"]
    sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=msgs[0]["ReceiptHandle"], VisibilityTimeout=43000)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.change_message_visibility(QueueUrl=queue, ReceiptHandle=msgs[0]["ReceiptHandle"],
                                      VisibilityTimeout=43201)
    assert code(e.value) == "InvalidParameterValue"
    out = sqs.change_message_visibility_batch(QueueUrl=queue, Entries=[
        {"Id": "a", "ReceiptHandle": msgs[0]["ReceiptHandle"], "VisibilityTimeout": 0},
        {"Id": "b", "ReceiptHandle": "garbage", "VisibilityTimeout": 0}])
    assert [s["Id"] for s in out["Successful"]] == ["a"]
    assert [(f["Id"], f["Code"]) for f in out["Failed"]] == [("b", "ReceiptHandleIsInvalid")]


def test_fifo_groups_keep_order_and_one_message_in_flight(sqs, fifo):
    for i in range(3):
        for g in ("a", "b"):
            sqs.send_message(QueueUrl=fifo, MessageBody=f"{g}{i}", MessageGroupId=g, MessageDeduplicationId=f"{g}{i}")
    first = sqs.receive_message(QueueUrl=fifo, MaxNumberOfMessages=10, AttributeNames=["All"])["Messages"]
    assert sorted(m["Body"] for m in first) == ["a0", "b0"]  # one per group while it is in flight
    assert "Messages" not in sqs.receive_message(QueueUrl=fifo, MaxNumberOfMessages=10)
    seqs = {m["Attributes"]["MessageGroupId"]: int(m["Attributes"]["SequenceNumber"]) for m in first}
    for m in first:
        sqs.delete_message(QueueUrl=fifo, ReceiptHandle=m["ReceiptHandle"])
    second = sqs.receive_message(QueueUrl=fifo, MaxNumberOfMessages=10, AttributeNames=["All"])["Messages"]
    assert sorted(m["Body"] for m in second) == ["a1", "b1"]
    for m in second:
        assert int(m["Attributes"]["SequenceNumber"]) > seqs[m["Attributes"]["MessageGroupId"]]
        assert m["Attributes"]["MessageDeduplicationId"] == m["Body"]  # given back, as AWS does


def test_fifo_dedup_answers_the_first_send_within_the_window(sqs):
    url = sqs.create_queue(QueueName="cbd.fifo", Attributes={"FifoQueue": "true",
                                                             "ContentBasedDeduplication": "true"})["QueueUrl"]
    a = sqs.send_message(QueueUrl=url, MessageBody="same", MessageGroupId="g" * 128)
    b = sqs.send_message(QueueUrl=url, MessageBody="same", MessageGroupId="g" * 128)
    c = sqs.send_message(QueueUrl=url, MessageBody="same", MessageGroupId="g" * 128, MessageDeduplicationId="d" * 128)
    assert (a["MessageId"], a["SequenceNumber"]) == (b["MessageId"], b["SequenceNumber"])
    assert c["MessageId"] != a["MessageId"] and int(c["SequenceNumber"]) > int(a["SequenceNumber"])
    msg = sqs.receive_message(QueueUrl=url, AttributeNames=["All"])["Messages"][0]
    sqs.delete_message(QueueUrl=url, ReceiptHandle=msg["ReceiptHandle"])
    d = sqs.send_message(QueueUrl=url, MessageBody="same", MessageGroupId="g" * 128)  # remembered after delete
    assert d["MessageId"] == a["MessageId"]
    for bad in ({"MessageGroupId": "g" * 129}, {"MessageGroupId": "g", "MessageDeduplicationId": "d" * 129},
                {"MessageGroupId": "g", "DelaySeconds": 1}):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message(QueueUrl=url, MessageBody="x", **bad)
        assert code(e.value) == "InvalidParameterValue", bad
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=url, MessageBody="x")
    assert code(e.value) == "MissingParameter"


def test_fifo_throughput_per_message_group_needs_dedup_per_message_group(sqs):
    ok = sqs.create_queue(QueueName="tp-ok.fifo", Attributes={
        "FifoQueue": "true", "DeduplicationScope": "messageGroup", "FifoThroughputLimit": "perQueue"})["QueueUrl"]
    sqs.set_queue_attributes(QueueUrl=ok, Attributes={"FifoThroughputLimit": "perMessageGroupId"})
    for attrs in ({"DeduplicationScope": "queue", "FifoThroughputLimit": "perMessageGroupId"},
                  {"FifoThroughputLimit": "perMessageGroupId"}):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.create_queue(QueueName="tp-bad.fifo", Attributes={"FifoQueue": "true", **attrs})
        assert code(e.value) == "InvalidAttributeValue", attrs
    with pytest.raises(botocore.exceptions.ClientError) as e:  # the pair the change would leave
        sqs.set_queue_attributes(QueueUrl=ok, Attributes={"DeduplicationScope": "queue"})
    assert code(e.value) == "InvalidAttributeValue"
    got = sqs.get_queue_attributes(QueueUrl=ok, AttributeNames=["All"])["Attributes"]
    assert (got["DeduplicationScope"], got["FifoThroughputLimit"]) == ("messageGroup", "perMessageGroupId")


def test_redrive_moves_a_message_past_max_receive_count_and_a_move_task_brings_it_back(sqs):
    dlq = sqs.create_queue(QueueName="dead")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    src = sqs.create_queue(QueueName="src", Attributes={
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 1})})["QueueUrl"]
    with pytest.raises(botocore.exceptions.ClientError):
        sqs.create_queue(QueueName="src2", Attributes={"RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": arn.replace(":dead", ":nope"), "maxReceiveCount": 1})})
    sqs.send_message(QueueUrl=src, MessageBody="poison", MessageAttributes={
        "k": {"DataType": "String", "StringValue": "kept"}})
    h = sqs.receive_message(QueueUrl=src)["Messages"][0]["ReceiptHandle"]
    sqs.change_message_visibility(QueueUrl=src, ReceiptHandle=h, VisibilityTimeout=0)
    assert "Messages" not in sqs.receive_message(QueueUrl=src)  # the 2nd receive moved it
    moved = sqs.receive_message(QueueUrl=dlq, AttributeNames=["All"], MessageAttributeNames=["All"])["Messages"][0]
    assert moved["Body"] == "poison" and moved["MessageAttributes"]["k"]["StringValue"] == "kept"
    assert moved["Attributes"]["DeadLetterQueueSourceArn"].endswith(":src")
    assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [src]
    sqs.change_message_visibility(QueueUrl=dlq, ReceiptHandle=moved["ReceiptHandle"], VisibilityTimeout=0)
    task = sqs.start_message_move_task(SourceArn=arn)["TaskHandle"]
    wait_until(lambda: sqs.list_message_move_tasks(SourceArn=arn)["Results"][0]["Status"] != "RUNNING", 20, 0.05,
               "the move task")
    (t,) = sqs.list_message_move_tasks(SourceArn=arn)["Results"]
    assert t["Status"] == "COMPLETED" and t["ApproximateNumberOfMessagesMoved"] == 1 and task
    back = sqs.receive_message(QueueUrl=src, MessageAttributeNames=["All"])["Messages"][0]
    assert back["Body"] == "poison" and back["MessageAttributes"]["k"]["StringValue"] == "kept"



def test_a_move_task_that_fails_leaves_every_message_it_did_not_move_visible_and_unreceived(sqs):
    dlq = sqs.create_queue(QueueName="dead-nowhere")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sqs.create_queue(QueueName="src-nowhere", Attributes={
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 1})})
    # sent to the dead-letter queue itself: no source queue to go back to, so the task fails
    sqs.send_message_batch(QueueUrl=dlq, Entries=[{"Id": f"e{i}", "MessageBody": f"m{i}"} for i in range(10)])
    sqs.start_message_move_task(SourceArn=arn)
    wait_until(lambda: sqs.list_message_move_tasks(SourceArn=arn)["Results"][0]["Status"] != "RUNNING", 20, 0.05,
               "the move task")
    (t,) = sqs.list_message_move_tasks(SourceArn=arn)["Results"]
    assert t["Status"] == "FAILED" and "no source queue" in t["FailureReason"]
    assert t["ApproximateNumberOfMessagesMoved"] == 0
    assert _counts(sqs, dlq) == [10, 0, 0]  # none left hidden for the task's 60 s lease
    got = sqs.receive_message(QueueUrl=dlq, MaxNumberOfMessages=10, AttributeNames=["ApproximateReceiveCount"])
    assert sorted(m["Body"] for m in got["Messages"]) == [f"m{i}" for i in range(10)]
    assert {m["Attributes"]["ApproximateReceiveCount"] for m in got["Messages"]} == {"1"}  # no receive counted


def test_a_fifo_send_takes_delay_seconds_0_and_the_queues_delay_applies(sqs):
    now = sqs.create_queue(QueueName="d0.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    later = sqs.create_queue(QueueName="d900.fifo", Attributes={"FifoQueue": "true", "DelaySeconds": "900"})[
        "QueueUrl"]
    for q in (now, later):
        sqs.send_message(QueueUrl=q, MessageBody="one", MessageGroupId="g1", MessageDeduplicationId="1",
                         DelaySeconds=0)
        out = sqs.send_message_batch(QueueUrl=q, Entries=[
            {"Id": "zero", "MessageBody": "two", "MessageGroupId": "g2", "MessageDeduplicationId": "2",
             "DelaySeconds": 0},
            {"Id": "none", "MessageBody": "three", "MessageGroupId": "g3", "MessageDeduplicationId": "3"},
            {"Id": "one", "MessageBody": "four", "MessageGroupId": "g4", "MessageDeduplicationId": "4",
             "DelaySeconds": 1}])
        assert sorted(e["Id"] for e in out["Successful"]) == ["none", "zero"]
        assert [(f["Id"], f["Code"]) for f in out["Failed"]] == [("one", "InvalidParameterValue")]
    assert _counts(sqs, now) == [3, 0, 0]
    assert _counts(sqs, later) == [0, 0, 3]  # the queue's 900 s, per-message 0 or not
    got = sqs.receive_message(QueueUrl=now, MaxNumberOfMessages=10)["Messages"]
    assert sorted(m["Body"] for m in got) == ["one", "three", "two"]
    assert "Messages" not in sqs.receive_message(QueueUrl=later, MaxNumberOfMessages=10)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=now, MessageBody="x", MessageGroupId="g", MessageDeduplicationId="5",
                         DelaySeconds=1)
    assert code(e.value) == "InvalidParameterValue"


# ---------------------------------------------------------------------------- one engine, two faces
def test_an_arn_of_another_region_or_account_names_no_queue_here(sqs):
    dlq = sqs.create_queue(QueueName="here-dlq")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    assert arn == "arn:aws:sqs:us-east-1:000000000000:here-dlq"
    elsewhere = (arn.replace(":us-east-1:", ":eu-west-1:"), arn.replace(":000000000000:", ":999999999999:"))
    src = sqs.create_queue(QueueName="here-src")["QueueUrl"]
    for other in elsewhere:
        policy = json.dumps({"deadLetterTargetArn": other, "maxReceiveCount": 1})
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.create_queue(QueueName="there-src", Attributes={"RedrivePolicy": policy})
        assert code(e.value) == "InvalidParameterValue" and "Dead letter target does not exist" in \
            e.value.response["Error"]["Message"], other
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.set_queue_attributes(QueueUrl=src, Attributes={"RedrivePolicy": policy})
        assert code(e.value) == "InvalidParameterValue", other
    sqs.set_queue_attributes(QueueUrl=src, Attributes={"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": arn, "maxReceiveCount": 1})})
    src_arn = arn.replace(":here-dlq", ":here-src")
    for other in elsewhere:
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.start_message_move_task(SourceArn=other)
        assert code(e.value) == "ResourceNotFoundException", other
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.start_message_move_task(SourceArn=arn, DestinationArn=other.replace(":here-dlq", ":here-src"))
        assert code(e.value) == "ResourceNotFoundException", other
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.list_message_move_tasks(SourceArn=other)
        assert code(e.value) == "ResourceNotFoundException", other
    assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [src] and src_arn


def test_dead_letter_sources_are_the_queues_naming_that_very_arn(sqs):
    short = sqs.create_queue(QueueName="dl")["QueueUrl"]
    longer = sqs.create_queue(QueueName="dl2")["QueueUrl"]  # its ARN starts with the other's
    arn = sqs.get_queue_attributes(QueueUrl=longer, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    src = sqs.create_queue(QueueName="dl2-src", Attributes={"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": arn, "maxReceiveCount": 1})})["QueueUrl"]
    assert sqs.list_dead_letter_source_queues(QueueUrl=longer)["queueUrls"] == [src]
    assert sqs.list_dead_letter_source_queues(QueueUrl=short)["queueUrls"] == []
    with pytest.raises(botocore.exceptions.ClientError) as e:  # no source names it: no dead-letter queue
        sqs.start_message_move_task(SourceArn=arn[:-1])
    assert code(e.value) == "InvalidParameterValue"


def test_what_boto3_sends_a_shardq_worker_leases_and_the_other_way_round(sqs, svc):
    url = sqs.create_queue(QueueName="both.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    plain = sqs.create_queue(QueueName="both")["QueueUrl"]
    sqs.set_queue_attributes(QueueUrl=url, Attributes={"ContentBasedDeduplication": "true"})
    sqs.send_message(QueueUrl=url, MessageBody="from boto3", MessageGroupId="album-1")
    sqs.send_message(QueueUrl=url, MessageBody="with its id", MessageGroupId="album-1", MessageDeduplicationId="2")
    with shardq.connect(svc.data_dir) as q:
        lease = q.dequeue("both.fifo", wait=5)
        assert (lease.body, lease.key) == (b"from boto3", "album-1")  # the body itself
        q.ack(lease)
        lease = q.dequeue("both.fifo", wait=5)  # an explicit dedup id rides in an envelope
        assert unwrap(lease.body) == (b"with its id", {"d": "2", "t": unwrap(lease.body)[1]["t"]})
        q.ack(lease)
        q.enqueue(b"from shardq", queue="both")
        q.enqueue(b"\xff\xfe binary", queue="both")
    got = sqs.receive_message(QueueUrl=plain, MaxNumberOfMessages=10, MessageAttributeNames=["All"])["Messages"]
    bodies = {m["Body"]: m.get("MessageAttributes") for m in got}
    assert bodies["from shardq"] is None
    assert bodies["//4gYmluYXJ5"] == {"shardq.body-encoding": {"DataType": "String", "StringValue": "base64"}}


def test_a_long_poll_whose_client_has_gone_hands_it_nothing(sqs, svc, queue):
    host = urlsplit(svc.url)
    before = waiting_dequeues(svc)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    conn.request("POST", "/", json.dumps({"QueueUrl": queue, "WaitTimeSeconds": 20}),
                 {"X-Amz-Target": "AmazonSQS.ReceiveMessage", "Content-Type": "application/x-amz-json-1.0"})
    parked(svc, before, 1, "the long poll waiting at the shards")  # then its client goes (a worker stopped mid-poll)
    conn.sock.close()
    parked(svc, before, 0, "the long poll withdrawn from the shards")  # the listener cancelled it
    sqs.send_message(QueueUrl=queue, MessageBody="for the living")
    msgs = sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=10, AttributeNames=["ApproximateReceiveCount"])
    (m,) = msgs["Messages"]
    assert m["Body"] == "for the living" and m["Attributes"]["ApproximateReceiveCount"] == "1"


def test_a_redrive_allow_policy_decides_which_sources_may_name_a_dead_letter_queue(sqs):
    dlq = sqs.create_queue(QueueName="picky", Attributes={"RedriveAllowPolicy": json.dumps(
        {"redrivePermission": "byQueue", "sourceQueueArns": ["arn:aws:sqs:us-east-1:000000000000:allowed"]})})
    arn = sqs.get_queue_attributes(QueueUrl=dlq["QueueUrl"], AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = {"RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 3})}
    sqs.create_queue(QueueName="allowed", Attributes=policy)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.create_queue(QueueName="not-allowed", Attributes=policy)
    assert code(e.value) == "InvalidParameterValue"
    fifo_dlq = sqs.create_queue(QueueName="dlq.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    fifo_arn = sqs.get_queue_attributes(QueueUrl=fifo_dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    with pytest.raises(botocore.exceptions.ClientError):  # a standard queue's DLQ is a standard queue
        sqs.create_queue(QueueName="mixed", Attributes={"RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": fifo_arn, "maxReceiveCount": 3})})


def test_a_fifo_dead_letter_queue_moves_back_keeping_each_group_in_order(sqs):
    dlq = sqs.create_queue(QueueName="fdead.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    src = sqs.create_queue(QueueName="fsrc.fifo", Attributes={"FifoQueue": "true", "RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": arn, "maxReceiveCount": 1})})["QueueUrl"]
    for i in range(3):
        sqs.send_message(QueueUrl=src, MessageBody=f"m{i}", MessageGroupId="g", MessageDeduplicationId=str(i))
    for _ in range(3):  # each message: received once, released, then moved by the next receive
        h = sqs.receive_message(QueueUrl=src)["Messages"][0]["ReceiptHandle"]
        sqs.change_message_visibility(QueueUrl=src, ReceiptHandle=h, VisibilityTimeout=0)
        sqs.receive_message(QueueUrl=src)
    sqs.start_message_move_task(SourceArn=arn)
    wait_until(lambda: sqs.list_message_move_tasks(SourceArn=arn)["Results"][0]["Status"] != "RUNNING", 20, 0.05,
               "the move task")
    bodies = []
    while msgs := sqs.receive_message(QueueUrl=src, AttributeNames=["MessageGroupId"]).get("Messages"):
        assert msgs[0]["Attributes"]["MessageGroupId"] == "g"
        bodies.append(msgs[0]["Body"])
        sqs.delete_message(QueueUrl=src, ReceiptHandle=msgs[0]["ReceiptHandle"])
    assert bodies == ["m0", "m1", "m2"]


def test_dedup_scope_queue_spans_groups_and_message_group_scope_does_not(sqs):
    q = sqs.create_queue(QueueName="scope-q.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    per_group = {"FifoQueue": "true", "DeduplicationScope": "messageGroup", "FifoThroughputLimit": "perMessageGroupId"}
    g = sqs.create_queue(QueueName="scope-g.fifo", Attributes=per_group)["QueueUrl"]
    for url, same in ((q, True), (g, False)):
        a = sqs.send_message(QueueUrl=url, MessageBody="x", MessageGroupId="a", MessageDeduplicationId="d")
        b = sqs.send_message(QueueUrl=url, MessageBody="x", MessageGroupId="b", MessageDeduplicationId="d")
        c = sqs.send_message_batch(QueueUrl=url, Entries=[
            {"Id": "1", "MessageBody": "x", "MessageGroupId": "c", "MessageDeduplicationId": "d"},
            {"Id": "2", "MessageBody": "y", "MessageGroupId": "c", "MessageDeduplicationId": "e"}])["Successful"]
        assert [e["Id"] for e in c] == ["1", "2"]
        assert (a["MessageId"] == b["MessageId"] == c[0]["MessageId"]) is same, url
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
        assert len(got) == (2 if same else 3)  # one head per group: a and c (b held only a duplicate), or a, b, c
