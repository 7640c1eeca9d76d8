"""Hypothesis over the SQS mapping (shardq/backends/sqs_mapping.py), the pure functions the
sqs backend trusts with what it sends and what it receives (issue 32, section 6).

* ``decode`` of any message a sender could put on the queue (bodies, attributes of any
  name and type, group and dedup ids of any form) is an ``Incoming`` or a ``Foreign``,
  never an exception; what it calls ``Incoming`` is a job shardq could have written.
* ``encode`` of any job the backend's checks let through is what SQS accepts (group, dedup
  id, body text and attributes within SQS's characters and lengths) or ``InvalidJob``; and
  ``decode`` gives the job back: body, key, error, and for a redriven copy the job id.
* A redrive id that was not made with the queue's redrive key, or that is carried by
  another body, key or group than it was made for, gives no message an existing job id.
* ``parse_target``, ``queue_names``, ``parse_redrive_key`` and ``error_for`` raise nothing but
  their typed errors.

The fixed cases at the end are the bugs this fuzz found, each failing before its fix.
``SHARDQ_FUZZ_EXAMPLES`` sets the examples per property (default 150; e.g. 5000 for a long run).
"""
from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardq import limits
from shardq.backends import sqs_mapping as m
from shardq.errors import AuthError, InvalidConfig, InvalidJob, ShardqError
from shardq.protocol import validate

EXAMPLES = int(os.environ.get("SHARDQ_FUZZ_EXAMPLES", "150"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
MAX_BODY = limits.SQS_MESSAGE_BYTES_MAX
# What SQS accepts (docs.aws.amazon.com, SendMessage): group and dedup ids are 1-128 of
# these; a body and a String attribute are XML 1.0 characters.
SQS_ID = re.compile(r"[\x21-\x7e]{1,128}")
SQS_TEXT = re.compile("[\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")

# Text of every code point, lone surrogates included (no SQS sends them; decode must not
# trip over them anyway), and text close to the forms shardq writes.
any_text = st.text(st.one_of(st.characters(codec=None, exclude_categories=()),
                             st.characters(codec=None, categories=["Cs"])), max_size=40)
hex_text = st.text("0123456789abcdef", min_size=0, max_size=70)
ascii_id = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=130)
near_forms = st.builds(lambda head, digits, tail: head + digits + tail,
                       st.sampled_from(["n", "d", "f", "u", "k", "h", "r", ""]), hex_text,
                       st.sampled_from(["", "\n", " ", ".", "\x00", "Z"]))
ids = st.one_of(any_text, ascii_id, near_forms)


def _attribute():
    string = st.fixed_dictionaries({"DataType": st.sampled_from(["String", "Number", "String.x", "Binary"]),
                                    "StringValue": any_text})
    binary = st.fixed_dictionaries({"DataType": st.sampled_from(["Binary", "Binary.x", "String"]),
                                    "BinaryValue": st.binary(max_size=300)})
    odd = st.one_of(st.none(), st.integers(), any_text, st.fixed_dictionaries({"DataType": st.just("Binary")}),
                    st.fixed_dictionaries({"DataType": st.just("Binary"), "BinaryValue": any_text}))
    return st.one_of(string, binary, odd)


_KNOWN = st.sampled_from([m.ATTR_KEY, m.ATTR_BODY, m.ATTR_ERROR])
attr_names = st.one_of(_KNOWN, _KNOWN, _KNOWN, any_text)
messages = st.fixed_dictionaries(
    {"MessageId": any_text, "ReceiptHandle": any_text,
     "Body": st.one_of(any_text, st.just(m.BINARY_BODY_MARK), st.just("")),
     "Attributes": st.fixed_dictionaries({}, optional={
         "MessageGroupId": ids, "MessageDeduplicationId": ids,
         "ApproximateReceiveCount": st.one_of(any_text, st.integers().map(str))}),
     "MessageAttributes": st.dictionaries(attr_names, _attribute(), max_size=4)})


def delivered(out: m.Outgoing, message_id: str = "0f7a4b8e-1c2d-4e5f-8a9b-0c1d2e3f4a5b", receives: int = 1) -> dict:
    """The message SQS delivers for ``out`` (as boto3's receive_message gives it)."""
    return {"MessageId": message_id, "ReceiptHandle": "rh-" + message_id, "Body": out.body,
            "Attributes": {"MessageGroupId": out.group, "MessageDeduplicationId": out.dedup,
                           "ApproximateReceiveCount": str(receives)},
            "MessageAttributes": dict(out.attributes)}


def decoded(msg: dict, secret: bytes | None = SECRET, dead: bool = False, max_body: int = MAX_BODY):
    return m.decode(msg, lambda: secret, max_body, dead=dead)


# ---------------------------------------------------------------------------- decode
@st.composite
def near_shardqs(draw) -> dict:
    """A message shardq wrote (a plain job, or a redriven copy), with some of its parts
    replaced by what a foreign sender might put there."""
    body, key = draw(st.binary(min_size=1, max_size=64)), draw(st.one_of(st.none(), st.text(min_size=1, max_size=20)))
    if draw(st.booleans()):
        out = m.encode(body, key, draw(st.one_of(st.none(), st.text(min_size=1, max_size=8))))
    else:
        group = m.group_id(key)
        out = m.encode(body, key, m.redrive_dedup_id(SECRET, "job-1", "dead-1", group, key, body), group=group)
    msg = delivered(out)
    foreign = draw(messages)
    for part in draw(st.sets(st.sampled_from(["Body", "MessageGroupId", "MessageDeduplicationId",
                                              "ApproximateReceiveCount", "MessageAttributes"]))):
        if part in ("Body", "MessageAttributes"):
            msg[part] = foreign[part]
        else:
            msg["Attributes"][part] = draw(ids)
    return msg


@fuzz
@given(st.one_of(messages, near_shardqs()), st.booleans(), st.sampled_from([1, 16, MAX_BODY]),
       st.sampled_from([SECRET, None]))
def test_decode_never_raises_and_calls_incoming_only_what_shardq_could_have_written(msg, dead, max_body, secret):
    got = decoded(msg, secret, dead, max_body)
    assert isinstance(got, (m.Incoming, m.Foreign))
    if isinstance(got, m.Foreign):
        assert got.reason and got.message_id == msg["MessageId"]
        return
    assert 0 < len(got.body) <= max_body
    assert got.key == validate.key(got.key)
    assert got.group == (m.group_id(got.key) if got.key is not None else got.group)
    dedup = msg["Attributes"]["MessageDeduplicationId"]
    if got.job_id == msg["MessageId"]:
        assert re.fullmatch(r"n[0-9a-f]{32}|d[0-9a-f]{64}" + ("|f[0-9a-f]{64}" if dead else ""), dedup), dedup
    else:  # only the genuine redrive id, on the body, key and group it was made for
        assert (secret, got.job_id, got.body) == (SECRET, "job-1", msg_body(msg))
        assert dedup == m.redrive_dedup_id(SECRET, "job-1", "dead-1", got.group, got.key, got.body)


def msg_body(msg: dict) -> bytes:
    attr = msg["MessageAttributes"].get(m.ATTR_BODY)
    return bytes(attr["BinaryValue"]) if attr else msg["Body"].encode()


# ---------------------------------------------------------------------------- encode
keys = st.one_of(st.none(), st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=limits.KEY_BYTES_MAX // 4),
                 st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=126, max_size=129))
dedups = st.one_of(st.none(), st.text(min_size=1, max_size=limits.DEDUP_ID_BYTES_MAX // 4),
                   st.binary(min_size=1, max_size=limits.DEDUP_ID_BYTES_MAX))
bodies = st.one_of(st.binary(min_size=1, max_size=200), st.text(min_size=1, max_size=200).map(str.encode),
                   st.sampled_from([b"b", b"\x00", b"\xff", "\ufffe".encode(), b"\r\n", b"x" * 1024]))
errors = st.one_of(st.none(), any_text, st.text(min_size=1, max_size=50))


def assert_sqs_accepts(out: m.Outgoing) -> None:
    assert SQS_ID.fullmatch(out.group), out.group
    assert SQS_ID.fullmatch(out.dedup), out.dedup
    assert out.body and SQS_TEXT.fullmatch(out.body)
    for name, attr in out.attributes.items():
        assert attr["DataType"] in ("String", "Binary")
        if attr["DataType"] == "String":
            assert SQS_TEXT.fullmatch(attr["StringValue"]), name
    assert out.size >= len(out.body.encode()) + sum(len(a.get("BinaryValue") or a["StringValue"].encode())
                                                    for a in out.attributes.values())


@fuzz
@given(bodies, st.one_of(keys, any_text), st.one_of(dedups, any_text), errors)
def test_encode_gives_what_sqs_accepts_or_invalid_job(body, key, dedup, error):
    try:
        out = m.encode(body, validate.key(key), validate.dedup_id(dedup), error=error)
    except InvalidJob:
        return  # a key or dedup id that is not valid text (validate.* lets short ones through)
    assert_sqs_accepts(out)


@fuzz
@given(bodies, keys, dedups, errors, st.booleans())
def test_every_valid_job_round_trips(body, key, dedup, error, dead):
    out = m.encode(body, key, dedup, error=error)
    assert_sqs_accepts(out)
    got = decoded(delivered(out, receives=3), dead=dead)
    if error and not dead:  # shardq writes its error attribute on dead-letter copies only
        assert isinstance(got, m.Foreign) and m.ATTR_ERROR in got.reason
        return
    assert isinstance(got, m.Incoming), got
    assert (got.body, got.key, got.attempt, got.group) == (body, key, 3, out.group)
    assert got.job_id == "0f7a4b8e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
    if error:
        assert got.error == m._NOT_SQS_TEXT.sub("\ufffd", error)


@fuzz
@given(bodies, keys, st.uuids().map(str), st.uuids().map(str), st.booleans())
def test_a_redriven_copy_keeps_its_job_id(body, key, job_id, dead_message_id, dead):
    group = m.group_id(key)
    dedup = m.redrive_dedup_id(SECRET, job_id, dead_message_id, group, key, body)
    out = m.encode(body, key, dedup, group=group)
    assert_sqs_accepts(out)
    got = decoded(delivered(out), dead=dead)
    assert isinstance(got, m.Incoming) and got.job_id == job_id and got.body == body


# ---------------------------------------------------------------------------- forged redrive ids
_FIELDS = ("job_id", "nonce", "mac", "body", "key", "group", "secret")


@fuzz
@given(bodies, keys, st.uuids().map(str), st.sampled_from(_FIELDS), st.data())
def test_a_forged_or_replayed_redrive_id_gives_no_message_a_job_id(body, key, job_id, field, data):
    """Start from a genuine redriven copy and change one thing its mac covers: the result
    is Foreign (its own job id never comes out) whatever the change."""
    group = m.group_id(key)
    dedup = m.redrive_dedup_id(SECRET, job_id, "dead-1", group, key, body)
    msg = delivered(m.encode(body, key, dedup, group=group), message_id="new-message")
    _, nonce, mac = m._REDRIVE.fullmatch(dedup).groups()
    secret = SECRET
    if field == "job_id":
        other = data.draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="."),
                                  min_size=1, max_size=m.REDRIVE_JOB_ID_CHARS_MAX).filter(lambda j: j != job_id))
        msg["Attributes"]["MessageDeduplicationId"] = f"r{other}.{nonce}.{mac}"
    elif field in ("nonce", "mac"):
        size = m.REDRIVE_NONCE_CHARS if field == "nonce" else m.REDRIVE_MAC_CHARS
        forged = data.draw(st.text("0123456789abcdef", min_size=size, max_size=size).filter(
            lambda v: v != (nonce if field == "nonce" else mac)))
        msg["Attributes"]["MessageDeduplicationId"] = (f"r{job_id}.{forged}.{mac}" if field == "nonce"
                                                       else f"r{job_id}.{nonce}.{forged}")
    elif field == "body":
        other_body = data.draw(bodies.filter(lambda b: b != body))
        copy = m.encode(other_body, key, dedup, group=group)  # the genuine id on another body
        msg = delivered(copy, message_id="new-message")
    elif field in ("key", "group"):
        other_key = data.draw(keys.filter(lambda k: k != key and k is not None))
        copy = m.encode(body, other_key, dedup, group=m.group_id(other_key))
        msg = delivered(copy, message_id="new-message")
    else:
        secret = OTHER_SECRET
    got = decoded(msg, secret)
    assert isinstance(got, m.Foreign), (field, got)
    assert got.message_id == "new-message"


@fuzz
@given(ids, bodies, keys)
def test_a_redrive_id_of_random_form_is_refused(dedup, body, key):
    msg = delivered(m.encode(body, key, None))
    msg["Attributes"]["MessageDeduplicationId"] = "r" + dedup
    got = decoded(msg)
    assert isinstance(got, m.Foreign) or got.job_id == msg["MessageId"]


@fuzz
@given(any_text, any_text, st.sampled_from(["", "bury:", "x" * 200]))
def test_redrive_dedup_id_carries_a_job_id_or_refuses_it(job_id, dead_message_id, prefix):
    try:
        dedup = m.redrive_dedup_id(SECRET, prefix + job_id, dead_message_id.encode("utf-8", "replace").decode(),
                                   "g", None, b"x")
    except InvalidJob:
        return
    assert SQS_ID.fullmatch(dedup) and m._REDRIVE.fullmatch(dedup).group(1) == prefix + job_id


# ---------------------------------------------------------------------------- the other parsers
@fuzz
@given(st.one_of(any_text, st.builds(lambda a, b, c: f"sqs://{a}/{b}{c}", any_text, any_text,
                                     st.sampled_from(["", "?endpoint=http://127.0.0.1:1", "?endpoint=[",
                                                      "?x=1", "?endpoint=http://[::1"]))))
def test_parse_target_raises_only_invalid_config(target):
    try:
        t = m.parse_target(target)
    except InvalidConfig:
        return
    assert m.parse_target(t.url()) == t


@fuzz
@given(st.one_of(any_text, st.integers(), st.none()), any_text)
def test_queue_names_are_sqs_names_or_invalid_job(queue, prefix):
    try:
        fifo, dlq = m.queue_names("p", queue)
    except InvalidJob:
        return
    for name in (fifo, dlq):
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,75}\.fifo", name) and len(name) <= limits.SQS_QUEUE_NAME_CHARS_MAX
    assert m.shardq_queue("p", fifo) == queue and m.shardq_queue("p", dlq) is None


@fuzz
@given(st.one_of(any_text, hex_text, st.integers(), st.none(), st.binary()))
def test_parse_redrive_key_is_none_or_the_key(value):
    key = m.parse_redrive_key(value)
    assert key is None or (len(key) == m.REDRIVE_KEY_BYTES and key.hex() == value)


@fuzz
@given(any_text, any_text, st.one_of(st.none(), st.integers(0, 600)), any_text)
def test_error_for_maps_any_sqs_error_to_a_shardq_error(code, message, status, what):
    assert isinstance(m.error_for(code, message, status, what), ShardqError)


@pytest.mark.parametrize("code, status", [("InvalidClientTokenId", 403), ("SignatureDoesNotMatch", 403),
                                          ("403", 403), ("401", 401)])
def test_a_refused_identity_is_an_auth_error_whatever_code_the_sdk_read(code, status):
    """A server whose auth error body the SDK cannot read (moto answers the JSON protocol
    in XML) leaves botocore the HTTP status as the code: it was a bare ShardqError ('SQS 403:
    <?xml ...'), exit 1; it is AuthError, as InvalidClientTokenId is."""
    assert type(m.error_for(code, "<?xml version='1.0'?><ErrorResponse/>", status, "get_queue_url")) is AuthError


# ---------------------------------------------------------------------------- found by the fuzz
def test_a_key_ending_in_a_newline_gets_a_group_sqs_accepts():
    """``re.match`` with ``$`` matched before a final newline: the key "abc\\n" became the
    group "kabc\\n", which SQS refuses, so its jobs could not be enqueued at all."""
    assert SQS_ID.fullmatch(m.group_id("abc\n"))
    assert m.group_id("abc\n") != m.group_id("abc")


@pytest.mark.parametrize("dedup", ["n" + "0" * 32 + "\n", "d" + "0" * 64 + "\n"])
def test_a_dedup_id_with_a_trailing_newline_is_of_no_form_shardq_writes(dedup):
    msg = delivered(m.encode(b"x", "k", None))
    msg["Attributes"]["MessageDeduplicationId"] = dedup
    assert isinstance(decoded(msg), m.Foreign)


def test_a_keyless_group_with_a_trailing_newline_is_not_a_keyless_jobs():
    msg = delivered(m.encode(b"x", None, None))
    msg["Attributes"]["MessageGroupId"] += "\n"
    assert isinstance(decoded(msg), m.Foreign)


def test_a_queue_name_ending_in_a_newline_is_refused():
    with pytest.raises(InvalidJob):
        m.queue_names("p", "emails\n")


@pytest.mark.parametrize("msg_part", [{"Body": "\ud800"},
                                      {"MessageAttributes": {m.ATTR_KEY: {"DataType": "Binary",
                                                                          "BinaryValue": "text, not bytes"}}}])
def test_decode_of_a_body_or_attribute_no_sqs_sends_is_foreign_not_an_exception(msg_part):
    """A lone surrogate raised UnicodeEncodeError; a Binary attribute holding a str raised
    TypeError (decode promises Foreign for whatever a message holds)."""
    msg = {**delivered(m.encode(b"x", None, None)), **msg_part}
    assert isinstance(decoded(msg), m.Foreign)


@pytest.mark.parametrize("key, dedup", [("\ud800", None), ("k" * 200 + "\ud800", None), ("k", "\udfff")])
def test_encode_refuses_a_key_or_dedup_id_that_is_not_text_with_invalid_job(key, dedup):
    """validate.key measures only long keys as UTF-8, so a short key with a lone surrogate
    reached encode and raised UnicodeEncodeError out of the sqs backend's enqueue."""
    with pytest.raises(InvalidJob, match="lone surrogate"):
        m.encode(b"x", key, dedup)


def test_a_bury_error_with_characters_sqs_refuses_is_kept_readable():
    out = m.encode(b"x", "k", None, error="boom\x00\ud800!")
    assert out.attributes[m.ATTR_ERROR]["StringValue"] == "boom\ufffd\ufffd!"
    assert_sqs_accepts(out)


@pytest.mark.parametrize("target", ["sqs://[x/prefix", "sqs://r/p?endpoint=http://[::1"])
def test_parse_target_of_an_unclosed_ipv6_literal_is_invalid_config(target):
    with pytest.raises(InvalidConfig):
        m.parse_target(target)
