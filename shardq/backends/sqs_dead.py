"""Dead letters on SQS: list, redrive and purge a queue's FIFO dead-letter queue.

All three read the DLQ by receiving from it (SQS has no peek): each received dead letter is
hidden for ``LIST_HIDE_S`` while the call pages on, then shown again, moved or deleted.

* ``attempts`` of a dead letter is the queue's ``max_deliveries``: SQS moves a message after
  that many receives. ``error`` is None for those (SQS keeps no error text with a message),
  and the bury's error for a job a task buried (``SqsQueue.bury`` sends it as an attribute).
* A key with more than 10 dead letters shows its first 10 per call: SQS locks a group while
  any of its messages is received.
* Redrive is done here (receive, send a copy to the tail of its key, delete the dead
  letter) rather than by StartMessageMoveTask, which cannot pick jobs. The copy carries the
  job id in its dedup id, so the id survives and a redrive retried within 5 minutes adds no
  second copy.
"""
from __future__ import annotations

from typing import Iterator

from .. import limits
from ..types import DeadLetter
from .sqs_client import Api, QueueInfo
from .sqs_mapping import Incoming, decode, encode, redrive_dedup_id

LIST_HIDE_S = 30  # how long a listed dead letter stays hidden while the call pages on
SYS_ATTRS = ["ApproximateReceiveCount", "MessageGroupId", "MessageDeduplicationId"]


def _scan(api: Api, info: QueueInfo, limit: int) -> Iterator[Incoming]:
    seen = 0
    while seen < limit:
        msgs = api.call("receive_message", QueueUrl=info.dlq_url,
                        MaxNumberOfMessages=min(limits.SQS_BATCH_ENTRIES_MAX, limit - seen),
                        VisibilityTimeout=LIST_HIDE_S, WaitTimeSeconds=0,
                        MessageSystemAttributeNames=SYS_ATTRS,
                        MessageAttributeNames=["All"]).get("Messages", [])
        if not msgs:
            return
        for m in msgs:
            seen += 1
            yield decode(m)


def _show_again(api: Api, info: QueueInfo, msgs: list[Incoming]) -> None:
    if msgs:
        api.batch("change_message_visibility_batch", info.dlq_url,
                  [{"ReceiptHandle": m.receipt, "VisibilityTimeout": 0} for m in msgs], lambda i, e: None)


def _delete(api: Api, info: QueueInfo, msgs: list[Incoming]) -> None:
    api.batch("delete_message_batch", info.dlq_url, [{"ReceiptHandle": m.receipt} for m in msgs],
              lambda i, e: None)


def list_dead(api: Api, info: QueueInfo, limit: int) -> list[DeadLetter]:
    msgs = list(_scan(api, info, limit))
    _show_again(api, info, msgs)
    return [DeadLetter(m.job_id, m.key, m.body, info.name, info.max_deliveries, m.error) for m in msgs]


def redrive(api: Api, info: QueueInfo, job_ids: list | None) -> int:
    """Move dead letters (all, or ``job_ids``) back; returns how many moved."""
    wanted = None if job_ids is None else set(job_ids)
    moved, skipped, seen = 0, [], set()
    while True:
        batch = [m for m in _scan(api, info, limits.SQS_BATCH_ENTRIES_MAX) if m.message_id not in seen]
        if not batch:  # nothing left, or only dead letters this call saw already
            break
        seen.update(m.message_id for m in batch)
        take = [m for m in batch if wanted is None or m.job_id in wanted]
        skipped.extend(m for m in batch if not (wanted is None or m.job_id in wanted))
        if take:
            copies = [encode(m.body, m.key, redrive_dedup_id(m.job_id, m.message_id), group=m.group).entry()
                      for m in take]
            errors: list = []
            api.batch("send_message_batch", info.url, copies, lambda i, e: errors.append(e))
            if errors:
                _show_again(api, info, take + skipped)
                raise errors[0]
            _delete(api, info, take)
            moved += len(take)
        if wanted is not None and moved >= len(wanted):
            break
    _show_again(api, info, skipped)
    return moved


def purge(api: Api, info: QueueInfo) -> int:
    """Delete every dead letter (receive + delete: an exact count, no PurgeQueue rate limit)."""
    n = 0
    while True:
        batch = list(_scan(api, info, limits.SQS_BATCH_ENTRIES_MAX))
        if not batch:
            return n
        _delete(api, info, batch)
        n += len(batch)
