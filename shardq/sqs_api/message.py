"""Messages as SQS sees them, as shardq jobs: pure functions, no I/O.

* **The job body.** A message sent with nothing but its body (and, on a FIFO queue, its
  group and a content-based dedup id) is stored as that body, UTF-8: a ``shardq worker``
  leases exactly what a boto3 producer sent. A message that carries more (message
  attributes, the ``AWSTraceHeader`` system attribute, an explicit MessageDeduplicationId,
  which receives give back as AWS does, a standard queue's MessageGroupId, or the move to a
  dead-letter queue) is stored as an *envelope*:
  :data:`MAGIC`, one line of JSON with what it carries, then the body. No SQS body can start
  with :data:`MAGIC` (it holds a NUL, a character SQS refuses), so the two never mix;
  :func:`unwrap` gives a worker the body and the attributes.
* **Its size.** The JSON is UTF-8, not ``\\u`` escapes (which took 6 bytes for a 2-byte
  ``é``, 12 for a 4-byte emoji); a binary value is base64, and so is a String value that JSON
  would escape more than base64 costs (``StringValueBase64`` in the envelope; :func:`unwrap`
  gives it back as ``StringValue``). So an envelope is at most 4/3 of the message's size as
  SQS counts it plus :data:`ENVELOPE_FIXED_BYTES_MAX` (what the largest names, data types,
  group and dedup ids, the sent time and a move's source ARN and MessageId take), and a 1 MiB
  message fits the 2 MiB ``max_body_bytes`` docs/sqs-api.md recommends, moved to a
  dead-letter queue too, with room to spare (:func:`envelope_bytes_max`).
* **The other way.** A job enqueued by shardq's own client is received with its body as the
  message body when it is text SQS allows; otherwise base64-encoded, with the String message
  attribute ``shardq.body-encoding = base64`` saying so.
* **MD5s** as AWS computes them (SDKs check them): the body's UTF-8; the attributes sorted by
  name, each as length-prefixed name, data type, transport byte (1 string, 2 binary) and
  length-prefixed value.
"""
from __future__ import annotations

import base64
import binascii
import decimal
import hashlib
import importlib
import json
import re
import struct
import uuid
from collections.abc import Callable
from typing import Any

from .. import limits
from .faults import fault, invalid


def _builtin(module: str, openssl: Callable[..., Any]) -> Callable[..., Any]:
    """CPython's own hash ``module`` (``_md5``, ``_sha1``), else OpenSSL's: for 100 bytes
    its digest takes 0.27 us against OpenSSL's 0.66 (timeit: the latter's context setup)."""
    try:
        own: Callable[..., Any] = getattr(importlib.import_module(module), module[1:])
        return own
    except ImportError:  # an interpreter built without it
        return openssl


_md5, _sha1 = _builtin("_md5", hashlib.md5), _builtin("_sha1", hashlib.sha1)

MAGIC = b"\x00sqs1\n"
BODY_ENCODING_ATTRIBUTE = "shardq.body-encoding"
# What SQS allows in a body and a String attribute (#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD |
# #x10000-#x10FFFF): the complement, to search for.
_BAD_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_ATTR_NAME = re.compile(r"[A-Za-z0-9_.-]{1,256}\Z")
_DATA_TYPE = re.compile(r"(String|Number|Binary)(\.[^\x00-\x1f]{1,250})?\Z")
_GROUP_OR_DEDUP = re.compile(r"[!-~]{1,128}\Z")  # ASCII 33-126: letters, digits, punctuation
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_SIZE_MIN = decimal.Decimal(10) ** limits.SQS_API_NUMBER_EXP_MIN  # a nonzero Number's size (AWS)
_NUMBER_SIZE_MAX = decimal.Decimal(10) ** limits.SQS_API_NUMBER_EXP_MAX
SYSTEM_ATTRIBUTES_FOR_SENDS = ("AWSTraceHeader",)
#: What JSON escapes in a string written as UTF-8 (ensure_ascii=False), two bytes each: SQS
#: text holds no other character below U+0020.
_JSON_ESCAPED = ('"', "\\", "\t", "\n", "\r")
_BASE64_STRING = "StringValueBase64"  # an envelope's String value kept base64 (_compact)
#: What an envelope may hold beyond 4/3 of its message's size (:func:`envelope_bytes_max`):
#: per attribute (10) its JSON keys and a data type escaped to twice its 256 characters'
#: bytes; a group and a dedup id of 128 characters escaped; the braces, the sent time and a
#: move's source ARN (80-character name) and MessageId. A bound, checked at the worst case
#: in tests/sqs_api/test_sizes.py; the AWSTraceHeader system attribute is not counted
#: (SQS does not count it either): it adds its own size, or 4/3 of it.
ENVELOPE_FIXED_BYTES_MAX = 16 * 1024


def check_text(what: str, text: str) -> None:
    """InvalidMessageContents for a character SQS refuses."""
    m = _BAD_CHARS.search(text)
    if m is not None:
        raise fault("InvalidMessageContents",
                    f"Invalid characters found in {what}: U+{ord(m.group()):04X}. Valid Unicode characters are "
                    f"#x9 | #xA | #xD | #x20 to #xD7FF | #xE000 to #xFFFD | #x10000 to #x10FFFF")


def check_group_or_dedup(what: str, value: Any) -> str:
    if not isinstance(value, str) or not _GROUP_OR_DEDUP.match(value):
        raise invalid(f"Value {str(value)[:140]!r} for parameter {what} is invalid. Reason: it must be 1 to "
                      f"128 characters of letters, digits and punctuation (!\"#$%&'()*+,-./:;<=>?@[\\]^_`{{|}}~).")
    return value


def check_attributes(attrs: Any, system: bool = False) -> dict[str, dict[str, Any]]:
    """Message attributes as sent (``{name: {DataType, StringValue | BinaryValue}}``),
    checked as SQS checks them; BinaryValue decoded to bytes. InvalidParameterValue."""
    kind = "MessageSystemAttributes" if system else "MessageAttributes"
    if attrs is None:
        return {}
    if not isinstance(attrs, dict):
        raise invalid(f"{kind} must be a map")
    if len(attrs) > limits.SQS_API_ATTRIBUTES_MAX:
        raise invalid(f"Number of message attributes [{len(attrs)}] exceeds the allowed maximum "
                      f"[{limits.SQS_API_ATTRIBUTES_MAX}].")
    out: dict[str, dict[str, Any]] = {}
    for name, value in attrs.items():
        if system:
            if name not in SYSTEM_ATTRIBUTES_FOR_SENDS:
                raise invalid(f"Message system attribute name '{name}' is invalid.")
        elif (not isinstance(name, str) or not _ATTR_NAME.match(name) or name.startswith(".")
              or name.endswith(".") or ".." in name or name.lower().startswith(("aws.", "amazon."))):
            raise invalid(f"Message attribute name '{str(name)[:260]}' is invalid: up to 256 letters, digits, "
                          f"'_', '-' and '.', not starting or ending with '.', no '..', not starting with "
                          f"'AWS.' or 'Amazon.'.")
        if not isinstance(value, dict):
            raise invalid(f"The message attribute '{name}' must be a structure.")
        dtype = value.get("DataType")
        if not isinstance(dtype, str) or not dtype:
            raise invalid(f"The message attribute '{name}' must contain a non-empty attribute type.")
        if not _DATA_TYPE.match(dtype):
            raise invalid(f"The type of message attribute '{name}' is invalid. You must use only the following "
                          f"supported type prefixes: Binary, Number, String.")
        check_text(f"the type of message attribute '{name}'", dtype)  # a body's characters (AWS)
        has_s, has_b = value.get("StringValue") is not None, value.get("BinaryValue") is not None
        if dtype.startswith("Binary"):
            if not has_b or has_s:
                raise invalid(f"The message attribute '{name}' with type 'Binary' must use field 'Binary'.")
            raw = value["BinaryValue"]
            if isinstance(raw, str):
                try:
                    raw = base64.b64decode(raw, validate=True)
                except (binascii.Error, ValueError):
                    raise invalid(f"The message attribute '{name}' has a BinaryValue that is not base64.") from None
            if not isinstance(raw, bytes) or not raw:
                raise invalid(f"The message attribute '{name}' must contain a non-empty message attribute value.")
            out[name] = {"DataType": dtype, "BinaryValue": raw}
        else:
            if not has_s or has_b:
                raise invalid(f"The message attribute '{name}' with type '{dtype.split('.')[0]}' must use field "
                              f"'String'.")
            text = value["StringValue"]
            if not isinstance(text, str) or not text:
                raise invalid(f"The message attribute '{name}' must contain a non-empty message attribute value.")
            check_text(f"message attribute '{name}'", text)
            if dtype.startswith("Number") and not _is_number(text):
                raise invalid(f"Can't cast the value of message (user) attribute '{name}' to a number.")
            out[name] = {"DataType": dtype, "StringValue": text}
    return out


def _is_number(text: str) -> bool:
    """AWS's Number: up to 38 digits of precision, 0 or between 10^-128 and 10^+126 either
    side of it (both edges taken)."""
    if not _NUMBER.match(text):
        return False
    mantissa = text.lower().partition("e")[0]
    if len(mantissa.lstrip("+-").replace(".", "").lstrip("0")) > limits.SQS_API_NUMBER_DIGITS_MAX:
        return False
    try:
        size = decimal.Decimal(text).copy_abs()  # exact: abs() would round to 28 digits
    except decimal.InvalidOperation:  # an exponent beyond what Decimal holds: far out of range
        return False
    return not size or _NUMBER_SIZE_MIN <= size <= _NUMBER_SIZE_MAX


def attributes_size(attrs: dict[str, dict[str, Any]]) -> int:
    """Bytes the attributes count towards the message size: name, type and value."""
    return sum(len(n.encode()) + len(a["DataType"].encode())
               + len(a["BinaryValue"] if "BinaryValue" in a else a["StringValue"].encode())
               for n, a in attrs.items())


def md5_of_body(body: str) -> str:
    return md5_of_utf8(body.encode("utf-8"))


def md5_of_utf8(data: bytes) -> str:
    """:func:`md5_of_body` of the body's UTF-8 bytes (a send has them already)."""
    digest: str = _md5(data).hexdigest()  # noqa: S324 - AWS's checksum, not security
    return digest


def md5_of_attributes(attrs: dict[str, dict[str, Any]]) -> str | None:
    """AWS's MD5OfMessageAttributes (and of system attributes); None for none."""
    if not attrs:
        return None
    h = hashlib.md5()  # noqa: S324 - AWS's checksum, not security
    for name in sorted(attrs):
        a = attrs[name]
        for part in (name.encode(), a["DataType"].encode()):
            h.update(struct.pack(">I", len(part)) + part)
        if "BinaryValue" in a:
            value, transport = a["BinaryValue"], b"\x02"
        else:
            value, transport = a["StringValue"].encode(), b"\x01"
        h.update(transport + struct.pack(">I", len(value)) + value)
    return h.hexdigest()


def to_wire(attrs: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Attributes as an answer carries them (binary values base64)."""
    out = {}
    for name, a in attrs.items():
        if "BinaryValue" in a:
            out[name] = {"DataType": a["DataType"], "BinaryValue": base64.b64encode(a["BinaryValue"]).decode()}
        else:
            out[name] = {"DataType": a["DataType"], "StringValue": a["StringValue"]}
    return out


def wrap(body: str | bytes, *, sent_ms: int, attrs: dict[str, dict[str, Any]], system: dict[str, dict[str, Any]],
         dedup_id: str | None = None, group: str | None = None) -> bytes:
    """The job body of a message (``body``: its text, or the text's UTF-8 bytes): the body
    itself when nothing else must ride with it. ``group``: a standard queue's MessageGroupId
    (on a FIFO queue the group is the key)."""
    head: dict[str, Any] = {}
    if attrs:
        head["a"] = to_wire(attrs)
    if system:
        head["s"] = to_wire(system)
    if group is not None:
        head["g"] = group
    if dedup_id is not None:
        head["d"] = dedup_id
    data = body if isinstance(body, bytes) else body.encode("utf-8")
    if not head:
        return data
    head["t"] = sent_ms
    return rewrap(data, head)


def rewrap(data: bytes, head: dict[str, Any]) -> bytes:
    """An envelope of ``data`` with ``head`` (as :func:`unwrap` gives them): UTF-8 JSON,
    each String value that JSON escapes more than base64 costs kept base64 (:func:`_compact`)."""
    stored = dict(head)
    for part in ("a", "s"):
        if part in stored:
            stored[part] = _compact(stored[part])
    return MAGIC + json.dumps(stored, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" + data


def _compact(wire: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Attributes in wire form as an envelope keeps them: a String value whose characters JSON
    escapes (``"``, ``\\``, tab, newline, return: two bytes each) would take more than its
    base64 is kept base64 instead, so no value takes more than 4/3 of its bytes."""
    out = {}
    for name, a in wire.items():
        text = a.get("StringValue")
        if text is not None:
            escaped = sum(map(text.count, _JSON_ESCAPED))
            if escaped:
                size = len(text.encode("utf-8"))
                if size + escaped > 4 * -(-size // 3):
                    a = {"DataType": a["DataType"], _BASE64_STRING: base64.b64encode(text.encode("utf-8")).decode()}
        out[name] = a
    return out


def _opened(wire: Any) -> Any:
    """Attributes as an envelope keeps them, in wire form again (``StringValue`` text)."""
    if not isinstance(wire, dict) or not any(isinstance(a, dict) and _BASE64_STRING in a for a in wire.values()):
        return wire
    out = {}
    for name, a in wire.items():
        if isinstance(a, dict) and _BASE64_STRING in a:
            a = {"DataType": a["DataType"], "StringValue": base64.b64decode(a[_BASE64_STRING]).decode("utf-8")}
        out[name] = a
    return out


def envelope_bytes_max(message_bytes: int) -> int:
    """The most an envelope of a message of ``message_bytes`` (body and attributes, as SQS
    counts them) takes, moved to a dead-letter queue included, its AWSTraceHeader aside:
    base64's 4/3 (a binary value, or a String value escaped more) plus
    :data:`ENVELOPE_FIXED_BYTES_MAX`."""
    return 4 * -(-message_bytes // 3) + ENVELOPE_FIXED_BYTES_MAX


def unwrap(job_body: bytes) -> tuple[bytes, dict[str, Any]]:
    """A job body's message body and what rode with it: ``{"a": message attributes, "s":
    system attributes, "d": dedup id, "g": a standard queue's MessageGroupId, "q": the
    dead-letter source ARN, "m": the MessageId it had before a move, "t": sent (ms)}`` (the
    keys present), binary values base64. A
    body without an envelope comes back unchanged, with ``{}``. For shardq workers that
    consume what SQS producers send."""
    if not job_body.startswith(MAGIC):
        return job_body, {}
    end = job_body.find(b"\n", len(MAGIC))
    try:
        head = json.loads(job_body[len(MAGIC):end]) if end > 0 else None
    except ValueError:
        head = None
    if not isinstance(head, dict):
        return job_body, {}  # not one of ours after all: shown as it is
    for part in ("a", "s"):
        if part in head:
            head[part] = _opened(head[part])
    return job_body[end + 1:], head


def from_wire(attrs: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, a in attrs.items():
        if "BinaryValue" in a:
            out[name] = {"DataType": a["DataType"], "BinaryValue": base64.b64decode(a["BinaryValue"])}
        else:
            out[name] = {"DataType": a["DataType"], "StringValue": a["StringValue"]}
    return out


def presented(job_body: bytes) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]], bytes]:
    """(message body, envelope head, message attributes, the body's UTF-8 bytes: what
    MD5OfBody hashes, held already) of a job, as a receive shows it."""
    if not job_body.startswith(MAGIC):  # a bare body (the usual message): no envelope to read
        data: bytes = job_body
        head: dict[str, Any] = {}
        attrs: dict[str, dict[str, Any]] = {}
    else:
        data, head = unwrap(job_body)
        attrs = from_wire(head.get("a", {}))
    try:
        text = data.decode("utf-8")
        if _BAD_CHARS.search(text) is None:
            return text, head, attrs, data
    except UnicodeDecodeError:
        pass
    attrs = dict(attrs)
    attrs[BODY_ENCODING_ATTRIBUTE] = {"DataType": "String", "StringValue": "base64"}
    shown = base64.b64encode(data)
    return shown.decode(), head, attrs, shown


def message_id(service_id: str, job_id: int) -> str:
    """A stable UUID per job (``uuid5(NAMESPACE_URL, "shardq:<service>:<job id>")``): a
    duplicate send answers the first send's id."""
    return message_ids(service_id)(job_id)


def message_ids(service_id: str) -> Callable[[int], str]:
    """:func:`message_id` of one service, as ``message_id(job_id)``: the hash of the prefix
    made once (a receive makes ten), each id formatted from the hex digest (0.9 us an id
    against 1.35 through the digest's bytes, timeit)."""
    prefix = _sha1(_URL_NAMESPACE + f"shardq:{service_id}:".encode())  # uuid5's hash

    def message_id(job_id: int) -> str:
        h = prefix.copy()
        h.update(b"%d" % job_id)
        x = h.hexdigest()
        # version 5 in the 13th digit; the RFC 4122 variant (10xx) in the 17th
        return f"{x[:8]}-{x[8:12]}-5{x[13:16]}-{_VARIANT[x[16]]}{x[17:20]}-{x[20:32]}"
    return message_id


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}
_URL_NAMESPACE = uuid.NAMESPACE_URL.bytes


def sequence_number(job_id: int) -> str:
    """SQS's 20-or-more-digit SequenceNumber: the job id, which grows within a shard, so
    within a key (a message group)."""
    return f"{job_id:020d}"
