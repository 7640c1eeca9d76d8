"""Dead letters on SQS: list, redrive and purge a queue's FIFO dead-letter queue, and move
foreign messages there.

All three read the DLQ by receiving from it (SQS has no peek): each received dead letter is
hidden for ``LIST_HIDE_S`` while the call pages on, then shown again, moved or deleted.

* ``attempts`` of a dead letter is the queue's ``max_deliveries``: SQS moves a message after
  that many receives. ``error`` is None for those (SQS keeps no error text with a message),
  the bury's error for a job a task buried (``SqsQueue.bury`` sends it as an attribute), and
  the reason for a foreign message (:func:`move_foreign`).
* A key with more than 10 dead letters shows its first 10 per call: SQS locks a group while
  any of its messages is received.
* Redrive is done here (receive, send a copy to the tail of its key, delete the dead
  letter) rather than by StartMessageMoveTask, which cannot pick jobs. The copy carries the
  job id in its signed dedup id, so the id survives and a redrive retried within 5 minutes
  adds no second copy. Letters it passes over stay hidden until it ends (their visibility
  is extended as it pages on), and it returns only once every letter it copied is deleted
  (a failed delete is retried with the letter's next receipt): so a redrive never leaves a
  copied letter behind for a later redrive to copy again. Foreign letters are never copied
  back (they would only be moved here again).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .. import limits
from ..clock import Clock, SystemClock
from ..errors import InvalidJob, ShardqError, ShardUnavailable
from ..types import DeadLetter, JobId
from .sqs_client import Api, QueueInfo, chunks_by_size
from .sqs_mapping import (ATTR_ERROR, Foreign, Incoming, decode, encode, foreign_dedup_id,
                          redrive_dedup_id)

log = logging.getLogger("shardq.sqs")

LIST_HIDE_S = 30  # how long a listed dead letter stays hidden while the call pages on
REDRIVE_IDLE_ROUNDS_MAX = 3  # receives in a row that bring only letters seen already: done
REDRIVE_DELETE_TRIES = 3     # deletes of a copied letter (each with its latest receipt) before giving up
SYS_ATTRS = ["ApproximateReceiveCount", "MessageGroupId", "MessageDeduplicationId"]


@dataclass
class _Held:
    """A dead letter this call received, and until when (at the latest) it stays hidden."""

    msg: Incoming | Foreign
    until: float
    deletes: int = 0  # failed deletes of a copied letter


def _receive(api: Api, info: QueueInfo, n: int, wait_s: int = 0) -> list[Incoming | Foreign]:
    msgs = api.call("receive_message", QueueUrl=info.dlq_url, MaxNumberOfMessages=n,
                    VisibilityTimeout=LIST_HIDE_S, WaitTimeSeconds=wait_s,
                    MessageSystemAttributeNames=SYS_ATTRS, MessageAttributeNames=["All"]).get("Messages", [])
    return [decode(m, lambda: api.redrive_key(info), limits.SQS_MESSAGE_BYTES_MAX, dead=True) for m in msgs]


def _scan(api: Api, info: QueueInfo, limit: int) -> Iterator[Incoming | Foreign]:
    seen = 0
    while seen < limit:
        msgs = _receive(api, info, min(limits.SQS_BATCH_ENTRIES_MAX, limit - seen))
        if not msgs:
            return
        for m in msgs:
            seen += 1
            yield m


def _show_again(api: Api, info: QueueInfo, msgs: Sequence[Incoming | Foreign]) -> None:
    if msgs:
        api.batch("change_message_visibility_batch", info.dlq_url,
                  [{"ReceiptHandle": m.receipt, "VisibilityTimeout": 0} for m in msgs], lambda i, e: None)


def _delete(api: Api, info: QueueInfo, msgs: Sequence[Incoming | Foreign]) -> set[int]:
    """Delete dead letters; returns the indexes of those that were not deleted."""
    failed: set[int] = set()
    api.batch("delete_message_batch", info.dlq_url, [{"ReceiptHandle": m.receipt} for m in msgs],
              lambda i, e: failed.add(i))
    return failed


def _letter(m: Incoming | Foreign, info: QueueInfo) -> DeadLetter:
    if isinstance(m, Foreign):
        return DeadLetter(m.message_id, None, m.text.encode(), info.name, info.max_deliveries,
                          m.error or f"not a shardq message: {m.reason}")
    return DeadLetter(m.job_id, m.key, m.body, info.name, info.max_deliveries, m.error)


def list_dead(api: Api, info: QueueInfo, limit: int) -> list[DeadLetter]:
    msgs = list(_scan(api, info, limit))
    _show_again(api, info, msgs)
    return [_letter(m, info) for m in msgs]


def redrive(api: Api, info: QueueInfo, job_ids: Iterable[JobId] | None, clock: Clock | None = None) -> int:
    """Move dead letters (all, or ``job_ids``) back; returns how many moved. Returns only
    once each letter it copied is deleted from the dead-letter queue; if one cannot be (its
    copy is in the queue), raises :class:`ShardUnavailable` naming its job id."""
    clock = clock or SystemClock()
    wanted = None if job_ids is None else set(job_ids)
    skipped: dict[str, _Held] = {}   # passed over: kept hidden until the end, then shown again
    copied: dict[str, _Held] = {}    # copy sent; the dead letter still to delete
    sent_jobs: set[str] = set()
    moved, idle = 0, 0
    try:
        while True:
            _keep_hidden(api, info, skipped, clock)
            retry = [h for h in copied.values() if h.deletes < REDRIVE_DELETE_TRIES]
            if wanted is not None and wanted <= sent_jobs and not retry:
                break
            t0 = clock.monotonic()
            wait_s = 0
            if retry:  # a letter whose delete failed comes back when its hide ends
                wait_s = max(1, min(limits.SQS_WAIT_S_MAX, math.ceil(max(h.until for h in retry) - t0)))
            batch = _receive(api, info, limits.SQS_BATCH_ENTRIES_MAX, wait_s)
            if not batch:
                if not retry or clock.monotonic() > max(h.until for h in retry) + 1:
                    break
                continue
            fresh, again = [], []   # again: letters this call received before
            for m in batch:
                held = _Held(m, t0 + LIST_HIDE_S)
                if m.message_id in copied:
                    held.deletes = copied[m.message_id].deletes
                    copied[m.message_id] = held   # copied already: delete it, never copy it twice
                    again.append(m)
                elif m.message_id in skipped:
                    skipped[m.message_id] = held  # its hide ran out: a new receipt
                    again.append(m)
                else:
                    fresh.append(held)
            idle = 0 if fresh else idle + 1
            take = [(h, h.msg) for h in fresh
                    if isinstance(h.msg, Incoming) and (wanted is None or h.msg.job_id in wanted)]
            taken = {m.message_id for _, m in take}
            skipped.update((h.msg.message_id, h) for h in fresh if h.msg.message_id not in taken)
            if take:
                try:
                    _send_copies(api, info, [m for _, m in take])
                except ShardqError:
                    skipped.update((m.message_id, h) for h, m in take)  # shown again below
                    raise
                for h, m in take:
                    copied[m.message_id] = h
                    sent_jobs.add(m.job_id)
            # Delete what was copied now, and copied letters received again (a new receipt).
            pending = [copied[m.message_id] for m in batch if m.message_id in copied]
            if pending:
                failed = _delete(api, info, [h.msg for h in pending])
                for i, h in enumerate(pending):
                    if i in failed:
                        h.deletes += 1
                    else:
                        del copied[h.msg.message_id]
                        moved += 1
            if idle >= REDRIVE_IDLE_ROUNDS_MAX and all(h.deletes >= REDRIVE_DELETE_TRIES for h in copied.values()):
                break
    finally:
        try:
            _show_again(api, info, [h.msg for h in skipped.values()])
        except ShardqError as e:  # they reappear when their hide ends
            log.warning("redrive: showing %d passed-over dead letters again failed: %s", len(skipped), e)
    if copied:
        # A letter received again decodes as before, unless the queue's redrive key went
        # meanwhile (a Foreign then): its message id names it.
        ids = ", ".join(sorted(h.msg.job_id if isinstance(h.msg, Incoming) else h.msg.message_id
                               for h in copied.values()))
        raise ShardUnavailable(f"redrive of queue {info.name!r}: job(s) {ids} are back in the queue, but "
                               "their dead letters could not be deleted; a redrive within 5 minutes "
                               "adds no second copy (run it again now), a later one would")
    return moved


def _keep_hidden(api: Api, info: QueueInfo, held: dict[str, _Held], clock: Clock) -> None:
    """Extend the hide of passed-over letters close to its end, so that a long scan does not
    receive them again (nor end early because a page brought only letters it had seen)."""
    now = clock.monotonic()
    due = [h for h in held.values() if h.until - now < LIST_HIDE_S / 3]
    if not due:
        return
    failed: set[int] = set()
    api.batch("change_message_visibility_batch", info.dlq_url,
              [{"ReceiptHandle": h.msg.receipt, "VisibilityTimeout": LIST_HIDE_S} for h in due],
              lambda i, e: failed.add(i))
    for i, h in enumerate(due):
        if i not in failed:  # a failed one is visible again: received again, it gets a new receipt
            h.until = now + LIST_HIDE_S


def _send_copies(api: Api, info: QueueInfo, take: list[Incoming]) -> None:
    secret = api.need_redrive_key(info)
    copies = [encode(m.body, m.key, redrive_dedup_id(secret, m.job_id, m.message_id, m.group, m.key, m.body),
                     group=m.group) for m in take]
    errors: list[ShardqError] = []
    for chunk in chunks_by_size(copies, lambda c: c.size, limits.SQS_BATCH_ENTRIES_MAX,
                                limits.SQS_BATCH_BYTES_MAX):
        api.batch("send_message_batch", info.url, [c.entry() for c in chunk], lambda i, e: errors.append(e))
    if errors:  # the letters stay: those already copied are deduplicated by a retry within 5 min
        raise errors[0]


def move_foreign(api: Api, info: QueueInfo, foreign: list[Foreign]) -> None:
    """Move messages shardq did not write from the queue to its dead letters, each with the
    reason in ``shardq.error``: a copy (dedup id from the message id, so a retried move adds
    nothing), then the delete. A move that fails is logged; the message stays hidden until
    its visibility timeout and is moved when it is received again (or by SQS's redrive
    policy, without the reason, after ``max_deliveries`` receives)."""
    for f in foreign:
        error = f"not a shardq message: {f.reason}"
        log.warning("queue %s: message %s is not a shardq message (%s); moving it to the dead letters",
                    info.name, f.message_id, f.reason)
        attrs = {n: a for n, a in ((n, _resendable(a)) for n, a in f.attributes.items() if n != ATTR_ERROR)
                 if a is not None}
        entry = {"QueueUrl": info.dlq_url, "MessageBody": f.text, "MessageGroupId": f.group or "foreign",
                 "MessageDeduplicationId": foreign_dedup_id(f.message_id)}
        error_attr = {ATTR_ERROR: {"DataType": "String", "StringValue": error}}
        try:
            try:
                api.call("send_message", **entry, MessageAttributes={**attrs, **error_attr})
            except InvalidJob:  # its own attributes are what SQS refuses, or too large: keep the reason
                api.call("send_message", **entry, MessageAttributes=error_attr)
            api.call("delete_message", QueueUrl=info.url, ReceiptHandle=f.receipt)
        except ShardqError as e:
            log.warning("queue %s: moving message %s to the dead letters failed (%s); it is moved when "
                        "received again", info.name, f.message_id, e)


def _resendable(attr: object) -> dict[str, Any] | None:
    """A received message attribute in the form SendMessage takes, or None."""
    if not isinstance(attr, dict) or not isinstance(attr.get("DataType"), str):
        return None
    for field in ("StringValue", "BinaryValue"):
        if field in attr:
            return {"DataType": attr["DataType"], field: attr[field]}
    return None


def purge(api: Api, info: QueueInfo) -> int:
    """Delete every dead letter (receive + delete: an exact count, no PurgeQueue rate limit)."""
    n = 0
    while True:
        batch = list(_scan(api, info, limits.SQS_BATCH_ENTRIES_MAX))
        if not batch:
            return n
        _delete(api, info, batch)
        n += len(batch)
