"""Message move tasks (StartMessageMoveTask, ListMessageMoveTasks, CancelMessageMoveTask):
moving the messages of a dead-letter queue back to where they came from (their
DeadLetterQueueSourceArn) or to a chosen queue of the same type, as a task on the listener's
event loop, one task per source at a time; a FIFO message keeps its group.

A message is enqueued at its destination, then deleted at the source (acked, or cancelled
if its lease has ended: :func:`.messages.delete_held`); the enqueue carries a dedup id of
the message, so a crash between the two cannot make two. A task's record is
kept in the catalog, shared by every process of the SQS API: a task runs in the process
that started it, which holds a lock for as long as it lives (:class:`.catalog.Owner`), and
looks at its record between rounds, so a CancelMessageMoveTask answered by another process
stops it. A task whose process is gone (stopped, killed) is listed FAILED. A task that fails
(a message with no queue to go back to, an enqueue refused) hands back, as not delivered,
every message of its round it has not moved: they stay visible, their receive count as it
was, as AWS leaves the messages a task did not move."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

from .. import limits
from ..errors import ShardqError
from ..types import Lease
from . import attributes as qattr
from .catalog import Owner, alive
from . import message as m
from . import params as p
from .faults import fault, invalid
from .messages import delete_held

log = logging.getLogger("shardq.sqs_api")

ROUND = 10
RATE_MAX = 500
ACTIVE = ("RUNNING", "CANCELLING")


class MoveTasks:
    def __init__(self, api: Any):
        self.api = api
        self._cancel: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.owner = Owner(api.catalog.dir)
        self._sweep()

    def _sweep(self) -> None:
        """List FAILED the running tasks whose process is gone."""
        for handle, task in self.api.catalog.tasks().items():
            if task["Status"] in ACTIVE and not alive(self.api.catalog.dir, task.get("_owner")):
                self.api.catalog.update_task(handle, only_if=ACTIVE, Status="FAILED",
                                             FailureReason="the service stopped while the task ran")

    async def start(self, params: dict[str, Any]) -> dict[str, Any]:
        source_arn = p.string(params, "SourceArn", required=True)
        dest_arn = p.string(params, "DestinationArn")
        rate = p.integer(params, "MaxNumberOfMessagesPerSecond", 1, RATE_MAX)
        source = self._queue_of(source_arn)
        if not self.api.catalog.sources_of(source_arn):
            raise invalid("Source queue must be configured as a Dead Letter Queue.")
        if dest_arn is not None and self._queue_of(dest_arn).endswith(".fifo") != source.endswith(".fifo"):
            raise invalid("The destination queue must be of the same type as the source (FIFO or standard).")
        self._sweep()
        handle = secrets.token_urlsafe(24)
        counts = await self.api._counts(source)
        task = {"TaskHandle": handle, "Status": "RUNNING", "SourceArn": source_arn,
                "StartedTimestamp": int(self.api.clock.now() * 1000), "ApproximateNumberOfMessagesMoved": 0,
                "ApproximateNumberOfMessagesToMove": int(counts["ApproximateNumberOfMessages"]),
                "_owner": self.owner.id}  # "_": kept, never listed
        if dest_arn is not None:
            task["DestinationArn"] = dest_arn
        if rate is not None:
            task["MaxNumberOfMessagesPerSecond"] = rate
        # checked under the catalog's flock (every process); its writes are off the loop
        if not await asyncio.to_thread(self.api.catalog.start_task, handle, task, ACTIVE):
            raise fault("UnsupportedOperation", "A message move task is already running on this source.")
        self._cancel[handle] = asyncio.Event()
        t = asyncio.get_running_loop().create_task(self._run(handle, source, dest_arn, rate), name="shardq-sqs-move")
        self._tasks.append(t)
        t.add_done_callback(self._tasks.remove)
        return {"TaskHandle": handle}

    def _queue_of(self, arn: str | None) -> str:
        name: str | None = self.api.local_name(arn)  # another region's or account's names no queue here
        if name is None or self.api.catalog.get(name) is None:
            raise fault("ResourceNotFoundException", f"The resource that you specified for the ARN {arn} does "
                                                     f"not exist.")
        return name

    async def _run(self, handle: str, source: str, dest_arn: str | None, rate: int | None) -> None:
        q, moved = self.api.q, 0
        stop = self._cancel[handle]
        status, reason = "COMPLETED", None
        try:
            while not self._stopped(handle, stop):
                began = self.api.clock.monotonic()
                leases = await q.dequeue_many(source, max_jobs=min(ROUND, rate or ROUND), wait=0.0, visibility=60.0)
                if not leases:
                    break
                done = 0  # the leases of the round moved so far
                try:
                    for lease in leases:
                        await self._move(lease, dest_arn)
                        done += 1
                        moved += 1
                except BaseException:
                    # what the round has not moved stays as it was: visible, no receive counted
                    # (handed back as not delivered, at once; a message enqueued at its destination
                    # but not deleted here yet too: a later task moves it under the same dedup id)
                    await self.api._release(leases[done:])
                    raise
                await self._update(handle, ApproximateNumberOfMessagesMoved=moved)
                if rate:
                    pause = max(0.0, len(leases) / rate - (self.api.clock.monotonic() - began))
                    # (not wait_for: in 3.11 it loses a cancel that comes as the wait ends)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pause):
                            await stop.wait()
            if self._stopped(handle, stop):
                status = "CANCELLED"
        except ShardqError as e:
            status, reason = "FAILED", str(e)[:200]
        except Exception as e:  # a task that cannot go on ends FAILED, never RUNNING for ever
            log.exception("event=sqs-api-move-task-failed task=%s", handle)
            status, reason = "FAILED", f"internal error: {type(e).__name__}"
        fields: dict[str, Any] = {"Status": status, "ApproximateNumberOfMessagesMoved": moved}
        if reason:
            fields["FailureReason"] = reason
        await self._update(handle, **fields)

    async def _move(self, lease: Lease, dest_arn: str | None) -> None:
        """Enqueue the message of ``lease`` at its destination, then delete it here."""
        q = self.api.q
        data, head = m.unwrap(lease.body)
        target = dest_arn or head.get("q")
        parsed = qattr.parse_arn(target)
        if parsed is None or self.api.catalog.get(parsed[2]) is None:
            raise invalid(f"message {lease.job_id} has no source queue to go back to")
        rest = {k: v for k, v in head.items() if k != "q"}
        body = m.rewrap(data, rest) if rest else data
        # a FIFO message keeps its group (the key), so its group's order holds
        await q.enqueue(body, key=lease.key if parsed[2].endswith(".fifo") else None, queue=parsed[2],
                        dedup_id=f"shardq-move:{lease.job_id}"[:limits.DEDUP_ID_BYTES_MAX])
        await delete_held(q, lease)

    def _stopped(self, handle: str, stop: asyncio.Event) -> bool:
        """Cancelled here, or by another process (the record says CANCELLING)."""
        if not stop.is_set() and self.api.catalog.tasks().get(handle, {}).get("Status") == "CANCELLING":
            stop.set()
        return stop.is_set()

    async def _update(self, handle: str, **fields: Any) -> None:
        await asyncio.to_thread(self.api.catalog.update_task, handle, **fields)

    def list(self, params: dict[str, Any]) -> dict[str, Any]:
        source_arn = p.string(params, "SourceArn", required=True)
        limit = p.integer(params, "MaxResults", 1, 10, 1)
        self._queue_of(source_arn)
        self._sweep()
        tasks = sorted((t for t in self.api.catalog.tasks().values() if t["SourceArn"] == source_arn),
                       key=lambda t: -t["StartedTimestamp"])[:limit]
        out = []
        for t in tasks:
            t = {k: v for k, v in t.items() if not k.startswith("_")}
            if t["Status"] != "RUNNING":
                t.pop("TaskHandle", None)  # AWS gives the handle of a running task only
            out.append(t)
        return {"Results": out}

    async def cancel(self, params: dict[str, Any]) -> dict[str, Any]:
        handle = p.string(params, "TaskHandle", required=True) or ""
        self._sweep()
        # the process that runs it sees CANCELLING between two rounds
        task = await asyncio.to_thread(self.api.catalog.update_task, handle, only_if=("RUNNING",), Status="CANCELLING")
        if task is None:
            raise fault("ResourceNotFoundException", "The task handle does not name a running task.")
        if handle in self._cancel:
            self._cancel[handle].set()
        return {"ApproximateNumberOfMessagesMoved": task["ApproximateNumberOfMessagesMoved"]}

    async def close(self) -> None:
        for ev in self._cancel.values():
            ev.set()
        if self._tasks:  # each ends at its next round (a round: ten messages)
            await asyncio.wait(list(self._tasks), timeout=5)
        self.owner.close()
