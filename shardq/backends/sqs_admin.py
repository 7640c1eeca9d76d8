"""``shardq sqs init``: create or update the FIFO queues of a config, idempotently.

For each queue of the config (``[queues.*]``): a FIFO dead-letter queue, then the FIFO
queue with ``VisibilityTimeout`` = ``visibility_timeout`` (rounded up to whole seconds),
``MaximumMessageSize`` = ``max_body_bytes``, a ``RedrivePolicy`` with ``maxReceiveCount`` =
``max_deliveries``, 14 days retention and explicit dedup ids. The dead-letter queue gets a
tag ``shardq.redrive-key``: 32 random bytes (hex) that sign the job id a redriven or buried
copy carries (:func:`.sqs_mapping.redrive_dedup_id`); an existing key is never changed, so
copies signed with it stay valid. What SQS cannot hold is
refused before anything is created: a setting with ``Unsupported`` or ``InvalidConfig``,
naming the key; a queue name with ``InvalidJob`` (not only letters, digits and ``-``, or
too long with the prefix and the DLQ suffix: :func:`.sqs_mapping.queue_names`).
Running it again changes only what differs, and says what it did.
"""
from __future__ import annotations

import json
import math
import secrets

from .. import limits
from ..config import LIMIT_KEYS, Config, QueueConfig
from ..errors import InvalidConfig, Unsupported, UnknownQueue
from .sqs_client import Api
from .sqs_mapping import REDRIVE_KEY_TAG, parse_redrive_key, queue_names

RETENTION_S = limits.SQS_RETENTION_S_MAX


def queue_attributes(name: str, q: QueueConfig, high_throughput: bool) -> dict[str, str]:
    """The SQS attributes of shardq queue ``name`` (without the RedrivePolicy)."""
    where = f"queues.{name}"
    if not 1 <= q.max_deliveries <= limits.SQS_MAX_RECEIVE_COUNT_MAX:
        raise InvalidConfig(f"{where}.max_deliveries: {q.max_deliveries} is over SQS's maxReceiveCount "
                            f"limit of {limits.SQS_MAX_RECEIVE_COUNT_MAX} (sqs backend)")
    if q.dedup_window != limits.SQS_DEDUP_WINDOW_S:
        raise Unsupported(f"{where}.dedup_window: {q.dedup_window:g} s is not supported by the sqs backend "
                          f"(SQS's deduplication window is fixed at {limits.SQS_DEDUP_WINDOW_S:g} s)")
    if not limits.SQS_MESSAGE_BYTES_MIN <= q.max_body_bytes <= limits.SQS_MESSAGE_BYTES_MAX:
        raise Unsupported(f"{where}.max_body_bytes: {q.max_body_bytes} is not supported by the sqs backend "
                          f"(SQS allows {limits.SQS_MESSAGE_BYTES_MIN}..{limits.SQS_MESSAGE_BYTES_MAX})")
    if q.placed():
        key = next(k for k in LIMIT_KEYS if getattr(q, k) not in (None, False))
        raise Unsupported(f"{where}.{key}: limits (concurrency, rate, burst, group_*, fair) are not supported by "
                          "the sqs backend: SQS has no place that sees every consumer's leases, so no cap or rate "
                          "could be exact (docs/limits.md); remove them, or use the local shards")
    attrs = {"VisibilityTimeout": str(math.ceil(q.visibility_timeout)),
             "MaximumMessageSize": str(q.max_body_bytes),
             "MessageRetentionPeriod": str(RETENTION_S),
             "ContentBasedDeduplication": "false"}
    if high_throughput:
        attrs.update(DeduplicationScope="messageGroup", FifoThroughputLimit="perMessageGroupId")
    else:
        attrs.update(DeduplicationScope="queue", FifoThroughputLimit="perQueue")
    return attrs


def init(api: Api, config: Config, *, high_throughput: bool = False) -> list[str]:
    """Create or update every queue of ``config``; returns one line per SQS queue."""
    plans = []
    for name, q in config.queues.items():  # check every queue before touching any
        main, dlq = queue_names(api.target.prefix, name)
        plans.append((name, main, dlq, queue_attributes(name, q, high_throughput), q.max_deliveries))
    lines = []
    for name, main, dlq, attrs, max_deliveries in plans:
        dlq_url, line = _ensure(api, dlq, {"MessageRetentionPeriod": str(RETENTION_S)})
        lines.append(line + _ensure_key(api, dlq_url))
        dlq_arn = api.call("get_queue_attributes", QueueUrl=dlq_url,
                           AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attrs = dict(attrs, RedrivePolicy=json.dumps({"deadLetterTargetArn": dlq_arn,
                                                       "maxReceiveCount": max_deliveries}))
        _, line = _ensure(api, main, attrs)
        lines.append(line)
        api.forget(name)
    return lines


def _ensure(api: Api, name: str, attrs: dict[str, str]) -> tuple[str, str]:
    try:
        url = api.call("get_queue_url", QueueName=name)["QueueUrl"]
    except UnknownQueue:
        url = api.call("create_queue", QueueName=name, Attributes=dict(attrs, FifoQueue="true"))["QueueUrl"]
        return url, f"created {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(attrs.items()))
    have = api.call("get_queue_attributes", QueueUrl=url, AttributeNames=["All"])["Attributes"]
    if have.get("FifoQueue") != "true":
        raise InvalidConfig(f"{name} exists and is not a FIFO queue")
    changed = {k: v for k, v in attrs.items() if not _same(k, have.get(k), v)}
    if not changed:
        return url, f"unchanged {name}"
    api.call("set_queue_attributes", QueueUrl=url, Attributes=changed)
    return url, f"updated {name}: " + ", ".join(f"{k} {have.get(k)} -> {v}" for k, v in sorted(changed.items()))


def _ensure_key(api: Api, dlq_url: str) -> str:
    """Give the dead-letter queue a redrive key if it has none (a valid one is kept)."""
    tags = api.call("list_queue_tags", QueueUrl=dlq_url).get("Tags") or {}
    if parse_redrive_key(tags.get(REDRIVE_KEY_TAG)) is not None:
        return ""
    api.call("tag_queue", QueueUrl=dlq_url, Tags={REDRIVE_KEY_TAG: secrets.token_hex(32)})
    return f" (tag {REDRIVE_KEY_TAG} added)"


def _same(key: str, have: str | None, want: str) -> bool:
    if have is None:
        return False
    if key == "RedrivePolicy":
        a, b = json.loads(have), json.loads(want)
        return (a.get("deadLetterTargetArn"), int(a.get("maxReceiveCount", 0))) == \
               (b["deadLetterTargetArn"], int(b["maxReceiveCount"]))
    return str(have).lower() == want.lower()
