"""The client core: what a client sends, re-sends, keeps and releases, with no socket, no
thread and no event loop (sans-I/O, as h11). The threaded :class:`~shardq.client.router.Router`
and the asyncio :class:`~shardq.client.aio.AsyncQueue` are drivers over it: they move the
bytes and wait; every rule below is written once, here (routing is in :mod:`.routing`).

* **Retry table** (:func:`after_break`): a request whose connection broke is sent again if
  it was never written, or if its op may be re-sent (:data:`shardq.protocol.wire.RETRY`);
  otherwise :class:`~shardq.errors.OutcomeUnknown`. Past its retry deadline:
  :class:`~shardq.errors.ShardUnavailable`.
* **Frames** (:func:`encode_frames`): the requests queued on one connection leave in one
  frame, cut into several only where together they pass ``limits.FRAME_BYTES_MAX`` or
  ``limits.FRAME_REQUESTS_MAX`` requests (a shard drops a connection that sends a larger
  frame); a request that cannot be encoded fails alone with :class:`~shardq.errors.InvalidJob`.
* **Lease rounds** (:class:`LeaseRound`): which shards to ask, in which order, when to peek
  at priorities and what to keep, release and take (:mod:`.priority`). **A round that
  fails, for any error (a shard's ProtocolError or InvalidJob, Closed, a cancelled caller),
  releases every lease it took**, unstarted (not counted as a delivery): none is left
  blocking its key until the visibility timeout.
* **Waiting dequeues** (:func:`wait_outcome`) and the loop of ``dequeue_many`` (:class:`Polling`).
* **Acks** (:func:`ack_error`): a ``JobGone`` answering a re-sent ack means the first landed.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Generator
from typing import Any, NamedTuple

from .. import limits
from ..errors import (AuthError, InvalidJob, JobGone, OutcomeUnknown, ProtocolError, ShardqError, ShardUnavailable,
                      TooManyConnections, UnknownQueue)
from ..protocol import validate, wire
from ..protocol.sockio import HANDSHAKE_TIMEOUT_S
from ..types import Lease
from .priority import merge, plan
from .routing import lease_shard, leases_of, shard_of_job

log = logging.getLogger("shardq.router")

DOWN_PROBE_S = 0.2  # how long dequeue tries to reach a shard that is down before skipping it
DOWN_RECHECK_S = 1.0  # a waiting dequeue with a shard down asks again this often
QUEUE_CONFIG_MAX_AGE_S = 1.0  # a client's queue_config is at most this old (a reload reaches it)
#: A lease round that holds leases waits at most this long for another shard's reply: the
#: leases in hand run down meanwhile (a hung shard had kept them past their deadline, and
#: they were returned expired, leased again elsewhere); a later reply's are released unstarted.
HELD_STEP_S = 1.0
#: A shard that had none ready of the jobs of a placed queue it held before a restart placed
#: the queue (docs/limits.md) is asked again this long after: such a job may come back.
LEFTOVERS_RECHECK_S = 5.0
#: ``stats`` waits this long at most for a shard's answer (a request timeout at most): one
#: that takes requests and does not answer (hung, stopped) is listed as unavailable rather
#: than holding ``shardq stats`` and the console's totals for the whole request timeout.
STATS_WAIT_S = 5.0
WAIT_REPLY_MARGIN_S = 0.5  # a waiting dequeue's [] may arrive this long after its wait ends
WITHDRAW_SETTLE_S = 2.0  # close() waits this long at most for withdrawals still in flight
_WIRE_INT_MAX = (1 << 64) - 1  # the largest integer msgpack holds
JOB_ID_MAX = (1 << 63) - 1     # the largest job id (validate.integer's rule)
_ENCODE_ERRORS = (ValueError, TypeError, OverflowError)  # what msgpack raises for what it cannot hold


class Call(NamedTuple):
    """One request a driver is asked to make."""
    shard: int
    op: str
    args: list[Any]


# ---------------------------------------------------------------------- connecting
RECONNECT_DELAY_S_MIN, RECONNECT_DELAY_S_MAX = 0.005, 0.2  # back-off between connection attempts


def failed_connect(shard: int, exc: Exception) -> ShardqError | None:
    """What a failed connection attempt means, on both connections: the error to raise now
    where trying again cannot help (another wire version, a wrong key), else None: try
    again (absent, refused, reset, silent, turned away) until the deadline, then
    :func:`unreachable`."""
    if isinstance(exc, ProtocolError):
        return ProtocolError(f"shard {shard}: {exc}")
    if type(exc).__name__ == "AuthenticationError":
        return AuthError(f"shard {shard}: authentication failed (wrong key file?)")
    return None


class Attempts:
    """The attempts of one connect of either connection to ``shard``, until ``deadline`` (its
    monotonic clock): each a handshake of at most :meth:`timeout`; after one that failed,
    :meth:`failed` gives the back-off before the next, or raises what ends them."""

    def __init__(self, shard: int, address: str, who: str, deadline: float) -> None:
        self.shard, self.address, self.who, self.deadline = shard, address, who, deadline
        self.delay = RECONNECT_DELAY_S_MIN

    def timeout(self, now: float) -> float:
        return max(0.05, min(HANDSHAKE_TIMEOUT_S, self.deadline - now))

    def failed(self, exc: Exception, now: float) -> float:
        if (fatal := failed_connect(self.shard, exc)) is not None:
            raise fatal from None
        if now + self.delay > self.deadline:
            raise unreachable(self.shard, self.address, exc, self.who) from None
        delay, self.delay = self.delay, min(self.delay * 2, RECONNECT_DELAY_S_MAX)
        return delay


def unreachable(shard: int, address: str, err: BaseException, who: str) -> ShardUnavailable:
    """The error of a shard no attempt reached before the deadline (``err``: the last
    attempt's); ``who``: the client, as the message names it."""
    if isinstance(err, TooManyConnections):
        return TooManyConnections(f"shard {shard} turned this {who} away: {err}")
    return ShardUnavailable(f"shard {shard} at {address} is not reachable: {err}")


# ---------------------------------------------------------------------- the retry table
class ConnectionLost(Exception):
    """The connection broke before the reply came: what a driver reports for a call of a
    :func:`~.effects.transmit` (the engine then re-sends, or raises ShardUnavailable /
    OutcomeUnknown: :func:`after_break`). ``sent``: the request had been written to the
    socket, so the shard may have applied it."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


def after_break(shard: int, op: str, sent: bool, expired: bool, why: object = "connection lost",
                written: bool = False) -> ShardqError | None:
    """What becomes of a request whose connection broke before its reply: None, send it
    again (on a new connection); else the error its caller gets. ``sent``: it was written
    this time, so the shard may have applied it; ``expired``: its retry deadline has
    passed; ``why``: what broke, for the message; ``written``: an earlier attempt was
    written (then a request given up at the deadline may have been applied too, unless it
    only reads, ``wire.READS``: ShardUnavailable)."""
    if sent and wire.RETRY[op] is not wire.RESEND:
        return OutcomeUnknown(f"shard {shard}: {op} was sent but the connection broke before its "
                              "reply; it may or may not have been applied")
    if expired:
        if (sent or written) and op not in wire.READS:
            return OutcomeUnknown(f"shard {shard}: {op} was sent, then its shard could not be reached to "
                                  f"learn its outcome within retry_s ({why}); it may or may not have been applied")
        return ShardUnavailable(f"shard {shard}: {why}")
    return None


#: Ops whose reply, if it comes after its caller has given up, is read and what it leased
#: released (client/channel.py): a timeout leaves nothing of theirs applied for the caller.
RELEASED_LATE = frozenset({"dequeue", "dequeue_wait"})


def no_answer(shard: int, op: str, within_s: float) -> ShardUnavailable:
    """The error of a written request not answered within its request timeout:
    OutcomeUnknown (the shard may apply it yet: a hung or paused shard), but for a dequeue,
    whose late reply is released, and a read (``wire.READS``), which applies nothing:
    ShardUnavailable."""
    text = f"shard {shard} did not answer {op} within {within_s:.1f} s"
    if op in RELEASED_LATE or op in wire.READS:
        return ShardUnavailable(text)
    return OutcomeUnknown(f"{text}; it was sent, and may or may not have been applied")


def ack_error(payload: Any, resent: bool) -> ShardqError | None:
    """The error of one ack's per-item reply ``payload`` (None: acked). A ``JobGone`` that
    answers a re-sent ack is no error: the first attempt was applied before the break."""
    err = wire.error_from_payload(payload)
    return None if resent and isinstance(err, JobGone) else err


def acks_by_shard(leases: list[Lease], shards: int | None = None) -> tuple[list[list[int]], list[Call]]:
    """The ``ack`` calls for ``leases``, one per shard (more for a shard's part past
    ``BATCH_JOBS_MAX``, which a shard refuses in one request): (the indexes of ``leases`` each call acks,
    the calls). Every lease is checked first (:func:`~.routing.lease_shard`: InvalidJob, and
    nothing is sent, for what is not a lease of a service of ``shards`` shards, or whose id
    or token is out of range: refused by the encoder or the shard, it would fail its
    shard's request only, after the other shards had acked theirs)."""
    per_shard: dict[int, list[int]] = {}
    for i, lease in enumerate(leases):
        per_shard.setdefault(lease_shard(lease, shards), []).append(i)
        job_id, token = lease.job_id, lease.token
        if type(job_id) is int and job_id > JOB_ID_MAX or type(token) is int and not 0 <= token <= _WIRE_INT_MAX:
            # else one shard's request fails (the encoder or the shard refuses it) after
            # the other shards acked theirs: half applied
            raise InvalidJob(f"not a lease: job {job_id} or token {token} is out of range (job ids are below "
                             "2**63, tokens fit the wire's 64-bit integers)")
    # a shard takes at most BATCH_JOBS_MAX pairs a request: more go in several, in order
    step = limits.BATCH_JOBS_MAX
    cut = [(s, idx[k:k + step]) for s, idx in per_shard.items() for k in range(0, len(idx), step)]
    calls = [Call(s, "ack", [[[leases[i].job_id, leases[i].token] for i in idx]]) for s, idx in cut]
    return [idx for _, idx in cut], calls


def ack_many_outcome(count: int, indexes: list[list[int]], replies: list[Any]) -> list[BaseException | None]:
    """Per lease of an ``ack_many``, None or its error, from each call's ``(errors, resent)``."""
    out: list[BaseException | None] = [None] * count
    for idx, (errs, resent) in zip(indexes, replies):
        for i, payload in zip(idx, errs):
            if payload is not None:
                out[i] = ack_error(payload, resent)
    return out


def note_calls(queues: list[str], shards: int) -> list[Call]:
    """The ``note_priorities`` calls that tell every shard ``queues`` use priorities."""
    return [Call(s, "note_priorities", [q]) for q in queues for s in range(shards)]


def missed_notes(calls: list[Call], results: list[Any]) -> set[str]:
    """The queues a shard that is down did not hear about (told again with the next
    prioritized enqueue); any other error, a typed refusal (an undeclared queue), is raised."""
    missed: set[str] = set()
    for (_, _, (queue,)), r in zip(calls, results):
        if isinstance(r, ShardUnavailable):
            missed.add(queue)
        elif isinstance(r, BaseException):
            raise r
    return missed


def release_call(lease: Lease) -> Call:
    """The request that hands ``lease`` back unstarted: a nack now that is not a delivery."""
    return Call(shard_of_job(lease.job_id), "nack",  # type: ignore[arg-type]  # ints on shards
                [lease.job_id, lease.token, 0, None, False])


# ---------------------------------------------------------------------- enqueue sessions
class Sessions:
    """The enqueue sessions of one client at one shard: each request carries ``[client
    id, its seq, the lowest seq still unanswered]``, so the shard answers a request re-sent
    after a broken connection with the ids of its first execution, and forgets the entries
    of the requests answered before the lowest."""

    def __init__(self, client_id: int) -> None:
        self.client_id = client_id
        self._seq = 0
        self._open: dict[int, None] = {}  # the seqs not yet answered, in order
        self._lock = threading.Lock()     # the threaded client's callers open them at once

    def open(self) -> list[int]:
        with self._lock:
            self._seq += 1
            seq = self._seq
            low = next(iter(self._open), seq)
            self._open[seq] = None
        return [self.client_id, seq, low]

    def close(self, session: list[int]) -> None:
        with self._lock:
            self._open.pop(session[1], None)


# ---------------------------------------------------------------------- frames
def encode_frames(requests: list[Any], refuse: Callable[[int, InvalidJob], object]) -> list[bytes]:
    """The frames that carry ``requests`` (each ``[request_id, op, args]``), in order: one
    frame, unless together they pass ``limits.FRAME_BYTES_MAX`` or are more than
    ``limits.FRAME_REQUESTS_MAX``. A request that cannot be encoded (text with a lone
    surrogate, an integer msgpack cannot hold), or that alone passes the limit, is left out
    and given to ``refuse(index, InvalidJob)``, so it fails alone instead of breaking the
    connection for every caller. Every frame returned is within both limits."""
    frame_max, count_max = limits.FRAME_BYTES_MAX, limits.FRAME_REQUESTS_MAX  # read per call: a test may lower them
    if len(requests) <= count_max:
        try:
            data = wire.pack(requests)
            if len(data) <= frame_max:
                return [data]
        except _ENCODE_ERRORS:
            pass
    frames: list[bytes] = []
    parts: list[bytes] = []
    size = 0
    for i, req in enumerate(requests):
        try:
            one = wire.pack(req)
        except _ENCODE_ERRORS as e:
            refuse(i, InvalidJob(f"{req[1]}: the request cannot be encoded: {e}"))
            continue
        if len(one) + 5 > frame_max:  # the clients cut batches: a bug if seen
            refuse(i, InvalidJob(f"{req[1]}: a request of {len(one)} bytes is over the "
                                 f"{frame_max}-byte frame limit"))
            continue
        if parts and (size + len(one) + 5 > frame_max or len(parts) == count_max):  # 5: the largest array header
            frames.append(wire.pack_array(parts))
            parts, size = [], 0
        parts.append(one)
        size += len(one)
    if parts:
        frames.append(wire.pack_array(parts))
    return frames


# ---------------------------------------------------------------------- lease rounds
def check_dequeue(max_jobs: object, wait: object, visibility: object) -> float:
    """Check a ``dequeue_many``'s arguments (InvalidJob); returns the wait in seconds."""
    validate.count("max_jobs", max_jobs, limits.BATCH_JOBS_MAX)
    # None and 0 mean no wait; any other value is checked (a falsy [] or "" was taken for 0)
    wait = 0.0 if wait is None or wait == 0 and type(wait) in (int, float) else \
        validate.seconds("wait", wait, hi=limits.WAIT_S_MAX)
    if visibility is not None:
        validate.seconds("visibility", visibility, hi=limits.VISIBILITY_TIMEOUT_S_MAX, positive=True)
    return wait


def nack_delay(delay: object) -> float:
    """A nack's delay, checked before it is sent (InvalidJob): None or 0 for none. The shard
    reads any falsy value as 0, so ``[]`` or ``""`` released the lease at once instead of
    being refused."""
    if delay is None or delay == 0 and type(delay) in (int, float):
        return 0
    return validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)


class LeaseRound:
    """One try at leasing ``max_jobs`` jobs of ``queue``, starting at shard ``first`` (for a
    queue placed at ``owner`` because it declares limits, docs/limits.md: only there and at
    the ``leftovers``, shards that may still hold jobs of it from before it was placed).

    A queue known to use priorities (``prioritized``) gets the highest over all shards
    (:mod:`.priority`): lease at ``first`` while peeking at the others, then keep, release
    and take more as the plan says. Any other queue is asked one shard at a time until
    ``max_jobs`` are leased; a lease that says its queue uses priorities switches to the
    plan at once (and sets :attr:`uses_priorities`). A shard that is down, or whose
    dequeue's outcome is unknown, is noted (:attr:`down`, :attr:`down_shards`,
    :attr:`unknown`) and skipped; the shards in ``down`` (found down by a recent round of
    this client) are not asked, unless every shard is: a round that met one paid a connect
    attempt's back-off, and every round that began there would pay it again.

    The driver calls :meth:`start`, makes the calls it gets (all at once), and hands one
    result per call, in order, to :meth:`receive` (the value, or the exception), until it
    gets no calls: then :attr:`leases` holds what the round returns. Any other error of a
    shard is raised by :meth:`receive` once every lease of that step is taken; whatever the
    round raises, or the driver meets (cancelled, closed), the driver releases
    :meth:`abandon`'s leases: a failed round keeps none."""

    def __init__(self, queue: str, visibility: float | None, max_jobs: int, first: int, shards: int,
                 prioritized: bool, owner: int | None = None, down: Collection[int] = (),
                 leftovers: Collection[int] = ()) -> None:
        self.queue, self.visibility, self.max_jobs, self.shards = queue, visibility, max_jobs, shards
        # first, then round the ring; a placed queue's jobs are on its owner (docs/limits.md),
        # but for those another shard held when a restart placed it (``leftovers``)
        self.order = [*range(first, shards), *range(first)]
        if owner is not None:
            self.order = [s for s in self.order if s == owner or s in leftovers]
        if down:
            self.order = [s for s in self.order if s not in down or s == owner] or self.order
        self.uses_priorities = prioritized
        self.down: list[ShardUnavailable] = []
        self.down_shards: list[int] = []  # the shards of :attr:`down`
        self.unknown: list[OutcomeUnknown] = []
        # the shards that hold no such queue (undeclared, its jobs on other shards); raised
        # when every shard asked said so
        self.absent: list[int] = []
        self._absent_error: UnknownQueue | None = None
        self._heard = False  # a shard answered otherwise (a reply, down, an unknown outcome)
        self.leases: list[Lease] = []
        self.empty: list[int] = []  # the shards whose dequeue leased nothing
        self.taken: list[Lease] = []  # leased in this round and not yet returned or released
        self._flagged = False         # the last step's leases say the queue uses priorities
        self._steps = self._run()

    def start(self) -> list[Call]:
        return self._advance(None)

    def receive(self, results: list[Any]) -> list[Call]:
        """The results of the last calls; returns the next calls ([]: the round is over)."""
        return self._advance(results)

    def abandon(self) -> list[Lease]:
        """The round failed: the leases it holds, for the driver to release unstarted."""
        taken, self.taken = self.taken, []
        self._steps.close()
        return taken

    def _advance(self, results: list[Any] | None) -> list[Call]:
        try:
            return self._steps.send(results)  # type: ignore[arg-type]  # None: the first send starts it
        except StopIteration as stop:
            if self._absent_error is not None and not self._heard:
                raise self._absent_error from None  # no shard holds it: a name the service does not know
            self.leases, self.taken = stop.value, []  # handed to the caller
            return []

    def _sort(self, calls: list[Call], results: list[Any], dequeues: int) -> list[Any]:
        """Each result of ``calls``: its value (for the first ``dequeues``, dequeue replies:
        ``(priority, lease)`` pairs, taken), or None for a shard down or an unknown outcome
        (noted). Any other error is raised after every lease of ``results`` is taken."""
        error = None
        values = []
        self._flagged = False
        for i, r in enumerate(results):
            if type(r) is list:  # a reply (the usual case): the checks below are for errors
                self._heard = True
                if i < dequeues:
                    self._flagged = self._flagged or bool(r and r[0][wire.USES_PRIORITIES])
                    r = leases_of(self.queue, r)
                    self.taken.extend([lease for _, lease in r])
            elif isinstance(r, OutcomeUnknown):
                self.unknown.append(r)  # never re-sent: a lease it may have made expires unheld
                self._heard = True
                r = None
            elif isinstance(r, ShardUnavailable):
                self.down.append(r)
                self.down_shards.append(calls[i].shard)
                self._heard = True
                r = None
            elif type(r) is UnknownQueue:
                self.absent.append(calls[i].shard)
                self._absent_error = r
                r = None
            elif isinstance(r, BaseException):
                error = error or r
                r = None
            values.append(r)
        if error is not None:
            raise error
        return values

    def _run(self) -> Generator[list[Call], list[Any], list[Lease]]:
        queue, vis, n, order = self.queue, self.visibility, self.max_jobs, self.order
        if self.uses_priorities and self.shards > 1:
            calls = [Call(order[0], "dequeue", [queue, vis, n])] + [Call(s, "peek", [queue, n]) for s in order[1:]]
            first, *peeks = self._sort(calls, (yield calls), 1)
            return (yield from self._settle(first or [], {s: p for s, p in zip(order[1:], peeks) if p}))
        held: list[tuple[int, Lease]] = []
        for k, shard in enumerate(order):
            calls = [Call(shard, "dequeue", [queue, vis, n - len(held)])]
            (got,) = self._sort(calls, (yield calls), 1)
            if got is None:
                continue
            if not got:
                self.empty.append(shard)
            held += got
            if got and self._flagged and self.shards > 1:  # the queue uses priorities
                self.uses_priorities = True
                rest = order[k + 1:]
                calls = [Call(s, "peek", [queue, n]) for s in rest]
                values = self._sort(calls, (yield calls), 0) if rest else []
                return (yield from self._settle(held, {s: p for s, p in zip(rest, values) if p}))
            if len(held) >= n:
                break
        return [lease for _, lease in held]

    def _settle(self, held: list[tuple[int, Lease]],
                peeks: dict[int, list[Any]]) -> Generator[list[Call], list[Any], list[Lease]]:
        """Keep the ``held`` leases the plan keeps, release the others unstarted and lease
        what the plan takes from the ``peeks``ed shards; highest priority first."""
        if not peeks:
            return [lease for _, lease in held]
        keep, release, take = plan(held, peeks, self.order, self.max_jobs)
        calls = [Call(s, "dequeue", [self.queue, self.visibility, k]) for s, k in take.items()]
        calls += [release_call(lease) for lease in release]
        if not calls:
            return merge(keep, held, [])
        results = yield calls
        released = set(map(id, release))  # answered (a failed release expires by itself)
        self.taken = [lease for lease in self.taken if id(lease) not in released]
        for r in results[len(take):]:
            if isinstance(r, BaseException):
                log.info("releasing a lower-priority lease failed (%s); it expires by itself", r)
        taken = self._sort(calls, results[:len(take)], len(take))
        return merge(keep, held, [t or () for t in taken])


#: What :func:`~.effects.wait_any` gives for a call it could not send (its shard not connected).
UNSENT: Any = object()


def wait_outcome(queue: str, answers: list[Any],
                 max_jobs: int) -> tuple[list[Lease], list[Lease], bool, BaseException | None]:
    """What the waiting dequeues of one wait come to: ``answers`` holds, per shard asked,
    its lease rows, its error, None (withdrawn, or its connection broke) or UNSENT.
    Returns ``(keep, release, uses_priorities, error)``: the first ``max_jobs`` leases to
    return, the others to release unstarted, whether a lease says the queue uses
    priorities, and the first error, to raise only when no lease is kept. (One loop, no
    helper: the end of a wake-up, figure W.)"""
    keep: list[Lease] = []
    release: list[Lease] = []
    error = None
    uses = False
    for a in answers:
        if a is None or a is UNSENT:
            continue
        if isinstance(a, BaseException):
            error = error or a
            continue
        # unpacked by name in wire.LeaseRow's order, as routing.leases_of does
        for job_id, key, body, attempt, token, deadline, _priority, uses_priorities in a:
            (keep if len(keep) < max_jobs else release).append(
                Lease(job_id, key, body, queue, attempt, token, deadline))
            uses = uses or uses_priorities
    return keep, release, uses, None if keep else error


class Polling:
    """The loop of one ``dequeue_many``, after each lease round: return what it leased,
    probe again when every shard is down, or wait for work until ``deadline`` (the
    driver's clock). Leases in hand are returned, never stranded by another shard's error;
    a service that stays down is reported after ``retry_s``. A round's dequeue whose
    connection broke after it was written raises OutcomeUnknown, but in a dequeue that
    waits (``waits``) with time left, which goes on waiting: what the lost request leased
    expires unheld, as what a lost waiting dequeue leased does (a shard restarted while a
    worker waited on it ended the worker's wait with an error)."""

    RETURN, PROBE, WAIT = "return", "probe", "wait"

    def __init__(self, shards: int, retry_s: float, deadline: float, waits: bool = False) -> None:
        self.shards, self.retry_s, self.deadline, self.waits = shards, retry_s, deadline, waits
        self.all_down_since: float | None = None

    def after_round(self, leases: list[Lease], down: list[ShardUnavailable], unknown: list[OutcomeUnknown],
                    now: float) -> str:
        if leases:
            return self.RETURN
        if unknown:
            if not self.waits or now >= self.deadline:
                raise unknown[0]
            down = [*down, *unknown]  # (asked again with the next round)
        if len(down) == self.shards:
            self.all_down_since = self.all_down_since or now
            if now >= self.deadline or now - self.all_down_since >= self.retry_s:
                raise down[0]
            return self.PROBE
        self.all_down_since = None
        return self.RETURN if self.deadline <= now else self.WAIT
