"""One connection to a shard as a state machine, with no socket, no thread and no event loop
(sans-I/O, as h11's ``Connection``): both clients' connections are shells around it.

It owns what a connection must remember between bytes: request ids, the table of requests
written and not yet answered, the outbox of those not yet written, the merging of single
enqueues and acks of many callers into one request (and the splitting of its reply), the
request deadlines, what a break means for each request, the leases of replies nobody waits
for, and the withdrawal of a waiting dequeue nobody waits for. Time comes in as numbers
(``now``, on the executor's monotonic clock); bytes go out as frames and come in as decoded
replies. Every input returns the **completions** it caused: ``(waiter, value, error)``, a
waiter being whatever the executor handed in (an asyncio future; nothing, for the threaded
lone-call lane), or
:data:`RELEASE` with lease rows to hand back unstarted. The executor resolves them.

* **Frames.** :meth:`Channel.flush` gives ids to the outbox's requests (merging first) and
  returns their frames, one unless they pass the frame limit (:func:`~.core.encode_frames`);
  a request that cannot be encoded fails alone. A frame handed to the connection counts as
  written (the asyncio transport buffers what the socket does not take yet): after a break,
  its requests' outcome is unknown to the engine's retry table, never assumed unsent.
* **Merging.** Single-job enqueues (:meth:`Channel.enqueue_part`) and single-lease acks
  (:meth:`Channel.ack_part`) queued between two flushes leave as one request each (cut at
  ``BATCH_JOBS_MAX`` items, enqueues at :data:`MERGE_BYTES_MAX` body bytes); each waiter
  gets its item of the reply and whether the request was re-sent. A merged enqueue the
  shard refuses as a whole (all-or-nothing) is re-sent item by item, so one caller's bad
  queue never fails another's job.
* **A break** (:meth:`Channel.broken`). A request made with ``report`` (every call the
  engine makes) fails with :class:`~.core.ConnectionLost`, saying whether it was written:
  what is sent again is the engine's decision (:func:`~.effects.deliver`). A merged request,
  which only the connection knows, is decided here by the same table
  (:func:`~.core.after_break`): re-queued in order, with its session, or failed. With
  ``hold`` (the asyncio connection, which reconnects by itself) requests not yet written
  wait for the next connection until their retry deadline, in their order, so a later one
  never overtakes one written before the break; without (the threaded lone-call lane,
  which writes its one request itself), they fail unsent at once.
* **Giving up** (:meth:`Channel.abandon`, :meth:`Channel.tick`). A waiter that leaves takes
  its part only; a request left with no waiter leaves the outbox or the table, except a
  written ``dequeue``, kept until its reply so that its leases are released, and a written
  ``dequeue_wait``, withdrawn with ``cancel_wait``: kept until the shard says it was
  withdrawn, or released if it answered first. A break takes the shard's waits with it.
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .. import limits
from ..errors import Closed, OutcomeUnknown, ShardUnavailable, TooManyConnections
from ..protocol import wire
from .core import ConnectionLost, Sessions, after_break, encode_frames, no_answer

# A merged enqueue (or a combined round: combine.py) holds at most this many body bytes: with
# BATCH_JOBS_MAX items' keys, queues and dedup ids at their longest, its request stays far below
# REQUEST_BYTES_MAX.
MERGE_BYTES_MAX = 8 * 1024 * 1024
OWN_DEADLINE = frozenset(("watch", "dequeue_wait"))  # their callers time them: no request deadline
RELEASE = object()  # the waiter of a completion whose value is lease rows to hand back unstarted
_HEADER = struct.Struct("!i")
_WITHDRAWN, _ORPHAN = "withdraw", "orphan"
_DEQUEUES = ("dequeue", "dequeue_wait")  # the requests whose reply is lease rows

Completion = tuple[Any, Any, BaseException | None]


def closed_after_write(shard: int, op: str) -> OutcomeUnknown:
    """The error of a call that its client's close ended after its request was written:
    the shard may have applied it (as :func:`~.core.after_break`'s OutcomeUnknown)."""
    return OutcomeUnknown(f"shard {shard}: the client was closed after {op} was sent, before its reply; "
                          "it may or may not have been applied")


class Request:
    """One wire request and its waiters: one, or one per item of a merged request (None
    where that caller left)."""

    __slots__ = ("rid", "op", "args", "waiters", "sent", "resent", "retry_deadline", "deadline", "session",
                 "merged", "report", "orphan", "target", "done")

    def __init__(self, op: str, args: list[Any], waiters: list[Any], retry_deadline: float,
                 merged: bool = False, report: bool = True) -> None:
        self.rid = 0
        self.op, self.args, self.waiters = op, args, waiters
        self.sent = self.resent = self.done = False
        self.retry_deadline = retry_deadline
        self.deadline = 0.0
        self.session: list[int] | None = None
        self.merged, self.report = merged, report
        self.orphan: str | None = None      # _ORPHAN: release what its reply leases; _WITHDRAWN: a cancel_wait
        self.target: Request | None = None  # the wait a cancel_wait withdraws

    def live(self) -> bool:
        return self.waiters.count(None) != len(self.waiters)


class Channel:
    """The state of the connection to shard ``shard``. ``timeout_s``: every request but a
    wait fails with ShardUnavailable that long after it was made, through :meth:`tick`
    (None: the executor's callers time their own waits); ``hold``: see the module doc."""

    def __init__(self, shard: int, client_id: int, retry_s: float, timeout_s: float | None = None,
                 hold: bool = True, gone: Callable[[Any], bool] | None = None) -> None:
        self.shard, self.retry_s, self.timeout_s, self.hold = shard, retry_s, timeout_s, hold
        # gone(waiter): it stopped waiting before its caller could say so (an asyncio future a
        # cancellation reached in the loop turn its reply came in): a dequeue's leases for it
        # are released, not handed to nobody
        self.gone = gone
        self.sessions = Sessions(client_id)  # enqueue sessions not yet answered
        self.up = False
        self.closed = False
        self.pending: dict[int, Request] = {}
        self.outbox: list[Request] = []
        self.enq_parts: list[tuple[Any, list[Any]]] = []
        self.ack_parts: list[tuple[Any, list[Any]]] = []
        self.next_rid = 1       # the next request's id
        self._deadlines: deque[Request] = deque()  # by deadline: every request times out after the same

    # ------------------------------------------------------------------ inputs
    def connected(self) -> None:
        """A new connection is up."""
        self.up = True

    def idle(self) -> bool:
        return not self.pending and not self.outbox

    def __len__(self) -> int:
        """The requests due a reply or waiting to be written: a reader that finds none may
        sleep, since a request written later was queued after it looked."""
        return len(self.pending) + len(self.outbox)

    def submit(self, op: str, args: list[Any], waiter: Any, now: float,
               retry_s: float | None = None) -> Request | BaseException:
        """Queue a request for the next :meth:`flush`; the request, or at once the error
        its waiter gets: Closed, or (without ``hold``) a ConnectionLost, unsent, when no
        connection is up."""
        if self.closed:
            return Closed("client is closed")
        if not self.up and not self.hold:
            return ConnectionLost(f"shard {self.shard}: not connected", sent=False)
        req = Request(op, args, [waiter], now + (self.retry_s if retry_s is None else retry_s))
        self._queue(req, now)
        return req

    def enqueue_part(self, item: list[Any], waiter: Any) -> None:
        """A single-job enqueue, merged at the next flush; its value ``(job id, resent)``."""
        self.enq_parts.append((waiter, item))

    def ack_part(self, pair: list[Any], waiter: Any) -> None:
        """A single-lease ack, merged at the next flush; its value ``(error payload, resent)``."""
        self.ack_parts.append((waiter, pair))

    def flush(self, now: float) -> tuple[list[bytes], list[Completion]]:
        """The frames to write now (each with its length header), and the completions of
        requests refused on the way (not encodable, or nobody waits for them)."""
        self._merge(now)
        if not self.up or not self.outbox:
            return [], []
        reqs, self.outbox = self.outbox, []
        out: list[Request] = []
        rid, pending = self.next_rid, self.pending
        for req in reqs:
            if req.orphan is None and not req.live() or req.target is not None and req.target.done:
                self._finish(req)  # nobody waits for it (or for the wait it withdraws): never sent
                continue
            if req.op == "enqueue" and req.args[1] is None:  # a merged one (the engine's have theirs)
                req.args[1] = req.session = self.sessions.open()
            req.rid, req.sent = rid, True
            pending[rid] = req
            rid += 1
            out.append(req)
        self.next_rid = rid
        done: list[Completion] = []
        if not out:
            return [], done
        encoded = encode_frames([[r.rid, r.op, r.args] for r in out],
                                lambda i, error: done.extend(self._fail(out[i], error)))
        return [_HEADER.pack(len(payload)) + payload for payload in encoded], done

    def replies(self, replies: Iterable[list[Any]]) -> list[Completion]:
        """Decoded replies ``[rid, status, payload]``: who gets what."""
        done: list[Completion] = []
        pending = self.pending
        for rid, status, payload in replies:
            req = pending.pop(rid, None)
            if req is None:
                continue  # a watch or a request whose callers left
            req.done = True
            if req.session is not None:
                self._finish(req)
            if req.orphan is not None:
                if req.orphan is _WITHDRAWN:
                    if payload is True and req.target is not None and pending.get(req.target.rid) is req.target:
                        del pending[req.target.rid]  # withdrawn: no reply will come
                        self._finish(req.target)
                elif status == wire.OK and payload:
                    done.append((RELEASE, payload, None))  # leases nobody takes: released unstarted
            elif status == wire.OK:
                if req.merged:
                    resent = req.resent
                    done.extend((w, (p, resent), None) for w, p in zip(req.waiters, payload) if w is not None)
                elif payload and req.op in _DEQUEUES and self.gone is not None and self.gone(req.waiters[0]):
                    done.append((RELEASE, payload, None))
                else:
                    done.append((req.waiters[0], payload, None))
            elif req.merged and req.op == "enqueue" and len(req.waiters) > 1:
                for w, item in zip(req.waiters, req.args[0]):  # all-or-nothing: re-sent item by item
                    if w is not None:
                        single = Request("enqueue", [[item], None], [w], req.retry_deadline, True, False)
                        self._queue(single, req.deadline - (self.timeout_s or 0.0))  # the merged one's deadline
            else:
                done.extend(self._fail(req, wire.error_from_payload(payload)))
        return done

    def tick(self, now: float) -> list[Completion]:
        """The requests past their deadline fail: a written one with OutcomeUnknown (the
        shard may apply it yet; :func:`~.core.no_answer`), one never written with
        ShardUnavailable (a written dequeue stays, to release what its reply leases)."""
        done: list[Completion] = []
        queue = self._deadlines
        while queue and (queue[0].done or queue[0].deadline <= now):
            req = queue.popleft()
            if not req.done:
                error = no_answer(self.shard, req.op, self.timeout_s or 0.0) if req.sent or req.resent else \
                    ShardUnavailable(f"shard {self.shard} did not answer {req.op} within {self.timeout_s:.1f} s "
                                     "(not sent: no connection)")
                done.extend(self._fail(req, error, keep_dequeue=True))
        return done

    def next_deadline(self) -> float | None:
        queue = self._deadlines
        while queue and queue[0].done:
            queue.popleft()
        return queue[0].deadline if queue else None

    def abandon(self, req: Request, waiter: Any) -> bool:
        """``waiter`` stopped waiting for ``req`` (see the module doc). True when its reply
        came first: the completion that settles ``waiter`` is already handed out, and what
        it leased is the caller's to take or release, as for any reply."""
        if req.done:
            return waiter in req.waiters
        req.waiters = [None if w is waiter else w for w in req.waiters]
        if req.live():
            return False
        if not req.sent:
            if req in self.outbox:
                self.outbox.remove(req)
            self._finish(req)
        elif req.op == "dequeue" and self.pending.get(req.rid) is req:
            req.orphan = _ORPHAN
        elif req.op == "dequeue_wait" and self.pending.get(req.rid) is req:
            self._withdraw(req)
        else:
            self.pending.pop(req.rid, None)
            self._finish(req)
        return False

    def left(self, rid: int, op: str) -> None:
        """The caller of request ``rid``, which the executor wrote itself (the threaded
        lone-call path, its id taken from ``next_rid``), left before its reply: a
        ``dequeue`` is kept, as :meth:`abandon` keeps one, so that what its reply leases is
        released; a ``dequeue_wait`` is withdrawn too."""
        if op in ("dequeue", "dequeue_wait") and self.up:
            req = Request(op, [], [], 0.0, report=False)
            req.rid, req.sent, req.orphan = rid, True, _ORPHAN
            self.pending[rid] = req
            if op == "dequeue_wait":
                self._withdraw(req)

    def _withdraw(self, req: Request) -> None:
        """Withdraw the written wait ``req`` (``cancel_wait``)."""
        req.orphan = _ORPHAN  # a reply that beats the withdrawal: its leases are released
        cancel = Request("cancel_wait", [req.rid], [], 0.0, report=False)
        cancel.orphan, cancel.target = _WITHDRAWN, req
        self.outbox.append(cancel)

    def forget(self, waiter: Any) -> None:
        """A single enqueue's or ack's caller left: its part of a merged request goes (a
        rare path, so a scan)."""
        self.enq_parts = [p for p in self.enq_parts if p[0] is not waiter]
        self.ack_parts = [p for p in self.ack_parts if p[0] is not waiter]
        for req in [*self.pending.values(), *self.outbox]:
            if req.merged and waiter in req.waiters:
                self.abandon(req, waiter)
                return

    def broken(self, now: float) -> list[Completion]:
        """The connection broke: every request handed to it counts as written (see the
        module doc)."""
        self.up = False
        reqs = sorted(self.pending.values(), key=lambda r: r.rid)
        self.pending = {}
        done: list[Completion] = []
        requeue = []
        for req in reqs:
            if req.orphan is not None:
                self._finish(req)  # an abandoned dequeue: what it leased expires; a withdrawal: moot
            elif req.report:
                done.extend(self._fail(req, ConnectionLost(f"connection to shard {self.shard} lost", sent=req.sent)))
            elif (error := after_break(self.shard, req.op, req.sent, now >= req.retry_deadline,
                                       written=req.resent)) is not None:
                done.extend(self._fail(req, error))
            else:
                req.resent, req.sent = req.resent or req.sent, False
                requeue.append(req)
        self.outbox[:0] = [r for r in requeue if r.live()]
        if not self.hold:
            done.extend(self.unreachable(ConnectionLost(f"shard {self.shard}: not connected", sent=False)))
        return done

    def reconnect_deadline(self) -> float | None:
        """Until when a new connection is worth trying (None: nothing waits for one)."""
        return max((r.retry_deadline for r in self.outbox), default=None)

    def unreachable(self, error: BaseException) -> list[Completion]:
        """No connection came back: every request waiting to be written fails; one written
        before the break (waiting to be re-sent) with OutcomeUnknown, as the shard may have
        applied it."""
        if isinstance(error, ShardUnavailable) and not isinstance(error, TooManyConnections):
            error = ShardUnavailable(f"shard {self.shard}: {error}")
        reqs, self.outbox = self.outbox, []
        done = [c for req in reqs for c in self._fail(req, self._given_up(req, error))]
        done += [(w, None, error) for w, _ in self.enq_parts + self.ack_parts]
        self.enq_parts, self.ack_parts = [], []
        return done

    def _given_up(self, req: Request, error: BaseException) -> BaseException:
        """The error of ``req`` when its shard stays out of reach (``error``): OutcomeUnknown
        if an attempt was written."""
        if req.resent and isinstance(error, ShardUnavailable):
            return after_break(self.shard, req.op, False, True, error, written=True) or error
        return error

    def close(self) -> list[Completion]:
        """The client closes: every request fails. One written (now, or before a break it
        waits to be re-sent after) fails with :class:`~shardq.errors.OutcomeUnknown`: the
        shard may have applied it, and a caller told Closed would take it for never applied
        (an enqueue made again would be a duplicate). Any other fails with Closed."""
        self.closed, self.up = True, False
        error = Closed("client is closed")
        reqs, self.pending = [*self.pending.values(), *self.outbox], {}
        done = [c for req in reqs
                for c in self._fail(req, closed_after_write(self.shard, req.op) if req.sent or req.resent else error)]
        return done + self.unreachable(error)

    def orphans(self) -> bool:
        """Requests nobody waits for are still due a reply that matters (leases to release,
        a withdrawal to confirm)."""
        return any(r.orphan is not None for r in self.pending.values()) or \
            any(r.orphan is not None for r in self.outbox)

    # ------------------------------------------------------------------ inside
    def _queue(self, req: Request, now: float) -> None:
        if self.timeout_s is not None and req.op not in OWN_DEADLINE:
            req.deadline = now + self.timeout_s
            queue = self._deadlines
            while queue and queue[0].done:  # answered: most are, in order (keeps the queue short)
                queue.popleft()
            queue.append(req)
        self.outbox.append(req)

    def _merge(self, t: float) -> None:
        """This turn's single enqueues and acks as merged requests."""
        if not (self.enq_parts or self.ack_parts):
            return
        enq, self.enq_parts = self.enq_parts, []
        chunk: list[tuple[Any, list[Any]]] = []
        size = 0
        for part in enq:
            if chunk and (len(chunk) >= limits.BATCH_JOBS_MAX or size + len(part[1][0]) > MERGE_BYTES_MAX):
                self._add_merged("enqueue", chunk, t)
                chunk, size = [], 0
            chunk.append(part)
            size += len(part[1][0])
        if chunk:
            self._add_merged("enqueue", chunk, t)
        acks, self.ack_parts = self.ack_parts, []
        for i in range(0, len(acks), limits.BATCH_JOBS_MAX):
            self._add_merged("ack", acks[i:i + limits.BATCH_JOBS_MAX], t)

    def _add_merged(self, op: str, chunk: list[tuple[Any, list[Any]]], now: float) -> None:
        items = [item for _, item in chunk]
        req = Request(op, [items, None] if op == "enqueue" else [items], [w for w, _ in chunk],
                      now + self.retry_s, merged=True, report=False)
        self._queue(req, now)

    def _fail(self, req: Request, error: BaseException, keep_dequeue: bool = False) -> list[Completion]:
        """Every waiter of ``req`` gets ``error``. A written dequeue whose reply may still
        come stays (``keep_dequeue``), to release its leases when it does."""
        waiters, req.waiters = req.waiters, []
        if keep_dequeue and req.op == "dequeue" and req.sent and self.pending.get(req.rid) is req:
            req.orphan = _ORPHAN
        else:
            self.pending.pop(req.rid, None)
            self._finish(req)
            if not req.sent and req in self.outbox:
                self.outbox.remove(req)
        return [(w, None, error) for w in waiters if w is not None]

    def _finish(self, req: Request) -> None:
        req.done = True
        if req.session is not None:
            self.sessions.close(req.session)
            req.session = None
