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
* a redriven copy keeps its job id in its ``MessageDeduplicationId`` (``r<job id>.<hash>``),
  a system attribute that counts towards no size limit, so a job at the size limit can
  still be redriven.
"""
from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from .. import limits
from ..errors import (AuthError, InvalidConfig, InvalidJob, LeaseLost, QueueFull, ShardqError,
                      ShardUnavailable, UnknownQueue)

BACKEND = "sqs"
ATTR_KEY = "shardq.key"      # Binary: the key, UTF-8
ATTR_BODY = "shardq.body"    # Binary: the body, when it is not text SQS accepts
ATTR_ERROR = "shardq.error"  # String: a buried job's error (in the dead-letter queue)
BINARY_BODY_MARK = "b"       # MessageBody of a message whose body is in ATTR_BODY
DLQ_SUFFIX = "_dlq.fifo"

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
    parts = urlsplit(target)
    if parts.scheme != "sqs" or not parts.netloc:
        raise InvalidConfig(f"{target!r}: expected sqs://<region>/<queue-name-prefix>")
    prefix = parts.path.strip("/")
    if not prefix or not _PREFIX.match(prefix) or len(prefix) > 40:
        raise InvalidConfig(f"{target!r}: the prefix must be 1-40 letters, digits, '-' or '_'")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"endpoint"}
    if unknown:
        raise InvalidConfig(f"{target!r}: unknown option {sorted(unknown)[0]!r} (known: endpoint)")
    endpoint = query.get("endpoint", [None])[-1] or None
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
        raise InvalidConfig(f"{target!r}: endpoint must be an http(s) URL")
    return Target(parts.netloc, prefix, endpoint)


def queue_names(prefix: str, queue) -> tuple[str, str]:
    """(FIFO queue name, its dead-letter queue's name) of shardq queue ``queue``."""
    if not isinstance(queue, str) or not _QUEUE_PART.match(queue):
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


def group_id(key: str | None) -> str:
    if key is None:
        return "u" + uuid.uuid4().hex
    if len(key) < limits.SQS_GROUP_ID_CHARS_MAX and _GROUP_SAFE.match(key):
        return "k" + key
    return "h" + hashlib.sha256(key.encode()).hexdigest()


def dedup_id(key: str | None, dedup: str | bytes | None) -> str:
    if dedup is None:
        return "n" + uuid.uuid4().hex
    raw = dedup if isinstance(dedup, bytes) else dedup.encode()
    scope = b"\x00" if key is None else b"\x01" + key.encode()
    return "d" + hashlib.sha256(scope + b"\x00" + raw).hexdigest()


REDRIVE_JOB_ID_CHARS_MAX = 80  # r + id + . + 40 hex <= SQS's 128


def redrive_dedup_id(job_id: str, dead_message_id: str) -> str:
    """A redriven copy's dedup id: it carries the job id, and a retried redrive within 5
    minutes (same dead letter) adds nothing."""
    if len(job_id) > REDRIVE_JOB_ID_CHARS_MAX or not _GROUP_SAFE.match(job_id) or "." in job_id:
        raise InvalidJob(f"job id {job_id!r} cannot be carried by a redriven copy")
    return f"r{job_id}." + hashlib.sha256(dead_message_id.encode()).hexdigest()[:40]


def job_id_of(message_id: str, dedup: str | None) -> str:
    """A message's job id: its own id, or the one its redrive dedup id carries."""
    if dedup and dedup.startswith("r") and "." in dedup:
        return dedup[1:dedup.index(".")]
    return message_id


@dataclass(frozen=True)
class Outgoing:
    """One message ready for SendMessage(Batch), with its size as SQS counts it."""

    body: str
    attributes: dict
    group: str
    dedup: str
    size: int

    def entry(self) -> dict:
        e = {"MessageBody": self.body, "MessageGroupId": self.group, "MessageDeduplicationId": self.dedup}
        if self.attributes:
            e["MessageAttributes"] = self.attributes
        return e


def _attr_size(name: str, attr: dict) -> int:
    value = attr.get("BinaryValue")
    if value is None:
        value = attr["StringValue"].encode()
    return len(name.encode()) + len(attr["DataType"].encode()) + len(value)


def encode(body: bytes, key: str | None, dedup: str | bytes | None, *, group: str | None = None,
           error: str | None = None) -> Outgoing:
    """The SQS form of one job (``group`` and a ready ``dedup`` given for a redriven or
    buried copy; ``error`` kept with a buried copy)."""
    attrs: dict = {}
    if error:
        attrs[ATTR_ERROR] = {"DataType": "String", "StringValue": error}
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
        attrs[ATTR_KEY] = {"DataType": "Binary", "BinaryValue": key.encode()}
    size = len(text.encode()) + sum(_attr_size(n, a) for n, a in attrs.items())
    return Outgoing(text, attrs, group or group_id(key), dedup_id(key, dedup) if group is None else dedup,
                    size)


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


def decode(msg: dict) -> Incoming:
    attrs = msg.get("MessageAttributes") or {}
    sys_attrs = msg.get("Attributes") or {}
    body_attr = attrs.get(ATTR_BODY)
    body = bytes(body_attr["BinaryValue"]) if body_attr else msg["Body"].encode()
    key_attr = attrs.get(ATTR_KEY)
    key = bytes(key_attr["BinaryValue"]).decode() if key_attr else None
    error = (attrs.get(ATTR_ERROR) or {}).get("StringValue")
    return Incoming(job_id_of(msg["MessageId"], sys_attrs.get("MessageDeduplicationId")), msg["MessageId"], key, body,
                    int(sys_attrs.get("ApproximateReceiveCount", 1)), sys_attrs.get("MessageGroupId", ""),
                    msg["ReceiptHandle"], error)


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
    if code in _AUTH_CODES:
        return AuthError(text)
    if code.startswith("Invalid") or code.startswith("Missing") or code in ("BatchRequestTooLong",
                                                                           "MessageTooLong"):
        return InvalidJob(text)
    return ShardqError(text)
