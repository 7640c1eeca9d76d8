"""Queue attributes: AWS's names, defaults, ranges and rules, checked without I/O.

Values are kept as AWS returns them (strings). What shardq cannot honour is refused with
the reason, never stored and ignored: ``Policy`` (one principal: the configured key; see
docs/sqs-api.md), KMS encryption (``KmsMasterKeyId``, ``SqsManagedSseEnabled = true``)."""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from .. import limits
from .faults import fault

# name -> (default for a new queue, lowest, highest) of the integer attributes
INTEGERS: dict[str, tuple[int, int, int]] = {
    "DelaySeconds": (0, 0, limits.SQS_API_DELAY_S_MAX),
    "MaximumMessageSize": (limits.SQS_MESSAGE_BYTES_MAX, limits.SQS_MESSAGE_BYTES_MIN, limits.SQS_MESSAGE_BYTES_MAX),
    "MessageRetentionPeriod": (345600, 60, limits.SQS_RETENTION_S_MAX),
    "ReceiveMessageWaitTimeSeconds": (0, 0, limits.SQS_WAIT_S_MAX),
    "VisibilityTimeout": (30, 0, limits.SQS_VISIBILITY_S_MAX),
    "KmsDataKeyReusePeriodSeconds": (300, 60, 86400),
}
FIFO_ONLY = ("ContentBasedDeduplication", "DeduplicationScope", "FifoThroughputLimit")
SETTABLE = (*INTEGERS, "RedrivePolicy", "RedriveAllowPolicy", "Policy", "KmsMasterKeyId", "SqsManagedSseEnabled",
            *FIFO_ONLY)
READ_ONLY = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
             "ApproximateNumberOfMessagesDelayed", "CreatedTimestamp", "LastModifiedTimestamp", "QueueArn")
ALL_NAMES = frozenset((*SETTABLE, *READ_ONLY, "FifoQueue", "All"))
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,80}\Z")
_ARN = re.compile(r"arn:aws:sqs:([a-z0-9-]+):([0-9]{12}):([A-Za-z0-9_.-]{1,80})\Z")


def check_queue_name(name: Any) -> str:
    base = name[:-5] if isinstance(name, str) and name.endswith(".fifo") else name
    if not isinstance(name, str) or len(name) > limits.SQS_QUEUE_NAME_CHARS_MAX or not _QUEUE_NAME.match(base or "-!"):
        raise fault("InvalidParameterValue", "Can only include alphanumeric characters, hyphens, or underscores. "
                                             "1 to 80 in length")
    return name


def defaults(fifo: bool) -> dict[str, str]:
    out = {k: str(v[0]) for k, v in INTEGERS.items() if k != "KmsDataKeyReusePeriodSeconds"}
    out["SqsManagedSseEnabled"] = "false"
    if fifo:
        out.update(FifoQueue="true", ContentBasedDeduplication="false", DeduplicationScope="queue",
                   FifoThroughputLimit="perQueue")
    return out


def parse_arn(arn: Any) -> tuple[str, str, str] | None:
    """(region, account, queue name) of an SQS queue ARN; None if it is not one."""
    m = _ARN.match(arn) if isinstance(arn, str) else None
    return (m.group(1), m.group(2), m.group(3)) if m else None


def _bad(name: str, why: str) -> Exception:
    return fault("InvalidAttributeValue", f"Invalid value for the parameter {name}. Reason: {why}")


def check(given: Any, fifo: bool, *, creating: bool) -> dict[str, str]:
    """The attributes of a CreateQueue or SetQueueAttributes, each checked alone (the
    redrive target's existence is the caller's): InvalidAttributeName for a name that is
    not one, or not one for this kind of queue; InvalidAttributeValue for a bad value."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise fault("InvalidParameterValue", "Attributes must be a map of attribute names to strings")
    out: dict[str, str] = {}
    for name, value in given.items():
        if name == "FifoQueue":
            if not creating:
                raise fault("InvalidAttributeName", f"Unknown Attribute {name}.")
            if str(value).lower() != ("true" if fifo else "false"):
                raise _bad(name, "a FIFO queue's name ends in .fifo, and it has FifoQueue = true")
            if fifo:
                out[name] = "true"
            continue
        if name not in SETTABLE or (name in FIFO_ONLY and not fifo):
            raise fault("InvalidAttributeName", f"Unknown Attribute {name}.")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _bad(name, "expected a string")
        text = str(value)
        if name in INTEGERS:
            _, lo, hi = INTEGERS[name]
            if not re.fullmatch(r"-?[0-9]{1,12}", text) or not lo <= int(text) <= hi:
                raise _bad(name, f"must be an integer from {lo} to {hi}.")
            out[name] = str(int(text))
        elif name in ("ContentBasedDeduplication", "SqsManagedSseEnabled"):
            if text.lower() not in ("true", "false"):
                raise _bad(name, "must be true or false.")
            if name == "SqsManagedSseEnabled" and text.lower() == "true":
                raise _bad(name, "shardq does not encrypt messages at rest (docs/sqs-api.md).")
            out[name] = text.lower()
        elif name == "DeduplicationScope":
            if text not in ("messageGroup", "queue"):
                raise _bad(name, "must be messageGroup or queue.")
            out[name] = text
        elif name == "FifoThroughputLimit":
            if text not in ("perQueue", "perMessageGroupId"):
                raise _bad(name, "must be perQueue or perMessageGroupId.")
            out[name] = text
        elif name == "RedrivePolicy":
            out[name] = _redrive_policy(text)
        elif name == "RedriveAllowPolicy":
            out[name] = _redrive_allow_policy(text)
        elif name == "Policy":
            if text:
                raise _bad(name, "shardq has one principal, the configured key, and enforces no access policy "
                                 "(docs/sqs-api.md).")
            out[name] = ""
        elif name == "KmsMasterKeyId":
            if text:
                raise _bad(name, "shardq does not encrypt messages at rest (docs/sqs-api.md).")
            out[name] = ""
    return out


def check_together(attrs: dict[str, str], given: dict[str, str]) -> None:
    """The rule between two attributes, on a queue's attributes as a CreateQueue or
    SetQueueAttributes would leave them (``attrs``), when ``given`` names either: "The
    perMessageGroupId value is allowed only when the value for DeduplicationScope is
    messageGroup" (AWS's API reference; DeduplicationScope is queue unless set). A queue
    that holds the pair already (made before this rule) keeps it until one is changed."""
    if "FifoThroughputLimit" not in given and "DeduplicationScope" not in given:
        return
    if attrs.get("FifoThroughputLimit") == "perMessageGroupId" and attrs.get("DeduplicationScope") != "messageGroup":
        raise _bad("FifoThroughputLimit", "The perMessageGroupId value is allowed only when the value for "
                                          "DeduplicationScope is messageGroup.")


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise _bad(name, "must be a JSON object.")
    return obj


def _redrive_policy(text: str) -> str:
    if text == "":
        return ""  # removes it
    obj = _json_object("RedrivePolicy", text)
    unknown = set(obj) - {"deadLetterTargetArn", "maxReceiveCount"}
    if unknown:
        raise _bad("RedrivePolicy", f"Redrive policy has unknown keys {sorted(unknown)}.")
    if parse_arn(obj.get("deadLetterTargetArn")) is None:
        raise _bad("RedrivePolicy", "Dead-letter target ARN is missing or not a queue ARN.")
    try:
        count = int(obj["maxReceiveCount"])  # AWS takes "5" and 5
    except (KeyError, TypeError, ValueError):
        count = 0
    if isinstance(obj.get("maxReceiveCount"), bool) or not 1 <= count <= limits.SQS_MAX_RECEIVE_COUNT_MAX:
        raise _bad("RedrivePolicy", f"Value {obj.get('maxReceiveCount')} for parameter MaxReceiveCount is invalid. "
                                    f"Reason: must be an integer from 1 to {limits.SQS_MAX_RECEIVE_COUNT_MAX}.")
    return json.dumps({"deadLetterTargetArn": obj["deadLetterTargetArn"], "maxReceiveCount": count},
                      separators=(",", ":"))


def _redrive_allow_policy(text: str) -> str:
    if text == "":
        return ""
    obj = _json_object("RedriveAllowPolicy", text)
    perm = obj.get("redrivePermission")
    arns = obj.get("sourceQueueArns")
    if perm not in ("allowAll", "denyAll", "byQueue"):
        raise _bad("RedriveAllowPolicy", "redrivePermission must be allowAll, denyAll or byQueue.")
    if perm == "byQueue":
        if (not isinstance(arns, list) or not 1 <= len(arns) <= 10
                or not all(parse_arn(a) is not None for a in arns)):
            raise _bad("RedriveAllowPolicy", "byQueue needs sourceQueueArns: 1 to 10 queue ARNs.")
    elif arns is not None:
        raise _bad("RedriveAllowPolicy", "sourceQueueArns is allowed with byQueue only.")
    return json.dumps(obj, separators=(",", ":"))


def redrive(attrs: dict[str, str]) -> tuple[str, int] | None:
    """(dead-letter queue name, maxReceiveCount) of a queue with a redrive policy."""
    text = attrs.get("RedrivePolicy")
    return _redrive_of(text) if text else None


@functools.lru_cache(maxsize=1024)
def _redrive_of(text: str) -> tuple[str, int] | None:  # read on every receive: parsed once
    obj = json.loads(text)
    arn = parse_arn(obj["deadLetterTargetArn"])
    return (arn[2], int(obj["maxReceiveCount"])) if arn else None


def redrive_target(attrs: dict[str, str]) -> str | None:
    """The deadLetterTargetArn of a queue's redrive policy, if it has one."""
    text = attrs.get("RedrivePolicy")
    return str(json.loads(text)["deadLetterTargetArn"]) if text else None


def allows_source(dlq_attrs: dict[str, str], source_arn: str) -> bool:
    """Whether the DLQ's RedriveAllowPolicy lets ``source_arn`` name it (default: all)."""
    text = dlq_attrs.get("RedriveAllowPolicy")
    if not text:
        return True
    obj = json.loads(text)
    perm = obj["redrivePermission"]
    return perm == "allowAll" or (perm == "byQueue" and source_arn in obj.get("sourceQueueArns", []))
