"""The message actions: send, receive, delete, change visibility (and their batches).

* A send is answered once ``enqueue`` has returned, so once the job is fsynced.
* On a FIFO queue the MessageGroupId is the job's key: shardq leases only the head of a key,
  so no later message of a group is received while one is in flight. The dedup id (given, or
  the body's SHA-256 with ContentBasedDeduplication) is the job's ``dedup_id``: a duplicate
  within the queue's ``dedup_window`` (300 s by default, as SQS) answers the first send's
  MessageId and SequenceNumber. A standard queue's MessageGroupId rides in the envelope.
* A receive is ``dequeue_many`` with the visibility as the lease; the receipt handle is the
  lease (:mod:`.handles`). A message past its queue's ``maxReceiveCount`` is moved to the
  dead-letter queue when a receive finds it, as SQS does: enqueued there, then acked here.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
from typing import Any

from .. import limits
from ..errors import JobGone, LeaseLost, NotFound, ShardqError
from ..types import Lease
from . import attributes as qattr
from . import handles
from . import message as m
from . import params as p
from .faults import fault, invalid, missing

log = logging.getLogger("shardq.sqs_api")

VISIBILITY_ZERO_S = 0.001       # a receive with VisibilityTimeout 0: shardq leases are never 0 long
FIRST_RECEIVES_KEPT = 100_000   # ApproximateFirstReceiveTimestamp: remembered in memory (approximate)
ATTEMPTS_KEPT = 10_000          # ReceiveRequestAttemptId answers kept (FIFO), each for 5 minutes
ATTEMPT_S = 300.0
QUEUE_DEDUP_KEPT = 1_000_000    # queue-scope dedup ids remembered (in memory, each for the window)
POLL_SLICE_S = 2.0              # a long poll checks that its client is still there this often
SYSTEM_NAMES = ("SenderId", "SentTimestamp", "ApproximateReceiveCount", "ApproximateFirstReceiveTimestamp",
                "SequenceNumber", "MessageDeduplicationId", "MessageGroupId", "AWSTraceHeader",
                "DeadLetterQueueSourceArn")


class MessageActions:
    """A mixin of :class:`~shardq.sqs_api.api.SqsApi` (which gives ``router``, ``catalog``,
    ``cfg``, ``clock``, ``queue()``, ``arn()``)."""

    router: Any
    catalog: Any
    cfg: Any
    clock: Any
    service_id: str

    def __init__(self) -> None:
        self._first: collections.OrderedDict[int, int] = collections.OrderedDict()
        # (queue, ReceiveRequestAttemptId) -> (kept until, the answer)
        self._attempts: collections.OrderedDict[tuple[str, str], tuple[float, dict[str, Any]]] = \
            collections.OrderedDict()
        self._memo_lock = threading.Lock()
        # (queue, dedup id) -> (job id, remembered until): DeduplicationScope = queue across groups
        self._queue_dedup: collections.OrderedDict[tuple[str, str], tuple[int, float]] = collections.OrderedDict()
        #: per request thread: ``gone()`` says whether the client closed its connection
        self.caller = threading.local()

    def queue(self, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def arn(self, name: str) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ send
    def _prepare(self, name: str, rec: dict[str, Any], e: dict[str, Any]) -> dict[str, Any]:
        """One message of a send, checked and made into a job (``job``) with its answer's
        MD5s; SqsApiError for anything AWS refuses."""
        attrs = rec["attributes"]
        fifo = name.endswith(".fifo")
        body = p.string(e, "MessageBody")
        if not body:
            raise missing("MessageBody")
        m.check_text("the message body", body)
        mattrs = m.check_attributes(e.get("MessageAttributes"))
        sattrs = m.check_attributes(e.get("MessageSystemAttributes"), system=True)
        size = len(body.encode("utf-8")) + m.attributes_size(mattrs)
        max_size = int(attrs["MaximumMessageSize"])
        if size > max_size:
            raise invalid(f"One or more parameters are invalid. Reason: Message must be shorter than {max_size} "
                          f"bytes.")
        delay = p.integer(e, "DelaySeconds", 0, limits.SQS_API_DELAY_S_MAX)
        group = e.get("MessageGroupId")
        dedup = e.get("MessageDeduplicationId")
        explicit = dedup is not None
        if fifo:
            if delay is not None:
                raise invalid(f"Value {delay} for parameter DelaySeconds is invalid. Reason: The request include "
                              f"parameter that is not valid for this queue type.")
            if group is None:
                raise missing("MessageGroupId")
            m.check_group_or_dedup("MessageGroupId", group)
            if explicit:
                m.check_group_or_dedup("MessageDeduplicationId", dedup)
            elif attrs.get("ContentBasedDeduplication") == "true":
                dedup = hashlib.sha256(body.encode("utf-8")).hexdigest()
            else:
                raise invalid("The queue should either have ContentBasedDeduplication enabled or "
                              "MessageDeduplicationId provided explicitly")
        else:
            if explicit:
                raise invalid(f"Value {str(dedup)[:140]} for parameter MessageDeduplicationId is invalid. Reason: "
                              f"The request includes a parameter that is not valid for this queue type.")
            if group is not None:
                m.check_group_or_dedup("MessageGroupId", group)
        if delay is None:
            delay = int(attrs.get("DelaySeconds", "0"))
        sent_ms = int(self.clock.now() * 1000)
        job_body = m.wrap(body, sent_ms=sent_ms, attrs=mattrs, system=sattrs, dedup_id=dedup if explicit else None,
                          group=None if fifo else group)
        ceiling = self.router.queue_config(name).get("max_body_bytes", limits.BODY_BYTES_MAX_DEFAULT)
        if len(job_body) > ceiling:
            raise invalid(f"One or more parameters are invalid. Reason: Message must be shorter than "
                          f"{ceiling - (len(job_body) - size)} bytes here: the shardq queue {name!r} has "
                          f"max_body_bytes = {ceiling} (raise it in [queue_defaults] or [queues.{name}]).")
        out: dict[str, Any] = {"job": {"body": job_body, "key": group if fifo else None, "delay": delay,
                                       "dedup_id": dedup},
                               "MD5OfMessageBody": m.md5_of_body(body)}
        if mattrs:
            out["MD5OfMessageAttributes"] = m.md5_of_attributes(mattrs)
        if sattrs:
            out["MD5OfMessageSystemAttributes"] = m.md5_of_attributes(sattrs)
        if fifo and attrs.get("DeduplicationScope", "queue") == "queue":
            out["queue_dedup"] = dedup
        return out

    def _first_send(self, name: str, prepared: dict[str, Any]) -> int | None:
        """The job of an earlier send with this dedup id in another group of the queue
        (DeduplicationScope = queue), if this process remembers one within the window.
        Within one group shardq's own dedup answers, durably (docs/sqs-api.md)."""
        dedup = prepared.get("queue_dedup")
        if dedup is None:
            return None
        with self._memo_lock:
            kept = self._queue_dedup.get((name, dedup))
            if kept is not None and kept[1] > self.clock.monotonic():
                return kept[0]
        return None

    def _remember(self, name: str, prepared: dict[str, Any], job_id: int) -> None:
        dedup = prepared.get("queue_dedup")
        if dedup is None:
            return
        window = float(self.router.queue_config(name).get("dedup_window", limits.SQS_DEDUP_WINDOW_S))
        now = self.clock.monotonic()
        with self._memo_lock:
            self._queue_dedup.setdefault((name, dedup), (job_id, now + window))
            while len(self._queue_dedup) > QUEUE_DEDUP_KEPT or (
                    self._queue_dedup and next(iter(self._queue_dedup.values()))[1] <= now):
                self._queue_dedup.popitem(last=False)

    def _sent(self, name: str, job_id: int, prepared: dict[str, Any]) -> dict[str, Any]:
        self._remember(name, prepared, job_id)
        out = {k: v for k, v in prepared.items() if k not in ("job", "queue_dedup")}
        out["MessageId"] = m.message_id(self.service_id, job_id)
        if name.endswith(".fifo"):
            out["SequenceNumber"] = m.sequence_number(job_id)
        return out

    def send_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, rec = self.queue(params)
        prepared = self._prepare(name, rec, params)
        first = self._first_send(name, prepared)
        if first is not None:
            return self._sent(name, first, prepared)
        job = prepared["job"]
        job_id = self.router.enqueue(job["body"], key=job["key"], queue=name, delay=job["delay"],
                                     dedup_id=job["dedup_id"])
        return self._sent(name, job_id, prepared)

    def send_message_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, rec = self.queue(params)
        entries = p.entries(params, limits.SQS_BATCH_ENTRIES_MAX, limits.SQS_API_ENTRY_ID_CHARS_MAX)
        total = 0
        for e in entries:
            body = e.get("MessageBody")
            total += len(body.encode("utf-8", "surrogatepass")) if isinstance(body, str) else 0
            try:
                total += m.attributes_size(m.check_attributes(e.get("MessageAttributes")))
            except ShardqError:
                pass  # refused on its own below
        if total > limits.SQS_BATCH_BYTES_MAX:
            raise fault("BatchRequestTooLong", f"Batch requested message too long. Length: {total}; at most "
                                               f"{limits.SQS_BATCH_BYTES_MAX} bytes together.")
        ok: list[tuple[str, dict[str, Any]]] = []
        failed: list[dict[str, Any]] = []
        for e in entries:
            try:
                ok.append((e["Id"], self._prepare(name, rec, e)))
            except ShardqError as err:
                failed.append(batch_error(e["Id"], err))
        successful: list[dict[str, Any]] = []
        todo: list[tuple[str, dict[str, Any]]] = []
        for eid, prep in ok:
            first = self._first_send(name, prep)
            if first is None:
                todo.append((eid, prep))
            else:
                successful.append(dict(self._sent(name, first, prep), Id=eid))
        if todo:
            try:
                ids = self.router.enqueue_many([prep["job"] for _, prep in todo], queue=name)
            except ShardqError as err:
                failed += [batch_error(eid, err) for eid, _ in todo]
            else:
                successful += [dict(self._sent(name, jid, prep), Id=eid) for (eid, prep), jid in zip(todo, ids)]
        order = {e["Id"]: i for i, e in enumerate(entries)}
        successful.sort(key=lambda e: order[e["Id"]])
        return {"Successful": successful, "Failed": failed}

    # ------------------------------------------------------------------ receive
    def receive_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, rec = self.queue(params)
        attrs = rec["attributes"]
        n = p.integer_or(params, "MaxNumberOfMessages", 1, limits.SQS_API_RECEIVE_MAX, 1)
        vis = p.integer_or(params, "VisibilityTimeout", 0, limits.SQS_VISIBILITY_S_MAX, int(attrs["VisibilityTimeout"]))
        wait = p.integer_or(params, "WaitTimeSeconds", 0, limits.SQS_WAIT_S_MAX,
                            int(attrs["ReceiveMessageWaitTimeSeconds"]))
        system = {*p.string_list(params, "AttributeNames"), *p.string_list(params, "MessageSystemAttributeNames")}
        for s in system:
            if s not in SYSTEM_NAMES and s != "All" and s not in qattr.ALL_NAMES:
                raise fault("InvalidAttributeName", f"Unknown Attribute {s}.")
        wanted = set(SYSTEM_NAMES) if "All" in system else system & set(SYSTEM_NAMES)
        names = p.string_list(params, "MessageAttributeNames")
        attempt = p.string(params, "ReceiveRequestAttemptId")
        if attempt is not None:
            if not name.endswith(".fifo"):
                attempt = None  # AWS ignores it on standard queues
            else:
                m.check_group_or_dedup("ReceiveRequestAttemptId", attempt)
                again = self._attempt_answer(name, attempt)
                if again is not None:
                    return again
        deadline = self.clock.monotonic() + wait
        out: list[dict[str, Any]] = []
        handed: list[Lease] = []  # the leases of ``out``
        gone = getattr(self.caller, "gone", None) or (lambda: False)
        while True:
            remaining = max(0.0, deadline - self.clock.monotonic())
            # A long poll waits in slices and looks at its connection between them: a client
            # that has gone (a worker stopped mid-poll) must not be handed messages it will
            # never see, which would stay invisible for the whole visibility timeout.
            leases = self.router.dequeue_many(name, max_jobs=n, wait=min(remaining, POLL_SLICE_S),
                                              visibility=vis or VISIBILITY_ZERO_S)
            if gone():
                self._release(leases)
                return {}
            now_ms = int(self.clock.now() * 1000)
            for i, lease in enumerate(leases):
                try:
                    msg = self._deliver(name, rec, lease, now_ms, wanted, names)
                except BaseException:
                    # nothing of this receive reaches the client: hand every lease back
                    self._release(handed + leases[i:])
                    raise
                if msg is not None:
                    out.append(msg)
                    handed.append(lease)
            if out or remaining <= 0:
                break
        answer = {"Messages": out} if out else {}
        if attempt is not None and out:
            with self._memo_lock:
                self._attempts[(name, attempt)] = (self.clock.monotonic() + min(ATTEMPT_S, vis), answer)
                while len(self._attempts) > ATTEMPTS_KEPT:
                    self._attempts.popitem(last=False)
        return answer

    def _release(self, leases: list[Lease]) -> None:
        """Give back leases whose messages no client saw: unstarted, so not a receive."""
        for lease in leases:
            try:
                self.router.nack(lease, 0.0, delivered=False)
            except ShardqError as e:  # lost, or the shard is down: it expires by itself
                log.info("event=sqs-api-release-failed job=%s error=%s", lease.job_id, e)

    def _attempt_answer(self, name: str, attempt: str) -> dict[str, Any] | None:
        """The answer of an earlier receive with this ReceiveRequestAttemptId, while its
        messages are still in flight (a retry of a receive whose answer was lost)."""
        with self._memo_lock:
            kept = self._attempts.get((name, attempt))
            if kept is None or kept[0] < self.clock.monotonic():
                self._attempts.pop((name, attempt), None)
                return None
            return kept[1]

    def _deliver(self, name: str, rec: dict[str, Any], lease: Lease, now_ms: int, wanted: set[str],
                 names: list[str]) -> dict[str, Any] | None:
        """The message of one lease; None when it is not handed out: past its retention
        (deleted) or past maxReceiveCount (moved to the dead-letter queue)."""
        attrs = rec["attributes"]
        job_id, token = int(lease.job_id), int(lease.token)
        body, head, mattrs = m.presented(lease.body)
        sent = head.get("t")
        if isinstance(sent, int) and now_ms - sent > int(attrs["MessageRetentionPeriod"]) * 1000:
            self._forget(lease)
            return None
        target = qattr.redrive(attrs)
        if target is not None and lease.attempt > target[1] and self._move(name, lease, head, target[0]):
            return None
        with self._memo_lock:
            first = self._first.get(job_id)
            if first is None:
                first = self._first[job_id] = now_ms if lease.attempt == 1 else (sent or now_ms)
                while len(self._first) > FIRST_RECEIVES_KEPT:
                    self._first.popitem(last=False)
        msg: dict[str, Any] = {
            "MessageId": head.get("m") or m.message_id(self.service_id, job_id),  # "m": kept by a move
            "ReceiptHandle": handles.encode(self.catalog.key, name, job_id, token, now_ms),
            "MD5OfBody": m.md5_of_body(body), "Body": body}
        if wanted:
            msg["Attributes"] = self._system(name, attrs, lease, head, wanted, first)
        chosen = {k: v for k, v in mattrs.items() if _selected(k, names)}
        if chosen:
            msg["MessageAttributes"] = m.to_wire(chosen)
            msg["MD5OfMessageAttributes"] = m.md5_of_attributes(chosen)
        return msg

    def _system(self, name: str, rec_attrs: dict[str, str], lease: Lease, head: dict[str, Any],
                wanted: set[str], first: int) -> dict[str, str]:
        fifo = name.endswith(".fifo")
        out = {"SenderId": self.cfg.access_key_id or self.cfg.account_id,
               "ApproximateReceiveCount": str(lease.attempt),
               "ApproximateFirstReceiveTimestamp": str(first)}
        if "SentTimestamp" in wanted:
            sent = head.get("t")
            if not isinstance(sent, int):  # a bare body: the job's enqueue time, to about a second
                try:
                    sent = int(self.router.job(lease.job_id)["enqueued_at"] * 1000)
                except (NotFound, KeyError, TypeError):
                    sent = first
            out["SentTimestamp"] = str(sent)
        if fifo:
            out["MessageGroupId"] = lease.key or ""
            out["SequenceNumber"] = m.sequence_number(int(lease.job_id))
            dedup = head.get("d")
            if dedup is None and rec_attrs.get("ContentBasedDeduplication") == "true":
                dedup = hashlib.sha256(m.unwrap(lease.body)[0]).hexdigest()  # content-based: the body's SHA-256
            if dedup is not None:
                out["MessageDeduplicationId"] = dedup
        elif head.get("g") is not None:
            out["MessageGroupId"] = head["g"]
        trace = head.get("s", {}).get("AWSTraceHeader")
        if trace is not None:
            out["AWSTraceHeader"] = trace.get("StringValue", "")
        if head.get("q"):
            out["DeadLetterQueueSourceArn"] = head["q"]
        return {k: v for k, v in out.items() if k in wanted}

    def _move(self, name: str, lease: Lease, head: dict[str, Any], dlq: str) -> bool:
        """Move a message past maxReceiveCount to its dead-letter queue: enqueue there (with
        a dedup id of this job, so a crash between the two steps cannot make two), then ack
        here. False if the dead-letter queue is gone (the message is delivered, as AWS)."""
        if self.catalog.get(dlq) is None:
            return False
        data, _ = m.unwrap(lease.body)
        # AWS keeps a message's MessageId (and attributes) when it moves it to a dead-letter queue
        moved = dict(head, q=self.arn(name), m=head.get("m") or m.message_id(self.service_id, int(lease.job_id)))
        moved.setdefault("t", int(self.clock.now() * 1000))
        self.router.enqueue(m.rewrap(data, moved), key=lease.key if dlq.endswith(".fifo") else None, queue=dlq,
                            dedup_id=f"shardq-dlq:{self.service_id}:{lease.job_id}"[:limits.DEDUP_ID_BYTES_MAX])
        self._forget(lease)
        return True

    def _forget(self, lease: Lease) -> None:
        try:
            self.router.ack(lease)
        except LeaseLost:
            pass  # expired meanwhile: the next receive finds it again

    # ------------------------------------------------------------------ delete, visibility
    def _lease(self, name: str, handle: Any) -> tuple[Lease, int]:
        r = handles.decode(self.catalog.key, name, handle)
        return Lease(r.job_id, None, b"", name, 0, r.token, 0.0), r.received_ms

    def delete_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        lease, _ = self._lease(name, p.string(params, "ReceiptHandle", required=True))
        try:
            self.router.ack(lease)
        except LeaseLost as e:
            _deleted_anyway(name, e)
        return {}

    def delete_message_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        entries = p.entries(params, limits.SQS_BATCH_ENTRIES_MAX, limits.SQS_API_ENTRY_ID_CHARS_MAX)
        failed: list[dict[str, Any]] = []
        todo: list[tuple[str, Lease]] = []
        for e in entries:
            try:
                todo.append((e["Id"], self._lease(name, e.get("ReceiptHandle"))[0]))
            except ShardqError as err:
                failed.append(batch_error(e["Id"], err))
        successful = []
        results = self.router.ack_many([lease for _, lease in todo]) if todo else []
        for (eid, _), outcome in zip(todo, results):
            try:
                if isinstance(outcome, LeaseLost):
                    _deleted_anyway(name, outcome)
                elif outcome is not None:
                    raise outcome
                successful.append({"Id": eid})
            except ShardqError as e2:
                failed.append(batch_error(eid, e2))
        return {"Successful": successful, "Failed": failed}

    def _change(self, name: str, handle: Any, vis_value: Any) -> None:
        lease, received_ms = self._lease(name, handle)
        vis = p.integer({"VisibilityTimeout": vis_value}, "VisibilityTimeout", 0, limits.SQS_VISIBILITY_S_MAX)
        if vis is None:
            raise missing("VisibilityTimeout")
        now_ms = int(self.clock.now() * 1000)
        if now_ms + vis * 1000 - received_ms > limits.SQS_VISIBILITY_S_MAX * 1000:
            raise invalid(f"Value {vis} for parameter VisibilityTimeout is invalid. Reason: Total VisibilityTimeout "
                          f"for the message is beyond the limit [{limits.SQS_VISIBILITY_S_MAX} seconds]")
        try:
            if vis == 0:
                self.router.nack(lease, 0.0)
            else:
                self.router.extend(lease, float(vis))
        except LeaseLost:
            raise fault("MessageNotInflight", "The message referred to isn't in flight: its receipt handle is "
                                              "from an earlier receive, or it was deleted.") from None

    def change_message_visibility(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        handle = p.string(params, "ReceiptHandle", required=True)
        if params.get("VisibilityTimeout") is None:
            raise missing("VisibilityTimeout")
        self._change(name, handle, params.get("VisibilityTimeout"))
        return {}

    def change_message_visibility_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        entries = p.entries(params, limits.SQS_BATCH_ENTRIES_MAX, limits.SQS_API_ENTRY_ID_CHARS_MAX)
        successful, failed = [], []
        for e in entries:
            try:
                self._change(name, e.get("ReceiptHandle"), e.get("VisibilityTimeout"))
                successful.append({"Id": e["Id"]})
            except ShardqError as err:
                failed.append(batch_error(e["Id"], err))
        return {"Successful": successful, "Failed": failed}


def _deleted_anyway(name: str, e: LeaseLost) -> None:
    """A delete with a handle that is no longer current: on a standard queue AWS answers
    success and deletes nothing (the newer delivery stays); on a FIFO queue it refuses an
    expired handle. A message deleted already (JobGone) is a success on both."""
    if isinstance(e, JobGone) or not name.endswith(".fifo"):
        return
    raise fault("ReceiptHandleIsInvalid", "The receipt handle has expired.")


def _selected(name: str, wanted: list[str]) -> bool:
    for w in wanted:
        if w in ("All", ".*") or w == name or (w.endswith(".*") and name.startswith(w[:-1])):
            return True
    return False


def batch_error(entry_id: str, err: ShardqError) -> dict[str, Any]:
    """A batch entry's failure (BatchResultErrorEntry)."""
    from .faults import as_sqs
    e = as_sqs(err)
    return {"Id": entry_id, "SenderFault": e.sender, "Code": e.query_code, "Message": e.message}
