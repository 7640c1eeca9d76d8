"""How shardq's names, ids and bodies map onto SQS FIFO, and SQS's errors back onto shardq's.

Pure functions, no I/O. One place for every rule the SQS backend relies on:

* target ``sqs://<region>/<prefix>[?endpoint=URL]``;
* queue ``Q`` -> FIFO queue ``<prefix>-Q.fifo``, its dead-letter queue ``<prefix>-Q_dlq.fifo``
  (queue names on SQS are letters, digits and ``-``, so a DLQ name never equals a queue's);
* key -> ``MessageGroupId`` (the key itself when SQS allows it, else a SHA-256 of it; a
  keyless job gets a group of its own, so keyless jobs have no order and full parallelism);
* ``dedup_id`` -> ``MessageDeduplicationId`` hashed with the key, so its scope is
  (queue, key) as on the local shards; no ``dedup_id`` -> a fresh one per call, which
  still makes the SDK's own retries of one request safe;
* body -> ``MessageBody`` when it is text SQS accepts, else a ``Binary`` attribute; the key
  rides in an attribute. Sizes are counted as SQS counts them: body plus each attribute's
  name, type and value;
* a redriven (or buried) copy keeps its job id in its ``MessageDeduplicationId``
  (``r<job id>.<nonce>.<mac>``), a system attribute that counts towards no size limit, so a
  job at the size limit can still be redriven. The mac is an HMAC-SHA256, under the queue's
  redrive key (a tag on its dead-letter queue, written by ``shardq sqs init``), of the job
  id, the nonce, the group, the key and the body: anyone may send a message, but only a
  holder of the key can make one carry an existing job id;
* :func:`decode` trusts nothing it receives: a message shardq did not write (attributes
  missing, of the wrong type or not UTF-8, a group that does not match the key, a dedup id
  of no form shardq makes, a redrive id whose mac does not verify, a body over the queue's
  limit) decodes to :class:`Foreign`, with the reason, never to an exception.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from .. import limits
from ..errors import (AuthError, InvalidConfig, InvalidJob, LeaseLost, QueueFull, ShardqError,
                      ShardUnavailable, UnknownQueue)
from ..protocol import validate

BACKEND = "sqs"
ATTR_KEY = "shardq.key"      # Binary: the key, UTF-8
ATTR_BODY = "shardq.body"    # Binary: the body, when it is not text SQS accepts
ATTR_ERROR = "shardq.error"  # String: a buried job's error (in the dead-letter queue)
BINARY_BODY_MARK = "b"       # MessageBody of a message whose body is in ATTR_BODY
DLQ_SUFFIX = "_dlq.fifo"

# Every pattern is used with fullmatch: with match, "$" also matches before a final "\n",
# so "abc\n" passed for a safe group ("kabc\n", which SQS refuses) or a queue name.
_QUEUE_PART = re.compile(r"^[A-Za-z0-9-]+$")
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+$")
_GROUP_SAFE = re.compile(r"^[\x21-\x7e]+$")  # what SQS allows in MessageGroupId
# Characters SQS accepts in a message body (the XML 1.0 character range).
_NOT_SQS_TEXT = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True)
class Target:
    region: str
    prefix: str
    endpoint: str | None = None

    def url(self) -> str:
        tail = f"?endpoint={self.endpoint}" if self.endpoint else ""
        return f"sqs://{self.region}/{self.prefix}{tail}"


def parse_target(target: str) -> Target:
    """``sqs://<region>/<prefix>[?endpoint=http://127.0.0.1:PORT]`` -> :class:`Target`."""
    try:
        parts = urlsplit(target)
    except (TypeError, ValueError):  # not a string; "sqs://[x/p" (an unclosed IPv6 literal)
        raise InvalidConfig(f"{target!r:.200}: expected sqs://<region>/<queue-name-prefix>") from None
    if parts.scheme != "sqs" or not parts.netloc:
        raise InvalidConfig(f"{target!r}: expected sqs://<region>/<queue-name-prefix>")
    prefix = parts.path.strip("/")
    if not prefix or not _PREFIX.fullmatch(prefix) or len(prefix) > 40:
        raise InvalidConfig(f"{target!r}: the prefix must be 1-40 letters, digits, '-' or '_'")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"endpoint"}
    if unknown:
        raise InvalidConfig(f"{target!r}: unknown option {sorted(unknown)[0]!r} (known: endpoint)")
    endpoint = query.get("endpoint", [None])[-1] or None
    try:
        scheme = urlsplit(endpoint).scheme if endpoint is not None else "http"
    except ValueError:
        scheme = ""
    if scheme not in ("http", "https"):
        raise InvalidConfig(f"{target!r}: endpoint must be an http(s) URL")
    return Target(parts.netloc, prefix, endpoint)


def queue_names(prefix: str, queue: object) -> tuple[str, str]:
    """(FIFO queue name, its dead-letter queue's name) of shardq queue ``queue``."""
    if not isinstance(queue, str) or not _QUEUE_PART.fullmatch(queue):
        raise InvalidJob(f"queue {queue!r}: on the sqs backend a queue name is letters, digits and '-'")
    dlq = f"{prefix}-{queue}{DLQ_SUFFIX}"
    if len(dlq) > limits.SQS_QUEUE_NAME_CHARS_MAX:
        raise InvalidJob(f"queue {queue!r}: {dlq!r} is over SQS's {limits.SQS_QUEUE_NAME_CHARS_MAX} "
                         "characters; use a shorter queue name or prefix")
    return f"{prefix}-{queue}.fifo", dlq


def shardq_queue(prefix: str, sqs_name: str) -> str | None:
    """The shardq queue a FIFO queue name holds, or None (a DLQ, or not ours)."""
    head = prefix + "-"
    if not sqs_name.startswith(head) or not sqs_name.endswith(".fifo") or sqs_name.endswith(DLQ_SUFFIX):
        return None
    return sqs_name[len(head):-len(".fifo")]


def _utf8(value: str, what: str) -> bytes:
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise InvalidJob(f"{what} is not valid text (it holds a lone surrogate)") from None


def group_id(key: str | None) -> str:
    """The MessageGroupId of ``key``: always what SQS accepts (1-128 characters of
    ``[\\x21-\\x7e]``). InvalidJob for a key that is not valid text."""
    if key is None:
        return "u" + uuid.uuid4().hex
    if len(key) < limits.SQS_GROUP_ID_CHARS_MAX and _GROUP_SAFE.fullmatch(key):
        return "k" + key
    return "h" + hashlib.sha256(_utf8(key, "key")).hexdigest()


def dedup_id(key: str | None, dedup: str | bytes | None) -> str:
    """The MessageDeduplicationId of a job: always what SQS accepts. InvalidJob for a key
    or dedup id that is not valid text."""
    if dedup is None:
        return "n" + uuid.uuid4().hex
    raw = dedup if isinstance(dedup, bytes) else _utf8(dedup, "dedup_id")
    scope = b"\x00" if key is None else b"\x01" + _utf8(key, "key")
    return "d" + hashlib.sha256(scope + b"\x00" + raw).hexdigest()


REDRIVE_KEY_TAG = "shardq.redrive-key"  # tag on the dead-letter queue: 64 hex digits
REDRIVE_KEY_BYTES = 32
REDRIVE_NONCE_CHARS = 16   # hex of SHA-256 of the dead letter's message id: one per dead letter
REDRIVE_MAC_CHARS = 32     # hex: a 128-bit HMAC-SHA256 tag
# r + id + . + nonce + . + mac <= SQS's 128 characters of MessageDeduplicationId
REDRIVE_JOB_ID_CHARS_MAX = limits.SQS_DEDUP_ID_CHARS_MAX - 3 - REDRIVE_NONCE_CHARS - REDRIVE_MAC_CHARS
FOREIGN_MARK = "f"         # dedup id prefix of a foreign message moved to the dead letters
_HEX = "0123456789abcdef"
_PLAIN_DEDUP = re.compile(r"^(n[0-9a-f]{32}|d[0-9a-f]{64})$")
_DEAD_DEDUP = re.compile(r"^f[0-9a-f]{64}$")
_KEYLESS_GROUP = re.compile(r"^u[0-9a-f]{32}$")
_REDRIVE = re.compile(rf"^r([\x21-\x2d\x2f-\x7e]{{1,{REDRIVE_JOB_ID_CHARS_MAX}}})\.([0-9a-f]{{{REDRIVE_NONCE_CHARS}}})"
                      rf"\.([0-9a-f]{{{REDRIVE_MAC_CHARS}}})$")


def parse_redrive_key(value: object) -> bytes | None:
    """The redrive key from its tag value, or None when it is missing or malformed."""
    if not isinstance(value, str) or len(value) != 2 * REDRIVE_KEY_BYTES or value.strip(_HEX):
        return None
    return bytes.fromhex(value)


def _redrive_mac(secret: bytes, job_id: str, nonce: str, group: str, key: str | None, body: bytes) -> str:
    mac = hmac.new(secret, b"shardq-redrive-v1", hashlib.sha256)
    # Each field is length-prefixed, so no two field lists give the same input.
    for field in (job_id.encode(), nonce.encode(), group.encode(),
                  b"\x00" if key is None else b"\x01" + key.encode(), body):
        mac.update(len(field).to_bytes(8, "big") + field)
    return mac.hexdigest()[:REDRIVE_MAC_CHARS]


def redrive_dedup_id(secret: bytes, job_id: str, dead_message_id: str, group: str, key: str | None,
                     body: bytes) -> str:
    """A redriven (or buried) copy's dedup id: it carries the job id, made unforgeable by a
    mac under the queue's redrive key over everything the copy carries, and a retried redrive
    within 5 minutes (same dead letter, so the same nonce) adds nothing."""
    if len(job_id) > REDRIVE_JOB_ID_CHARS_MAX or not _GROUP_SAFE.fullmatch(job_id) or "." in job_id:
        raise InvalidJob(f"job id {job_id!r} cannot be carried by a redriven copy")
    nonce = hashlib.sha256(dead_message_id.encode()).hexdigest()[:REDRIVE_NONCE_CHARS]
    return f"r{job_id}.{nonce}.{_redrive_mac(secret, job_id, nonce, group, key, body)}"


def foreign_dedup_id(message_id: str) -> str:
    """The dedup id of a foreign message's copy in the dead letters: one per message, so a
    move retried within 5 minutes adds nothing."""
    return FOREIGN_MARK + hashlib.sha256(message_id.encode()).hexdigest()


@dataclass(frozen=True)
class Outgoing:
    """One message ready for SendMessage(Batch), with its size as SQS counts it."""

    body: str
    attributes: dict[str, Any]
    group: str
    dedup: str
    size: int

    def entry(self) -> dict[str, Any]:
        e: dict[str, Any] = {"MessageBody": self.body, "MessageGroupId": self.group,
                             "MessageDeduplicationId": self.dedup}
        if self.attributes:
            e["MessageAttributes"] = self.attributes
        return e


def _attr_size(name: str, attr: dict[str, Any]) -> int:
    value = attr.get("BinaryValue")
    if value is None:
        value = attr["StringValue"].encode()
    return len(name.encode()) + len(attr["DataType"].encode()) + len(value)


def encode(body: bytes, key: str | None, dedup: str | bytes | None, *, group: str | None = None,
           error: str | None = None) -> Outgoing:
    """The SQS form of one job (``group`` and a ready ``dedup`` given for a redriven or
    buried copy; ``error`` kept with a buried copy). Everything in it is what SQS accepts:
    InvalidJob for a key or dedup id that is not valid text; characters SQS refuses in a
    String attribute (NUL, a lone surrogate) in ``error`` become U+FFFD, since a bury must
    not fail over the text of the error that caused it."""
    attrs: dict[str, Any] = {}
    if error:
        attrs[ATTR_ERROR] = {"DataType": "String", "StringValue": _NOT_SQS_TEXT.sub("\ufffd", error)}
    text: str | None
    try:
        text = body.decode("utf-8")
        if _NOT_SQS_TEXT.search(text):
            text = None
    except UnicodeDecodeError:
        text = None
    if text is None:
        text = BINARY_BODY_MARK
        attrs[ATTR_BODY] = {"DataType": "Binary", "BinaryValue": body}
    if key is not None:
        attrs[ATTR_KEY] = {"DataType": "Binary", "BinaryValue": _utf8(key, "key")}
    size = len(text.encode()) + sum(_attr_size(n, a) for n, a in attrs.items())
    if group is None:
        group, dedup = group_id(key), dedup_id(key, dedup)
    elif not isinstance(dedup, str):  # a copy's caller made its dedup id (redrive_dedup_id, foreign_dedup_id)
        raise TypeError(f"a copy's dedup id is made by its caller, not {dedup!r}")
    return Outgoing(text, attrs, group, dedup, size)


@dataclass(frozen=True)
class Incoming:
    """One received message, decoded."""

    job_id: str
    message_id: str
    key: str | None
    body: bytes
    attempt: int
    group: str
    receipt: str
    error: str | None = None


@dataclass(frozen=True)
class Foreign:
    """A received message shardq did not write, and why it is not shardq's."""

    message_id: str
    receipt: str
    group: str
    text: str            # the MessageBody as received
    attributes: dict[str, Any]  # the message attributes as received
    attempt: int
    reason: str
    error: str | None = None  # a String ``shardq.error`` it carries (a moved one's reason)


def _binary(attrs: dict[str, Any], name: str) -> bytes | None:
    attr = attrs.get(name)
    if attr is None:
        return None
    value = attr.get("BinaryValue") if isinstance(attr, dict) and attr.get("DataType") == "Binary" else None
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidJob(f"attribute {name} is not of type Binary")
    return bytes(value)


def decode(msg: dict[str, Any], secret: Callable[[], bytes | None], max_body_bytes: int, *,
           dead: bool = False) -> Incoming | Foreign:
    """A received message as shardq wrote it, or :class:`Foreign` with the reason; never
    raises for what a sender put in the message. ``secret`` returns the queue's redrive
    key (asked for only when a redrive id is to be checked); ``dead``: the message is in
    the dead-letter queue, where buried copies and moved foreign messages also live."""
    sys_attrs = msg.get("Attributes") or {}
    attrs = msg.get("MessageAttributes") or {}
    text = msg.get("Body") or ""
    group = sys_attrs.get("MessageGroupId") or ""
    try:
        attempt = max(1, int(sys_attrs.get("ApproximateReceiveCount", 1)))
    except (TypeError, ValueError):
        attempt = 1
    error_attr = attrs.get(ATTR_ERROR)
    error = error_attr.get("StringValue") if isinstance(error_attr, dict) and \
        error_attr.get("DataType") == "String" else None
    try:
        known = {ATTR_KEY, ATTR_BODY} | ({ATTR_ERROR} if dead else set())
        unknown = sorted(set(attrs) - known)
        if unknown:
            raise InvalidJob(f"attribute {unknown[0]!r} is not one shardq writes")
        if error_attr is not None and error is None:
            raise InvalidJob(f"attribute {ATTR_ERROR} is not of type String")
        raw_key = _binary(attrs, ATTR_KEY)
        try:
            key = validate.key(None if raw_key is None else raw_key.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidJob(f"attribute {ATTR_KEY} is not UTF-8") from None
        body = _binary(attrs, ATTR_BODY)
        if body is not None and text != BINARY_BODY_MARK:
            raise InvalidJob(f"attribute {ATTR_BODY} is set but the message body is text")
        if body is None:
            try:
                body = text.encode()
            except UnicodeEncodeError:  # a lone surrogate: no text SQS sends, nor a body shardq wrote
                raise InvalidJob("the message body is not valid text") from None
        if not body:
            raise InvalidJob("the body is empty")
        if len(body) > max_body_bytes:
            raise InvalidJob(f"the body is {len(body)} bytes, over the queue's limit of {max_body_bytes}")
        if key is None and not _KEYLESS_GROUP.fullmatch(group):
            raise InvalidJob(f"message group {group!r} is not a keyless job's and no {ATTR_KEY} is set")
        if key is not None and group != group_id(key):
            raise InvalidJob(f"message group {group!r} does not match its {ATTR_KEY} attribute")
        job_id = _job_id(msg["MessageId"], sys_attrs.get("MessageDeduplicationId"), secret, group, key,
                         body, dead)
    except InvalidJob as e:
        return Foreign(msg["MessageId"], msg["ReceiptHandle"], group, text, dict(attrs), attempt, str(e), error)
    return Incoming(job_id, msg["MessageId"], key, body, attempt, group, msg["ReceiptHandle"], error)


def _job_id(message_id: str, dedup: object, secret: Callable[[], bytes | None], group: str, key: str | None,
            body: bytes, dead: bool) -> str:
    """The job id a message's dedup id gives it: its own message id, or, for a redriven or
    buried copy whose mac verifies, the id it carries."""
    if not isinstance(dedup, str):
        raise InvalidJob("it has no MessageDeduplicationId")
    if _PLAIN_DEDUP.fullmatch(dedup) or (dead and _DEAD_DEDUP.fullmatch(dedup)):
        return message_id
    m = _REDRIVE.fullmatch(dedup)
    if m is None:
        raise InvalidJob(f"dedup id {dedup[:40]!r} is of no form shardq writes")
    job_id, nonce, mac = m.groups()
    key_bytes = secret()
    if key_bytes is None:
        raise InvalidJob(f"its redrive id cannot be checked: the queue has no {REDRIVE_KEY_TAG} tag "
                         "(run `shardq sqs init` again)")
    if not hmac.compare_digest(mac, _redrive_mac(key_bytes, job_id, nonce, group, key, body)):
        raise InvalidJob("its redrive id does not verify (not made by shardq with this queue's key)")
    return job_id


# ---------------------------------------------------------------------------- errors
_LEASE_CODES = {"ReceiptHandleIsInvalid", "InvalidReceiptHandle", "MessageNotInflight",
                "AWS.SimpleQueueService.MessageNotInflight", "ReceiptHandleIsInvalidException"}
_THROTTLE_CODES = {"Throttling", "ThrottlingException", "RequestThrottled", "RequestThrottledException",
                   "SlowDown", "TooManyRequestsException", "KmsThrottled", "KMS.ThrottlingException"}
_QUEUE_CODES = {"QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExistException"}
_AUTH_CODES = {"AccessDenied", "AccessDeniedException", "InvalidClientTokenId", "SignatureDoesNotMatch",
               "UnrecognizedClientException", "ExpiredToken", "InvalidSecurity", "MissingAuthenticationToken"}
_SERVER_CODES = {"InternalError", "InternalFailure", "ServiceUnavailable", "RequestTimeout"}
THROTTLE_CODES = frozenset(_THROTTLE_CODES)


def is_retriable(code: str) -> bool:
    return code in _THROTTLE_CODES or code in _SERVER_CODES


def error_for(code: str, message: str, status: int | None = None, what: str = "") -> ShardqError:
    """The shardq error for an SQS error code (per request, or per batch entry)."""
    where = f"{what}: " if what else ""
    text = f"{where}SQS {code}: {message}"
    if code in _LEASE_CODES or ("receipt handle" in message.lower() and "expired" in message.lower()):
        return LeaseLost(text)
    if code in _THROTTLE_CODES or code in _SERVER_CODES or (status or 0) >= 500:
        return ShardUnavailable(text)
    if code in _QUEUE_CODES:
        return UnknownQueue(f"{where}the SQS queue does not exist; create it with `shardq sqs init` ({code})")
    if code == "OverLimit":
        return QueueFull(text)
    if code in _AUTH_CODES or status in (401, 403):  # (an error body the SDK could not read leaves the status)
        return AuthError(text)
    if code.startswith("Invalid") or code.startswith("Missing") or code in ("BatchRequestTooLong",
                                                                           "MessageTooLong"):
        return InvalidJob(text)
    return ShardqError(text)
