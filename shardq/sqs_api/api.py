"""The SQS actions, as coroutines over shardq's public asyncio client (one
:class:`~shardq.client.aio.AsyncQueue` per listener process, shared by every request it
runs) and the :class:`.catalog.Catalog` of queues.

``await SqsApi.call(action, params, host)`` takes a request's parameters in the JSON
protocol's shapes and returns its result in the same shapes (the protocol layer turns both
into the query protocol's form and XML as needed), or raises
:class:`~shardq.errors.SqsApiError`. The queue actions are here; the message actions in
:mod:`.messages`. An ``SqsApi`` is used on its queue's event loop only. Cancelling a call
(the listener does when its client has gone) leaves no lease behind (:mod:`.messages`).
The catalog is a small file read from memory while unchanged; its writes (the queue
actions, rare) lock and fsync it in a thread (``asyncio.to_thread``), off the loop."""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import limits
from ..clock import Clock, SystemClock
from ..config import SqsApiConfig
from ..errors import UnknownQueue
from . import attributes as qattr
from . import params as p
from .catalog import Catalog
from .faults import fault, invalid, no_queue
from .messages import MessageActions
from .moves import MoveTasks

if TYPE_CHECKING:
    from ..client.aio import AsyncQueue

log = logging.getLogger("shardq.sqs_api")

#: Every action of the API model, and its method.
ACTIONS = {
    "CreateQueue": "create_queue", "DeleteQueue": "delete_queue", "GetQueueUrl": "get_queue_url",
    "ListQueues": "list_queues", "GetQueueAttributes": "get_queue_attributes",
    "SetQueueAttributes": "set_queue_attributes", "PurgeQueue": "purge_queue",
    "ListDeadLetterSourceQueues": "list_dead_letter_source_queues", "TagQueue": "tag_queue",
    "UntagQueue": "untag_queue", "ListQueueTags": "list_queue_tags", "AddPermission": "add_permission",
    "RemovePermission": "remove_permission", "SendMessage": "send_message", "SendMessageBatch": "send_message_batch",
    "ReceiveMessage": "receive_message", "DeleteMessage": "delete_message",
    "DeleteMessageBatch": "delete_message_batch",
    "ChangeMessageVisibility": "change_message_visibility",
    "ChangeMessageVisibilityBatch": "change_message_visibility_batch",
    "StartMessageMoveTask": "start_message_move_task", "ListMessageMoveTasks": "list_message_move_tasks",
    "CancelMessageMoveTask": "cancel_message_move_task",
}
PURGE_EVERY_S = 60.0   # AWS: one PurgeQueue per queue per 60 s


class SqsApi(MessageActions):
    def __init__(self, q: AsyncQueue, catalog: Catalog, cfg: SqsApiConfig, clock: Clock | None = None):
        self.q, self.catalog, self.cfg = q, catalog, cfg
        self.clock = clock or SystemClock()
        self.service_id = q.service_id or "shardq"  # None: a data dir made before service ids
        self.moves = MoveTasks(self)
        MessageActions.__init__(self)

    async def call(self, action: str, params: dict[str, Any], host: str) -> dict[str, Any]:
        method = ACTIONS.get(action)
        if method is None:
            raise fault("InvalidAction", f"The action {action[:100]} is not valid for this endpoint.")
        result: dict[str, Any] = await getattr(self, method)(params, host)
        return result

    # ------------------------------------------------------------------ names
    def arn(self, name: str) -> str:
        return f"arn:aws:sqs:{self.cfg.region}:{self.cfg.account_id}:{name}"

    def local_name(self, arn: Any) -> str | None:
        """The queue name in ``arn`` if it is a queue ARN of this service (its region and
        account), whether or not the queue exists; None otherwise (it names no queue here)."""
        parsed = qattr.parse_arn(arn)
        if parsed is None or parsed[:2] != (self.cfg.region, self.cfg.account_id):
            return None
        return parsed[2]

    def url(self, host: str, name: str) -> str:
        return f"http://{host}/{self.cfg.account_id}/{name}"

    def queue(self, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(name, catalog record) of the request's QueueUrl; NonExistentQueue if unknown."""
        url = p.required(params, "QueueUrl")
        try:
            path = urlsplit(url).path if "://" in url else url
        except ValueError:
            raise no_queue() from None
        parts = [s for s in path.split("/") if s]
        if not parts or (len(parts) == 2 and parts[0] != self.cfg.account_id) or len(parts) > 2:
            raise no_queue()
        rec = self.catalog.get(parts[-1])
        if rec is None:
            raise no_queue()
        return parts[-1], rec

    # ------------------------------------------------------------------ queues
    async def create_queue(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name = qattr.check_queue_name(p.string(params, "QueueName", required=True))
        fifo = name.endswith(".fifo")
        given = qattr.check(params.get("Attributes"), fifo, creating=True)
        if fifo and given.get("FifoQueue") != "true":
            raise invalid("The name of a FIFO queue can only include alphanumeric characters, hyphens, or "
                          "underscores, must end with .fifo suffix. Set FifoQueue to true to create one.")
        try:
            await self.q.queue_config(name)
        except UnknownQueue:
            raise invalid(f"The shardq service takes declared queues only (service.declare_queues = true): "
                          f"declare [queues.\"{name}\"] in its config first.") from None
        await self._check_redrive(name, given)
        tags = self._check_tags(params.get("tags"))
        attrs = qattr.defaults(fifo)
        attrs.update(given)
        qattr.check_together(attrs, given)
        # False: it exists with these attributes (AWS: its URL)
        await asyncio.to_thread(self.catalog.create, name, attrs, given, tags)
        return {"QueueUrl": self.url(host, name)}

    async def delete_queue(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        await asyncio.to_thread(self.catalog.delete, name)
        await self._drain(name)
        return {}

    async def get_queue_url(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name = p.string(params, "QueueName", required=True)
        owner = p.string(params, "QueueOwnerAWSAccountId")
        if owner is not None and owner != self.cfg.account_id:
            raise no_queue()
        if not isinstance(name, str) or self.catalog.get(name) is None:
            raise no_queue()
        return {"QueueUrl": self.url(host, name)}

    async def list_queues(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        prefix = p.string(params, "QueueNamePrefix") or ""
        names = [n for n in self.catalog.names() if n.startswith(prefix)]
        urls, token = self._page(names, params)
        out: dict[str, Any] = {"QueueUrls": [self.url(host, n) for n in urls]} if urls else {}
        if token:
            out["NextToken"] = token
        return out

    def _page(self, names: list[str], params: dict[str, Any]) -> tuple[list[str], str | None]:
        """One page of sorted ``names``: after NextToken, up to MaxResults (1000 without it;
        a NextToken only with MaxResults, as AWS)."""
        max_results = p.integer(params, "MaxResults", 1, limits.SQS_API_LIST_MAX)
        token = p.string(params, "NextToken")
        if token:
            try:
                after = base64.urlsafe_b64decode(token.encode()).decode()
            except (binascii.Error, ValueError):
                raise invalid("Invalid NextToken value.") from None
            names = [n for n in names if n > after]
        if max_results is None:
            return names[:limits.SQS_API_LIST_MAX], None
        page = names[:max_results]
        more = len(names) > max_results
        return page, base64.urlsafe_b64encode(page[-1].encode()).decode() if more else None

    async def get_queue_attributes(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, rec = self.queue(params)
        wanted = p.string_list(params, "AttributeNames")
        for w in wanted:
            if w not in qattr.ALL_NAMES:
                raise fault("InvalidAttributeName", f"Unknown Attribute {w}.")
        fifo = name.endswith(".fifo")
        if "All" in wanted:
            wanted = [*rec["attributes"], *qattr.READ_ONLY]
        attrs = dict(rec["attributes"])
        attrs["QueueArn"] = self.arn(name)
        attrs["CreatedTimestamp"] = str(rec["created"])
        attrs["LastModifiedTimestamp"] = str(rec["modified"])
        if any(w.startswith("Approximate") for w in wanted):
            attrs.update(await self._counts(name))
        # an attribute set to "" (a removed RedrivePolicy) is not shown, as AWS
        out = {w: attrs[w] for w in wanted if attrs.get(w) and (w not in qattr.FIFO_ONLY or fifo)}
        return {"Attributes": out} if out else {}

    async def _counts(self, name: str) -> dict[str, str]:
        counts = (await self.q.stats())["queues"].get(name, {})
        return {"ApproximateNumberOfMessages": str(counts.get("ready", 0) + counts.get("waiting", 0)),
                "ApproximateNumberOfMessagesNotVisible": str(counts.get("in_flight", 0)),
                "ApproximateNumberOfMessagesDelayed": str(counts.get("delayed", 0))}

    async def set_queue_attributes(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        given = qattr.check(params.get("Attributes"), name.endswith(".fifo"), creating=False)
        await self._check_redrive(name, given)
        await asyncio.to_thread(self.catalog.set_attributes, name, given,
                                lambda attrs: qattr.check_together(attrs, given))
        return {}

    async def _check_redrive(self, name: str, given: dict[str, str]) -> None:
        target = qattr.redrive(given)
        if target is None:
            return
        dlq, _ = target
        rec = self.catalog.get(dlq)
        if rec is None or dlq == name or self.local_name(qattr.redrive_target(given)) is None:
            raise invalid(f"Value {given['RedrivePolicy']} for parameter RedrivePolicy is invalid. Reason: "
                          f"Dead letter target does not exist.")
        if dlq.endswith(".fifo") != name.endswith(".fifo"):
            raise invalid(f"Value {given['RedrivePolicy']} for parameter RedrivePolicy is invalid. Reason: "
                          f"Dead-letter queue must be of the same type as the source queue (FIFO or standard).")
        if not qattr.allows_source(rec["attributes"], self.arn(name)):
            raise invalid(f"Value {given['RedrivePolicy']} for parameter RedrivePolicy is invalid. Reason: "
                          f"the dead-letter queue's RedriveAllowPolicy does not allow this source queue.")
        # shardq dead-letters a job past the queue's max_deliveries at lease time, into its own
        # dead letters: the receive that moves a message here (receive maxReceiveCount + 1)
        # must come first, or messages would leave the SQS API silently
        deliveries = (await self.q.queue_config(name)).get("max_deliveries", 0)
        if target[1] >= deliveries:
            raise fault("InvalidAttributeValue", f"Invalid value for the parameter RedrivePolicy. Reason: "
                                                 f"maxReceiveCount {target[1]} must be below the shardq queue's "
                                                 f"max_deliveries ({deliveries}): raise max_deliveries in "
                                                 f"[queue_defaults] or [queues.\"{name}\"] of the config.")

    async def purge_queue(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        # in the catalog: every process sees it; before the purge
        await asyncio.to_thread(self.catalog.stamp_purge, name, PURGE_EVERY_S)
        await self._drain(name)
        return {}

    async def _drain(self, name: str) -> int:
        """Delete every message of the queue: received or not, delayed or not (the shard's
        ``purge_queue``, logged and fsynced before the answer). A receipt handle of a
        deleted message deletes or changes nothing after."""
        gone: int = await self.q.purge(name)
        return gone

    async def list_dead_letter_source_queues(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        urls, token = self._page(self.catalog.sources_of(self.arn(name)), params)
        out: dict[str, Any] = {"queueUrls": [self.url(host, n) for n in urls]}
        if token:
            out["NextToken"] = token
        return out

    # ------------------------------------------------------------------ tags
    @staticmethod
    def _check_tags(tags: Any) -> dict[str, str]:
        if tags is None:
            return {}
        if not isinstance(tags, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
            raise invalid("Tags must be a map of strings.")
        if len(tags) > limits.SQS_API_TAGS_MAX:
            raise invalid(f"Too many tags: a queue has at most {limits.SQS_API_TAGS_MAX}.")
        for k, v in tags.items():
            if not 1 <= len(k) <= 128 or len(v) > 256:
                raise invalid("Tag keys are 1 to 128 characters, values up to 256.")
        return dict(tags)

    async def tag_queue(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        tags = self._check_tags(params.get("Tags"))
        if not tags:
            raise missing_tags()
        await asyncio.to_thread(self.catalog.set_tags, name, tags, [], limits.SQS_API_TAGS_MAX)
        return {}

    async def untag_queue(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        keys = p.string_list(params, "TagKeys")
        if not keys:
            raise fault("MissingParameter", "The request must contain the parameter TagKeys.")
        await asyncio.to_thread(self.catalog.set_tags, name, {}, keys, limits.SQS_API_TAGS_MAX)
        return {}

    async def list_queue_tags(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        _, rec = self.queue(params)
        return {"Tags": rec["tags"]} if rec["tags"] else {}

    # ------------------------------------------------------------------ permissions: refused
    async def add_permission(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        self.queue(params)
        raise fault("UnsupportedOperation", "AddPermission is not supported: shardq has one principal (the "
                                            "configured access key, or loopback callers), and no access policy "
                                            "to extend (docs/sqs-api.md).")

    async def remove_permission(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        self.queue(params)
        raise fault("UnsupportedOperation", "RemovePermission is not supported: shardq has one principal and no "
                                            "access policy (docs/sqs-api.md).")

    # ------------------------------------------------------------------ message move tasks
    async def start_message_move_task(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        return await self.moves.start(params)

    async def list_message_move_tasks(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        return self.moves.list(params)

    async def cancel_message_move_task(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        return await self.moves.cancel(params)

    async def close(self) -> None:
        """End the background work (move tasks, the memo sweeper); the queue is the caller's."""
        await self.moves.close()
        await self.memos.close()
        await self.released()


def missing_tags() -> Exception:
    return fault("MissingParameter", "The request must contain the parameter Tags.")
