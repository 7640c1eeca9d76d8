"""Sizes at their maxima, over both protocols, on the config docs/sqs-api.md recommends
(``max_body_bytes = 2097152``): every request AWS takes at 1 MiB fits the listener's body
limit however it is encoded; every message AWS takes is stored (its envelope at most 4/3 of
it plus a little); and a message past maxReceiveCount leaves its queue by the receive that
finds it, whatever its size, without failing that receive or any other."""
from __future__ import annotations

import json
import re
import time

import botocore.exceptions
import pytest

import shardq
from shardq import limits
from shardq.errors import SqsApiError
from shardq.sqs_api import message as m
from shardq.sqs_api.catalog import Catalog
from tests.support.service import Service, wait_until
from tests.support.sqs_inproc import InProcessApi
from tests.support.sqs_listener import QUEUE_DEFAULTS, client, sqs_url

MIB = limits.SQS_MESSAGE_BYTES_MAX
SMALL = 4096  # max_body_bytes of the queues declared small below
_n = iter(range(10**6))


@pytest.fixture(scope="module")
def svc():
    small = {"max_body_bytes": SMALL, "max_deliveries": 1_000_000}
    with Service(shards=1, config={"sqs_api": {"listen": "127.0.0.1:0"}, "http": {"listen": ""},
                                   "queue_defaults": dict(QUEUE_DEFAULTS),
                                   "queues": {"small": small, "small-dead": small}}) as s:
        s.url = sqs_url(s)
        yield s


@pytest.fixture(scope="module", params=["json", "query"])
def sqs(svc, request):
    return client(svc.url, request.param)


@pytest.fixture(scope="module")
def sqs_json(svc):
    return client(svc.url, "json")


def sent_sizes(sqs) -> list[int]:
    """The sizes of the request bodies ``sqs`` sends from now on."""
    sizes: list[int] = []
    sqs.meta.events.register("before-send.sqs.*", lambda request, **_: sizes.append(len(request.body or b"")))
    return sizes


def code(e: botocore.exceptions.ClientError) -> str:
    return e.response["Error"]["Code"]


def arn_of(sqs, url: str) -> str:
    return sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]


def redriven(sqs, dead: str | None = None) -> tuple[str, str, str]:
    """A source queue moving a message to a dead-letter queue (``dead``, or a new one) at its
    2nd receive: (source URL, its ARN, the dead-letter queue's URL)."""
    dlq = sqs.create_queue(QueueName=dead or f"dead{next(_n)}")["QueueUrl"]
    src = sqs.create_queue(QueueName=f"src{next(_n)}", Attributes={"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": arn_of(sqs, dlq), "maxReceiveCount": 1})})["QueueUrl"]
    return src, arn_of(sqs, src), dlq


def receive_all(sqs, url: str, **kw) -> list[dict]:
    return sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"],
                               AttributeNames=["All"], **kw).get("Messages", [])


def past_max_receive_count(sqs, src: str) -> dict:
    """Receive the one message of ``src`` once and make it visible again: the next receive
    finds it past maxReceiveCount."""
    (first,) = receive_all(sqs, src)
    sqs.change_message_visibility(QueueUrl=src, ReceiptHandle=first["ReceiptHandle"], VisibilityTimeout=0)
    return first


# ---------------------------------------------------------------------------- request bodies
def worst_message(kind: str, size: int) -> dict:
    """A message of exactly ``size`` bytes (body and attributes, as SQS counts them) in what
    the protocol encodes largest: DEL (JSON: botocore writes it \\u007f, 6 bytes a byte) or
    a binary value of 0xff bytes (base64 "////", each character then %2F in a query form: 4
    bytes a byte); with 10 attributes."""
    attrs: dict = {f"a{j}": {"DataType": "String", "StringValue": "\x7f"} for j in range(9)}
    size -= m.attributes_size(attrs)
    if kind == "binary":
        attrs["b"] = {"DataType": "Binary", "BinaryValue": b"\xff" * (size - 1 - len("b") - len("Binary"))}
        return {"MessageBody": "\x7f", "MessageAttributes": attrs}
    attrs["b"] = {"DataType": "String", "StringValue": "\x7f"}
    return {"MessageBody": "\x7f" * (size - len("b") - len("String") - 1), "MessageAttributes": attrs}


def worst_batch(kind: str, fifo: bool) -> list[dict]:
    """10 entries of 1 MiB in all (:func:`worst_message`), with the longest Ids and, on a FIFO
    queue, group and dedup ids of 128 characters that JSON escapes."""
    entries = []
    for i in range(10):
        e = dict(worst_message(kind, MIB // 10 + (MIB % 10 if i == 0 else 0)), Id=f"{i:0>80}")
        if fifo:
            e.update(MessageGroupId='"' * 128, MessageDeduplicationId='"' * 126 + f"{i:02d}")
        entries.append(e)
    return entries


def size_of(e: dict) -> int:
    return len(e["MessageBody"].encode()) + m.attributes_size(m.check_attributes(e["MessageAttributes"]))


# what each protocol makes of 1 MiB in the worst characters of each kind, at least
GROWTH = {("json", "text"): 6, ("json", "binary"): 1, ("query", "text"): 3, ("query", "binary"): 4}


@pytest.mark.parametrize("kind", ["text", "binary"])
def test_the_worst_encoded_1_mib_batch_and_message_fit_the_body_limit_and_a_byte_more_is_refused_by_sqs(
        svc, sqs, kind):
    sizes = sent_sizes(sqs)
    for fifo in (False, True):
        url = sqs.create_queue(QueueName=f"b{next(_n)}" + (".fifo" if fifo else ""),
                               Attributes={"FifoQueue": "true"} if fifo else {})["QueueUrl"]
        entries = worst_batch(kind, fifo)
        assert sum(map(size_of, entries)) == limits.SQS_BATCH_BYTES_MAX
        out = sqs.send_message_batch(QueueUrl=url, Entries=entries)
        assert len(out["Successful"]) == 10 and not out.get("Failed")
        one = dict(worst_message(kind, MIB), **({"MessageGroupId": '"' * 128, "MessageDeduplicationId": "one"}
                                                if fifo else {}))
        assert size_of(one) == limits.SQS_MESSAGE_BYTES_MAX
        sqs.send_message(QueueUrl=url, **one)
        got = []
        while batch := receive_all(sqs, url):
            got += batch
            sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": x["ReceiptHandle"]}
                                                            for i, x in enumerate(batch)])
        assert sorted((x["Body"], x["MD5OfMessageAttributes"]) for x in got) == sorted(
            (e["MessageBody"], m.md5_of_attributes(m.check_attributes(e["MessageAttributes"])))
            for e in [*entries, one])
        # one byte more: refused by SQS's own rules, never by the listener's body limit
        entries[0]["MessageBody"] += "\x7f"
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message_batch(QueueUrl=url, Entries=entries)
        assert code(e.value).endswith("BatchRequestTooLong")  # the query protocol's AWS.SimpleQueueService.*
        one["MessageBody"] += "\x7f"
        with pytest.raises(botocore.exceptions.ClientError) as e:
            sqs.send_message(QueueUrl=url, **one)
        assert e.value.response["Error"]["Message"].endswith("Message must be shorter than 1048576 bytes.")
    # the requests were as large as the protocol makes them (over the 4 MiB limit of before), and fit
    protocol = sqs.meta.service_model.protocol
    assert GROWTH[protocol, kind] * MIB < max(sizes) <= limits.SQS_API_BODY_BYTES_MAX


# ---------------------------------------------------------------------------- envelopes
WORST_FILLS = ['"', "\\", "é", "😀", "\x7f", "\n", "\t\r", "中"]


def message_of(fill: str, size: int, count: int = 10) -> tuple[str, dict]:
    """A message of exactly ``size`` bytes (body and attributes), with ``count`` attributes
    whose data types JSON escapes too, nearly all of it in an attribute value of ``fill``."""
    attrs = {f"n{i}": {"DataType": "String." + '"' * 249, "StringValue": fill} for i in range(count)}
    unit = len(fill.encode())
    free = size - 1 - m.attributes_size(attrs)  # 1: the body's first byte
    attrs["n0"]["StringValue"] = fill * (1 + free // unit)
    return "a" * (1 + free % unit), attrs


@pytest.mark.parametrize("fill", WORST_FILLS + ["binary"])
def test_an_envelope_is_at_most_four_thirds_of_its_message_and_opens_to_what_went_in(fill):
    if fill == "binary":
        body = "a"
        attrs = {f"b{i}": {"DataType": "Binary." + '"' * 249, "BinaryValue": b"\xff"} for i in range(9)}
        attrs["b9"] = {"DataType": "Binary", "BinaryValue": b"\xff" * (MIB - 1 - m.attributes_size(attrs) - 8)}
    else:
        body, attrs = message_of(fill, MIB)
    assert len(body.encode()) + m.attributes_size(attrs) == MIB
    attrs = m.check_attributes(attrs)
    job = m.wrap(body, sent_ms=int(time.time() * 1000), attrs=attrs, system={}, dedup_id='"' * 128, group='"' * 128)
    data, head = m.unwrap(job)
    moved = m.rewrap(data, dict(head, q="arn:aws:sqs:us-east-1:000000000000:" + "q" * 80, m="x" * 36))
    assert len(job) < len(moved) <= m.envelope_bytes_max(MIB) < 2 * MIB - 512 * 1024
    for stored in (job, moved):
        text, head, got, _ = m.presented(stored)
        assert text == body and got == attrs and head["d"] == head["g"] == '"' * 128


def test_an_envelope_keeps_a_string_value_as_text_unless_base64_is_shorter():
    for value, text in (("plain é 😀", True), ('a "quoted" word', True), ('"' * 3, False), ("\\" * 6, False)):
        job = m.wrap("b", sent_ms=1, attrs={"k": {"DataType": "String", "StringValue": value}}, system={})
        assert (b"StringValueBase64" not in job) is text, value
        assert m.unwrap(job)[1]["a"]["k"] == {"DataType": "String", "StringValue": value}
    assert "plain é 😀".encode() in m.wrap("b", sent_ms=1, attrs={"k": {"DataType": "String",
                                                                       "StringValue": "plain é 😀"}}, system={})
    old = b'\x00sqs1\n{"a":{"k":{"DataType":"String","StringValue":"\\u00e9"}},"t":1}\nbody'  # written before
    assert m.presented(old)[:3:2] == ("body", {"k": {"DataType": "String", "StringValue": "é"}})


def test_a_data_type_holds_a_bodys_characters_only():
    # a lone surrogate (JSON's "\\ud800") has no UTF-8: refused, not an internal failure later
    with pytest.raises(SqsApiError) as e:
        m.check_attributes({"k": {"DataType": "String.\ud800", "StringValue": "v"}})
    assert e.value.code == "InvalidMessageContents"
    assert m.check_attributes({"k": {"DataType": 'String."é😀', "StringValue": "v"}})


@pytest.mark.parametrize("fill", ["é", "😀", '"', "\\", "中", "\n"])
def test_a_1_mib_message_in_any_characters_is_taken_and_comes_back_intact(svc, sqs, fill):
    url = sqs.create_queue(QueueName=f"e{next(_n)}")["QueueUrl"]
    body, attrs = message_of(fill, MIB)
    sqs.send_message(QueueUrl=url, MessageBody=body, MessageAttributes=attrs)
    (got,) = receive_all(sqs, url)
    assert got["Body"] == body and {n: dict(a) for n, a in got["MessageAttributes"].items()} == attrs
    assert got["MD5OfMessageAttributes"] == m.md5_of_attributes(attrs)
    sqs.delete_message(QueueUrl=url, ReceiptHandle=got["ReceiptHandle"])
    body += "a"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=url, MessageBody=body, MessageAttributes=attrs)
    assert e.value.response["Error"]["Message"].endswith("Message must be shorter than 1048576 bytes.")


def test_the_refusal_of_a_small_shardq_queue_names_a_size_that_fits_never_a_negative_one(svc, sqs_json):
    sqs = sqs_json
    url = sqs.create_queue(QueueName="small")["QueueUrl"]
    attrs = {"k": {"DataType": "String", "StringValue": "é" * 100}}
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=url, MessageBody="x" * SMALL, MessageAttributes=attrs)
    text = e.value.response["Error"]["Message"]
    room = int(re.search(r"shorter than (\d+) bytes here", text).group(1))
    assert "max_body_bytes = 4096" in text and 0 < room < SMALL
    fits = "x" * (room - m.attributes_size(attrs))
    sqs.send_message(QueueUrl=url, MessageBody=fits, MessageAttributes=attrs)  # at its maximum
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=url, MessageBody=fits + "x", MessageAttributes=attrs)
    assert f"shorter than {room} bytes here" in e.value.response["Error"]["Message"]
    # attributes that alone take more than the queue holds (a trace header does not count for SQS)
    trace = {"AWSTraceHeader": {"DataType": "String", "StringValue": "Root=1-" + "a" * SMALL}}
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.send_message(QueueUrl=url, MessageBody="x", MessageSystemAttributes=trace)
    text = e.value.response["Error"]["Message"]
    assert code(e.value) == "InvalidParameterValue" and "max_body_bytes = 4096" in text
    assert not re.search(r"-\d", text), text


# ---------------------------------------------------------------------------- dead-letter moves
@pytest.mark.parametrize("fill", ["é", '"'])
def test_a_1_mib_message_past_max_receive_count_is_moved_whole_and_the_queue_goes_on(svc, sqs, fill):
    src, src_arn, dlq = redriven(sqs)
    body, attrs = message_of(fill, MIB, count=1)
    sent = sqs.send_message(QueueUrl=src, MessageBody=body, MessageAttributes=attrs)["MessageId"]
    past_max_receive_count(sqs, src)
    sqs.send_message(QueueUrl=src, MessageBody="good")
    assert [x["Body"] for x in receive_all(sqs, src)] == ["good"]  # the receive that moved the other
    (moved,) = receive_all(sqs, dlq)
    assert moved["Body"] == body and {n: dict(a) for n, a in moved["MessageAttributes"].items()} == attrs
    assert moved["MessageId"] == sent and moved["Attributes"]["DeadLetterQueueSourceArn"] == src_arn


def test_a_job_at_its_queues_max_body_bytes_past_max_receive_count_is_moved_as_it_is(svc, sqs):
    src, _, dlq = redriven(sqs)
    with svc.connect() as q:
        q.enqueue(b"a" * QUEUE_DEFAULTS["max_body_bytes"], queue=src.rpartition("/")[2])
    past_max_receive_count(sqs, src)
    sqs.send_message(QueueUrl=src, MessageBody="good")
    for _ in range(3):  # no receive fails, the good message comes
        got = [x["Body"] for x in receive_all(sqs, src)]
        if got:
            break
    assert got == ["good"]
    (moved,) = receive_all(sqs, dlq)
    assert moved["Body"] == "a" * QUEUE_DEFAULTS["max_body_bytes"]
    assert "DeadLetterQueueSourceArn" not in moved["Attributes"]  # no room for it


def sized(sqs, src: str, src_arn: str, stored: int, moved: int | None = None) -> tuple[str, str]:
    """Send to ``src`` a message whose envelope takes ``stored`` bytes, or whose envelope
    moved (with its source ARN and MessageId) takes ``moved``: (its body, its MessageId)."""
    attrs = {"k": {"DataType": "String", "StringValue": "v"}}
    head = m.unwrap(m.wrap("x", sent_ms=int(time.time() * 1000), attrs=m.check_attributes(attrs), system={}))[1]
    extra = len(m.rewrap(b"", dict(head, q=src_arn, m="x" * 36))) - len(m.rewrap(b"", head))
    overhead = len(m.rewrap(b"", head)) + (extra if moved is not None else 0)
    body = "x" * ((moved if moved is not None else stored) - overhead)
    return body, sqs.send_message(QueueUrl=src, MessageBody=body, MessageAttributes=attrs)["MessageId"]


def test_a_move_into_a_smaller_dead_letter_queue_at_its_limit_and_one_past(svc, sqs_json):
    sqs = sqs_json
    src, src_arn, dlq = redriven(sqs, "small-dead")
    # moved whole at the dead-letter queue's limit; as stored one past it
    for moved_size, whole in ((SMALL, True), (SMALL + 1, False)):
        body, sent = sized(sqs, src, src_arn, 0, moved=moved_size)
        past_max_receive_count(sqs, src)
        assert receive_all(sqs, src) == []
        (moved,) = receive_all(sqs, dlq)
        assert moved["Body"] == body and moved["MessageAttributes"]["k"]["StringValue"] == "v"
        assert (moved["MessageId"] == sent) is whole
        assert ("DeadLetterQueueSourceArn" in moved["Attributes"]) is whole
        sqs.delete_message(QueueUrl=dlq, ReceiptHandle=moved["ReceiptHandle"])
    # as stored at its limit; one past it, buried in shardq's dead letters of its own queue
    for stored, moves in ((SMALL, True), (SMALL + 1, False)):
        body, _ = sized(sqs, src, src_arn, stored)
        past_max_receive_count(sqs, src)
        sqs.send_message(QueueUrl=src, MessageBody="good")
        (good,) = receive_all(sqs, src)  # the receive that found the other message goes on
        assert good["Body"] == "good"
        sqs.delete_message(QueueUrl=src, ReceiptHandle=good["ReceiptHandle"])
        got = receive_all(sqs, dlq)
        assert [x["Body"] for x in got] == ([body] if moves else [])
        for x in got:
            sqs.delete_message(QueueUrl=dlq, ReceiptHandle=x["ReceiptHandle"])
    with svc.connect() as q:
        (dead,) = q.dead_letters(src.rpartition("/")[2])
    assert m.unwrap(dead.body)[0] == body.encode() and "max_body_bytes = 4096" in dead.error
    assert _counts(sqs, src) == ["0", "0"]
    with open(svc.log_path, "rb") as f:
        assert b"event=sqs-api-dead-letter-too-large" in f.read()


def _counts(sqs, url: str) -> list[str]:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return [a["ApproximateNumberOfMessages"], a["ApproximateNumberOfMessagesNotVisible"]]


class DeadLetterQueueDown:
    """The API's client, whose enqueues to ``queue`` fail as if its shard were down."""

    def __init__(self, real, queue: str):
        self.real, self.queue = real, queue

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def enqueue(self, body, **kw):
        if kw.get("queue") == self.queue:
            raise shardq.ShardUnavailable("shard 0 is down (test)")
        return await self.real.enqueue(body, **kw)


def test_a_move_that_fails_fails_no_receive_and_is_tried_again(svc, tmp_path):
    host = "127.0.0.1:9324"
    api = InProcessApi(svc.data_dir, Catalog(str(tmp_path)))
    try:
        def call(action, **params):
            return api.call(action, params, host)
        dlq = call("CreateQueue", QueueName="down-dead")["QueueUrl"]
        arn = call("GetQueueAttributes", QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        src = call("CreateQueue", QueueName="down-src", Attributes={"RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": arn, "maxReceiveCount": 1})})["QueueUrl"]
        call("SendMessage", QueueUrl=src, MessageBody="poison")
        (first,) = call("ReceiveMessage", QueueUrl=src)["Messages"]
        call("ChangeMessageVisibility", QueueUrl=src, ReceiptHandle=first["ReceiptHandle"], VisibilityTimeout=0)
        call("SendMessage", QueueUrl=src, MessageBody="good")
        api.sqs.q = DeadLetterQueueDown(api.sqs.q, "down-dead")
        (good,) = call("ReceiveMessage", QueueUrl=src, MaxNumberOfMessages=10, VisibilityTimeout=2)["Messages"]
        assert good["Body"] == "good"  # the poison, which could not move, is held back: not handed out
        call("DeleteMessage", QueueUrl=src, ReceiptHandle=good["ReceiptHandle"])
        assert "Messages" not in call("ReceiveMessage", QueueUrl=src, VisibilityTimeout=2)
        api.sqs.q = api.sqs.q.real  # up again: a receive after the poison's 2 s moves it
        wait_until(lambda: "Messages" not in call("ReceiveMessage", QueueUrl=src)
                   and call("ReceiveMessage", QueueUrl=dlq).get("Messages"), 10, 0.2, "the move, tried again")
    finally:
        api.close()
