"""The query protocol (form-encoded ``Action=...``, XML answers) that older SDKs and tools
send: botocore made to speak it (the model's protocol switched to query, with the query
model's member names), plus hand-made requests."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlencode, urlsplit
from xml.etree import ElementTree

import botocore.exceptions
import pytest

from shardq.sqs_api.message import md5_of_attributes, md5_of_body
from tests.support.sqs_listener import module_fixtures

NS = {"s": "http://queue.amazonaws.com/doc/2012-11-05/"}


svc, sqs = module_fixtures("query")


def _post(svc, form: dict, path: str = "/") -> tuple[int, ElementTree.Element]:
    host = urlsplit(svc.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    conn.request("POST", path, urlencode(form) if form else None,
                 {"Content-Type": "application/x-www-form-urlencoded"} if form else {})
    r = conn.getresponse()
    root = ElementTree.fromstring(r.read())
    conn.close()
    return r.status, root


def test_every_kind_of_member_travels_both_ways(sqs):
    url = sqs.create_queue(QueueName="qp.fifo", Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"},
                           tags={"t": "1"})["QueueUrl"]
    assert sqs.list_queue_tags(QueueUrl=url)["Tags"] == {"t": "1"}
    attrs = {"s": {"DataType": "String", "StringValue": "a\r\nb & <c>"},
             "b": {"DataType": "Binary", "BinaryValue": bytes(range(256))}}
    out = sqs.send_message_batch(QueueUrl=url, Entries=[
        {"Id": "one", "MessageBody": "x\ry", "MessageGroupId": "g", "MessageAttributes": attrs},
        {"Id": "two", "MessageBody": "bad \x01", "MessageGroupId": "g"}])
    assert [s["Id"] for s in out["Successful"]] == ["one"] and out["Successful"][0]["SequenceNumber"]
    assert [(f["Id"], f["Code"], f["SenderFault"]) for f in out["Failed"]] == [("two", "InvalidMessageContents", True)]
    msg = sqs.receive_message(QueueUrl=url, AttributeNames=["All"], MessageAttributeNames=["All"])["Messages"][0]
    assert msg["Body"] == "x\ry" and msg["MessageAttributes"] == attrs
    assert msg["MD5OfMessageAttributes"] == md5_of_attributes(attrs) and msg["MD5OfBody"] == md5_of_body("x\ry")
    assert msg["Attributes"]["MessageGroupId"] == "g" and msg["Attributes"]["ApproximateReceiveCount"] == "1"
    out = sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": "a", "ReceiptHandle": msg["ReceiptHandle"]}])
    assert [s["Id"] for s in out["Successful"]] == ["a"]
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn", "FifoQueue"])["Attributes"]
    assert got == {"QueueArn": "arn:aws:sqs:us-east-1:000000000000:qp.fifo", "FifoQueue": "true"}
    assert sqs.list_queues(QueueNamePrefix="qp")["QueueUrls"] == [url]


def test_errors_are_error_responses_with_the_legacy_code(sqs, svc):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.get_queue_url(QueueName="missing")
    assert e.value.response["Error"]["Code"] == "AWS.SimpleQueueService.NonExistentQueue"
    assert e.value.response["Error"]["Type"] == "Sender"
    status, root = _post(svc, {"Action": "Frobnicate", "Version": "2012-11-05"})
    assert status == 400 and root.find("s:Error/s:Code", NS).text == "InvalidAction"
    status, root = _post(svc, {"Version": "2012-11-05"})
    assert status == 400 and root.find("s:Error/s:Code", NS).text == "MissingParameter"


def test_a_request_to_the_queue_url_names_its_queue_by_path(sqs, svc):
    url = sqs.create_queue(QueueName="by-path")["QueueUrl"]
    status, root = _post(svc, {"Action": "SendMessage", "MessageBody": "hi"}, urlsplit(url).path)
    assert status == 200 and root.find("s:SendMessageResult/s:MessageId", NS) is not None
    assert sqs.receive_message(QueueUrl=url)["Messages"][0]["Body"] == "hi"


def test_get_with_a_query_string_works_too(sqs, svc):
    sqs.create_queue(QueueName="by-get")
    host = urlsplit(svc.url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
    conn.request("GET", "/?" + urlencode({"Action": "GetQueueUrl", "QueueName": "by-get"}))
    r = conn.getresponse()
    root = ElementTree.fromstring(r.read())
    assert r.status == 200 and root.find("s:GetQueueUrlResult/s:QueueUrl", NS).text.endswith("/by-get")


def test_a_posts_url_parameters_and_its_body_are_one_set(sqs, svc):
    url = sqs.create_queue(QueueName="url-params")["QueueUrl"]
    status, root = _post(svc, {}, "/?" + urlencode({"Action": "ListQueues", "Version": "2012-11-05",
                                                    "QueueNamePrefix": "url-p"}))
    assert status == 200 and [u.text for u in root.iter(f"{{{NS['s']}}}QueueUrl")] == [url]
    status, root = _post(svc, {"MessageBody": "split", "Version": "2012-11-05"},
                         "/?" + urlencode({"Action": "SendMessage", "QueueUrl": url, "Version": "2012-11-05"}))
    assert status == 200 and root.find("s:SendMessageResult/s:MessageId", NS) is not None
    assert sqs.receive_message(QueueUrl=url)["Messages"][0]["Body"] == "split"
    status, root = _post(svc, {"Action": "ListQueues", "QueueNamePrefix": "b"},
                         "/?" + urlencode({"Action": "ListQueues", "QueueNamePrefix": "a"}))
    assert status == 400 and root.find("s:Error/s:Code", NS).text == "MalformedQueryString"
    assert "QueueNamePrefix" in root.find("s:Error/s:Message", NS).text


def test_a_batch_of_no_entries_is_an_empty_batch_request(sqs, svc):
    url = sqs.create_queue(QueueName="no-entries")["QueueUrl"]
    for batch in (sqs.send_message_batch, sqs.delete_message_batch, sqs.change_message_visibility_batch):
        with pytest.raises(botocore.exceptions.ClientError) as e:  # boto3 sends "Entries="
            batch(QueueUrl=url, Entries=[])
        assert e.value.response["Error"]["Code"] == "AWS.SimpleQueueService.EmptyBatchRequest", batch
    for action, entry in (("SendMessageBatch", "SendMessageBatchRequestEntry"),
                          ("DeleteMessageBatch", "DeleteMessageBatchRequestEntry"),
                          ("ChangeMessageVisibilityBatch", "ChangeMessageVisibilityBatchRequestEntry")):
        for name in ("Entries", entry):
            status, root = _post(svc, {"Action": action, "QueueUrl": url, name: ""})
            assert (status, root.find("s:Error/s:Code", NS).text) == \
                (400, "AWS.SimpleQueueService.EmptyBatchRequest"), (action, name)


def test_redrive_policy_and_move_tasks_over_query(sqs):
    dlq = sqs.create_queue(QueueName="qdlq")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    src = sqs.create_queue(QueueName="qsrc", Attributes={"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": arn, "maxReceiveCount": "3"})})["QueueUrl"]
    assert sqs.list_dead_letter_source_queues(QueueUrl=dlq)["queueUrls"] == [src]
    assert sqs.list_message_move_tasks(SourceArn=arn).get("Results", []) == []  # XML: no element at all
