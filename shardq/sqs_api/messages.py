"""The message actions: send, receive, delete, change visibility (and their batches).

* A send is answered once ``enqueue`` has returned, so once the job is fsynced.
* On a FIFO queue the MessageGroupId is the job's key: shardq leases only the head of a key,
  so no later message of a group is received while one is in flight. The dedup id (given, or
  the body's SHA-256 with ContentBasedDeduplication), scoped to the queue's incarnation
  (:func:`incarnation_dedup_id`), is the job's ``dedup_id``: a duplicate within the queue's
  ``dedup_window`` (300 s by default, as SQS) answers the first send's MessageId and
  SequenceNumber; a queue deleted and created again remembers none of the one before. A
  FIFO message's DelaySeconds may be 0 only (ignored, as AWS: the queue's applies). A
  standard queue's MessageGroupId rides in the envelope.
* DeduplicationScope = queue (FIFO's default): a dedup id also stands across groups. The
  message and the claim of its id for the queue (a memo, :mod:`.memos`) are enqueued
  together; if another group claimed the id first, this message is cancelled and the send
  answers that group's message. A crash between the two writes can leave a duplicate, never
  an answered send with nothing behind it (:meth:`MessageActions._enqueue`).
* A receive is ``dequeue_many`` with the visibility as the lease; the receipt handle is the
  lease (:mod:`.handles`). A receive cancelled (its client has gone: the listener cancels
  its task) hands nothing out: a dequeue still waiting is withdrawn by the client, and
  leases it already holds are released (not counted as deliveries). A message past its
  queue's ``maxReceiveCount`` is moved to the dead-letter queue when a receive finds it, as
  SQS does: enqueued there, then acked here, or cancelled here if its lease has ended
  meanwhile (:func:`delete_held`); one too large for the dead-letter queue moves as it is
  stored, or goes to shardq's dead letters (:meth:`MessageActions._move`), and one that
  cannot move now is handed back: no receive fails because of one message. A FIFO receive
  with a ReceiveRequestAttemptId writes its receipts in a memo before it answers; a retry
  (in any process, after a restart too) answers them again while they are in flight. First
  receive times are memos too, on a queue where a receive has asked for
  ApproximateFirstReceiveTimestamp.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from typing import Any, NamedTuple

from .. import limits
from ..errors import Cancelled, JobGone, LeaseLost, NotFound, ShardqError, UnknownQueue
from ..types import Lease
from . import attributes as qattr
from . import handles
from . import message as m
from . import params as p
from .faults import fault, invalid, missing
from .memos import QUEUE as MEMO_QUEUE
from .memos import Claim, Memos

log = logging.getLogger("shardq.sqs_api")

VISIBILITY_ZERO_S = 0.001       # a receive with VisibilityTimeout 0: shardq leases are never 0 long
ATTEMPT_S = 300.0               # a ReceiveRequestAttemptId's answer: at most 5 minutes (AWS)
ATTEMPTS_NOTED = 10_000         # attempt ids this process answered lately (a retry skips its receive)
SYSTEM_NAMES = ("SenderId", "SentTimestamp", "ApproximateReceiveCount", "ApproximateFirstReceiveTimestamp",
                "SequenceNumber", "MessageDeduplicationId", "MessageGroupId", "AWSTraceHeader",
                "DeadLetterQueueSourceArn")


class Received(NamedTuple):
    """A lease to hand out, when it was received (ms), and its message as a receive shows it
    (:func:`.message.presented`: body, envelope head, message attributes, the body's UTF-8;
    read once)."""
    lease: Lease
    at_ms: int
    shown: tuple[str, dict[str, Any], dict[str, dict[str, Any]], bytes]

    @property
    def sent_ms(self) -> int | None:
        """When it was sent, if its envelope says (a bare body does not)."""
        sent = self.shown[1].get("t")
        return sent if isinstance(sent, int) else None


class MessageActions:
    """A mixin of :class:`~shardq.sqs_api.api.SqsApi` (which gives ``q``, ``catalog``,
    ``cfg``, ``clock``, ``queue()``, ``arn()``)."""

    q: Any
    catalog: Any
    cfg: Any
    clock: Any
    service_id: str

    def __init__(self) -> None:
        self.memos = Memos(self.q, self.clock)
        self.message_id = m.message_ids(self.service_id)  # a job's MessageId: m.message_id of this service
        # (queue, ReceiveRequestAttemptId) -> until (monotonic): answered here lately, so a retry
        # reads its memo before any receive (the memo itself is what every process shares)
        self._attempted: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._releases: set[asyncio.Task[None]] = set()  # hand-backs under way (each outlives its request)

    def queue(self, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def arn(self, name: str) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ send
    async def _prepare(self, name: str, rec: dict[str, Any], e: dict[str, Any],
                       ceilings: dict[str, int] | None = None) -> dict[str, Any]:
        """One message of a send, checked and made into a job (``job``) with its answer's
        MD5s; SqsApiError for anything AWS refuses. ``ceilings``: the queue's
        ``max_body_bytes`` once asked in this request (a batch asks once, not once an entry)."""
        attrs = rec["attributes"]
        fifo = name.endswith(".fifo")
        body = p.string(e, "MessageBody")
        if not body:
            raise missing("MessageBody")
        m.check_text("the message body", body)
        given, given_system = e.get("MessageAttributes"), e.get("MessageSystemAttributes")
        mattrs = m.check_attributes(given) if given is not None else {}
        sattrs = m.check_attributes(given_system, system=True) if given_system is not None else {}
        data = body.encode("utf-8")  # once: the size, the job's body and the MD5 read it
        size = len(data) + m.attributes_size(mattrs) if mattrs else len(data)
        max_size = int(attrs["MaximumMessageSize"])
        if size > max_size:
            raise invalid(f"One or more parameters are invalid. Reason: Message must be shorter than {max_size} "
                          f"bytes.")
        delay = p.integer(e, "DelaySeconds", 0, limits.SQS_API_DELAY_S_MAX)
        group = e.get("MessageGroupId")
        dedup = e.get("MessageDeduplicationId")
        explicit = dedup is not None
        if fifo:
            if delay:  # 0 is accepted and ignored, as AWS: the queue's DelaySeconds applies
                raise invalid(f"Value {delay} for parameter DelaySeconds is invalid. Reason: The request include "
                              f"parameter that is not valid for this queue type.")
            delay = None
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
        job_body = m.wrap(data, sent_ms=sent_ms, attrs=mattrs, system=sattrs, dedup_id=dedup if explicit else None,
                          group=None if fifo else group)
        ceiling = ceilings.get(name) if ceilings is not None else None
        if ceiling is None:
            ceiling = await self._max_body(name)
            if ceilings is not None:
                ceilings[name] = ceiling
        if len(job_body) > ceiling:
            raise invalid(_too_large(name, ceiling, size, len(job_body)))
        if fifo:  # the job's dedup id (and queue-wide claim) name this queue, not an earlier one of its name
            dedup = incarnation_dedup_id(rec, str(dedup))
        out: dict[str, Any] = {"job": {"body": job_body, "key": group if fifo else None, "delay": delay,
                                       "dedup_id": dedup},
                               "MD5OfMessageBody": m.md5_of_utf8(data)}
        if mattrs:
            out["MD5OfMessageAttributes"] = m.md5_of_attributes(mattrs)
        if sattrs:
            out["MD5OfMessageSystemAttributes"] = m.md5_of_attributes(sattrs)
        if fifo and attrs.get("DeduplicationScope", "queue") == "queue":
            out["queue_dedup"] = dedup
        return out

    async def _enqueue(self, name: str, prepared: list[dict[str, Any]]) -> list[int]:
        """Enqueue the jobs of sends to ``name``; the job id each send answers.

        DeduplicationScope = queue: each send's dedup id is claimed for the queue in a memo
        (:mod:`.memos`) whose value is the send's group, enqueued in the same ``enqueue_many``
        as the messages (their fsyncs overlap). A send whose id another group claimed first
        is a duplicate: its own copy is cancelled and it answers the message of that group
        with this id (an enqueue there with the dedup id finds it; if the first send never got
        that far, a crash, this one's body goes there). Whatever the order the two writes
        reach the disk in, a crash between them leaves at most a duplicate, never an answered
        send with nothing behind it."""
        if len(prepared) == 1 and prepared[0].get("queue_dedup") is None:
            # one job and no claim: the client's enqueue, merged with the other lone sends of
            # this loop turn into one request per shard (enqueue_many is a request of its own)
            job = prepared[0]["job"]
            return [await self.q.enqueue(job["body"], key=job["key"], queue=name, delay=job["delay"],
                                         dedup_id=job["dedup_id"])]
        jobs = [dict(prep["job"], queue=name) for prep in prepared]
        window = await self._dedup_window(name) if any(prep.get("queue_dedup") for prep in prepared) else 0.0
        claims = [(i, Claim("d", f"{name}\n{prep['queue_dedup']}", prep["job"]["key"], window))
                  for i, prep in enumerate(prepared) if prep.get("queue_dedup") is not None]
        ids, memos = await self.memos.enqueue_and_claim(jobs, [c for _, c in claims])
        for (i, claim), memo in zip(claims, memos):
            if memo is None or memo.mine or memo.value == claim.value:
                continue  # claimed here; the same group (shardq's dedup answered); or lapsed
            try:
                outcome = await self.q.cancel(ids[i])
            except ShardqError as e:  # it stays: a duplicate, never a loss
                log.info("event=sqs-api-duplicate-kept job=%s error=%s", ids[i], e)
            else:
                if outcome == "cancelling":  # received already: that delivery stands
                    log.info("event=sqs-api-duplicate-received job=%s", ids[i])
            job = prepared[i]["job"]
            ids[i] = await self.q.enqueue(job["body"], key=str(memo.value), queue=name, delay=job["delay"],
                                          dedup_id=job["dedup_id"])
        return ids

    async def _max_body(self, name: str) -> int:
        """The shardq queue's ``max_body_bytes``: the most a job (a message's envelope) takes."""
        return int((await self.q.queue_config(name)).get("max_body_bytes", limits.BODY_BYTES_MAX_DEFAULT))

    async def _dedup_window(self, name: str) -> float:
        return float((await self.q.queue_config(name)).get("dedup_window", limits.SQS_DEDUP_WINDOW_S))

    def _sent(self, name: str, job_id: int, prepared: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in prepared.items() if k not in ("job", "queue_dedup")}
        out["MessageId"] = self.message_id(job_id)
        if name.endswith(".fifo"):
            out["SequenceNumber"] = m.sequence_number(job_id)
        return out

    async def send_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, rec = self.queue(params)
        prepared = await self._prepare(name, rec, params)
        (job_id,) = await self._enqueue(name, [prepared])
        return self._sent(name, job_id, prepared)

    async def send_message_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
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
        ceilings: dict[str, int] = {}
        for e in entries:
            try:
                ok.append((e["Id"], await self._prepare(name, rec, e, ceilings)))
            except ShardqError as err:
                failed.append(batch_error(e["Id"], err))
        successful: list[dict[str, Any]] = []
        if ok:
            try:
                ids = await self._enqueue(name, [prep for _, prep in ok])
            except ShardqError as err:
                failed += [batch_error(eid, err) for eid, _ in ok]
            else:
                successful += [dict(self._sent(name, jid, prep), Id=eid) for (eid, prep), jid in zip(ok, ids)]
        order = {e["Id"]: i for i, e in enumerate(entries)}
        successful.sort(key=lambda e: order[e["Id"]])
        return {"Successful": successful, "Failed": failed}

    # ------------------------------------------------------------------ receive
    async def receive_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
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
        if "ApproximateFirstReceiveTimestamp" in wanted and not rec.get("first_receives"):
            # from now on this queue's first receives are remembered (memos): asked once, kept
            await asyncio.to_thread(self.catalog.note_first_receives, name)  # a catalog write: off the loop
            rec = self.catalog.get(name) or rec
        attempt = p.string(params, "ReceiveRequestAttemptId")
        if attempt is not None:
            if not name.endswith(".fifo"):
                attempt = None  # AWS ignores it on standard queues
            else:
                m.check_group_or_dedup("ReceiveRequestAttemptId", attempt)
                if self._answered_here(name, attempt):
                    again = await self._attempt_answer(name, rec, attempt, None, wanted, names)
                    if again is not None:
                        return again
        received = await self._receive(name, rec, n, vis, wait)
        if not received:
            return {}
        try:
            out = await self._present_all(name, rec, received, wanted, names)
            if attempt is not None:
                again = await self._attempt_answer(name, rec, attempt, (received, vis), wanted, names)
                if again is not None:  # an earlier receive with this attempt id: its answer, ours back
                    await self._release([r.lease for r in received])
                    return again
        except BaseException:  # a cancellation too (the client has gone)
            await self._release([r.lease for r in received])  # nothing of this receive reaches the client
            raise
        return {"Messages": out}

    async def _receive(self, name: str, rec: dict[str, Any], n: int, vis: int, wait: int) -> list[Received]:
        """Lease up to ``n`` messages to hand out, waiting up to ``wait`` s for the first.

        A cancellation (the listener cancels a request whose client has gone: a worker
        stopped mid-poll) hands out nothing, so nothing stays invisible for a visibility
        timeout that no one will see: a dequeue still waiting is withdrawn by the client
        (:mod:`shardq.client.aio`), and leases taken here are released."""
        deadline = self.clock.monotonic() + wait
        out: list[Received] = []
        # what decides whether a message may have to go (_keep), read once a receive
        attrs = rec["attributes"]
        retention_ms = int(attrs["MessageRetentionPeriod"]) * 1000
        target = qattr.redrive(attrs)
        receives_max = target[1] if target is not None else None
        presented = m.presented
        while True:
            remaining = max(0.0, deadline - self.clock.monotonic())
            leases = await self.q.dequeue_many(name, max_jobs=n, wait=remaining, visibility=vis or VISIBILITY_ZERO_S)
            now_ms = int(self.clock.now() * 1000)
            held = False  # a message that had to go and could not (yet): this receive waits no longer
            for i, lease in enumerate(leases):
                got = Received(lease, now_ms, presented(lease.body))
                sent = got.shown[1].get("t")  # a bare body ({} head) has no sent time: never past retention
                if not ((receives_max is not None and lease.attempt > receives_max)
                        or (isinstance(sent, int) and now_ms - sent > retention_ms)):
                    out.append(got)  # the usual message: kept, without a coroutine of its own
                    continue
                try:
                    keep = await self._keep(name, rec, got)
                except ShardqError as e:
                    # one message fails no receive: not handed out but handed back (not a
                    # receive), so the next receive that finds it tries again
                    log.warning("event=sqs-api-move-failed queue=%s job=%s error=%s", name, lease.job_id, e)
                    await self._release([lease])
                    keep, held = False, True
                except BaseException:
                    # nothing of this receive reaches the client: hand every lease back
                    await self._release([r.lease for r in out] + leases[i:])
                    raise
                if keep:
                    out.append(got)
            if out or held or remaining <= 0:
                return out

    async def _release(self, leases: list[Lease]) -> None:
        """Give back leases whose messages no client saw: unstarted, so not a receive. The
        hand-back runs as a task of its own: a request cancelled again meanwhile does not
        cut it short (:meth:`released` waits for those under way)."""
        if not leases:
            return
        task = asyncio.get_running_loop().create_task(self._release_all(leases))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        await asyncio.shield(task)

    async def _release_all(self, leases: list[Lease]) -> None:
        outcomes = await asyncio.gather(*(self.q.nack(lease, 0.0, delivered=False) for lease in leases),
                                        return_exceptions=True)
        for lease, outcome in zip(leases, outcomes):
            if isinstance(outcome, ShardqError):  # lost, or the shard is down: it expires by itself
                log.info("event=sqs-api-release-failed job=%s error=%s", lease.job_id, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def released(self) -> None:
        """Wait for the hand-backs under way (closing)."""
        while self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    # ------------------------------------------------------------------ ReceiveRequestAttemptId
    def _answered_here(self, name: str, attempt: str) -> bool:
        until = self._attempted.get((name, attempt))
        if until is not None and until < self.clock.monotonic():
            del self._attempted[(name, attempt)]
            until = None
        return until is not None

    async def _attempt_answer(self, name: str, rec: dict[str, Any], attempt: str,
                        ours: tuple[list[Received], int] | None, wanted: set[str],
                        names: list[str]) -> dict[str, Any] | None:
        """The answer of an earlier receive with this ReceiveRequestAttemptId (in any process,
        before a restart too) while its messages are still in flight, or None. With ``ours``
        (this receive's messages, its visibility), this receive's receipts are written as
        the attempt's memo first, before it answers; without, the memo is only looked at."""
        if ours is None:
            receipts: list[list[Any]] = []
            life = 0.0
        else:
            receipts = [[r.lease.job_id, r.lease.token, r.at_ms, r.lease.attempt, r.lease.key] for r in ours[0]]
            life = min(ATTEMPT_S, float(ours[1]))
        memo = await self.memos.claim("a", f"{name}\n{attempt}", receipts, life)
        if memo is None or memo.mine:
            if memo is not None and ours is not None:
                self._attempted[(name, attempt)] = self.clock.monotonic() + life
                while len(self._attempted) > ATTEMPTS_NOTED:
                    self._attempted.popitem(last=False)
            return None
        again: list[Received] = []
        jobs = await asyncio.gather(*(self.q.job(r[0]) for r in memo.value), return_exceptions=True)
        for (job_id, token, at_ms, count, key), job in zip(memo.value, jobs):
            if isinstance(job, NotFound):
                continue  # deleted since
            if isinstance(job, BaseException):
                raise job
            if job.get("state") == "leased":
                lease = Lease(job_id, key, job["body"], name, count, token, 0.0)
                again.append(Received(lease, at_ms, m.presented(lease.body)))
        if not again:
            return None
        return {"Messages": await self._present_all(name, rec, again, wanted, names)}

    # ------------------------------------------------------------------ presenting messages
    async def _keep(self, name: str, rec: dict[str, Any], r: Received) -> bool:
        """Whether a lease's message is handed out: not when past its retention (deleted) or
        past maxReceiveCount (moved to the dead-letter queue)."""
        attrs, lease, head, sent = rec["attributes"], r.lease, r.shown[1], r.sent_ms
        if sent is not None and r.at_ms - sent > int(attrs["MessageRetentionPeriod"]) * 1000:
            await self._forget(lease)
            return False
        target = qattr.redrive(attrs)
        return not (target is not None and lease.attempt > target[1] and
                    await self._move(name, lease, head, target[0]))

    async def _present_all(self, name: str, rec: dict[str, Any], received: list[Received], wanted: set[str],
                           names: list[str]) -> list[dict[str, Any]]:
        """The messages of ``received`` as ReceiveMessage answers them. What is the same for
        every message of the receive (the handle's MAC and queue tag, the message ids'
        prefix) is made once; a message's system attributes and first receive time are
        looked up only when asked for (or remembered for the queue)."""
        firsts = (await self._first_receives(name, rec, received, wanted)
                  if rec.get("first_receives") or "ApproximateFirstReceiveTimestamp" in wanted else {})
        handle = handles.encoder(self.catalog.key, name)
        message_id = self.message_id
        md5 = m.md5_of_utf8
        out = []
        for r in received:
            lease = r.lease
            job_id = int(lease.job_id)
            body, head, mattrs, utf8 = r.shown
            msg: dict[str, Any] = {
                "MessageId": head.get("m") or message_id(job_id),  # "m": kept by a move
                "ReceiptHandle": handle(job_id, int(lease.token), r.at_ms),
                "MD5OfBody": md5(utf8), "Body": body}
            if wanted:
                msg["Attributes"] = await self._system(name, rec["attributes"], lease, head, wanted,
                                                       firsts.get(job_id, r.at_ms))
            if mattrs and names:
                chosen = {k: v for k, v in mattrs.items() if _selected(k, names)}
                if chosen:
                    msg["MessageAttributes"] = m.to_wire(chosen)
                    msg["MD5OfMessageAttributes"] = m.md5_of_attributes(chosen)
            out.append(msg)
        return out

    async def _first_receives(self, name: str, rec: dict[str, Any], received: list[Received],
                        wanted: set[str]) -> dict[int, int]:
        """ApproximateFirstReceiveTimestamp of each message, by job id, from memos: written at
        a message's first receive on a queue where a receive has asked for it (the catalog
        says so), read back when asked for. A message first received before that, or whose
        memo has lapsed (the memo queue's dedup_window), gives its sent time."""
        claims: list[tuple[int, Claim]] = []
        for r in received:
            job_id, first = int(r.lease.job_id), r.lease.attempt == 1
            if (first and rec.get("first_receives")) or (not first and "ApproximateFirstReceiveTimestamp" in wanted):
                value = r.at_ms if first else (r.sent_ms or r.at_ms)
                claims.append((job_id, Claim("f", f"{name}\n{job_id}", value, await self._memo_window())))
        out: dict[int, int] = {}
        memos = await self.memos.claim_many([c for _, c in claims]) if claims else []
        for (job_id, claim), memo in zip(claims, memos):
            out[job_id] = int(memo.value) if memo is not None else int(claim.value)
        if "ApproximateFirstReceiveTimestamp" in wanted:
            for r in received:  # not remembered: the first receive is this one, or before it the sent time
                if int(r.lease.job_id) not in out and r.lease.attempt != 1:
                    out[int(r.lease.job_id)] = r.sent_ms or r.at_ms
        return out

    async def _memo_window(self) -> float:
        try:
            return float((await self.q.queue_config(MEMO_QUEUE)).get("dedup_window", limits.SQS_DEDUP_WINDOW_S))
        except UnknownQueue:  # not declared: the claim says so, naming the config
            return limits.SQS_DEDUP_WINDOW_S

    async def _system(self, name: str, rec_attrs: dict[str, str], lease: Lease, head: dict[str, Any],
                wanted: set[str], first: int) -> dict[str, str]:
        fifo = name.endswith(".fifo")
        out = {"SenderId": self.cfg.access_key_id or self.cfg.account_id,
               "ApproximateReceiveCount": str(lease.attempt),
               "ApproximateFirstReceiveTimestamp": str(first)}
        if "SentTimestamp" in wanted:
            sent = head.get("t")
            if not isinstance(sent, int):  # a bare body: the job's enqueue time, to about a second
                try:
                    sent = int((await self.q.job(lease.job_id))["enqueued_at"] * 1000)
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

    async def _move(self, name: str, lease: Lease, head: dict[str, Any], dlq: str) -> bool:
        """Move a message past maxReceiveCount to its dead-letter queue: enqueue there (with
        a dedup id of this job, so a crash between the two steps cannot make two), then
        delete it here (:func:`delete_held`). False if the dead-letter queue is gone (the
        message is delivered, as AWS).

        It goes with its source ARN and MessageId added to its envelope, as AWS keeps them;
        if that is over the dead-letter queue's ``max_body_bytes`` (a job enqueued natively
        at its queue's limit, a dead-letter queue with a lower limit), as it is stored here,
        without them; if that is over too, it is buried in shardq's dead letters of this
        queue (:meth:`_bury`). Never refused there, so it never stays to block the queue.
        An enqueue that fails (a shard down) raises: the receive hands it back and goes on
        without it (:meth:`_receive`)."""
        if self.catalog.get(dlq) is None:
            return False
        data, _ = m.unwrap(lease.body)
        # AWS keeps a message's MessageId (and attributes) when it moves it to a dead-letter queue
        moved = dict(head, q=self.arn(name), m=head.get("m") or self.message_id(int(lease.job_id)))
        moved.setdefault("t", int(self.clock.now() * 1000))
        body = m.rewrap(data, moved)
        room = await self._max_body(dlq)
        if len(body) > room:
            log.warning("event=sqs-api-move-as-stored queue=%s job=%s bytes=%d dead_letter_queue=%s max_body_bytes=%d",
                        name, lease.job_id, len(body), dlq, room)
            body = lease.body  # no DeadLetterQueueSourceArn, a MessageId of its own there
        if len(body) > room:
            await self._bury(name, lease, dlq, room)
            return True
        await self.q.enqueue(body, key=lease.key if dlq.endswith(".fifo") else None, queue=dlq,
                             dedup_id=f"shardq-dlq:{self.service_id}:{lease.job_id}"[:limits.DEDUP_ID_BYTES_MAX])
        await self._forget(lease)
        return True

    async def _bury(self, name: str, lease: Lease, dlq: str, room: int) -> None:
        """A message too large for its dead-letter queue goes to shardq's dead letters of its
        own queue (``shardq dead-letters``, which can retry it), out of every receive's way,
        with the reason as its error and a warning logged. A lease ended meanwhile: it stays,
        and the next receive that finds it buries it."""
        reason = (f"past maxReceiveCount, but its {len(lease.body)} bytes are over max_body_bytes = {room} of its "
                  f"dead-letter queue {dlq!r}")
        log.warning("event=sqs-api-dead-letter-too-large queue=%s job=%s %s", name, lease.job_id, reason)
        try:
            await self.q.bury(lease, error=reason)
        except LeaseLost as e:
            log.info("event=sqs-api-bury-late job=%s error=%s", lease.job_id, e)

    async def _forget(self, lease: Lease) -> None:
        await delete_held(self.q, lease)

    # ------------------------------------------------------------------ delete, visibility
    def _lease(self, name: str, handle: Any) -> tuple[Lease, int]:
        job_id, token, received_ms = handles.decoder(self.catalog.key, name)(handle)
        return Lease(job_id, None, b"", name, 0, token, 0.0), received_ms

    async def delete_message(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        lease, _ = self._lease(name, p.string(params, "ReceiptHandle", required=True))
        try:
            await self.q.ack(lease)
        except LeaseLost as e:
            _deleted_anyway(name, e)
        return {}

    async def delete_message_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        entries = p.entries(params, limits.SQS_BATCH_ENTRIES_MAX, limits.SQS_API_ENTRY_ID_CHARS_MAX)
        failed: list[dict[str, Any]] = []
        ids: list[str] = []
        leases: list[Lease] = []
        decode = handles.decoder(self.catalog.key, name)  # the batch's handles: one queue, one key
        for e in entries:
            try:
                job_id, token, _ = decode(e.get("ReceiptHandle"))
            except ShardqError as err:
                failed.append(batch_error(e["Id"], err))
            else:
                ids.append(e["Id"])
                leases.append(Lease(job_id, None, b"", name, 0, token, 0.0))
        successful = []
        results = await self.q.ack_many(leases) if leases else []
        for eid, outcome in zip(ids, results):
            if outcome is None:
                successful.append({"Id": eid})
                continue
            try:
                if isinstance(outcome, LeaseLost):
                    _deleted_anyway(name, outcome)
                else:
                    raise outcome
                successful.append({"Id": eid})
            except ShardqError as e2:
                failed.append(batch_error(eid, e2))
        return {"Successful": successful, "Failed": failed}

    async def _change(self, name: str, handle: Any, vis_value: Any) -> None:
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
                await self.q.nack(lease, 0.0)
            else:
                await self.q.extend(lease, float(vis))
        except LeaseLost:
            raise fault("MessageNotInflight", "The message referred to isn't in flight: its receipt handle is "
                                              "from an earlier receive, or it was deleted.") from None

    async def change_message_visibility(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        handle = p.string(params, "ReceiptHandle", required=True)
        if params.get("VisibilityTimeout") is None:
            raise missing("VisibilityTimeout")
        await self._change(name, handle, params.get("VisibilityTimeout"))
        return {}

    async def change_message_visibility_batch(self, params: dict[str, Any], host: str) -> dict[str, Any]:
        name, _ = self.queue(params)
        entries = p.entries(params, limits.SQS_BATCH_ENTRIES_MAX, limits.SQS_API_ENTRY_ID_CHARS_MAX)
        successful, failed = [], []
        # the entries at once: their calls leave in one loop turn, one request per shard
        outcomes = await asyncio.gather(*(self._change(name, e.get("ReceiptHandle"), e.get("VisibilityTimeout"))
                                          for e in entries), return_exceptions=True)
        for e, outcome in zip(entries, outcomes):
            if outcome is None:
                successful.append({"Id": e["Id"]})
            elif isinstance(outcome, ShardqError):
                failed.append(batch_error(e["Id"], outcome))
            else:
                raise outcome
        return {"Successful": successful, "Failed": failed}


def incarnation_dedup_id(rec: dict[str, Any], dedup: str) -> str:
    """The shardq dedup id of a FIFO send's dedup id (given, or content-based) to the queue of
    catalog record ``rec``: scoped to the queue's incarnation (:meth:`.catalog.Catalog.get`),
    so a queue deleted and created again under its name shares no dedup id with the one
    before (shardq keeps a queue's dedup ids for its ``dedup_window`` after a purge, and the
    queue-wide claims are memos keyed by it). ``<incarnation>:<id>``, or, past shardq's 128
    bytes, ``<incarnation>#<the id's SHA-256>`` (the two never meet). A record made before
    incarnations (an upgrade) has none: the id as given, so its open dedup windows hold. The
    MessageDeduplicationId a receive gives back is the envelope's, as sent."""
    incarnation = rec.get("incarnation")
    if not incarnation:
        return dedup
    scoped = f"{incarnation}:{dedup}"
    if len(scoped.encode("utf-8")) <= limits.DEDUP_ID_BYTES_MAX:
        return scoped
    return f"{incarnation}#{hashlib.sha256(dedup.encode('utf-8')).hexdigest()}"


async def delete_held(q: Any, lease: Lease) -> None:
    """Delete the message of ``lease``, which is not to be delivered again from its queue: it
    was moved (enqueued elsewhere first) or is past its retention. The lease may have ended
    already (a receive with VisibilityTimeout 0 leases for a millisecond, less than a move
    takes; a stalled move task outlives its 60 s): its ack still deletes it if nothing leased
    it since; one that finds it leased again cancels it instead, so no receive hands it out
    again (deleted when that lease is settled or ends). A crash before this leaves the message where it was: the next
    receive (or round) moves it again, under the same dedup id, so never twice."""
    try:
        await q.ack(lease)
    except (JobGone, Cancelled):
        return  # gone already, or cancelled and removed by this ack
    except LeaseLost:
        outcome = await q.cancel(int(lease.job_id))
        log.info("event=sqs-api-deleted-after-lease job=%s outcome=%s", lease.job_id, outcome)


def _too_large(name: str, ceiling: int, size: int, stored: int) -> str:
    """InvalidParameterValue's text for a message (``size`` bytes as SQS counts them) whose
    envelope (``stored`` bytes) is over the shardq queue's ``max_body_bytes``: the size that
    would fit with the same attributes, or, when they alone are over it, what they take."""
    fix = f"the shardq queue {name!r} has max_body_bytes = {ceiling} (raise it in [queue_defaults] or [queues.{name}])"
    room = ceiling - (stored - size)
    if room > 0:
        return f"One or more parameters are invalid. Reason: Message must be shorter than {room} bytes here: {fix}."
    return (f"One or more parameters are invalid. Reason: Message is {stored} bytes as stored here, with its "
            f"attributes, over the limit: {fix}.")


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
