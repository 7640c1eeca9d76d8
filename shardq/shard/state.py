"""The shard state machine: pure logic, no I/O, no clock, no randomness.

Every public method takes ``now`` (wall-clock seconds) from the caller, validates its
input (raising a typed error and changing nothing), then mutates the state only by
applying log operations (:mod:`.ops`) through :meth:`ShardState.apply`, the same function
replay uses. The operations produced are collected for the caller to persist
(:meth:`ShardState.take_ops`); a caller must make them durable before it replies, with one
exception: a lease of a ``lease_sync = "batched"`` queue whose job's enqueue is already
durable may be answered once its record is written, before its fsync (:mod:`.committer`).

Data layout, chosen so nothing is O(number of jobs) per request:

* ``jobs``: job id -> :class:`Job` (``__slots__``, no dict per job).
* per queue, per key: that key's jobs in enqueue order (a list while short, then a
  deque). Only the head can be ready, delayed or leased; the rest are WAITING. That gives
  per-key FIFO with at most one lease per key, and a long backlog under one key never
  hides other keys.
* per queue: one FIFO deque of READY jobs per priority, and a sorted list of priorities
  present; higher priority is served first, FIFO within a priority.
* shard-wide heaps: delayed jobs by due time, leases by expiry (entries are checked
  against the job when popped, so acks and extensions never search a heap).
"""
from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, deque
from typing import Iterator

import msgpack

from .. import limits
from ..config import Config, QueueConfig, check_queue_name
from ..errors import (InvalidJob, InvariantViolation, JobGone, LeaseLost, NotFound, QueueFull,
                      UnknownQueue, check)
from ..types import DeadLetter, Lease
from . import ops, validate
from .control import ACKED, DEAD_LETTERED, ENQUEUED, EXPIRED, LEASED, NACKED, REDRIVEN, ControlOps
from .jobstate import FROM_NEW, NEW, TRANSITIONS, D, G, JobState, L, R, W, X


#: A key's jobs are kept in a list while there are few (a deque costs ~600 bytes even for
#: one job; most keys hold a handful) and in a deque once it grows past this, where
#: removing the head of a list would start to cost a real copy.
KEY_LIST_MAX = 64

_SHARD_BITS = limits.JOB_ID_SHARD_BITS
_EPOCH_BITS = ops.TOKEN_EPOCH_BITS
_INT63 = 1 << 63
_ENQUEUE = ops.ENQUEUE
_JOB_ID = ops.JOB_ID
_DEDUP_EXPIRES = ops.field(ops.Enqueue, "dedup_expires")
_JOB_END = 1 + len(ops.Job._fields)
_DEDUP_END = 1 + len(ops.Dedup._fields)
_BATCH_JOBS_MAX, _REQUEST_BYTES_MAX = limits.BATCH_JOBS_MAX, limits.REQUEST_BYTES_MAX
#: One job, every field at its maximum, always fits in a request: only batches are measured.
_ONE_JOB_FITS = (64 + 16 + validate.job_bytes(b"", "k" * limits.KEY_BYTES_MAX, "q" * limits.QUEUE_NAME_BYTES_MAX,
                                              "d" * limits.DEDUP_ID_BYTES_MAX)
                 + limits.BODY_BYTES_MAX_CEILING <= _REQUEST_BYTES_MAX)
#: A key this short is within limits.KEY_BYTES_MAX whatever its characters (4 UTF-8 bytes
#: at most each): only longer ones are encoded to be measured.
_KEY_FAST_CHARS = limits.KEY_BYTES_MAX // 4


class Job:
    # Eight slots keep a job at 96 bytes. A lease (token, deadline) lives in
    # ShardState.inflight and a last error in ShardState.errors: few jobs have either.
    __slots__ = ("id", "q", "key", "body", "priority", "ready_at", "attempts", "state")

    def __init__(self, job_id, q, key, body, priority, ready_at):
        self.id = job_id
        self.q = q
        self.key = key
        self.body = body
        self.priority = priority
        self.ready_at = ready_at
        self.attempts = 0
        self.state = NEW


class QueueState:
    """One named queue on one shard."""

    __slots__ = ("name", "cfg", "ready", "prios", "keys", "dead", "dedup", "dedup_order", "counts",
                 "paused", "totals", "prioritized")

    def __init__(self, name: str, cfg: QueueConfig):
        self.name = name
        self.cfg = cfg
        self.ready: dict[int, deque] = {}
        self.prios: list[int] = []          # negated priorities, ascending = highest first
        self.keys: dict[str, deque] = {}
        self.dead: dict[int, Job] = {}      # in order of death
        self.dedup: dict[tuple, tuple[int, float]] = {}
        self.dedup_order: deque = deque()   # (expires_at, dedup key), oldest first
        self.counts = [0, 0, 0, 0, 0, 0]    # by JobState
        self.paused: float | None = None    # paused since (control.py)
        self.totals = [0] * 8               # counters since this process started (control.COUNTERS)
        self.prioritized = False            # ever held a job of priority != 0, or was told so

    def push_ready(self, job: Job) -> None:
        dq = self.ready.get(job.priority)
        if dq is None:
            dq = self.ready[job.priority] = deque()
            bisect.insort(self.prios, -job.priority)
        dq.append(job)


class ShardState(ControlOps):
    """The state of one shard. See the module docstring for the guarantees. Pause, cancel,
    look-ups and metrics figures are in :class:`~shardq.shard.control.ControlOps`."""

    def __init__(self, shard_index: int, config: Config):
        check(0 <= shard_index < (1 << limits.JOB_ID_SHARD_BITS), "shard index out of range")
        self.shard_index = shard_index
        self.config = config
        self.max_pending = config.limits.max_pending_jobs
        self.max_dedup = config.limits.max_dedup_ids
        self.dedup_held = 0   # dedup entries kept over every queue (each until its window ends)
        self.jobs: dict[int, Job] = {}
        self.queues: dict[str, QueueState] = {}
        self.delayed: list[tuple[float, int]] = []
        self.leases: list[tuple[float, int, int]] = []
        self.inflight: dict[int, tuple[int, float]] = {}   # job id -> (token, expires_at)
        self.errors: dict[int, str] = {}                    # job id -> last error
        self.next_seq = 1
        self.next_token = 1
        self.epoch = 0               # lease tokens are >= epoch << TOKEN_EPOCH_BITS (begin_epoch)
        self.sync_forced = False     # an operation that must be durable before any reply (EPOCH)
        self.sessions: OrderedDict[int, list] = OrderedDict()  # client -> [last_seen, {seq: ids}]
        self._sessions_due = float("-inf")  # when the oldest session expires (advance)
        self.undeclared: set[str] = set()  # queues the log holds and today's config does not declare
        self._ops: list[list] = []
        self._atomic: list[tuple[int, int]] = []  # index ranges of _ops that share one record
        self._now = float("-inf")
        #: code -> the method that applies it, derived from the one table of operations
        self._apply = {code: getattr(self, spec.apply) for code, spec in ops.REGISTRY.items()}
        self._init_control()

    # ------------------------------------------------------------------ plumbing
    def take_ops(self) -> list[list]:
        """The operations produced since the last call; the caller persists them."""
        return self.take_batch()[0]

    def take_batch(self) -> tuple[list[list], list[tuple[int, int]]]:
        """The operations produced since the last call, and the index ranges among them
        that must be logged in one record (a batch enqueue: all or nothing)."""
        out, atomic = self._ops, self._atomic
        self._ops, self._atomic = [], []
        return out, atomic

    def apply(self, op: list) -> None:
        """Apply one logged operation (replay and live path alike)."""
        try:
            fn = self._apply[op[0]]
        except (KeyError, TypeError, IndexError):
            check(False, f"unknown log operation {op!r:.80}")
        fn(op)

    def replay(self, records) -> None:
        """Apply every operation of every record, in order (the fast path of :meth:`apply`)."""
        table = self._apply
        try:
            for record in records:
                for op in record:
                    table[op[0]](op)
        except (KeyError, TypeError, IndexError) as e:
            raise InvariantViolation(f"log operation could not be applied: {type(e).__name__}: {e}") from e

    def _emit(self, op: list) -> None:
        self._apply[op[0]](op)
        self._ops.append(op)

    def _queue(self, name, *, create: bool = True) -> QueueState:
        """The queue ``name`` for a live request: UnknownQueue if the config does not
        declare it (with ``declare_queues``) and it holds nothing."""
        q = self.queues.get(name)
        if q is None:
            check_queue_name(name, InvalidJob)
            cfg = self.config.queue(name)
            if cfg is None:
                raise UnknownQueue(f"queue {name!r} is not declared in the config")
            q = QueueState(name, cfg)
            if create:
                self._room_for_queues(1)
                self.queues[name] = q
        return q

    def _room_for_queues(self, n: int) -> None:
        if len(self.queues) + n > limits.QUEUES_MAX:
            raise QueueFull(f"shard {self.shard_index} holds {len(self.queues)} queues, the most it takes "
                            f"({limits.QUEUES_MAX}); use keys, not queue names, for many small partitions")

    def _logged_queue(self, name: str) -> QueueState:
        """The queue a logged operation names. Replay never depends on today's config: a
        queue removed from it (``declare_queues``) while it still held jobs is rebuilt with
        the queue defaults and listed in :attr:`undeclared`; its jobs stay reachable
        (stats, dead letters, dequeue by name) and only new enqueues are refused."""
        q = self.queues.get(name)
        if q is None:
            cfg = self.config.queue(name)
            if cfg is None:
                cfg = self.config.queue_defaults
                self.undeclared.add(name)
            q = self.queues[name] = QueueState(name, cfg)
        return q

    def _set(self, job: Job, new: JobState) -> None:
        old = job.state
        if old is None:
            if new not in FROM_NEW:
                check(False, f"job {job.id}: illegal transition new -> {new!r}")
        else:
            if (old, new) not in TRANSITIONS:
                check(False, f"job {job.id}: illegal transition {old!r} -> {new!r}")
            job.q.counts[old] -= 1
        job.q.counts[new] += 1
        job.state = new

    def _make_available(self, job: Job) -> None:
        """``job`` just became the head of its key (or is keyless): ready, or delayed."""
        if job.ready_at and job.ready_at > self._now:
            self._set(job, D)
            heapq.heappush(self.delayed, (job.ready_at, job.id))
        else:
            self._set(job, R)
            job.q.push_ready(job)

    def _unlink_head(self, job: Job) -> None:
        """Take ``job`` off the front of its key and let the next job of the key move up."""
        if job.key is None:
            return
        q = job.q
        kq = q.keys.get(job.key)
        if kq is None or kq[0] is not job:
            check(False, f"job {job.id} is not the head of key {job.key!r}")
        if type(kq) is list:
            del kq[0]
        else:
            kq.popleft()
        if kq:
            self._make_available(kq[0])
        else:
            del q.keys[job.key]

    def _append_to_key(self, job: Job) -> None:
        if job.key is None:
            self._make_available(job)
            return
        kq = job.q.keys.get(job.key)
        if kq is None:
            job.q.keys[job.key] = [job]
            self._make_available(job)
        else:
            job.key = kq[0].key  # one string object per key, not one per job (memory)
            kq.append(job)
            if type(kq) is list and len(kq) > KEY_LIST_MAX:
                job.q.keys[job.key] = deque(kq)
            self._set(job, W)

    # ------------------------------------------------------------------ time
    def advance(self, now: float) -> None:
        """Move due delayed jobs to ready and reclaim expired leases, earliest first.

        A reclaimed job that has had ``max_deliveries`` deliveries goes to the dead-letter
        queue (a logged operation); any other becomes ready again (at-least-once).
        """
        self._now = now
        delayed, jobs = self.delayed, self.jobs
        while delayed and delayed[0][0] <= now:
            ready_at, jid = heapq.heappop(delayed)
            job = jobs.get(jid)
            if job is not None and job.state is D and job.ready_at == ready_at:
                self._set(job, R)
                job.q.push_ready(job)
        leases = self.leases
        while leases and leases[0][0] <= now:
            expires_at, token, jid = heapq.heappop(leases)
            job = jobs.get(jid)
            if job is None or self.inflight.get(jid) != (token, expires_at):
                continue  # acked, released, extended or re-leased since
            job.q.totals[EXPIRED] += 1
            if self.cancelled and jid in self.cancelled:
                self._emit([ops.CANCEL, jid])  # a cancelled lease ended: the job goes
            elif job.attempts >= job.q.cfg.max_deliveries:
                job.q.totals[DEAD_LETTERED] += 1
                self._emit([ops.DEAD, jid, self.errors.get(jid) or f"lease expired after {job.attempts} deliveries"])
            else:
                del self.inflight[jid]
                self._set(job, R)
                job.q.push_ready(job)
        if now >= self._sessions_due or len(self.sessions) > limits.CLIENT_SESSIONS_MAX:
            self._expire_sessions(now)

    def _expire_sessions(self, now: float) -> None:
        """Forget the least recently seen clients past the TTL or the count limit, and note
        when the oldest one left comes due (advance() looks again only then)."""
        sessions = self.sessions
        ttl = limits.CLIENT_SESSION_TTL_S
        horizon = now - ttl
        while sessions and (len(sessions) > limits.CLIENT_SESSIONS_MAX
                            or next(iter(sessions.values()))[0] < horizon):
            sessions.popitem(last=False)
        # A client seen later than the oldest one expires later: this is never too late.
        self._sessions_due = (next(iter(sessions.values()))[0] if sessions else now) + ttl

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`advance` would change something."""
        times = []
        if self.delayed:
            times.append(self.delayed[0][0])
        if self.leases:
            times.append(self.leases[0][0])
        return min(times) if times else None

    # ------------------------------------------------------------------ enqueue
    def enqueue(self, body, now: float, key=None, queue="default", delay=0.0, priority=0,
                dedup_id=None) -> int:
        """Add one job; returns its id. See :meth:`enqueue_many`."""
        return self.enqueue_many([(body, key, queue, delay, priority, dedup_id)], now)[0]

    def enqueue_many(self, items, now: float, session: tuple[int, int, int] | None = None) -> list[int]:
        """Add jobs given as ``(body, key, queue, delay, priority, dedup_id)`` tuples.

        All or nothing: every item is validated before any is added. A ``dedup_id`` seen
        in the same queue and key scope within the queue's dedup window returns the first
        job's id and adds nothing. ``session`` = (client id, request seq, lowest unanswered
        seq) makes a retried request return the ids of its first execution.
        """
        self.advance(now)
        if session is not None:
            if type(session) not in (tuple, list) or len(session) != 3:
                raise InvalidJob("session must be (client, seq, low)")
            cid, cseq, low = session
            if not (type(cid) is int and type(cseq) is int and type(low) is int  # the usual shape
                    and 0 <= cid < _INT63 and 0 <= cseq < _INT63 and 0 <= low < _INT63):
                cid, cseq, low = (validate.integer("session", v) for v in session)
            entry = self.sessions.get(cid)
            if entry is not None and cseq in entry[1]:
                return list(entry[1][cseq])
        n = len(items)
        if not 1 <= n <= _BATCH_JOBS_MAX:
            raise InvalidJob(f"a batch holds 1 to {_BATCH_JOBS_MAX} jobs, got {n}")
        if len(self.jobs) + n > self.max_pending:
            raise QueueFull(f"shard {self.shard_index} holds {len(self.jobs)} jobs; limit {self.max_pending}")
        checked = []
        queues, undeclared = self.queues, self.undeclared
        new_queues: dict[str, QueueState] = {}
        log_bytes = 64 + 16 * n  # the session op and its job ids
        for item in items:
            if type(item) not in (tuple, list) or len(item) != 6:
                raise InvalidJob("each job is (body, key, queue, delay, priority, dedup_id)")
            b, k, qname, delay, prio, did = item
            if type(qname) is not str:
                raise InvalidJob(f"queue must be a string, got {type(qname).__name__}")
            q = queues.get(qname)
            if q is None:
                q = new_queues.get(qname)
                if q is None:
                    q = new_queues[qname] = self._queue(qname, create=False)
            elif undeclared and qname in undeclared:
                raise UnknownQueue(f"queue {qname!r} is no longer declared in the config: its remaining "
                                   "jobs can be dequeued and its dead letters handled, but it takes no new jobs")
            max_body = q.cfg.max_body_bytes
            if not (type(b) is bytes and 0 < len(b) <= max_body):
                b = validate.body(b, max_body)
            if k is not None and not (type(k) is str and 0 < len(k) <= _KEY_FAST_CHARS):
                k = validate.key(k)
            if type(delay) is not int or delay:  # fast path for the common int 0
                delay = validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
            if type(prio) is not int or prio:
                prio = validate.priority(prio)
            if did is not None:
                did = validate.dedup_id(did)
            checked.append((b, k, qname, delay, prio, did, q))
        if n > 1 or not _ONE_JOB_FITS:
            log_bytes += validate.jobs_bytes(checked)
        if self.dedup_held + n > self.max_dedup:
            self._room_for_dedup_ids(checked, now)
        if log_bytes > _REQUEST_BYTES_MAX:
            # Its operations must be logged as one record (all or nothing across a crash).
            raise InvalidJob(f"a batch of {n} jobs takes up to {log_bytes} bytes, over the "
                             f"{_REQUEST_BYTES_MAX}-byte limit of one request; send it in smaller batches")
        if new_queues:
            self._room_for_queues(len(new_queues))
        queues.update(new_queues)  # every item is valid: from here on nothing can refuse
        emitted = self._ops
        first_op = len(emitted)
        apply_enqueue = self._apply_enqueue
        ids = []
        batch_dedup = {}
        for b, k, qname, delay, prio, did, q in checked:
            if did is not None:
                dkey = (qname, k, did)
                hit = batch_dedup.get(dkey) or q.dedup.get((k, did))
                if hit is not None and hit[1] > now:
                    ids.append(hit[0])
                    continue
            jid = (self.next_seq << _SHARD_BITS) | self.shard_index
            if did is None:
                op = [_ENQUEUE, jid, qname, k, b, prio, now + delay if delay else 0, did, now]
            else:  # the dedup entry's expiry is logged: a later change of dedup_window replays nothing
                dedup_expires = now + q.cfg.dedup_window
                op = [_ENQUEUE, jid, qname, k, b, prio, now + delay if delay else 0, did, now, dedup_expires]
                batch_dedup[dkey] = (jid, dedup_expires)
            apply_enqueue(op)  # as _emit, written out: this runs once per job
            emitted.append(op)
            q.totals[ENQUEUED] += 1
            ids.append(jid)
        if session is not None:
            self._emit([ops.SESSION, cid, cseq, low, ids, now])
        if len(emitted) - first_op > 1:
            self._atomic.append((first_op, len(emitted)))
        return ids

    def _apply_enqueue(self, op) -> None:
        # ops.Enqueue's fields, unpacked by hand: this runs once per job, live and in replay
        _, jid, qname, key, body, prio, ready_at, did, created = op[:_DEDUP_EXPIRES]
        jobs = self.jobs
        if jid in jobs:  # (not check(): its message would be formatted on every call)
            check(False, f"duplicate job id {jid}")
        q = self.queues.get(qname) or self._logged_queue(qname)
        job = Job(jid, q, key, body, prio, ready_at)
        jobs[jid] = job
        if prio:
            q.prioritized = True
        seq = (jid >> _SHARD_BITS) + 1
        if seq > self.next_seq:
            self.next_seq = seq
        self.enqueue_times.note(seq - 1, created)
        # Records of format 1 and shardq 0.1 have no expiry: today's window stands in.
        if len(op) > _DEDUP_EXPIRES:
            expires = op[_DEDUP_EXPIRES]
        else:
            expires = created + q.cfg.dedup_window if did is not None else 0
        if did is not None and expires > created:
            q.dedup[(key, did)] = (jid, expires)
            q.dedup_order.append((expires, (key, did)))
            self.dedup_held += 1
            self._prune_dedup(q, created)
        self._append_to_key(job)

    def _prune_dedup(self, q: QueueState, now: float) -> None:
        order, table = q.dedup_order, q.dedup
        while order and order[0][0] <= now:
            expires, dkey = order.popleft()
            self.dedup_held -= 1
            hit = table.get(dkey)
            if hit is not None and hit[1] == expires:
                del table[dkey]

    def _room_for_dedup_ids(self, checked: list, now: float) -> None:
        """Backpressure on dedup ids: each is kept for its queue's dedup window, acked or
        not, so a high rate of them over a long window could grow without bound (and be
        rebuilt by replay after an out-of-memory crash). Refuse a batch that would pass
        ``max_dedup_ids``, counting only the ids it would add (a resend of a known id is
        answered as ever), after dropping what has expired in every queue."""
        for q in self.queues.values():
            self._prune_dedup(q, now)
        fresh = set()
        for b, k, qname, delay, prio, did, q in checked:
            if did is not None:
                hit = q.dedup.get((k, did))
                if hit is None or hit[1] <= now:
                    fresh.add((qname, k, did))
        if self.dedup_held + len(fresh) > self.max_dedup:
            raise QueueFull(f"shard {self.shard_index} holds {self.dedup_held} dedup ids, its limit "
                            f"{self.max_dedup} (limits.max_dedup_ids): each is kept for its queue's "
                            "dedup_window; retry later, or shorten the window")

    def _apply_session(self, op) -> None:
        _, cid, cseq, low, ids, at = op  # ops.Session
        sessions = self.sessions
        entry = sessions.get(cid)
        if entry is None:
            entry = sessions[cid] = [at, {}]
        else:
            sessions.move_to_end(cid)  # most recently seen last
            entry[0] = at
        seqs = entry[1]
        if seqs:
            for old in [s for s in seqs if s < low]:
                del seqs[old]
        seqs[cseq] = ids

    # ------------------------------------------------------------------ dequeue
    def dequeue(self, queue: str, now: float, visibility: float | None = None, max_jobs: int = 1) -> list[Lease]:
        """Lease up to ``max_jobs`` ready jobs of ``queue``, highest priority first.

        Each lease is a logged operation (its delivery count and deadline). With
        ``lease_sync = "strict"`` the caller makes it durable before the lease is handed out;
        with ``"batched"`` (the default) the shard process hands out a lease whose job's
        enqueue is already durable once its record is written, before its fsync (it becomes
        durable with the next commit: :mod:`.committer`). A job already delivered
        ``max_deliveries`` times goes to the dead-letter queue instead of out. The leases
        returned fit in one reply frame (``limits.REPLY_BYTES_MAX``): fewer come when the
        bodies are large, never none while a job is ready.
        """
        if not (type(max_jobs) is int and 1 <= max_jobs <= _BATCH_JOBS_MAX):
            max_jobs = validate.count("max_jobs", max_jobs, limits.BATCH_JOBS_MAX)
        if visibility is not None:
            visibility = validate.seconds("visibility", visibility, hi=limits.VISIBILITY_TIMEOUT_S_MAX,
                                          positive=True)
        self.advance(now)
        q = self.queues.get(queue)
        if q is None:
            self._queue(queue, create=False)  # validates the name; an unused queue is empty
            return []
        if q.paused is not None:
            return []  # paused (control.py): nothing is leased
        vis = q.cfg.visibility_timeout if visibility is None else visibility
        out: list[Lease] = []
        prios, ready = q.prios, q.ready
        max_deliveries = q.cfg.max_deliveries
        emit_ops = self._ops
        reply_left = limits.REPLY_BYTES_MAX
        while prios and len(out) < max_jobs:
            prio = -prios[0]  # re-read each time: dead-lettering a head can promote another
            dq = ready[prio]
            job = dq[0]
            size = len(job.body) + 4 * len(job.key or "") + limits.JOB_FIXED_BYTES_MAX
            if out and job.state is R and size > reply_left:
                break
            dq.popleft()
            if not dq:
                del ready[prio]
                del prios[bisect.bisect_left(prios, -prio)]
            if job.state is not R:
                continue  # stale entry left by replay
            if job.attempts >= max_deliveries:
                op = [ops.DEAD, job.id, self.errors.get(job.id) or f"delivered {job.attempts} times"]
                self._apply_dead(op, popped=True)
                emit_ops.append(op)
                q.totals[DEAD_LETTERED] += 1
                continue
            token = self.next_token
            if token >> _EPOCH_BITS != self.epoch:  # a new epoch before any token in it
                self._emit([ops.EPOCH, token >> _EPOCH_BITS])
            expires = now + vis
            op = [ops.LEASE, job.id, token, expires]
            self._apply_lease(op)
            emit_ops.append(op)
            out.append(Lease(job.id, job.key, job.body, queue, job.attempts, token, expires))
            reply_left -= size
        q.totals[LEASED] += len(out)
        return out

    def _apply_lease(self, op) -> None:
        _, jid, token, expires = op  # ops.Lease (once per lease: unpacked, no record built)
        job = self.jobs[jid]
        self._set(job, L)
        job.attempts += 1
        self.inflight[jid] = (token, expires)
        if token >= self.next_token:
            self.next_token = token + 1
        heapq.heappush(self.leases, (expires, token, jid))

    # ------------------------------------------------------------------ settle a lease
    def _leased(self, job_id, token) -> Job:
        """The job, if ``token`` is its live lease; LeaseLost or NotFound otherwise."""
        if not (type(job_id) is int and type(token) is int and 0 <= job_id < _INT63 and 0 <= token < _INT63):
            validate.integer("job_id", job_id)  # raises the precise error
            validate.integer("token", token)
        job = self.jobs.get(job_id)
        if job is None:
            if job_id & ((1 << limits.JOB_ID_SHARD_BITS) - 1) != self.shard_index:
                raise NotFound(f"job {job_id} does not belong to shard {self.shard_index}")
            raise JobGone(f"job {job_id} is gone (already acked)")
        lease = self.inflight.get(job_id)
        if lease is None or lease[0] != token:
            raise LeaseLost(f"job {job_id}: lease {token} is no longer current")
        if lease[1] <= self._now:
            raise LeaseLost(f"job {job_id}: lease {token} expired")
        return job

    def ack(self, job_id: int, token: int, now: float) -> None:
        """Delete a leased job. LeaseLost (and no change) unless ``token`` is its live lease."""
        self.advance(now)
        job = self._leased(job_id, token)
        if self.cancelled:
            self._settle_cancelled(job_id, settle=True)
        self._emit([ops.ACK, job_id])
        job.q.totals[ACKED] += 1

    def _apply_ack(self, op) -> None:
        job = self.jobs.pop(op[_JOB_ID])
        self.inflight.pop(job.id, None)
        self.errors.pop(job.id, None)
        self._unlink_head(job)
        self._set(job, G)

    def nack(self, job_id: int, token: int, now: float, delay: float = 0.0, error=None,
             delivered: bool = True) -> None:
        """End a lease early: the job is ready again now, or after ``delay`` (delayed state,
        never a long lease). A job with ``max_deliveries`` deliveries is dead-lettered.

        ``delivered=False`` says the job never reached a handler (a worker's unstarted
        prefetch): the lease is not counted as a delivery."""
        self.advance(now)
        job = self._leased(job_id, token)
        if self.cancelled:
            self._settle_cancelled(job_id, settle=True)
        if delivered is False:
            self._emit([ops.RELEASE, job_id, 0, None, True])
            return
        delay = validate.seconds("delay", delay, hi=limits.DELAY_S_MAX) if type(delay) is not int or delay else 0
        error = validate.error_text(error)
        job.q.totals[NACKED] += 1
        if job.attempts >= job.q.cfg.max_deliveries:
            job.q.totals[DEAD_LETTERED] += 1
            self._emit([ops.DEAD, job_id, error or self.errors.get(job_id)
                        or f"released after {job.attempts} deliveries"])
        else:
            self._emit([ops.RELEASE, job_id, now + delay if delay else 0, error])

    def bury(self, job_id: int, token: int, now: float, error=None) -> None:
        """Move a leased job to its queue's dead-letter queue now, whatever its delivery
        count (a task that failed for good, or whose task name no worker knows)."""
        self.advance(now)
        self._leased(job_id, token)
        error = validate.error_text(error)
        self._emit([ops.DEAD, job_id, error or self.errors.get(job_id) or "dead-lettered by the worker"])

    def _apply_release(self, op) -> None:
        jid, ready_at, error, undelivered = ops.read(ops.Release, op)
        job = self.jobs[jid]
        if undelivered:  # the lease does not count
            job.attempts -= 1
        job.ready_at = ready_at
        self.inflight.pop(jid, None)
        if error is not None:
            self.errors[jid] = error
        self._make_available(job)

    def extend(self, job_id: int, token: int, now: float, seconds: float) -> float:
        """Move a live lease's deadline to ``now + seconds``; returns the new deadline."""
        self.advance(now)
        seconds = validate.seconds("seconds", seconds, hi=limits.VISIBILITY_TIMEOUT_S_MAX, positive=True)
        self._leased(job_id, token)
        if self.cancelled:
            self._settle_cancelled(job_id, settle=False)
        expires = now + seconds
        self._emit([ops.EXTEND, job_id, expires])
        return expires

    def _apply_extend(self, op) -> None:
        jid, expires = ops.read(ops.Extend, op)
        job = self.jobs[jid]
        check(job.state is L, f"extend of job {job.id} in state {job.state!r}")
        token = self.inflight[job.id][0]
        self.inflight[job.id] = (token, expires)
        heapq.heappush(self.leases, (expires, token, job.id))

    # ------------------------------------------------------------------ dead letters
    def _apply_dead(self, op, popped: bool = False) -> None:
        _, jid, error = op  # ops.Dead
        job = self.jobs[jid]
        if job.state is R and not popped:  # replay only: the live path popped it from its deque already
            try:
                job.q.ready[job.priority].remove(job)
            except (KeyError, ValueError):
                pass
        self._unlink_head(job)
        self._set(job, X)
        self.inflight.pop(jid, None)
        self.errors[jid] = error
        job.q.dead[jid] = job

    def dead_letters(self, queue: str, limit: int = 1000) -> list[DeadLetter]:
        """Up to ``limit`` dead letters, oldest first, as many as fit in one reply frame."""
        q = self.queues.get(queue) or self._queue(queue, create=False)
        out = []
        reply_left = limits.REPLY_BYTES_MAX
        for job in q.dead.values():
            size = validate.job_bytes(job.body, job.key, "", error=self.errors.get(job.id))
            if len(out) >= limit or (out and size > reply_left):
                break
            reply_left -= size
            out.append(DeadLetter(job.id, job.key, job.body, queue, job.attempts, self.errors.get(job.id)))
        return out

    def redrive(self, queue: str, now: float, job_ids=None, limit: int | None = None) -> int:
        """Move dead letters back to the tail of their keys with a fresh delivery count.
        All of the queue's dead letters, or only ``job_ids``. Returns how many moved."""
        self.advance(now)
        q = self.queues.get(queue) or self._queue(queue, create=False)
        if job_ids is None:
            chosen = list(q.dead)[:limit] if limit else list(q.dead)
        else:
            chosen = list(dict.fromkeys(validate.integer("job_id", j) for j in job_ids))
            missing = [j for j in chosen if j not in q.dead]
            if missing:
                raise NotFound(f"not dead letters of {queue!r}: {missing[:5]}")
        for jid in chosen:
            self._emit([ops.REDRIVE, jid])
        q.totals[REDRIVEN] += len(chosen)
        return len(chosen)

    def _apply_redrive(self, op) -> None:
        job = self.jobs[op[_JOB_ID]]
        del job.q.dead[job.id]
        job.attempts = 0
        job.ready_at = 0
        self._append_to_key(job)

    def purge_dead(self, queue: str, now: float) -> int:
        """Delete every dead letter of ``queue``; returns how many."""
        self.advance(now)
        q = self.queues.get(queue) or self._queue(queue, create=False)
        ids = list(q.dead)
        for jid in ids:
            self._emit([ops.PURGE, jid])
        return len(ids)

    def _apply_purge(self, op) -> None:
        job = self.jobs.pop(op[_JOB_ID])
        self.errors.pop(job.id, None)
        del job.q.dead[job.id]
        self._set(job, G)

    # ------------------------------------------------------------------ inspection
    def ready_priorities(self, queue: str, max_jobs: int) -> list[list[int]]:
        """``[[priority, ready jobs], ...]``, highest priority first, until they cover
        ``max_jobs`` jobs (or all): what a dequeue of ``max_jobs`` would lease now. Empty for
        a paused queue. A router compares shards with it (queue-wide priorities)."""
        max_jobs = validate.count("max_jobs", max_jobs, limits.BATCH_JOBS_MAX)
        q = self.queues.get(queue)
        if q is None or q.paused is not None:
            if q is None:
                self._queue(queue, create=False)  # validates the name
            return []
        out, covered = [], 0
        for neg in q.prios:
            n = len(q.ready[-neg])  # may count a stale entry: then a dequeue gets fewer
            out.append([-neg, n])
            covered += n
            if covered >= max_jobs:
                break
        return out

    def note_priorities(self, queue: str) -> None:
        """Mark ``queue`` as using priorities on this shard, durably and for good, though
        this shard may hold none of its prioritized jobs. Leases say so (the dequeue reply),
        which tells a router to compare shards before it hands jobs out (queue-wide
        priorities); a queue that never uses priorities costs no comparison."""
        q = self._queue(queue)
        if not q.prioritized:
            self._emit([ops.PRIORITIES, queue])

    def _apply_priorities(self, op) -> None:
        (qname,) = ops.read(ops.Priorities, op)
        q = self.queues.get(qname) or self._logged_queue(qname)
        q.prioritized = True

    def has_ready(self, queue: str) -> bool:
        q = self.queues.get(queue)
        return q is not None and q.counts[R] > 0 and q.paused is None

    def stats(self) -> dict:
        out = {}
        for name, q in self.queues.items():
            c = q.counts
            out[name] = {"ready": c[R], "delayed": c[D], "waiting": c[W], "in_flight": c[L],
                         "dead": c[X], "keys": len(q.keys)}
            if q.paused is not None:
                out[name]["paused"] = True
            if name in self.undeclared:
                out[name]["undeclared"] = True  # removed from the config; drain it
        return out

    def queue_settings(self, queue: str) -> dict:
        q = self.queues.get(queue) or self._queue(queue, create=False)
        cfg = q.cfg
        return {"visibility_timeout": cfg.visibility_timeout, "max_deliveries": cfg.max_deliveries,
                "dedup_window": cfg.dedup_window, "max_body_bytes": cfg.max_body_bytes}

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self, chunk_bytes: int = limits.CHECKPOINT_CHUNK_BYTES) -> Iterator[bytes]:
        """Encoded lists of checkpoint operations that rebuild this state when applied to a
        new :class:`ShardState` (keys keep their order; leases keep token and deadline).

        Chunks are cut by size: each holds operations whose encoding is at most about
        ``chunk_bytes`` (one job with a larger body goes alone), so every chunk is within
        ``limits.CHECKPOINT_RECORD_BYTES_MAX`` whatever the bodies. Sizes are bounded from
        above without encoding twice (:func:`validate.job_bytes`)."""
        pack = msgpack.Packer().pack
        chunk: list = [[ops.META, self.next_seq, self.next_token, self.epoch]]
        size = 64
        inflight, errors = self.inflight, self.errors

        def job_op(j: Job) -> list:
            state = j.state if j.state in (L, X) else R
            token, expires = inflight.get(j.id, (0, 0.0)) if state is L else (0, 0.0)
            return [ops.JOB, j.id, j.q.name, j.key, j.body, j.priority, j.ready_at, j.attempts,
                    int(state), token, expires, errors.get(j.id)]

        def jobs_in_order() -> Iterator[Job]:
            for q in self.queues.values():
                for kq in q.keys.values():
                    yield from kq
            for j in self.jobs.values():
                if j.key is None and j.state is not X:
                    yield j
            for q in self.queues.values():
                yield from q.dead.values()

        job_bytes = validate.job_bytes
        for j in jobs_in_order():
            n = job_bytes(j.body, j.key, j.q.name, error=errors.get(j.id))
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(job_op(j))
            size += n
        for q in self.queues.values():
            for (key, did), (jid, expires) in q.dedup.items():
                n = 4 * (len(q.name) + len(key or "") + len(did)) + 64
                if size + n > chunk_bytes and chunk:
                    yield pack(chunk)
                    chunk, size = [], 0
                chunk.append([ops.DEDUP, q.name, key, did, jid, expires])
                size += n
        for cid, (seen, seqs) in self.sessions.items():
            # A client that sent hundreds of full batches before reading a reply keeps
            # millions of ids here: its requests go in as many CLIENT operations as the
            # chunks need (replay merges them), each request's ids whole (at most
            # BATCH_JOBS_MAX of them, far within a record).
            part: list = []
            n = 64
            for cseq, ids in seqs.items():
                m = 16 + 10 * len(ids)
                if part and size + n + m > chunk_bytes:
                    chunk.append([ops.CLIENT, cid, seen, part])
                    yield pack(chunk)
                    chunk, size, part, n = [], 0, [], 64
                part.append([cseq, ids])
                n += m
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append([ops.CLIENT, cid, seen, part])
            size += n
        for q in self.queues.values():
            if q.prioritized:  # a queue whose prioritized jobs are all gone still says so
                n = 16 + 4 * len(q.name)
                if size + n > chunk_bytes and chunk:
                    yield pack(chunk)
                    chunk, size = [], 0
                chunk.append([ops.PRIORITIES, q.name])
                size += n
        for op in self.control_checkpoint_ops():  # after the JOB operations they refer to
            n = len(pack(op))
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(op)
            size += n
        if chunk:
            yield pack(chunk)

    def _apply_meta(self, op) -> None:
        next_seq, next_token, epoch = ops.read(ops.Meta, op)
        self.next_seq = max(self.next_seq, next_seq)
        self.next_token = max(self.next_token, next_token)
        self.epoch = max(self.epoch, next_token >> _EPOCH_BITS if epoch is None else epoch)

    # ------------------------------------------------------------------ lease epochs
    def begin_epoch(self) -> int:
        """Start a new lease-token epoch (at each shard start, before serving; the caller
        makes it durable at once). Tokens of leases whose records a crash lost are all
        below it, so none is ever handed out again (with ``lease_sync = "batched"`` a lease
        may reach a worker before its record is durable)."""
        self._emit([ops.EPOCH, max(self.epoch, self.next_token >> _EPOCH_BITS) + 1])
        return self.epoch

    def _apply_epoch(self, op) -> None:
        (epoch,) = ops.read(ops.Epoch, op)
        self.epoch = max(self.epoch, epoch)
        self.next_token = max(self.next_token, self.epoch << _EPOCH_BITS)
        self.sync_forced = True  # an epoch is durable before any of its tokens is handed out

    def _apply_job(self, op) -> None:
        # ops.Job's fields, unpacked by hand: a checkpoint holds one per live job
        jid, qname, key, body, prio, ready_at, attempts, state, token, expires, error = op[1:_JOB_END]
        q = self.queues.get(qname) or self._logged_queue(qname)
        job = Job(jid, q, key, body, prio, ready_at)
        job.attempts = attempts
        if prio:
            q.prioritized = True
        if error is not None:
            self.errors[jid] = error
        self.jobs[jid] = job
        if state == X:
            self._set(job, X)
            q.dead[jid] = job
            return
        if state == L:
            if key is not None:
                check(key not in q.keys, f"checkpoint: leased job {jid} is not the head of its key")
                q.keys[key] = [job]
            self._set(job, L)
            self.inflight[jid] = (token, expires)
            heapq.heappush(self.leases, (expires, token, jid))
            return
        self._append_to_key(job)

    def _apply_dedup(self, op) -> None:
        qname, key, did, jid, expires = op[1:_DEDUP_END]  # ops.Dedup's fields
        q = self.queues.get(qname) or self._logged_queue(qname)
        q.dedup[(key, did)] = (jid, expires)
        q.dedup_order.append((expires, (key, did)))
        self.dedup_held += 1

    def _apply_client(self, op) -> None:
        """A client's session from a checkpoint; a session written as several operations
        (one per chunk of its requests, in a row) is merged back into one."""
        _, cid, seen, seqs = op  # ops.Client
        entry = self.sessions.get(cid)
        if entry is None:
            self.sessions[cid] = [seen, {s: ids for s, ids in seqs}]
        else:
            entry[1].update(seqs)
