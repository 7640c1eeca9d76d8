"""The pure parts, in process: MD5s as AWS computes them (moto's implementation, which
the SDKs that check MD5s accept, as the oracle), envelopes, receipt handles, queue
attributes, the query form, and the [sqs_api] config table."""
from __future__ import annotations

import base64
import threading
import hmac
import zlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moto.sqs.models import Message as MotoMessage

from shardq import config
from shardq.errors import InvalidConfig, SqsApiError
from shardq.sqs_api import attributes, handles, message, protocol
from shardq.sqs_api.catalog import Catalog

names = st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)).filter(
    lambda c: message._BAD_CHARS.search(c) is None), min_size=1, max_size=50)
values = st.one_of(
    st.builds(lambda t, v: {"DataType": t, "StringValue": v}, st.sampled_from(["String", "String.x", "Number"]),
              texts),
    st.builds(lambda v: {"DataType": "Binary", "BinaryValue": v}, st.binary(min_size=1, max_size=50)))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(names, values, min_size=1, max_size=10))
def test_md5_of_attributes_is_awss(attrs):
    oracle = MotoMessage("id", "body")
    oracle.message_attributes = attrs
    assert message.md5_of_attributes(attrs) == oracle.attribute_md5


def test_md5_known_value():
    # the JS SDK v3's and the Java SDK's algorithm, by hand: sorted names, length-prefixed parts
    attrs = {"b": {"DataType": "Binary", "BinaryValue": b"\x01"}, "a": {"DataType": "String", "StringValue": "x"}}
    # md5(\0\0\0\1 "a" \0\0\0\6 "String" \1 \0\0\0\1 "x" \0\0\0\1 "b" \0\0\0\6 "Binary" \2 \0\0\0\1 \1)
    assert message.md5_of_attributes(attrs) == "00b20ddba5ce5486e92e6154f9c21903"
    assert message.md5_of_body("hello") == message.md5_of_utf8(b"hello") == "5d41402abc4b2a76b9719d911017c592"


@settings(max_examples=100, deadline=None)
@given(texts, st.dictionaries(names, values, max_size=3), st.sampled_from([None, "dedup-1"]))
def test_an_envelope_gives_back_what_went_in(body, attrs, dedup):
    job = message.wrap(body, sent_ms=123, attrs=attrs, system={}, dedup_id=dedup)
    assert message.wrap(body.encode(), sent_ms=123, attrs=attrs, system={}, dedup_id=dedup) == job  # a send's bytes
    if not attrs and dedup is None:
        assert job == body.encode()  # a plain message is its body: what a shardq worker reads
    text, head, got, utf8 = message.presented(job)
    assert text == body and got == attrs and head.get("d") == dedup and utf8 == body.encode()


def test_a_body_that_is_not_sqs_text_is_presented_base64():
    for raw in (b"\xff\x00", b"nul \x00 inside", b"\x00sqs1\nnot json\nrest"):
        text, _, attrs, utf8 = message.presented(raw)
        assert base64.b64decode(text) == raw and utf8 == text.encode()  # MD5OfBody: of the text shown
        assert attrs[message.BODY_ENCODING_ATTRIBUTE]["StringValue"] == "base64"


def test_receipt_handles_are_bound_to_their_key_and_queue():
    key = b"k" * 32
    h = handles.encode(key, "q", 5 << 10, 2**62 + 7, 1_700_000_000_000)
    assert handles.decode(key, "q", h) == (5 << 10, 2**62 + 7, 1_700_000_000_000)
    for bad_key, queue, handle in ((b"x" * 32, "q", h), (key, "other", h), (key, "q", h[:-2] + "zz"),
                                   (key, "q", ""), (key, "q", "!" * 2000), (key, "q", None)):
        with pytest.raises(SqsApiError) as e:
            handles.decode(bad_key, queue, handle)
        assert e.value.code == "ReceiptHandleIsInvalid"


def test_a_receives_encoder_and_a_batchs_decoder_make_and_take_the_same_handles():
    """What a receive (handles.encoder: one a receive) and a delete batch (handles.decoder)
    use is the one handle format, fenced the same way."""
    key = b"k" * 32
    encode, decode = handles.encoder(key, "q"), handles.decoder(key, "q")
    for job_id, token, at_ms in ((5, 7, 99), (5 << 10, 2**62 + 7, 1_700_000_000_000)):
        h = encode(job_id, token, at_ms)
        assert h == handles.encode(key, "q", job_id, token, at_ms) and encode(job_id, token, at_ms) == h
        assert decode(h) == handles.decode(key, "q", h) == (job_id, token, at_ms)
    with pytest.raises(SqsApiError) as e:
        handles.decoder(key, "other")(encode(5, 7, 99))
    assert e.value.code == "ReceiptHandleIsInvalid"


def test_receipt_handles_of_version_1_made_before_an_upgrade_are_still_taken():
    """Version 1 handles (HMAC-SHA256) of messages received before an upgrade delete them
    after it; a version other than 1 and 2, or a version 1 handle under another key, is refused."""
    key = b"k" * 32

    def made(version: int, mac_key: bytes, queue: str = "q") -> str:
        payload = msgpack.packb([version, 5, 7, zlib.crc32(queue.encode()), 99])
        mac = hmac.digest(mac_key, payload, "sha256")[:16]
        return base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")
    assert handles.decode(key, "q", made(1, key)) == (5, 7, 99)
    assert handles.encode(key, "q", 5, 7, 99) != made(1, key)  # new handles are version 2
    for handle, queue in ((made(1, b"x" * 32), "q"), (made(3, key), "q"), (made(1, key), "other")):
        with pytest.raises(SqsApiError) as e:
            handles.decode(key, queue, handle)
        assert e.value.code == "ReceiptHandleIsInvalid"


def test_queue_attribute_checks():
    assert attributes.check({"VisibilityTimeout": 5}, False, creating=True) == {"VisibilityTimeout": "5"}
    rp = attributes.check({"RedrivePolicy": '{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:d",'
                                           '"maxReceiveCount":"1000"}'}, False, creating=False)
    assert attributes.redrive(rp) == ("d", 1000)
    for attrs, fifo, want in (({"RedrivePolicy": '{"deadLetterTargetArn":"x","maxReceiveCount":1}'}, False,
                               "InvalidAttributeValue"),
                              ({"RedrivePolicy": '{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:d",'
                                                 '"maxReceiveCount":1001}'}, False, "InvalidAttributeValue"),
                              ({"FifoQueue": "true"}, False, "InvalidAttributeValue"),
                              ({"DeduplicationScope": "queue"}, False, "InvalidAttributeName"),
                              ({"KmsMasterKeyId": "alias/x"}, False, "InvalidAttributeValue"),
                              ({"Bogus": "1"}, False, "InvalidAttributeName")):
        with pytest.raises(SqsApiError) as e:
            attributes.check(attrs, fifo, creating=True)
        assert e.value.code == want, attrs


def test_per_message_group_throughput_needs_message_group_dedup_scope():
    # AWS: "The perMessageGroupId value is allowed only when the value for DeduplicationScope is messageGroup."
    fifo = attributes.defaults(True)
    for scope, limit in (("messageGroup", "perMessageGroupId"), ("messageGroup", "perQueue"), ("queue", "perQueue")):
        given = attributes.check({"DeduplicationScope": scope, "FifoThroughputLimit": limit}, True, creating=True)
        attributes.check_together({**fifo, **given}, given)
    for given in ({"DeduplicationScope": "queue", "FifoThroughputLimit": "perMessageGroupId"},
                  {"FifoThroughputLimit": "perMessageGroupId"}):  # the scope is queue unless set
        with pytest.raises(SqsApiError) as e:
            attributes.check_together({**fifo, **given}, given)
        assert e.value.code == "InvalidAttributeValue" and "perMessageGroupId" in e.value.message, given
    held = {**fifo, "FifoThroughputLimit": "perMessageGroupId"}  # a queue made before the rule
    attributes.check_together(held, {"VisibilityTimeout": "5"})  # keeps its pair while neither changes


def test_the_query_form_becomes_the_json_shapes():
    action, params = protocol.decode_query(
        "Action=SendMessageBatch&QueueUrl=u&SendMessageBatchRequestEntry.2.Id=b&SendMessageBatchRequestEntry.1.Id=a"
        "&SendMessageBatchRequestEntry.1.MessageAttribute.1.Name=n"
        "&SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.DataType=String"
        "&SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.StringValue=v", "/")
    assert action == "SendMessageBatch"
    assert params == {"QueueUrl": "u", "Entries": [
        {"Id": "a", "MessageAttributes": {"n": {"DataType": "String", "StringValue": "v"}}}, {"Id": "b"}]}
    with pytest.raises(SqsApiError):
        protocol.decode_query("Action=X&AttributeName.x=1", "/")


def test_a_query_requests_url_and_body_parameters_are_one_set():
    signature = "&X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=ab&X-Amz-Credential=k%2Fd&X-Amz-Expires=9"
    assert protocol.decode_query("", "/", "Action=ListQueues&Version=2012-11-05&QueueNamePrefix=p" + signature) == \
        ("ListQueues", {"QueueNamePrefix": "p"})  # a presigned POST: everything in the URL
    assert protocol.decode_query("AttributeName.2=b&Action=GetQueueAttributes", "/000000000000/q",
                                 "AttributeName.1=a&Action=GetQueueAttributes") == \
        ("GetQueueAttributes", {"AttributeNames": ["a", "b"], "QueueUrl": "/000000000000/q"})
    with pytest.raises(SqsApiError) as e:  # two values of one name: refused, whichever is signed
        protocol.decode_query("Action=ListQueues&QueueNamePrefix=b", "/", "QueueNamePrefix=a")
    assert e.value.code == "MalformedQueryString" and "QueueNamePrefix" in e.value.message


def test_the_config_table_names_each_bad_key():
    assert config.parse({}).sqs_api.listen == ""
    ok = config.parse({"sqs_api": {"listen": "[::1]:9324", "region": "eu-west-3", "account_id": "123456789012"}})
    assert ok.sqs_api.region == "eu-west-3"
    for raw, where in (({"listen": "0.0.0.0:9324"}, "sqs_api.listen"), ({"listen": 9324}, "sqs_api.listen"),
                       ({"region": "Mars"}, "sqs_api.region"), ({"account_id": 12}, "sqs_api.account_id"),
                       ({"access_key_id": "short"}, "sqs_api.access_key_id"),
                       ({"access_key_id": "AKIDSHARDQTEST0001"}, "sqs_api.secret_access_key"),
                       ({"secret_access_key": "s" * 40}, "sqs_api.access_key_id"),
                       ({"secret_access_key": "short"}, "sqs_api.secret_access_key"), ({"port": 1}, "sqs_api.port")):
        with pytest.raises(InvalidConfig) as e:
            config.parse({"sqs_api": raw})
        assert str(e.value).startswith(where), (raw, str(e.value))
    keyed = config.parse({"sqs_api": {"listen": "0.0.0.0:9324", "access_key_id": "AKIDSHARDQTEST0001",
                                      "secret_access_key": "s" * 40}})
    assert "sqs_api" not in keyed.to_dict() and "s" * 40 not in repr(keyed)


def test_the_catalog_answers_only_what_is_on_disk(tmp_path, monkeypatch):
    from shardq.sqs_api.catalog import Catalog
    cat = Catalog(str(tmp_path))
    cat.create("kept", {"VisibilityTimeout": "30"}, {}, {"t": "1"})
    assert Catalog(str(tmp_path)).get("kept")["tags"] == {"t": "1"}  # a new process reads it back
    key = cat.key

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("shardq.sqs_api.catalog.os.fsync", full)
    with pytest.raises(OSError):
        cat.create("lost", {}, {}, {})
    with pytest.raises(OSError):
        cat.set_attributes("kept", {"VisibilityTimeout": "99"})
    assert cat.get("lost") is None and cat.get("kept")["attributes"]["VisibilityTimeout"] == "30"
    monkeypatch.undo()
    again = Catalog(str(tmp_path))
    assert again.names() == ["kept"] and again.key == key  # receipt handles stay valid across restarts


def test_a_request_head_is_read_as_the_stdlib_reads_it():
    import http.client
    import io

    from shardq.service import http_head as head
    raw = (b"POST /q?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9324\r\nX-Amz-Target:  AmazonSQS.SendMessage \r\n"
           b"x-amz-meta: a\r\nX-Amz-Meta: b\r\nX-Folded: one\r\n two\r\nContent-Length: 2\r\n\r\n{}")
    h = head.parse(raw)
    std = http.client.parse_headers(io.BytesIO(raw.split(b"\r\n", 1)[1]))
    assert (h.method, h.target, h.version, raw[h.body_at:]) == ("POST", "/q?x=1", "HTTP/1.1", b"{}")
    for name in ("host", "X-AMZ-TARGET", "Content-Length", "missing"):
        assert h.get(name) == std.get(name) or h.get(name) == (std.get(name) or "").strip(), name
    assert h.get_all("x-amz-meta") == std.get_all("x-amz-meta") == ["a", "b"]
    assert h.get("x-folded") == "one two"
    for bad in (b"GET /\r\n\r\n", b"GET / HTTP/2\r\n\r\n", b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
                b"GET / HTTP/1.1\r\n folded first\r\n\r\n", b"GET / HTTP/1.1\r\nName : v\r\n\r\n", b""):
        assert head.parse(bad) is None, bad
    assert head.parse(b"GET / HTTP/1.1\nHost: x\n\nrest").body_at == len(b"GET / HTTP/1.1\nHost: x\n\n")


def test_a_usual_head_read_by_its_regular_expressions_is_the_head_read_line_by_line():
    """http_head.parse reads the usual head with two regular expressions; any head (seeded
    random lines of spaces, CRs, colons, tokens and latin-1 whitespace) reads the same as
    line by line, the fast path taken or not."""
    import random

    from shardq.service import http_head as head
    rnd = random.Random(46)
    parts = [" ", "\t", "\r", "\n", ":", "a", "B", "-", "x", "\x0b", "\xa0", "\x85", "/", "HTTP/1.1", "\r\n", "\n "]
    usual = 0
    for _ in range(4000):
        lines = ["GET / HTTP/1.1" if rnd.random() < .7 else "".join(rnd.choices(parts, k=rnd.randint(1, 6)))]
        for _ in range(rnd.randint(0, 4)):
            lines.append(rnd.choice(["Host:", "X-a:", "x-A:", ""]) + "".join(rnd.choices(parts, k=rnd.randint(0, 6))))
        raw = ("".join(line + rnd.choice(["\r\n", "\n"]) for line in lines) + "\r\nbody").encode("latin-1")
        m = head.HEAD_END.search(raw)
        if m is None or m.start() == 0:
            continue
        fast, slow = head.parse(raw), head._parse_lines(raw, m)
        usual += head._USUAL.fullmatch(raw[:m.end()].decode("latin-1")) is not None
        assert (fast is None) == (slow is None), raw
        if fast is not None and slow is not None:
            assert (fast.method, fast.target, fast.version, fast.body_at, fast._fields) == (
                slow.method, slow.target, slow.version, slow.body_at, slow._fields), raw
    assert usual > 1000  # both paths ran


def test_the_listeners_end_of_a_head_is_the_regular_expressions():
    """The listener finds a head's blank line with two finds (aio_listener._head_end); for
    seeded random bytes of CRs, LFs and letters, from any start, it ends where HEAD_END's
    match ends, or neither finds one."""
    import random

    from shardq.service import http_head as head
    from shardq.service.aio_listener import _head_end
    rnd = random.Random(461)
    found = 0
    for _ in range(20000):
        raw = bytes(rnd.choices(b"\r\n\r\nab:", k=rnd.randint(0, 12)))
        start = rnd.randint(0, max(0, len(raw) - 1))
        m = head.HEAD_END.search(raw, start)
        assert _head_end(raw, start) == (-1 if m is None else m.end()), (raw, start)
        assert _head_end(bytearray(raw), start) == (-1 if m is None else m.end())
        found += m is not None
    assert found > 2000


_USUAL_MESSAGE = ("MessageId", "ReceiptHandle", "MD5OfBody", "Body")  # messages.py's order


@given(st.lists(st.one_of(
    st.tuples(st.text(), st.text(), st.text(), st.text()).map(lambda v: dict(zip(_USUAL_MESSAGE, v))),
    st.tuples(st.text(), st.text(), st.text(), st.text(), st.dictionaries(st.text(), st.text())).map(
        lambda v: dict(zip((*_USUAL_MESSAGE, "Attributes"), v))),
    st.dictionaries(st.sampled_from(["MessageId", "Body", "X"]), st.one_of(st.text(), st.integers())))),
    st.lists(st.one_of(st.fixed_dictionaries({"Id": st.text()}),
                       st.dictionaries(st.sampled_from(["Id", "X"]), st.one_of(st.text(), st.integers())))))
@settings(max_examples=200, deadline=None)
def test_the_drains_answers_written_by_hand_are_the_encoders_json(messages, entries):
    """encode_json writes a receive's and a delete batch's answers by hand: the encoder's
    bytes, whatever their members and strings (escapes, non-ASCII, surrogates), for
    messages whose members come in the order messages.py gives them."""
    for result in ({"Messages": messages}, {"Successful": entries, "Failed": []}):
        assert protocol.encode_json(result) == protocol._ENCODE(result).encode()


def test_message_ids_are_uuid5_of_the_service_and_job():
    import uuid
    for service, job in (("svc", 0), ("svc", 2048), ("another", 2**62 + 5)):
        want = str(uuid.uuid5(uuid.NAMESPACE_URL, f"shardq:{service}:{job}"))
        assert message.message_id(service, job) == want
        assert message.message_ids(service)(job) == want  # a receive's, prefix hashed once


def test_a_catalog_read_takes_no_lock_while_the_file_is_unchanged_and_sees_another_writer(tmp_path):
    """Catalog.get: a request reads its queue without the catalog's lock while the file is
    the one read last (request threads queued on it cost a switch each), and reads the file
    again once another catalog (another process) has replaced it."""
    here, there = Catalog(str(tmp_path)), Catalog(str(tmp_path))
    here.create("q", {"VisibilityTimeout": "30"}, {}, {})
    assert there.get("q")["attributes"] == {"VisibilityTimeout": "30"}  # written by the other
    with there._lock:  # held: a read of an unchanged file does not wait for it
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(there.get("q")))
        reader.start()
        reader.join(5)
        assert got and got[0]["attributes"] == {"VisibilityTimeout": "30"}
    here.set_attributes("q", {"VisibilityTimeout": "40"})
    assert there.get("q")["attributes"]["VisibilityTimeout"] == "40"


def test_a_listener_process_tunes_its_collector():
    """tune_gc (serve and a listener child call it once the listener serves): what was built
    to start is frozen, young collections come every GC_YOUNG net allocations, not 700;
    cycles are still collected (nothing frozen after)."""
    import gc

    from shardq.sqs_api.server import GC_YOUNG, tune_gc
    before, enabled = gc.get_threshold(), gc.isenabled()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG, 10, 10) and GC_YOUNG > before[0]
        assert gc.get_freeze_count() > 0
        gc.disable()  # the cycle below is collected by the explicit pass, not by chance
        cycle: list[Any] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect(0) >= 1
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_fifo_dedup_id_is_scoped_to_its_queues_incarnation_within_shardqs_128_bytes():
    from shardq import limits
    from shardq.sqs_api.messages import incarnation_dedup_id
    old, new = {"incarnation": "a" * 12}, {"incarnation": "b" * 12}
    assert incarnation_dedup_id(old, "id-1") == "aaaaaaaaaaaa:id-1"
    assert incarnation_dedup_id(old, "id-1") != incarnation_dedup_id(new, "id-1")
    longest = incarnation_dedup_id(old, "x" * 128)  # SQS's longest id: hashed, still its own
    assert len(longest.encode()) <= limits.DEDUP_ID_BYTES_MAX and longest.startswith("aaaaaaaaaaaa#")
    assert longest != incarnation_dedup_id(old, "x" * 127 + "y") != incarnation_dedup_id(new, "x" * 128)
    # a queue made before incarnations (an upgrade): the id as given, so its open dedup windows hold
    assert incarnation_dedup_id({"created": 1}, "id-1") == "id-1"


def test_a_queue_created_again_is_another_incarnation(tmp_path):
    from shardq.clock import FakeClock
    clock = FakeClock()
    catalog = Catalog(str(tmp_path), clock)
    catalog.create("q.fifo", attributes.defaults(True), {}, {})
    first = catalog.get("q.fifo")["incarnation"]
    assert not catalog.create("q.fifo", attributes.defaults(True), {}, {})  # it exists: the same one
    assert catalog.get("q.fifo")["incarnation"] == first
    catalog.delete("q.fifo")
    clock.advance(61)
    catalog.create("q.fifo", attributes.defaults(True), {}, {})
    assert catalog.get("q.fifo")["incarnation"] not in (None, first)
