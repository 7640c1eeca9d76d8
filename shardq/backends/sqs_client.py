"""The SQS backend's one boto3 client: retries, error mapping, batch chunking, queue lookups.

* Throttling, 5xx answers and broken connections are retried by botocore's ``standard``
  retry mode (exponential backoff with jitter, ``max_attempts`` tries in all); what still
  fails becomes :class:`~shardq.errors.ShardUnavailable`. Every other SQS error maps to the
  shardq error that names who caused it (:func:`.sqs_mapping.error_for`).
* Batch calls are cut to SQS's 10 entries and, for sends, to its 1 MiB per request.
* The credentials are boto3's usual chain; with an ``endpoint`` (a local server) and no
  credentials anywhere, fixed dummy ones are used, since local servers ignore them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .. import limits
from ..errors import AuthError, InvalidConfig, InvalidJob, ShardqError, ShardUnavailable, UnknownQueue
from .sqs_mapping import REDRIVE_KEY_TAG, Target, error_for, parse_redrive_key, queue_names

MAX_ATTEMPTS_DEFAULT = 5
T = TypeVar("T")


def make_client(target: Target, *, request_timeout_s: float, max_attempts: int) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:  # pragma: no cover - depends on the install
        raise InvalidJob("the sqs backend needs boto3: pip install 'shardq[sqs]'") from None
    session = boto3.session.Session()
    creds = {}
    if target.endpoint and session.get_credentials() is None:
        creds = {"aws_access_key_id": "local", "aws_secret_access_key": "local"}
    config = Config(retries={"mode": "standard", "total_max_attempts": max_attempts},
                    connect_timeout=min(request_timeout_s, 10.0),
                    # a long poll holds the request for up to 20 s before answering
                    read_timeout=request_timeout_s + limits.SQS_WAIT_S_MAX,
                    max_pool_connections=32)
    return session.client("sqs", region_name=target.region, endpoint_url=target.endpoint,
                          config=config, **creds)


@dataclass(frozen=True)
class QueueInfo:
    """A shardq queue's two FIFO queues and the settings the backend needs."""

    name: str
    url: str
    dlq_url: str
    visibility_s: int
    max_deliveries: int
    max_message_bytes: int


class Api:
    """Calls SQS; thread-safe (boto3 clients are)."""

    def __init__(self, target: Target, client: Any = None, *, request_timeout_s: float = 30.0,
                 max_attempts: int = MAX_ATTEMPTS_DEFAULT):
        self.target = target
        self.client = client or make_client(target, request_timeout_s=request_timeout_s,
                                            max_attempts=max_attempts)
        self._queues: dict[str, QueueInfo] = {}
        self._keys: dict[str, bytes | None] = {}
        self._lock = threading.Lock()

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        from botocore.exceptions import (BotoCoreError, ClientError, NoCredentialsError,
                                         ParamValidationError)
        try:
            answer: dict[str, Any] = getattr(self.client, op)(**params)
            return answer
        except ClientError as e:
            err = e.response.get("Error", {})
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise error_for(str(err.get("Code", "")), str(err.get("Message", "")), status, op) from None
        except NoCredentialsError as e:
            raise AuthError(f"{op}: {e} (boto3's credential chain found none)") from None
        except ParamValidationError as e:
            raise InvalidJob(f"{op}: {e}") from None
        except BotoCoreError as e:  # connection refused/reset, timeouts: after botocore's retries
            raise ShardUnavailable(f"{op}: {e}") from None

    def batch(self, op: str, url: str, entries: list[dict[str, Any]],
              on_fail: Callable[[int, ShardqError], None]) -> None:
        """Run ``op`` (a ``*Batch`` call) over ``entries`` in chunks of 10; entry ``i`` gets
        an ``Id`` of ``str(i)``. Calls ``on_fail(i, error)`` per failed entry."""
        for lo in range(0, len(entries), limits.SQS_BATCH_ENTRIES_MAX):
            chunk = [dict(e, Id=str(i)) for i, e in enumerate(entries[lo:lo + limits.SQS_BATCH_ENTRIES_MAX], lo)]
            resp = self.call(op, QueueUrl=url, Entries=chunk)
            for f in resp.get("Failed", []):
                on_fail(int(f["Id"]), error_for(f.get("Code", ""), f.get("Message", ""),
                                                None if f.get("SenderFault", True) else 500, op))

    def queue(self, queue: str) -> QueueInfo:
        info = self._queues.get(queue)
        if info is not None:
            return info
        name, dlq = queue_names(self.target.prefix, queue)
        try:
            url = self.call("get_queue_url", QueueName=name)["QueueUrl"]
            dlq_url = self.call("get_queue_url", QueueName=dlq)["QueueUrl"]
        except UnknownQueue:
            raise UnknownQueue(f"queue {queue!r}: SQS queues {name} / {dlq} do not exist; create them "
                               f"with `shardq sqs init --connect {self.target.url()}`") from None
        attrs = self.call("get_queue_attributes", QueueUrl=url, AttributeNames=["All"])["Attributes"]
        info = QueueInfo(queue, url, dlq_url, int(attrs.get("VisibilityTimeout", 30)),
                         max_receive_count(attrs), int(attrs.get("MaximumMessageSize",
                                                                 limits.SQS_MESSAGE_BYTES_MAX)))
        with self._lock:
            self._queues[queue] = info
        return info

    def forget(self, queue: str) -> None:
        with self._lock:
            self._queues.pop(queue, None)
            self._keys.pop(queue, None)

    def redrive_key(self, info: QueueInfo) -> bytes | None:
        """The queue's redrive key (the ``shardq.redrive-key`` tag of its dead-letter queue),
        or None when the queue has none. Read on first need, not at lookup: a producer never
        needs it, so it needs no ``ListQueueTags`` right."""
        with self._lock:
            if info.name in self._keys:
                return self._keys[info.name]
        tags = self.call("list_queue_tags", QueueUrl=info.dlq_url).get("Tags") or {}
        key = parse_redrive_key(tags.get(REDRIVE_KEY_TAG))
        with self._lock:
            self._keys[info.name] = key
        return key

    def need_redrive_key(self, info: QueueInfo) -> bytes:
        """The queue's redrive key, or :class:`InvalidConfig` when it has none."""
        key = self.redrive_key(info)
        if key is None:
            with self._lock:
                self._keys.pop(info.name, None)  # look again next time: init may run meanwhile
            raise InvalidConfig(f"queue {info.name!r}: its dead-letter queue has no {REDRIVE_KEY_TAG} "
                                f"tag, which redriven and buried copies are signed with; run "
                                f"`shardq sqs init --connect {self.target.url()}` again to add it")
        return key


def max_receive_count(attrs: dict[str, Any]) -> int:
    import json
    policy = attrs.get("RedrivePolicy")
    if not policy:
        return 0  # no dead-letter queue: delivered forever
    return int(json.loads(policy)["maxReceiveCount"])


def chunks_by_size(items: Iterable[T], size_of: Callable[[T], int], max_count: int,
                   max_bytes: int) -> list[list[T]]:
    """Consecutive chunks of at most ``max_count`` items and ``max_bytes`` bytes (an item
    larger than ``max_bytes`` on its own is the caller's error: it is checked before)."""
    out: list[list[T]] = []
    cur: list[T] = []
    cur_bytes = 0
    for item in items:
        n = size_of(item)
        if cur and (len(cur) >= max_count or cur_bytes + n > max_bytes):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(item)
        cur_bytes += n
    if cur:
        out.append(cur)
    return out
