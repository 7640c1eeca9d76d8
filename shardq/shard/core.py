"""The core of the shard state machine: the attributes every part of it shares, the
plumbing of operations (emit, apply, replay), queue look-ups, the one place a job changes
state, each key's line, and time (``advance``). :class:`~shardq.shard.state.ShardState` is
this core plus one mixin per concern, each in its own module and each built on this core
only: :mod:`.queues` (keys and queues: enqueue, dedup, sessions, inspection),
:mod:`.leases` (dequeue, settling a lease, dead letters, token epochs), :mod:`.control`
(pause, cancel, look-ups, metrics figures) and :mod:`.checkpoint` (the checkpoint codec).

Pure: no I/O, no clock (``now`` comes from the caller), no randomness.

Data layout, chosen so nothing is O(number of jobs) per request:

* ``jobs``: job id -> :class:`Job` (``__slots__``, no dict per job).
* per queue, per key: that key's jobs in enqueue order (a list while short, then a
  deque). Only the head can be ready, delayed or leased; the rest are WAITING. That gives
  per-key FIFO with at most one lease per key, and a long backlog under one key never
  hides other keys.
* per queue: one FIFO deque of READY jobs per priority, and a sorted list of priorities
  present; higher priority is served first, FIFO within a priority.
* ``lapsed``: job id -> the token of its lease that ran out, while nothing leased it again
  (an ack with it still deletes the job; :meth:`StateCore._leased`).
* shard-wide heaps: delayed jobs by due time, leases by expiry (entries are checked
  against the job when popped, so acks and extensions never search a heap). The entries an
  ack, release or extension left behind are dropped once they outnumber the live leases
  (:meth:`StateCore._push_lease`): the heap holds at most twice the leases in flight plus
  ``LEASE_HEAP_SLACK``, whatever the visibility timeout; those of delayed jobs cancelled or
  purged before their time, once they outnumber the jobs held (:meth:`StateCore._push_delayed`).
* workflow records (:mod:`.workflows`): ``workflows`` workflow id -> :class:`WorkflowRecord`;
* results, progress and barriers (:mod:`.results`): ``results`` job id -> (value,
  expires_at), ``progress`` job id -> (fraction, note) of live jobs, ``barriers`` barrier
  id -> :class:`Barrier`; what expires (results, fired or cancelled barriers) sits in a
  heap by expiry too, and :meth:`StateCore.advance` forgets it when due, like a lease
  running out (not logged: the expiry is).
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from .. import limits
from ..config import Config, QueueConfig, check_queue_name, owner_shard
from ..errors import InvalidJob, InvariantViolation, JobGone, LeaseLost, NotFound, QueueFull, UnknownQueue, check
from ..protocol import validate
from . import ops
from .enqueue_times import EnqueueTimes
from .jobstate import FROM_NEW, TRANSITIONS, NEW, D, JobState, L, R, W
from .limiter import Limiter
from .ops import Op

#: What each queue counts since this process started (QueueState.totals, by these indices).
#: Not logged: a restart starts them at zero (Prometheus ``rate()`` handles resets).
COUNTERS = ("enqueued", "leased", "acked", "nacked", "lease_expiries", "dead_lettered", "redriven",
            "cancelled", "purged")
ENQUEUED, LEASED, ACKED, NACKED, EXPIRED, DEAD_LETTERED, REDRIVEN, CANCELLED, PURGED = range(len(COUNTERS))

#: A key's jobs are kept in a list while there are few (a deque costs ~600 bytes even for
#: one job; most keys hold a handful) and in a deque once it grows past this, where
#: removing the head of a list would start to cost a real copy.
KEY_LIST_MAX = 64

#: Stale lease entries the heap may hold beyond the live ones before it is rebuilt
#: (:meth:`StateCore._push_lease`). Without a bound, each acked lease would stay there until
#: its deadline: at the 12 h visibility maximum, 43 million entries (about 6 GiB) for a
#: thousand lease + ack a second.
LEASE_HEAP_SLACK = 1024
#: The same for the heap of delayed jobs (:meth:`StateCore._push_delayed`), whose entries of
#: jobs cancelled or purged before their time would otherwise stay until it came (up to
#: ``limits.DELAY_S_MAX``, a year).
DELAYED_HEAP_SLACK = 1024

#: How far from the end of its ready line an ack of a lapsed lease looks for its job
#: (:meth:`StateCore._drop_ready`; the expiry put the job at the end, so it is usually among
#: the last few). Past it the entry stays, passed over by dequeue as a job cancelled while
#: ready is: the search costs at most a few milliseconds, whatever the backlog.
DROP_READY_SCAN_MAX = 1 << 14

#: A key this short is within limits.KEY_BYTES_MAX whatever its characters (4 UTF-8 bytes
#: at most each): only longer ones are encoded to be measured.
_KEY_FAST_CHARS = limits.KEY_BYTES_MAX // 4

#: A producer dedup entry's key within its queue: (job key, dedup id).
DedupKey: TypeAlias = tuple[str | None, str | bytes]
#: A router's retry session (``StateCore.sessions``): ``[last_seen, {client seq: job ids}]``,
#: a list so that a request updates it in place.
SessionEntry: TypeAlias = list[Any]
#: One enqueue item once checked (:meth:`StateCore._check_item`): (body, key, queue, delay,
#: priority, dedup_id, its queue).
CheckedItem: TypeAlias = "tuple[bytes, str | None, str, float, int, str | bytes | None, QueueState]"

#: A barrier's kinds (:attr:`Barrier.kind`; the counts in :attr:`StateCore.barrier_kinds`).
OPEN, FIRED, CANCELLED_BARRIER = 0, 1, 2
#: What the results and workflow ops count since this process started
#: (:attr:`StateCore.workflow_totals`, by these indices; :mod:`.results`). Not logged, like
#: :data:`COUNTERS`: counted on the live path only, so replay counts nothing again.
WORKFLOW_COUNTERS = ("results_stored", "barriers_fired", "barriers_cancelled", "workflows_started",
                     "workflows_succeeded", "workflows_failed", "workflows_cancelled")
(RESULTS_STORED, BARRIERS_FIRED, BARRIERS_CANCELLED, WORKFLOWS_STARTED, WORKFLOWS_SUCCEEDED,
 WORKFLOWS_FAILED, WORKFLOWS_CANCELLED) = range(len(WORKFLOW_COUNTERS))
#: How a workflow's record ends (:mod:`.workflows`); None is running.
WORKFLOW_ENDS = ("succeeded", "failed", "cancelled")


class Job:
    # Eight slots keep a job at 96 bytes. A lease (token, deadline) lives in
    # ShardState.inflight and a last error in ShardState.errors: few jobs have either.
    __slots__ = ("id", "q", "key", "body", "priority", "ready_at", "attempts", "state")

    def __init__(self, job_id: int, q: QueueState, key: str | None, body: bytes, priority: int,
                 ready_at: float) -> None:
        self.id = job_id
        self.q = q
        self.key = key
        self.body = body
        self.priority = priority
        self.ready_at = ready_at
        self.attempts = 0
        self.state: JobState | None = NEW


class QueueState:
    """One named queue on one shard."""

    __slots__ = ("name", "cfg", "ready", "prios", "keys", "dead", "dedup", "dedup_order", "counts",
                 "paused", "totals", "prioritized", "lim")

    def __init__(self, name: str, cfg: QueueConfig):
        self.name = name
        self.cfg = cfg
        self.ready: dict[int, deque[Job]] = {}
        self.prios: list[int] = []          # negated priorities, ascending = highest first
        # a list while short, a deque once longer than KEY_LIST_MAX (see there)
        self.keys: dict[str, list[Job] | deque[Job]] = {}
        self.dead: dict[int, Job] = {}      # in order of death
        self.dedup: dict[DedupKey, tuple[int, float]] = {}   # -> (job id, expires_at)
        self.dedup_order: deque[tuple[float, DedupKey]] = deque()   # (expires_at, dedup key), oldest first
        self.counts = [0, 0, 0, 0, 0, 0]    # by JobState
        self.paused: float | None = None    # paused since (control.py)
        self.totals = [0] * len(COUNTERS)   # counters since this process started (control.COUNTERS)
        self.prioritized = False            # ever held a job of priority != 0, or was told so
        #: the exact limits of a placed queue (limiter.py); None: no limit, the usual paths
        self.lim: Limiter | None = Limiter(cfg) if cfg.placed() else None

    def push_ready(self, job: Job) -> None:
        dq = self.ready.get(job.priority)
        if dq is None:
            dq = self.ready[job.priority] = deque()
            bisect.insort(self.prios, -job.priority)
        dq.append(job)


class GroupedQueueState(QueueState):
    """A queue with a ``group_separator``: its ready jobs wait in one line per group
    (:class:`~.limiter.GroupLine`), served in queue order or in turn (``fair``) by its
    limiter, which skips the groups a limit holds back; ``ready`` and ``prios`` stay empty."""

    __slots__ = ()

    def push_ready(self, job: Job) -> None:
        self.lim.push(job)  # type: ignore[union-attr]  # a grouped queue always has its limiter


class Barrier:
    """One barrier of a workflow (:mod:`.results`): ``total`` members, the values of those
    that arrived (index -> bytes), and how it ended. Open (neither fired nor cancelled)
    it is kept for ever; fired or cancelled, until ``expires_at``."""

    __slots__ = ("total", "values", "size", "fired_job", "cancelled", "expires_at", "callback")

    def __init__(self, total: int) -> None:
        self.total = total
        self.values: dict[int, bytes] = {}
        self.size = 0                        # the values' bytes together (limits.BARRIER_BYTES_MAX)
        self.fired_job: int | None = None    # the callback's job id, once fired
        self.cancelled = False
        #: fired or cancelled: when it is forgotten. Open and complete (its FIRED not yet
        #: logged), the expiry its FIRED is to get; None otherwise.
        self.expires_at: float | None = None
        #: [body, key, queue, delay, priority] of the callback, from the completing arrival
        self.callback: list[Any] | None = None

    @property
    def kind(self) -> int:
        """OPEN, FIRED or CANCELLED_BARRIER."""
        return FIRED if self.fired_job is not None else CANCELLED_BARRIER if self.cancelled else OPEN

    def put(self, index: int, value: bytes) -> None:
        old = self.values.get(index)
        if old is not None:
            self.size -= len(old)
        self.values[index] = value
        self.size += len(value)


class WorkflowRecord:
    """A workflow's record on its home shard (:mod:`.workflows`): its steps (``spec``),
    when it started, and how it ended. Running it is kept for ever; ended, until
    ``expires_at``."""

    __slots__ = ("spec", "started_at", "state", "error", "ended_at", "expires_at")

    def __init__(self, spec: bytes, started_at: float) -> None:
        self.spec = spec
        self.started_at = started_at
        self.state: str | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self.expires_at: float | None = None


def new_queue(name: str, cfg: QueueConfig) -> QueueState:
    return GroupedQueueState(name, cfg) if cfg.group_separator is not None else QueueState(name, cfg)


class StateCore:
    """What every part of :class:`~shardq.shard.state.ShardState` shares; see the module
    docstring. Not used alone."""

    def __init__(self, shard_index: int, config: Config):
        check(0 <= shard_index < (1 << limits.JOB_ID_SHARD_BITS), "shard index out of range")
        self.shard_index = shard_index
        self.config = config
        #: the service's shard count (the shard process sets it from its data dir): which
        #: shard owns a placed queue (config.owner_shard)
        self.shard_count = config.service.shards or 1
        self.limited: list[QueueState] = []  # the queues with limits (their wake-up times: next_deadline)
        #: queues with a run-time limit change in the log that today's config does not place
        #: (ControlOps.drop_unplaced_overrides makes their drop durable at start)
        self.unplaced_overrides: set[str] = set()
        self.placed_fence = 0.0  # placed queues lease nothing before this time (fence_placed)
        self.max_pending = config.limits.max_pending_jobs
        self.max_dedup = config.limits.max_dedup_ids
        self.dedup_held = 0   # dedup entries kept over every queue (each until its window ends)
        self.jobs: dict[int, Job] = {}
        self.queues: dict[str, QueueState] = {}
        self.delayed: list[tuple[float, int]] = []
        self.leases: list[tuple[float, int, int]] = []
        self.inflight: dict[int, tuple[int, float]] = {}   # job id -> (token, expires_at)
        #: job id -> the token of its lease that ran out (advance), while nothing leased it
        #: again: an ack with that token still deletes the job (:meth:`LeaseOps.ack`). Only
        #: READY jobs are here (DELAYED too, between a checkpoint's replay and the first
        #: advance); a lease, an ack, a dead-lettering, a cancel or a purge takes the entry
        #: out. Not logged: replay derives it as it derives the expiry, and a checkpoint writes
        #: it as its JOB's token (checkpoint.py).
        self.lapsed: dict[int, int] = {}
        self.errors: dict[int, str] = {}                    # job id -> last error
        self.next_seq = 1
        self.next_token = 1
        self.epoch = 0               # lease tokens are >= epoch << TOKEN_EPOCH_BITS (begin_epoch)
        self.sync_forced = False     # an operation that must be durable before any reply (EPOCH)
        self.sessions: OrderedDict[int, SessionEntry] = OrderedDict()  # client -> [last_seen, {seq: ids}]
        #: when the oldest session expires, or -inf once there are more than
        #: CLIENT_SESSIONS_MAX (the session's apply sets it): advance() forgets some then
        self._sessions_due = float("-inf")
        self.undeclared: set[str] = set()  # queues the log holds and today's config does not declare
        self._ops: list[tuple[Any, ...]] = []  # the records emitted since take_batch (ops.REGISTRY's types)
        self._atomic: list[tuple[int, int]] = []  # index ranges of _ops that share one record
        self._now = float("-inf")
        self.cancelled: set[int] = set()   # leased jobs marked cancelled (control.py)
        self.enqueue_times = EnqueueTimes()  # sampled enqueue times (control.py: metrics, look-ups)
        # Results and workflows (results.py)
        self.results: dict[int, tuple[bytes, float]] = {}   # job id -> (value, expires_at)
        self.progress: dict[int, tuple[float | None, str | None]] = {}  # live job id -> (fraction, note)
        self.barriers: dict[str, Barrier] = {}
        self.barrier_kinds = [0, 0, 0]      # barriers by kind (OPEN, FIRED, CANCELLED_BARRIER)
        self.workflow_totals = [0] * len(WORKFLOW_COUNTERS)  # since this process started
        self._result_expiry: list[tuple[float, int]] = []     # (expires_at, job id), a heap
        self._barrier_expiry: list[tuple[float, str]] = []    # (expires_at, barrier id), a heap
        self.workflows: dict[str, WorkflowRecord] = {}       # workflow id -> its record (workflows.py)
        #: records kept by state ("running", and WORKFLOW_ENDS): stats, and the supervisor's
        #: pong (its watcher looks at a shard while "running" is above 0)
        self.workflow_counts: dict[str, int] = dict.fromkeys(("running",) + WORKFLOW_ENDS, 0)
        self._workflow_expiry: list[tuple[float, str]] = []   # (expires_at, workflow id) of ended ones, a heap
        self._kept_due = float("inf")       # the earliest expiry in these heaps (advance)
        # Derived from the one table of operations: record type -> the method that applies
        # it (live: ``fn(*record)``), and code -> that method as a function of a logged list
        # (replay: ops.replay_function, the fast path).
        self._apply_record: dict[type, Callable[..., None]] = {
            spec.record: getattr(self, spec.apply) for spec in ops.REGISTRY.values()}
        self._apply: dict[int, Callable[[Op], None]] = {
            code: ops.replay_function(getattr(self, spec.apply), spec.record) for code, spec in ops.REGISTRY.items()}

    # ------------------------------------------------------------------ plumbing
    def take_ops(self) -> list[Op]:
        """The operations produced since the last call, as the log holds them; the caller
        persists them."""
        return self.take_batch()[0]

    def take_batch(self) -> tuple[list[Op], list[tuple[int, int]]]:
        """The operations produced since the last call, encoded for the log
        (:func:`ops.encode`), and the index ranges among them that must be logged in one
        record (a batch enqueue: all or nothing)."""
        records, atomic = self._ops, self._atomic
        self._ops, self._atomic = [], []
        return ops.encode_all(records), atomic

    def apply(self, op: Op) -> None:
        """Apply one logged operation (as replay does; salvage applies them one by one)."""
        try:
            fn = self._apply[op[0]]
        except (KeyError, TypeError, IndexError):
            check(False, f"unknown log operation {op!r:.80}")
        fn(op)

    def replay(self, records: Iterable[list[Op]]) -> None:
        """Apply every operation of every record, in order: the fast path of :meth:`apply`,
        which hands a logged list's fields to the apply function without building a record."""
        table = self._apply
        try:
            for record in records:
                for op in record:
                    table[op[0]](op)
        except (KeyError, TypeError, IndexError) as e:
            raise InvariantViolation(f"log operation could not be applied: {type(e).__name__}: {e}") from e

    def _emit(self, record: tuple[Any, ...]) -> None:
        """Apply ``record`` (an operation of ops.REGISTRY) and keep it for the log."""
        self._apply_record[type(record)](*record)
        self._ops.append(record)

    def _queue(self, name: str, *, create: bool = True) -> QueueState:
        """The queue ``name`` for a live request: UnknownQueue if the config does not
        declare it (with ``declare_queues``) and it holds nothing."""
        q = self.queues.get(name)
        if q is None:
            check_queue_name(name, InvalidJob)
            cfg = self.config.queue(name)
            if cfg is None:
                raise UnknownQueue(f"queue {name!r} is not declared in the config")
            q = new_queue(name, cfg)
            if create:
                self._room_for_queues(1)
                self.queues[name] = q
                self._note_limited(q)
        return q

    def _note_limited(self, q: QueueState) -> None:
        """Called for each queue the state adds: a limited one is looked at by next_deadline."""
        if q.lim is not None:
            q.lim.fence_until = self.placed_fence
            self.limited.append(q)

    def fence_placed(self, until: float) -> None:
        """No placed queue leases anything before ``until`` (wall clock): leases that a
        power cut may have taken from the log can still be running (boot_fence.py)."""
        self.placed_fence = until
        for q in self.limited:
            q.lim.fence_until = until  # type: ignore[union-attr]  # limited: it has a limiter

    def _owner_check(self, q: QueueState) -> None:
        """A placed queue takes new jobs on its owner shard only (docs/limits.md): a client
        that routed one elsewhere predates the config that placed it."""
        owner = owner_shard(q.name, self.shard_count)
        if owner != self.shard_index:
            raise InvalidJob(f"queue {q.name!r} declares limits, so all its jobs live on shard {owner} "
                             f"(docs/limits.md), not shard {self.shard_index}: this client learnt the queue's "
                             "settings before the config placed it; reconnect it")

    def _check_item(self, item: Any, new_queues: dict[str, QueueState]) -> CheckedItem:
        """One enqueue item ``(body, key, queue, delay, priority, dedup_id)`` checked as an
        enqueue checks it (queue name and declaration, a placed queue's owner, body size,
        key, delay, priority, dedup id): the normalised item and its queue, or the typed
        error. Changes nothing: a queue not yet held is made unregistered and put in
        ``new_queues`` (the caller registers it if it enqueues)."""
        if type(item) not in (tuple, list) or len(item) != 6:
            raise InvalidJob("each job is (body, key, queue, delay, priority, dedup_id)")
        b, k, qname, delay, prio, did = item
        if type(qname) is not str:
            raise InvalidJob(f"queue must be a string, got {type(qname).__name__}")
        q = self.queues.get(qname)
        if q is None:
            q = new_queues.get(qname)
            if q is None:
                q = new_queues[qname] = self._queue(qname, create=False)
        elif self.undeclared and qname in self.undeclared:
            raise UnknownQueue(f"queue {qname!r} is no longer declared in the config: its remaining "
                               "jobs can be dequeued and its dead letters handled, but it takes no new jobs")
        if q.lim is not None:
            self._owner_check(q)
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
        return (b, k, qname, delay, prio, did, q)

    def _enqueue_callback(self, item: tuple[Any, ...], now: float) -> int:
        """Enqueue one item ``(body, key, queue, delay, priority, dedup_id)`` through the
        enqueue path (all its checks and limits; nothing logged if it refuses), for a
        barrier's callback (:mod:`.results`); returns the job id. The enqueue path is
        another part of the state (:mod:`.queues`): ShardState, which holds both, provides it."""
        raise NotImplementedError

    def workflow_checkpoint_ops(self) -> list[tuple[ops.Workflow, int]]:
        """The workflow records as checkpoint operations (:mod:`.workflows` provides it;
        the checkpoint codec, another part of the state, writes them)."""
        raise NotImplementedError

    def _leased(self, job_id: int, token: int) -> Job:
        """The job, if ``token`` is its live lease; LeaseLost (JobGone when it is gone) or
        NotFound (not this shard's) otherwise. Settling a lease (leases.py) and what a
        worker reports while it holds one (results.py) check it alike; an ack alone also
        takes the token of a lease that ran out while nothing leased the job since
        (:attr:`lapsed`, ``LeaseOps.ack``)."""
        # (both in [0, 2**63) exactly when their OR is: one test for the two)
        if not (type(job_id) is int and type(token) is int and not (job_id | token) >> 63):
            validate.integer("job_id", job_id)  # raises the precise error
            validate.integer("token", token)
        job = self.jobs.get(job_id)
        if job is None:
            if job_id & ((1 << limits.JOB_ID_SHARD_BITS) - 1) != self.shard_index:
                raise NotFound(f"job {job_id} does not belong to shard {self.shard_index}")
            raise JobGone(f"job {job_id} is gone (already acked)")
        lease = self.inflight.get(job_id)
        if lease is None or lease[0] != token:
            if lease is None and self.lapsed.get(job_id) == token:
                raise LeaseLost(f"job {job_id}: lease {token} expired (nothing leased the job since: "
                                "only an ack may still settle it)")
            raise LeaseLost(f"job {job_id}: lease {token} is no longer current")
        if lease[1] <= self._now:
            raise LeaseLost(f"job {job_id}: lease {token} expired")
        return job

    # ------------------------------------------------------------------ results and barriers
    def _put_barrier(self, barrier_id: str, b: Barrier) -> None:
        """Hold ``b`` as ``barrier_id`` (replacing any barrier of that id), counted by kind;
        a fired or cancelled one is forgotten at its expiry."""
        old = self.barriers.get(barrier_id)
        if old is not None:
            self.barrier_kinds[old.kind] -= 1
        self.barriers[barrier_id] = b
        self.barrier_kinds[b.kind] += 1
        if b.kind != OPEN:
            self._barrier_expires(barrier_id, b)

    def _barrier_expires(self, barrier_id: str, b: Barrier) -> None:
        """``b`` was fired or cancelled, with its expiry: forget it then (advance)."""
        if b.expires_at is not None:
            heapq.heappush(self._barrier_expiry, (b.expires_at, barrier_id))
            if b.expires_at < self._kept_due:
                self._kept_due = b.expires_at

    def _result_expires(self, job_id: int, expires_at: float) -> None:
        heapq.heappush(self._result_expiry, (expires_at, job_id))
        if expires_at < self._kept_due:
            self._kept_due = expires_at

    def _expire_kept(self, now: float) -> None:
        """Forget the results and the fired or cancelled barriers whose expiry has come (a
        read already treats them as absent: this frees their memory). Not logged: replay
        and checkpoints drop them by the same expiry."""
        heap = self._result_expiry
        results = self.results
        while heap and heap[0][0] <= now:
            expires_at, jid = heapq.heappop(heap)
            kept = results.get(jid)
            if kept is not None and kept[1] == expires_at:
                del results[jid]
        bheap = self._barrier_expiry
        barriers = self.barriers
        while bheap and bheap[0][0] <= now:
            expires_at, bid = heapq.heappop(bheap)
            b = barriers.get(bid)
            if b is not None and b.kind != OPEN and b.expires_at == expires_at:
                del barriers[bid]
                self.barrier_kinds[b.kind] -= 1
        wheap = self._workflow_expiry
        workflows = self.workflows
        while wheap and wheap[0][0] <= now:
            expires_at, wid = heapq.heappop(wheap)
            w = workflows.get(wid)
            if w is not None and w.expires_at == expires_at:
                del workflows[wid]
                self.workflow_counts[w.state or "running"] -= 1
        self._kept_due = min(heap[0][0] if heap else float("inf"), bheap[0][0] if bheap else float("inf"),
                             wheap[0][0] if wheap else float("inf"))

    def _workflow_expires(self, wf_id: str, expires_at: float) -> None:
        heapq.heappush(self._workflow_expiry, (expires_at, wf_id))
        if expires_at < self._kept_due:
            self._kept_due = expires_at

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
            q = self.queues[name] = new_queue(name, cfg)
            self._note_limited(q)
        return q

    def _set(self, job: Job, new: JobState) -> None:
        old = job.state
        q = job.q
        if old is None:
            if new not in FROM_NEW:
                check(False, f"job {job.id}: illegal transition new -> {new!r}")
        else:
            if (old, new) not in TRANSITIONS:
                check(False, f"job {job.id}: illegal transition {old!r} -> {new!r}")
            q.counts[old] -= 1
        q.counts[new] += 1
        job.state = new
        lim = q.lim
        if lim is not None and lim.sep is not None and (old is L or new is L):
            lim.moved(job, old is L, new is L)  # a group's leases in flight

    def _make_available(self, job: Job) -> None:
        """``job`` just became the head of its key (or is keyless): ready, or delayed."""
        if job.ready_at and job.ready_at > self._now:
            self._set(job, D)
            self._push_delayed(job.ready_at, job.id)
        else:
            self._set(job, R)
            job.q.push_ready(job)

    def drop_stale_ready(self) -> int:
        """Take out of the plain queues' ready lines every entry whose job is not ready,
        and return how many went. Replay leaves there each job it leased (a logged lease
        does not look for its job in the line) and so each one acked since; a router's
        peek (:meth:`~.queues.QueueOps.ready_priorities`) counted them, and handed a lower priority out
        first (queue-wide priorities). Once, after replay and before the shard serves (a
        lease that ran out meanwhile is put back at the end of its line by ``advance``, as
        live)."""
        dropped = 0
        for q in self.queues.values():
            if type(q) is not QueueState or not q.prios:
                continue  # (a grouped queue's lines are its limiter's: they skip stale entries)
            for prio, dq in list(q.ready.items()):
                live = deque(job for job in dq if job.state is R)
                dropped += len(dq) - len(live)
                if live:
                    q.ready[prio] = live
                else:
                    del q.ready[prio]
                    del q.prios[bisect.bisect_left(q.prios, -prio)]
        return dropped

    def _drop_ready(self, job: Job) -> None:
        """Take the READY ``job`` out of its queue's ready line (it is being deleted: an ack
        of a lease that ran out), so that neither a dequeue nor a router's peek
        (``ready_priorities``) meets it. Its lease's expiry put it at the end of its line:
        it is looked for from there, in windows that grow fourfold, up to
        ``DROP_READY_SCAN_MAX`` entries; one further in stays, passed over as stale when
        reached, as a job cancelled while ready is. A grouped queue's lines (limiter.py)
        keep its entry likewise."""
        q = job.q
        prio = job.priority
        dq = q.ready.get(prio)
        if dq is None:
            return
        hi, width, floor = len(dq), 64, max(0, len(dq) - DROP_READY_SCAN_MAX)
        while hi > floor:
            lo = max(floor, hi - width)
            try:
                i = dq.index(job, lo, hi)  # (a scan in C: Job has no __eq__, so identity)
            except ValueError:
                hi, width = lo, width * 4
                continue
            del dq[i]
            if not dq:
                del q.ready[prio]
                del q.prios[bisect.bisect_left(q.prios, -prio)]
            return

    def _unlink_head(self, job: Job) -> None:
        """Take ``job`` off the front of its key and let the next job of the key move up."""
        if job.key is None:
            return
        q = job.q
        kq = q.keys.get(job.key)
        if kq is None or kq[0] is not job:
            raise InvariantViolation(f"job {job.id} is not the head of key {job.key!r}")
        if type(kq) is deque:
            kq.popleft()
        else:  # a list (a key's line is one of the two)
            del kq[0]
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
            kq.append(job)
            if type(kq) is list and len(kq) > KEY_LIST_MAX:
                job.q.keys[job.key] = deque(kq)
            job.key = kq[0].key  # one string object per key, not one per job (memory)
            self._set(job, W)

    # ------------------------------------------------------------------ time
    def advance(self, now: float) -> None:
        """Move due delayed jobs to ready and reclaim expired leases, earliest first.

        A reclaimed job that has had ``max_deliveries`` deliveries goes to the dead-letter
        queue (a logged operation); any other becomes ready again (at-least-once). Results
        and finished barriers past their expiry are forgotten (not logged: see
        :meth:`_expire_kept`).
        """
        self._now = now
        delayed = self.delayed
        if delayed and delayed[0][0] <= now:  # (the usual call finds nothing due: it tests only)
            self._ready_delayed(now)
        leases = self.leases
        if leases and leases[0][0] <= now:
            self._expire_leases(now)
        if now >= self._sessions_due:  # (due at once when a client past the limit was added)
            self._expire_sessions(now)
        if now >= self._kept_due:
            self._expire_kept(now)

    def _ready_delayed(self, now: float) -> None:
        """(advance) Delayed jobs due by ``now`` become ready, earliest first."""
        delayed, jobs = self.delayed, self.jobs
        while delayed and delayed[0][0] <= now:
            ready_at, jid = heapq.heappop(delayed)
            job = jobs.get(jid)
            if job is not None and job.state is D and job.ready_at == ready_at:
                self._set(job, R)
                job.q.push_ready(job)

    def _expire_leases(self, now: float) -> None:
        """(advance) Leases expired by ``now`` end, earliest first."""
        leases, jobs = self.leases, self.jobs
        while leases and leases[0][0] <= now:
            expires_at, token, jid = heapq.heappop(leases)
            job = jobs.get(jid)
            if job is None or self.inflight.get(jid) != (token, expires_at):
                continue  # acked, released, extended or re-leased since
            job.q.totals[EXPIRED] += 1
            if self.cancelled and jid in self.cancelled:
                self._emit(ops.Cancel(jid))  # a cancelled lease ended: the job goes
            elif job.attempts >= job.q.cfg.max_deliveries:
                job.q.totals[DEAD_LETTERED] += 1
                self._emit(ops.Dead(jid, self.errors.get(jid) or f"lease expired after {job.attempts} deliveries"))
            else:
                del self.inflight[jid]
                self._set(job, R)
                job.q.push_ready(job)
                self.lapsed[jid] = token  # an ack with it still deletes the job until it is leased again

    def _push_lease(self, expires_at: float, token: int, job_id: int) -> None:
        """Put a lease's deadline on the heap :meth:`advance` expires leases from. An entry
        is live while ``inflight`` holds its (token, deadline); the rest (acked, released,
        extended, re-leased) are skipped when popped. Once the heap holds more than twice
        the live leases plus ``LEASE_HEAP_SLACK``, it is rebuilt from its live entries:
        each rebuild drops at least half of what it scans, so it costs O(1) per push
        amortized, and the heap's size follows the leases in flight, not the lease rate
        times the visibility timeout. Replay and a checkpoint's leases come through here too."""
        leases = self.leases
        heapq.heappush(leases, (expires_at, token, job_id))
        inflight = self.inflight
        if len(leases) > 2 * len(inflight) + LEASE_HEAP_SLACK:
            live = [e for e in leases if inflight.get(e[2]) == (e[1], e[0])]
            heapq.heapify(live)
            leases[:] = live

    def _push_delayed(self, ready_at: float, job_id: int) -> None:
        """Put a delayed job's due time on the heap :meth:`advance` readies jobs from. An
        entry is live while its job is delayed until that time; once the heap holds more
        than twice the jobs held plus ``DELAYED_HEAP_SLACK``, it is rebuilt from its live
        entries (at most one per job), at O(1) amortized per push as for the leases."""
        delayed = self.delayed
        heapq.heappush(delayed, (ready_at, job_id))
        jobs = self.jobs
        if len(delayed) > 2 * len(jobs) + DELAYED_HEAP_SLACK:
            live = []
            for e in delayed:
                job = jobs.get(e[1])
                if job is not None and job.state is D and job.ready_at == e[0]:
                    live.append(e)
            live = list(dict.fromkeys(live))  # a job delayed twice until the same time: one entry
            heapq.heapify(live)
            delayed[:] = live

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
        now = self._now
        if self.limited and now > -math.inf:
            for q in self.limited:  # jobs held back for a token: when the next one is due
                lim = q.lim
                if q.counts[R] and q.paused is None and lim is not None:
                    for due in (lim.next_token(now), lim.next_group_token(now) if lim.sep is not None else None):
                        if due is not None:
                            times.append(due)
        return min(times) if times else None
