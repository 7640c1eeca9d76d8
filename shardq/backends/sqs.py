"""The Amazon SQS FIFO backend: the :class:`~shardq.client.queue.Queue` protocol on SQS.

``shardq.connect("sqs://<region>/<prefix>[?endpoint=URL]")`` returns a :class:`SqsQueue`.
The mapping (docs/scale-out.md has the full table):

* shardq queue ``Q`` = FIFO queue ``<prefix>-Q.fifo`` with dead-letter queue
  ``<prefix>-Q_dlq.fifo`` (``shardq sqs init`` creates both); key = message group; job id =
  the ``MessageId`` (a redriven copy keeps the original's); lease token = the receipt handle;
  ``visibility_timeout`` = the queue attribute; ``max_deliveries`` = ``maxReceiveCount``.
* **One lease per key at the API.** A receive may return several messages of one group;
  only the first is handed out, the rest wait in :class:`.sqs_buffer.HeadBuffer`, kept
  hidden by a keeper thread, and each is handed out after its predecessor is acked, or
  released in order before the head's lease ends.
* **Fencing.** An ack/nack/extend is refused locally with ``LeaseLost`` once the lease's
  deadline has passed (the local deadline is taken before the receive is sent, so it is
  never later than SQS's), or when this client already acked it (``JobGone``); SQS's own
  invalid-receipt-handle errors also map to ``LeaseLost``. So the fence on an ack, nack or
  extend holds even on servers that accept stale receipt handles. One step relies on the
  server: a receive answered later than half the visibility (a long poll, or a process
  stopped meanwhile) restarts the visibility before handing out, and a message another
  consumer received in between is refused there because its handle is stale (AWS refuses
  it; moto does not, so the tests' moto is made to).
* Refused with :class:`~shardq.errors.Unsupported`: a per-job ``delay`` and a non-zero
  ``priority`` (SQS FIFO has neither), a ``nack`` delay past SQS's 12 h visibility limit,
  purging chosen dead letters by job id.
* Times are whole seconds on SQS: visibility and waits are rounded up.
* **Hostile input.** A received message shardq did not write (see
  :func:`.sqs_mapping.decode`) is moved to the dead letters with the reason, once, and
  the receive goes on; a job id carried by a redriven copy is believed only if its mac
  verifies under the queue's redrive key.
"""
from __future__ import annotations

import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import limits
from ..clock import Clock, SystemClock
from ..errors import Closed, InvalidJob, JobGone, LeaseLost, ShardqError, ShardUnavailable, Unsupported
from ..protocol import validate
from ..types import DeadLetter, JobId, Lease
from .sqs_buffer import HeadBuffer, Held
from .sqs_client import Api, QueueInfo, chunks_by_size
from . import sqs_dead
from .sqs_mapping import (BACKEND, Foreign, Outgoing, decode, encode, error_for, group_id, is_retriable,
                          parse_target, redrive_dedup_id, shardq_queue)

log = logging.getLogger("shardq.sqs")

_JOB_FIELDS = frozenset({"body", "key", "queue", "delay", "priority", "dedup_id"})
ACKED_MEMORY = 100_000      # tokens this client acked, remembered for JobGone
SEND_RETRIES = 3            # rounds of re-sending batch entries SQS failed on its side
KEEPER_MARGIN_S_MAX = 2.0   # act on a follower this long before its deadline: at most this,
KEEPER_MARGIN_SHARE = 0.25  # ... and at most this share of the visibility timeout
RECEIVE_ROUNDS_EXTRA = 2    # receives per dequeue_many beyond max_jobs / 10
BUFFER_MAX = 200            # stop receiving more while this many followers are held
_SYS_ATTRS = sqs_dead.SYS_ATTRS


def _receipt(lease: Lease) -> str:
    """An sqs lease's token, its receipt handle; InvalidJob for any other token."""
    if not isinstance(lease.token, str) or not lease.token:
        raise InvalidJob(f"not an sqs lease token: {lease.token!r}")
    return lease.token


def _warn_overtaken(sent: list[tuple[int, QueueInfo, Outgoing]],
                    failed: list[tuple[int, QueueInfo, Outgoing]]) -> None:
    """Log each message group in which SQS accepted a message while failing an earlier one
    of the same SendMessageBatch on its side: the earlier one, re-sent, lands behind it, and
    nothing can move it back (a message cannot be un-sent). AWS documents that a batch is
    enqueued in order, not what a partial failure does to a group; see docs/scale-out.md."""
    failed_items = {id(item) for item in failed}
    failed_groups: set[str] = set()
    warned: set[str] = set()
    for item in sent:
        group = item[2].group
        if id(item) in failed_items:
            failed_groups.add(group)
        elif group in failed_groups and group not in warned:
            warned.add(group)
            log.warning("send_message_batch: SQS failed a message of group %r on its side and accepted a "
                        "later one of that group; the failed one is re-sent behind it, so the order of "
                        "these jobs of that key is not kept", group)


class SqsQueue:
    """A client of the SQS FIFO queues under one prefix. Thread-safe. See the module docstring."""

    backend = BACKEND
    #: Job fields this backend refuses when not at their default (``Unsupported``); the
    #: outbox relay records them so that ``outbox.enqueue`` refuses such rows up front.
    refuses = ("delay", "priority")

    def __init__(self, target: str, *, retry_s: float = 15.0, request_timeout_s: float = 30.0,
                 max_attempts: int | None = None, clock: Clock | None = None, client: Any = None):
        self.target = parse_target(target)
        if max_attempts is None:  # botocore's backoff grows to ~20 s; keep within retry_s
            max_attempts = max(2, min(8, int(math.log2(max(retry_s, 1.0))) + 2))
        self.api = Api(self.target, client, request_timeout_s=request_timeout_s, max_attempts=max_attempts)
        self.client = self.api.client  # for request counting (boto3 event hooks)
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._leases: dict[str, Held] = {}          # receipt handle -> lease handed out
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._buffer = HeadBuffer(hold_s=30.0)
        self._keeper: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._service_id: str | None = None

    # ------------------------------------------------------------------ identity
    @property
    def service_id(self) -> str:
        """``sqs:<region>:<account or endpoint>:<prefix>``: job ids are unique within it."""
        if self._service_id is None:
            t = self.target
            where = t.endpoint.split("://", 1)[-1].rstrip("/") if t.endpoint else self._account()
            self._service_id = f"sqs:{t.region}:{where}:{t.prefix}"
        return self._service_id

    def _account(self) -> str:
        import boto3
        try:
            account: str = boto3.session.Session().client("sts", region_name=self.target.region) \
                .get_caller_identity()["Account"]
            return account
        except Exception as e:  # noqa: BLE001 - identity is best effort; the prefix still binds
            log.warning("cannot read the AWS account id (%s); the service id names no account", e)
            return "unknown-account"

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise Closed("sqs client is closed")

    def _info(self, queue: str) -> QueueInfo:
        self._check_open()
        return self.api.queue(queue)

    def _outgoing(self, body: bytes, key: str | None, queue: str, delay: float, priority: int,
                  dedup: str | bytes | None) -> tuple[QueueInfo, Outgoing]:
        body = validate.body(body, limits.SQS_MESSAGE_BYTES_MAX)
        key = validate.key(key)
        if delay != 0:
            validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
            raise Unsupported("per-job delay is not supported by the sqs backend (SQS FIFO queues "
                              "have only a queue-level delay); enqueue without delay")
        if priority != 0:
            validate.priority(priority)
            raise Unsupported("priority is not supported by the sqs backend (SQS FIFO delivers "
                              "in send order per group); enqueue with priority 0")
        dedup = validate.dedup_id(dedup)
        info = self._info(queue)
        out = encode(body, key, dedup)
        if out.size > info.max_message_bytes:
            raise InvalidJob(f"body is {len(body)} bytes ({out.size} as SQS counts body and attributes), "
                             f"over the queue's limit of {info.max_message_bytes}")
        return info, out

    def _live(self, lease: Lease, now: float) -> Held | None:
        """The fence, checked locally before any request: raises LeaseLost/JobGone."""
        token = _receipt(lease)
        with self._lock:
            if token in self._acked:
                raise JobGone(f"job {lease.job_id}: this lease was already acked")
            held = self._leases.get(token)
        deadline = held.deadline if held is not None else lease.deadline
        if deadline > 0 and now >= deadline:
            self._lost(lease, now)
            raise LeaseLost(f"job {lease.job_id}: the lease ended at {deadline:.3f} (refused locally)")
        return held

    def _lost(self, lease: Lease, now: float) -> None:
        """The lease ended without an ack: forget it; release its group's followers."""
        token = _receipt(lease)
        with self._lock:
            held = self._leases.pop(token, None)
            release = self._buffer.drop(held.queue, held.msg.group, token, now) if held else []
        self._release(release)

    def _release(self, held: list[Held], first: tuple[Held, int] | None = None) -> None:
        """Make messages visible again (``first`` with its own delay), in order, in one
        batch per 10. Failures only mean they become visible when their timeout ends."""
        by_queue: dict[str, list[tuple[str, int]]] = {}
        if first is not None:
            by_queue.setdefault(first[0].queue, []).append((first[0].msg.receipt, first[1]))
        for h in held:
            by_queue.setdefault(h.queue, []).append((h.msg.receipt, 0))
        for queue, items in by_queue.items():
            entries = [{"ReceiptHandle": r, "VisibilityTimeout": v} for r, v in items]
            try:
                self.api.batch("change_message_visibility_batch", self.api.queue(queue).url, entries,
                               lambda i, e: log.info("release of a buffered message failed: %s", e))
            except ShardqError as e:
                log.warning("releasing %d buffered messages of %s failed (%s); they reappear when "
                            "their visibility timeout ends", len(entries), queue, e)

    def _lease_of(self, h: Held) -> Lease:
        m = h.msg
        return Lease(m.job_id, m.key, m.body, h.queue, m.attempt, m.receipt, h.deadline)

    # ------------------------------------------------------------------ producing
    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                priority: int = 0, dedup_id: str | None = None) -> str:
        """Durably add a job (SQS has stored it when SendMessage answers); returns its id.
        ``dedup_id``: scoped to (queue, key), SQS's fixed 5-minute window."""
        info, out = self._outgoing(body, key, queue, delay, priority, dedup_id)
        job_id: str = self.api.call("send_message", QueueUrl=info.url, **out.entry())["MessageId"]
        return job_id

    def enqueue_many(self, jobs: Iterable[dict[str, Any]], queue: str = "default") -> list[JobId]:
        """Every job is checked before anything is sent (bad input adds nothing). Sent in
        SendMessageBatch calls of at most 10 entries and 1 MiB, in input order. Entries SQS
        failed on its side are re-sent (same dedup ids, so a retry adds nothing twice); an
        entry refused for its content raises that error (earlier batches are in)."""
        items: list[tuple[int, QueueInfo, Outgoing]] = []
        for i, job in enumerate(jobs):
            if type(job) is not dict or "body" not in job or not job.keys() <= _JOB_FIELDS:
                raise InvalidJob(f"each job is a dict with 'body' and optional "
                                 f"{sorted(_JOB_FIELDS - {'body'})}")
            get = job.get
            info, out = self._outgoing(job["body"], get("key"), get("queue", queue), get("delay", 0),
                                       get("priority", 0), get("dedup_id"))
            items.append((i, info, out))
        ids: list[str | None] = [None] * len(items)
        by_queue: dict[str, list[tuple[int, QueueInfo, Outgoing]]] = {}
        for it in items:
            by_queue.setdefault(it[1].name, []).append(it)
        for qitems in by_queue.values():
            for chunk in chunks_by_size(qitems, lambda it: it[2].size, limits.SQS_BATCH_ENTRIES_MAX,
                                        limits.SQS_BATCH_BYTES_MAX):
                self._send_chunk(chunk, ids)
        return ids  # type: ignore[return-value]  # every entry set: _send_chunk fills its chunk's or raises

    def _send_chunk(self, chunk: list[tuple[int, QueueInfo, Outgoing]], ids: list[str | None]) -> None:
        url = chunk[0][1].url
        pending = chunk
        for _attempt in range(SEND_RETRIES + 1):
            resp = self.api.call("send_message_batch", QueueUrl=url,
                                 Entries=[dict(out.entry(), Id=str(k)) for k, (_, _, out) in enumerate(pending)])
            for ok in resp.get("Successful", []):
                ids[pending[int(ok["Id"])][0]] = ok["MessageId"]
            retry = []
            for f in sorted(resp.get("Failed", []), key=lambda f: int(f["Id"])):  # re-sent in input order
                code = f.get("Code", "")
                if f.get("SenderFault", True) and not is_retriable(code):
                    raise error_for(code, f.get("Message", ""), None, "send_message_batch")
                retry.append(pending[int(f["Id"])])
            if not retry:
                return
            _warn_overtaken(pending, retry)
            pending = retry  # SQS failed these on its side: re-send (same dedup ids)
        raise ShardUnavailable(f"send_message_batch: {len(pending)} entries still failing after "
                               f"{SEND_RETRIES} retries")

    # ------------------------------------------------------------------ consuming
    def dequeue(self, queue: str = "default", wait: float = 0.0, visibility: float | None = None) -> Lease | None:
        leases = self.dequeue_many(queue, max_jobs=1, wait=wait, visibility=visibility)
        return leases[0] if leases else None

    def dequeue_many(self, queue: str = "default", max_jobs: int = 100, wait: float = 0.0,
                     visibility: float | None = None) -> list[Lease]:
        """Lease up to ``max_jobs`` jobs, at most one per key. Waits (long polls, 20 s per
        request, looping for longer waits) only until the first job comes."""
        validate.count("max_jobs", max_jobs, limits.BATCH_JOBS_MAX)
        wait = validate.seconds("wait", wait, hi=limits.WAIT_S_MAX) if wait else 0.0
        if visibility is not None:
            validate.seconds("visibility", visibility, hi=limits.SQS_VISIBILITY_S_MAX, positive=True)
        info = self._info(queue)
        vis = math.ceil(visibility) if visibility is not None else info.visibility_s
        start = self._clock.monotonic()
        now = self._clock.now()
        with self._lock:
            held = self._buffer.take_available(queue, now, max_jobs)
            for h in held:
                self._leases[h.msg.receipt] = h
        out = [self._lease_of(h) for h in held]
        rounds = max_jobs // limits.SQS_BATCH_ENTRIES_MAX + RECEIVE_ROUNDS_EXTRA
        while len(out) < max_jobs and rounds > 0:
            rounds -= 1
            left = wait - (self._clock.monotonic() - start)
            wait_s = min(limits.SQS_WAIT_S_MAX, math.ceil(left)) if (not out and left > 0) else 0
            n = min(limits.SQS_BATCH_ENTRIES_MAX, max_jobs - len(out))
            got, heads = self._receive(info, queue, n, wait_s, vis)
            out.extend(self._lease_of(h) for h in heads)
            if got < n:
                if out or self._clock.monotonic() - start >= wait:
                    break
                rounds += 1  # an empty long poll: keep waiting until `wait` is over
            elif len(self._buffer) >= BUFFER_MAX:
                break
        return out

    def _receive(self, info: QueueInfo, queue: str, n: int, wait_s: int, vis: int) -> tuple[int, list[Held]]:
        """One ReceiveMessage; returns (messages received, heads to hand out)."""
        # The visibility is always sent, so the local deadline is what was asked for even
        # if someone changed the queue's attribute since this client read it.
        params = dict(QueueUrl=info.url, MaxNumberOfMessages=n, WaitTimeSeconds=wait_s, VisibilityTimeout=vis,
                      MessageSystemAttributeNames=_SYS_ATTRS, MessageAttributeNames=["All"],
                      # a retry of this request (by botocore) gets the same batch on AWS
                      ReceiveRequestAttemptId=uuid.uuid4().hex)
        t0 = self._clock.now()
        msgs = self.api.call("receive_message", **params).get("Messages", [])
        if not msgs:
            return 0, []
        margin = min(KEEPER_MARGIN_S_MAX, KEEPER_MARGIN_SHARE * vis)
        decoded = [decode(m, lambda: self.api.redrive_key(info), info.max_message_bytes) for m in msgs]
        # A message shardq did not write is never handed out, and never raises here (that
        # would stop every consumer that receives it): it goes to the dead letters with the
        # reason. Its group's later messages in this batch then lead (it is deleted first).
        sqs_dead.move_foreign(self.api, info, [m for m in decoded if isinstance(m, Foreign)])
        held = [Held(queue, m, t0 + vis, t0, margin) for m in decoded if not isinstance(m, Foreign)]
        if self._clock.now() - t0 > vis / 2:
            # A long poll answered late: the deadline taken before it is too early to be
            # useful. Restart the visibility now (the new deadline counts from this request).
            self._extend_held(held, vis)
        with self._lock:
            heads = self._buffer.admit([h for h in held if h.deadline > self._clock.now()], self._clock.now())
            for h in heads:
                self._leases[h.msg.receipt] = h
            followers = len(held) - len(heads)
            if followers:
                self._ensure_keeper()
                self._wake.notify()
        return len(msgs), heads

    def _extend_held(self, held: list[Held], seconds: int) -> None:
        t0 = self._clock.now()
        failed: set[int] = set()
        by_queue: dict[str, list[int]] = {}
        for i, h in enumerate(held):
            by_queue.setdefault(h.queue, []).append(i)
        for queue, idx in by_queue.items():
            entries = [{"ReceiptHandle": held[i].msg.receipt, "VisibilityTimeout": seconds} for i in idx]

            def fail(k: int, err: ShardqError, idx: list[int] = idx) -> None:
                failed.add(idx[k])
            try:
                self.api.batch("change_message_visibility_batch", self.api.queue(queue).url, entries, fail)
            except ShardqError as e:
                log.warning("extending %d held messages failed: %s", len(idx), e)
                failed.update(idx)
        for i, h in enumerate(held):
            if i not in failed:
                h.deadline = max(h.deadline, t0 + seconds)

    def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if the lease is no longer current (nothing changes)."""
        now = self._clock.now()
        self._live(lease, now)
        try:
            self.api.call("delete_message", QueueUrl=self._info(lease.queue).url, ReceiptHandle=lease.token)
        except LeaseLost:
            self._lost(lease, now)
            raise
        self._acked_ok(lease)

    def _acked_ok(self, lease: Lease) -> None:
        token = _receipt(lease)
        with self._lock:
            held = self._leases.pop(token, None)
            self._acked[token] = None
            while len(self._acked) > ACKED_MEMORY:
                self._acked.popitem(last=False)
            if held is not None:
                self._buffer.acked(held.queue, held.msg.group, token, self._clock.now())

    def ack_many(self, leases: Iterable[Lease]) -> list[BaseException | None]:
        """Ack many (DeleteMessageBatch, 10 per request); per lease, None or the error."""
        leases = list(leases)
        out: list[BaseException | None] = [None] * len(leases)
        now = self._clock.now()
        by_queue: dict[str, list[int]] = {}
        for i, lease in enumerate(leases):
            try:
                self._live(lease, now)
                by_queue.setdefault(self._info(lease.queue).url, []).append(i)
            except ShardqError as e:
                out[i] = e
        for url, idx in by_queue.items():
            def failed(k: int, err: ShardqError, idx: list[int] = idx) -> None:
                out[idx[k]] = err
            try:
                self.api.batch("delete_message_batch", url,
                               [{"ReceiptHandle": leases[i].token} for i in idx], failed)
            except ShardqError as e:
                for i in idx:
                    out[i] = out[i] or e
        for lease, err in zip(leases, out):
            if err is None:
                self._acked_ok(lease)
            elif isinstance(err, LeaseLost) and not isinstance(err, JobGone):
                self._lost(lease, now)
        return out

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
             delivered: bool = True) -> None:
        """Visible again after ``delay`` seconds (rounded up; ChangeMessageVisibility).

        SQS keeps no error text with a message: ``error`` is logged (logger ``shardq.sqs``)
        and not shown in dead letters. SQS counts every receive as a delivery, so
        ``delivered=False`` still costs the job one of its ``max_deliveries``; see
        docs/scale-out.md."""
        delay = validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
        validate.error_text(error)
        now = self._clock.now()
        held = self._live(lease, now)
        if held is not None:
            allowed = limits.SQS_VISIBILITY_S_MAX - (now - held.received_at)
            if delay > allowed:
                raise Unsupported(f"nack delay of {delay:.0f} s is not supported by the sqs backend: SQS "
                                  f"hides a message at most 12 h from its receipt ({allowed:.0f} s left)")
        if error:
            log.info("job %s attempt %s nacked: %s", lease.job_id, lease.attempt, error)
        token = _receipt(lease)
        with self._lock:
            self._leases.pop(token, None)
            followers = (self._buffer.drop(held.queue, held.msg.group, token, now)
                         if held is not None else [])
        try:
            self.api.call("change_message_visibility", QueueUrl=self._info(lease.queue).url,
                          ReceiptHandle=lease.token, VisibilityTimeout=math.ceil(delay))
        finally:
            self._release(followers)  # after the head: SQS redelivers the group head first

    def bury(self, lease: Lease, error: str | None = None) -> None:
        """Move the leased job to the dead-letter queue now, with ``error`` kept beside it.

        SQS has no such call: a copy goes to the dead-letter queue (same group, a dedup id
        that carries the job id, signed with the queue's redrive key, so a retried bury
        within 5 minutes adds no second copy),
        then the leased message is deleted. If the lease is lost between the two, the job
        is also delivered again (at-least-once); nothing is lost."""
        error = validate.error_text(error)
        now = self._clock.now()
        held = self._live(lease, now)
        info = self._info(lease.queue)
        group = (held.msg.group if held is not None else None) or group_id(lease.key)
        dedup = redrive_dedup_id(self.api.need_redrive_key(info), str(lease.job_id), "bury:" + _receipt(lease),
                                 group, lease.key, lease.body)
        copy = encode(lease.body, lease.key, dedup, group=group, error=error)
        if copy.size > info.max_message_bytes:  # a body at the limit leaves no room for the text
            copy = encode(lease.body, lease.key, dedup, group=group)
        self.api.call("send_message", QueueUrl=info.dlq_url, **copy.entry())
        self.ack(lease)

    def extend(self, lease: Lease, seconds: float) -> Lease:
        """Heartbeat: the lease ends ``seconds`` (rounded up) from now. SQS hides a message
        at most 12 h from its receipt: past that the returned deadline is shorter than asked
        (and ``LeaseLost`` once nothing is left)."""
        seconds = validate.seconds("seconds", seconds, hi=limits.SQS_VISIBILITY_S_MAX, positive=True)
        now = self._clock.now()
        held = self._live(lease, now)
        s = math.ceil(seconds)
        if held is not None:
            s = min(s, int(limits.SQS_VISIBILITY_S_MAX - (now - held.received_at)))
            if s < 1:
                self._lost(lease, now)
                raise LeaseLost(f"job {lease.job_id}: SQS's 12 h visibility limit for one receive is reached")
        try:
            self.api.call("change_message_visibility", QueueUrl=self._info(lease.queue).url,
                          ReceiptHandle=lease.token, VisibilityTimeout=s)
        except LeaseLost:
            self._lost(lease, now)
            raise
        deadline = now + s
        with self._lock:
            if held is not None:
                held.deadline = deadline
                self._buffer.head_extended(held.queue, held.msg.group, _receipt(lease), deadline)
        return lease._replace(deadline=deadline)

    # ------------------------------------------------------------------ the keeper thread
    def _ensure_keeper(self) -> None:
        if self._keeper is None or not self._keeper.is_alive():
            self._keeper = threading.Thread(target=self._keep, daemon=True, name="shardq-sqs-keeper")
            self._keeper.start()

    def _keep(self) -> None:
        """Keep buffered followers hidden while their head is live; release them (in order)
        before it ends; release available ones nobody takes."""
        while True:
            with self._lock:
                if self._closed:
                    return
                nxt = self._buffer.next_due()
                timeout = None if nxt is None else max(0.0, nxt - self._clock.now())
                if timeout is None or timeout > 0:
                    self._wake.wait(timeout if timeout is not None else 5.0)
                    continue
                now = self._clock.now()
                extend, release = self._buffer.due(now)
                self._buffer.forget_expired(now)
                for token in [t for t, h in self._leases.items() if h.deadline < now - 60]:
                    del self._leases[token]
            try:
                if release:
                    self._release(release)
                for queue in {h.queue for h in extend}:
                    mine = [h for h in extend if h.queue == queue]
                    self._extend_held(mine, self.api.queue(queue).visibility_s)
            except Exception:  # noqa: BLE001 - the keeper must outlive one failed request
                log.warning("sqs keeper: a request failed; retrying at the next due time", exc_info=True)

    # ------------------------------------------------------------------ settings, dead letters
    def queue_config(self, queue: str = "default") -> dict[str, Any]:
        info = self._info(queue)
        return {"visibility_timeout": float(info.visibility_s), "max_deliveries": info.max_deliveries,
                "dedup_window": limits.SQS_DEDUP_WINDOW_S, "max_body_bytes": info.max_message_bytes,
                "backend": BACKEND}

    def dead_letters(self, queue: str = "default", limit: int = 1000) -> list[DeadLetter]:
        """Dead letters, read by receiving them from the DLQ (see :mod:`.sqs_dead`):
        ``attempts`` = ``max_deliveries``, ``error`` None, at most 10 per key per call."""
        validate.count("limit", limit, 10**6)
        return sqs_dead.list_dead(self.api, self._info(queue), limit)

    def redrive(self, queue: str = "default", job_ids: list[JobId] | None = None) -> int:
        """Move dead letters (all, or ``job_ids``) back to the tail of their key with a fresh
        delivery count, keeping their job ids (done by this client: :mod:`.sqs_dead`)."""
        return sqs_dead.redrive(self.api, self._info(queue), job_ids, self._clock)

    def purge_dead_letters(self, queue: str = "default", job_ids: list[JobId] | None = None) -> int:
        """Delete every dead letter of ``queue`` (receive + delete: :mod:`.sqs_dead`).
        Purging chosen ``job_ids`` is not supported on SQS: :class:`Unsupported`, nothing
        deleted (redrive them by id, or purge all)."""
        if job_ids is not None:
            raise Unsupported(f"purge of dead letters by job id: not supported by the {BACKEND} backend "
                              "(purge all of them, or redrive chosen ones by id)")
        return sqs_dead.purge(self.api, self._info(queue))

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        """Per queue under the prefix, from SQS's queue attributes: **approximate** counts
        (SQS says so itself); ``waiting`` and ``keys`` are not known on SQS."""
        self._check_open()
        names = self._queue_names()
        queues = {}
        for q in names:
            info = self._info(q)
            a = self.api.call("get_queue_attributes", QueueUrl=info.url, AttributeNames=[
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed"])["Attributes"]
            d = self.api.call("get_queue_attributes", QueueUrl=info.dlq_url,
                              AttributeNames=["ApproximateNumberOfMessages",
                                              "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
            queues[q] = {"ready": int(a.get("ApproximateNumberOfMessages", 0)),
                         "delayed": int(a.get("ApproximateNumberOfMessagesDelayed", 0)),
                         "in_flight": int(a.get("ApproximateNumberOfMessagesNotVisible", 0)),
                         "dead": int(d.get("ApproximateNumberOfMessages", 0))
                         + int(d.get("ApproximateNumberOfMessagesNotVisible", 0)),
                         "approximate": True}
        return {"backend": BACKEND, "target": self.target.url(), "approximate": True,
                "queues": queues, "shards": []}

    def _queue_names(self) -> list[str]:
        names, token = [], None
        while True:
            params = {"QueueNamePrefix": self.target.prefix + "-", "MaxResults": 1000}
            if token:
                params["NextToken"] = token
            resp = self.api.call("list_queues", **params)
            for url in resp.get("QueueUrls", []):
                q = shardq_queue(self.target.prefix, url.rsplit("/", 1)[-1])
                if q is not None:
                    names.append(q)
            token = resp.get("NextToken")
            if not token:
                return sorted(names)

    def close(self) -> None:
        """Release buffered followers (in order) and stop the keeper. Leases handed out stay
        the caller's: they end at their deadline unless acked first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        # The keeper first: a release it has begun must land before the rest, or a key's
        # followers become visible out of order (moto then delivers them so).
        if self._keeper is not None:
            self._keeper.join(5)
        with self._lock:
            release = self._buffer.release_all(self._clock.now())
        self._release(release)

    def __enter__(self) -> SqsQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:  # mypy checks that the SQS backend is a Queue (client/queue.py)
    from ..client.queue import Queue

    def _contract(q: SqsQueue) -> Queue:
        return q
