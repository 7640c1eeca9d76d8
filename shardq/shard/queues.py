"""Keys and queues: enqueue (validation, batches, producer dedup, the router's retry
sessions) and what a queue shows (ready priorities, stats, settings). A mixin of
:class:`~shardq.shard.state.ShardState`, built on :class:`~shardq.shard.core.StateCore`
only; pure like it (no I/O, ``now`` from the caller, every change a logged operation)."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, NotRequired, TypeAlias, TypedDict

from .. import limits
from ..config import LIMIT_KEYS, owner_shard
from ..errors import InvalidJob, QueueFull, check
from . import ops
from ..protocol import validate
from .core import _KEY_FAST_CHARS, ENQUEUED, KEY_LIST_MAX, Job, QueueState, StateCore
from .jobstate import D, L, R, W, X

_SHARD_BITS = limits.JOB_ID_SHARD_BITS
_Enqueue, _Session, _new = ops.Enqueue, ops.Session, ops.new
_CLIENT_SESSIONS_MAX = limits.CLIENT_SESSIONS_MAX
_BATCH_JOBS_MAX, _REQUEST_BYTES_MAX = limits.BATCH_JOBS_MAX, limits.REQUEST_BYTES_MAX
#: One job, every field at its maximum, always fits in a request: only batches are measured.
_ONE_JOB_FITS = (64 + 16 + validate.job_bytes(b"", "k" * limits.KEY_BYTES_MAX, "q" * limits.QUEUE_NAME_BYTES_MAX,
                                              "d" * limits.DEDUP_ID_BYTES_MAX)
                 + limits.BODY_BYTES_MAX_CEILING <= _REQUEST_BYTES_MAX)
#: A key this short is within limits.KEY_BYTES_MAX whatever its characters (4 UTF-8 bytes
#: at most each): only longer ones are encoded to be measured.

#: One job of a batch once validated: (body, key, queue, delay, priority, dedup_id, its queue).
_Checked: TypeAlias = tuple[bytes, str | None, str, float, int, str | bytes | None, QueueState]


class QueueStats(TypedDict):
    """One queue's entry in :meth:`QueueOps.stats`."""
    ready: int
    delayed: int
    waiting: int
    in_flight: int
    dead: int
    keys: int
    paused: NotRequired[bool]        # only when paused
    undeclared: NotRequired[bool]    # only when the config no longer declares it
    limits: NotRequired[dict[str, Any]]   # a limited queue's figures (Limiter.figures)


class QueueOps(StateCore):
    """Enqueue and queue inspection; a mixin of ShardState (see the module docstring)."""

    # ------------------------------------------------------------------ enqueue
    def enqueue(self, body: bytes, now: float, key: str | None = None, queue: str = "default",
                delay: float = 0.0, priority: int = 0, dedup_id: str | bytes | None = None) -> int:
        """Add one job; returns its id. See :meth:`enqueue_many`."""
        return self.enqueue_many([(body, key, queue, delay, priority, dedup_id)], now)[0]

    def enqueue_many(self, items: Sequence[Sequence[Any]], now: float,
                     session: Sequence[int] | None = None) -> list[int]:
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
            # the usual shape: three ints, each in [0, 2**63) (then, and only then, so is their OR)
            if not (type(cid) is int and type(cseq) is int and type(low) is int and not (cid | cseq | low) >> 63):
                cid, cseq, low = (validate.integer("session", v) for v in session)
            entry = self.sessions.get(cid)
            if entry is not None and cseq in entry[1]:
                return list(entry[1][cseq])
        n = len(items)
        if not 1 <= n <= _BATCH_JOBS_MAX:
            raise InvalidJob(f"a batch holds 1 to {_BATCH_JOBS_MAX} jobs, got {n}")
        new_queues: dict[str, QueueState] = {}
        if n == 1:  # a lone job (figure A): no batch loop
            checked = [self._check_item(items[0], new_queues)]
            usual = checked[0][5] is None and not checked[0][3]
        else:
            checked, usual = self._check_items(items, new_queues)
        if len(self.jobs) + n > self.max_pending:
            self._room_for_jobs(checked, usual, now)
        # the session op and its job ids, and the jobs (one job always fits: not measured)
        log_bytes = 64 + 16 * n + validate.jobs_bytes(checked) if n > 1 or not _ONE_JOB_FITS else 0
        if self.dedup_held + n > self.max_dedup:
            self._room_for_dedup_ids(checked, now)
        if log_bytes > _REQUEST_BYTES_MAX:
            # Its operations must be logged as one record (all or nothing across a crash).
            raise InvalidJob(f"a batch of {n} jobs takes up to {log_bytes} bytes, over the "
                             f"{_REQUEST_BYTES_MAX}-byte limit of one request; send it in smaller batches")
        if new_queues:
            self._room_for_queues(len(new_queues))
            self.queues.update(new_queues)  # every item is valid: from here on nothing can refuse
            for q in new_queues.values():
                self._note_limited(q)
        emitted = self._ops
        first_op = len(emitted)
        if usual:
            ids = self._add_usual(checked, now)
        else:
            ids = self._add_jobs(checked, now)
        if session is not None:
            sop = _new(_Session, (cid, cseq, low, ids, now))
            self._apply_session(*sop)  # as _emit, written out: this runs once per request
            emitted.append(sop)
        if len(emitted) - first_op > 1:
            self._atomic.append((first_op, len(emitted)))
        return ids

    def _check_items(self, items: Sequence[Any], new_queues: dict[str, QueueState]) -> tuple[list[_Checked], bool]:
        """:meth:`_check_item` of each item, and whether every one is usual (no dedup id,
        no delay: :meth:`_add_usual` may add them). An item of the usual shape (a bytes
        body within its queue's limit, no key or a short one, delay and priority 0, no
        dedup id) in the queue of the item before it is checked here in one test: what
        depends on the queue alone (its look-up, declaration, owner, body limit) is checked
        once for a run of one queue's items. Any other item, or one that fails that test,
        goes through :meth:`_check_item`, which raises the precise error."""
        check_item = self._check_item
        checked: list[_Checked] = []
        append = checked.append
        usual = True
        run: str | None = None  # the queue of the item before (checked), its state, its body limit
        q: QueueState | None = None
        max_body = 0
        for item in items:
            if type(item) is list and len(item) == 6:
                b, k, qname, delay, prio, did = item
                if (qname == run and type(qname) is str and type(b) is bytes and 0 < len(b) <= max_body
                        and (k is None or (type(k) is str and 0 < len(k) <= _KEY_FAST_CHARS))
                        and did is None and type(delay) is int and not delay and type(prio) is int and not prio):
                    append((b, k, qname, 0, 0, None, q))  # type: ignore[arg-type]  # q: run's, not None
                    continue
            c = check_item(item, new_queues)
            append(c)
            if c[5] is not None or c[3]:
                usual = False
            run, q = c[2], c[6]
            max_body = q.cfg.max_body_bytes
        return checked, usual

    def _add_usual(self, checked: list[_Checked], now: float) -> list[int]:
        """Add checked jobs with no dedup id and no delay; their ids. Each is logged and
        applied as :meth:`_apply_enqueue` applies its record in replay, written out for the
        batch: what is the same for every job (the enqueue time, sampled once: they share
        ``now``; ``next_seq``, set once) is done once, a job becomes ready or waits behind
        its key's head as :meth:`_append_to_key` would place it (NEW -> READY or WAITING,
        both in FROM_NEW; neither moves a limiter's leases). tests/shard/test_batch_enqueue.py
        checks that replaying the records rebuilds exactly this state."""
        jobs, emitted, idx = self.jobs, self._ops, self.shard_index
        seq = self.next_seq
        self.enqueue_times.note(seq, now)  # the first job's: the batch's others would change nothing
        ids = []
        for b, k, qname, _delay, prio, _did, q in checked:
            jid = (seq << _SHARD_BITS) | idx
            seq += 1
            emitted.append(_new(_Enqueue, (jid, qname, k, b, prio, 0, None, now, None)))
            if jid in jobs:
                check(False, f"duplicate job id {jid}")
            job = jobs[jid] = Job(jid, q, k, b, prio, 0)
            ids.append(jid)
            q.totals[ENQUEUED] += 1
            if prio:
                q.prioritized = True
            if k is not None:
                keys = q.keys
                kq = keys.get(k)
                if kq is not None:
                    kq.append(job)
                    if type(kq) is list and len(kq) > KEY_LIST_MAX:
                        keys[k] = deque(kq)
                    job.key = kq[0].key  # one string object per key, not one per job (memory)
                    job.state = W
                    q.counts[W] += 1
                    continue
                keys[k] = [job]
            job.state = R
            q.counts[R] += 1
            q.push_ready(job)
        self.next_seq = seq
        return ids

    def _add_jobs(self, checked: list[_Checked], now: float) -> list[int]:
        """Add checked jobs of any kind (dedup ids, delays), one record applied at a time;
        their ids (a dedup id's first job's for a repeat within its window)."""
        emitted = self._ops
        apply_enqueue = self._apply_enqueue
        ids = []
        batch_dedup: dict[tuple[str, str | None, str | bytes], tuple[int, float]] = {}
        for b, k, qname, delay, prio, did, q in checked:
            if did is not None:
                dkey = (qname, k, did)
                hit = batch_dedup.get(dkey) or q.dedup.get((k, did))
                if hit is not None and hit[1] > now:
                    ids.append(hit[0])
                    continue
            jid = (self.next_seq << _SHARD_BITS) | self.shard_index
            if did is None:
                op = _new(_Enqueue, (jid, qname, k, b, prio, now + delay if delay else 0, None, now, None))
            else:  # the dedup entry's expiry is logged: a later change of dedup_window replays nothing
                dedup_expires = now + q.cfg.dedup_window
                op = _Enqueue(jid, qname, k, b, prio, now + delay if delay else 0, did, now, dedup_expires)
                batch_dedup[dkey] = (jid, dedup_expires)
            apply_enqueue(*op)  # as _emit, written out: this runs once per job
            emitted.append(op)
            q.totals[ENQUEUED] += 1
            ids.append(jid)
        return ids

    def _apply_enqueue(self, job_id: int, queue: str, key: str | None, body: bytes, priority: int, ready_at: float,
                       dedup_id: str | bytes | None, created_at: float, dedup_expires: float | None = None) -> None:
        jobs = self.jobs
        if job_id in jobs:  # (not check(): its message would be formatted on every call)
            check(False, f"duplicate job id {job_id}")
        q = self.queues.get(queue) or self._logged_queue(queue)
        job = Job(job_id, q, key, body, priority, ready_at)
        jobs[job_id] = job
        if priority:
            q.prioritized = True
        seq = (job_id >> _SHARD_BITS) + 1
        if seq > self.next_seq:
            self.next_seq = seq
        self.enqueue_times.note(seq - 1, created_at)
        # Records of format 1 and shardq 0.1 have no expiry: today's window stands in.
        if dedup_id is not None:
            expires = created_at + q.cfg.dedup_window if dedup_expires is None else dedup_expires
            if expires > created_at:
                q.dedup[(key, dedup_id)] = (job_id, expires)
                q.dedup_order.append((expires, (key, dedup_id)))
                self.dedup_held += 1
                self._prune_dedup(q, created_at)
        self._append_to_key(job)

    def _prune_dedup(self, q: QueueState, now: float) -> None:
        order, table = q.dedup_order, q.dedup
        while order and order[0][0] <= now:
            expires, dkey = order.popleft()
            self.dedup_held -= 1
            hit = table.get(dkey)
            if hit is not None and hit[1] == expires:
                del table[dkey]

    def _room_for_jobs(self, checked: list[_Checked], usual: bool, now: float) -> None:
        """Backpressure on jobs (``max_pending_jobs``): refuse a batch that would pass the
        limit, counting only the jobs it would add, as :meth:`_add_jobs` adds them: a dedup
        id held in its window, or repeated within the batch (kept: its window is not 0),
        adds none (a resend of a held id is answered as ever, the shard full or not)."""
        adding = len(checked)
        if not usual:
            seen: set[tuple[str, str | None, str | bytes]] = set()
            adding = 0
            for _body, k, qname, _delay, _prio, did, q in checked:
                if did is not None:
                    dkey = (qname, k, did)
                    hit = q.dedup.get((k, did))
                    if dkey in seen or (hit is not None and hit[1] > now):
                        continue
                    if q.cfg.dedup_window > 0:
                        seen.add(dkey)
                adding += 1
        if len(self.jobs) + adding > self.max_pending:
            raise QueueFull(f"shard {self.shard_index} holds {len(self.jobs)} jobs; limit {self.max_pending}")

    def _room_for_dedup_ids(self, checked: list[_Checked], now: float) -> None:
        """Backpressure on dedup ids: each is kept for its queue's dedup window, acked or
        not, so a high rate of them over a long window could grow without bound (and be
        rebuilt by replay after an out-of-memory crash). Refuse a batch that would pass
        ``max_dedup_ids``, counting only the ids it would add (a resend of a known id is
        answered as ever), after dropping what has expired in every queue."""
        for q in self.queues.values():
            self._prune_dedup(q, now)
        fresh = set()
        for _body, k, qname, _delay, _prio, did, q in checked:
            if did is not None:
                hit = q.dedup.get((k, did))
                if hit is None or hit[1] <= now:
                    fresh.add((qname, k, did))
        if self.dedup_held + len(fresh) > self.max_dedup:
            raise QueueFull(f"shard {self.shard_index} holds {self.dedup_held} dedup ids, its limit "
                            f"{self.max_dedup} (limits.max_dedup_ids): each is kept for its queue's "
                            "dedup_window; retry later, or shorten the window")

    def _apply_session(self, client_id: int, client_seq: int, client_low: int, job_ids: list[int],
                       at: float) -> None:
        sessions = self.sessions
        entry = sessions.get(client_id)
        if entry is None:
            entry = sessions[client_id] = [at, {}]
            if len(sessions) > _CLIENT_SESSIONS_MAX:
                self._sessions_due = -math.inf  # the next advance() forgets the least recent
        else:
            sessions.move_to_end(client_id)  # most recently seen last
            entry[0] = at
        seqs = entry[1]
        while seqs:  # oldest first (a client's seqs grow): stop at the first it may still retry
            old = next(iter(seqs))
            if old >= client_low:
                break
            del seqs[old]
        seqs[client_seq] = job_ids

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
            self._emit(ops.Priorities(queue))

    def _apply_priorities(self, queue: str) -> None:
        q = self.queues.get(queue) or self._logged_queue(queue)
        q.prioritized = True

    def has_ready(self, queue: str) -> bool:
        """Whether a dequeue of ``queue`` would lease a job now (as of the last
        :meth:`advance`): a job is ready and, on a limited queue, no limit holds it back.
        Waiting dequeues and watches are answered by it, so a limit never makes a consumer spin."""
        q = self.queues.get(queue)
        if q is None or not q.counts[R] or q.paused is not None:
            return False
        lim = q.lim
        if lim is None or self._now == float("-inf"):
            return True
        now = self._now
        return lim.allowance(q.counts[L], now) > 0 and (lim.sep is None or lim.first(now) is not None)

    def stats(self) -> dict[str, QueueStats]:
        out: dict[str, QueueStats] = {}
        for name, q in self.queues.items():
            c = q.counts
            out[name] = {"ready": c[R], "delayed": c[D], "waiting": c[W], "in_flight": c[L],
                         "dead": c[X], "keys": len(q.keys)}
            if q.paused is not None:
                out[name]["paused"] = True
            if name in self.undeclared:
                out[name]["undeclared"] = True  # removed from the config; drain it
            if q.lim is not None and self._now > float("-inf"):
                out[name]["limits"] = q.lim.figures(c[L], c[R], self._now)
        return out

    def placed_queues(self) -> list[str]:
        """The queues the config declares with limits (placed on their owner shard:
        docs/limits.md), sorted. A ``stats`` reply carries them, so that a client still lists
        a limited queue whose owner shard is down when no shard that answered holds it
        (client/routing.py ``queue_totals``)."""
        return sorted(name for name, cfg in self.config.queues.items() if cfg.placed())

    def queue_settings(self, queue: str) -> dict[str, Any]:
        q = self.queues.get(queue) or self._queue(queue, create=False)
        cfg = q.cfg
        out: dict[str, Any] = {"visibility_timeout": cfg.visibility_timeout, "max_deliveries": cfg.max_deliveries,
               "dedup_window": cfg.dedup_window, "max_body_bytes": cfg.max_body_bytes,
               # where a client sends the queue's jobs: its owner shard if it is placed
               # (it declares limits: docs/limits.md), else None (by key)
               "shard": owner_shard(queue, self.shard_count) if cfg.placed() else None,
               # named under [queues] in the config (else it takes [queue_defaults]): a queue
               # `shardq queue pause|resume|limit` may name before it holds anything
               "declared": queue in self.config.queues}
        for key in LIMIT_KEYS:
            value = getattr(cfg, key)
            if value is not None and value is not False:
                out[key] = value
        if q.lim is not None and q.lim.override:
            out["runtime_override"] = dict(q.lim.override)
        return out
