"""Log operations: what a shard writes to its WAL and replays.

The state emits each operation as its record (:class:`Enqueue`, :class:`Lease`, ...: a typed
NamedTuple) and applies it at once, through the same function replay uses, so replay
rebuilds the same state by construction. Lists exist only at the log boundary: on disk an
operation is a msgpack list whose first item is its code, then the record's fields in order
(:func:`encode`; a checkpoint writes every field, :func:`encode_whole`), and replay hands
the fields of each list it reads straight to the apply function (no record built: the fast
path of a replayed job).

:data:`REGISTRY` is the one table of operations: code, name, record type and the
:class:`~shardq.shard.state.ShardState` method that applies it, whose parameters are the
record's fields, by name and default. :data:`NAMES`, :data:`CODES` and the state's two
dispatch tables (by record type, live; by code, replay) are derived from it
(``test_op_registry.py`` of the tests checks them). An operation is declared in four
places: its code, its record, its row of the registry, its apply method.

Codes are never reused and old records keep their meaning: a field added to an operation
goes at the end of its list and has a default in its record, which :func:`read` gives a
record written before the field existed; fields a later version appends are ignored.

Lease expiry and the moment a delayed job becomes due are *not* logged: both follow from
the stored deadlines and the clock, so replay re-derives them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, TypeVar

#: One operation as the log holds it: ``[code, field, ...]``, the fields in its record's
#: order. The fields are msgpack values (read back from disk), so they are not typed here:
#: replay passes them to the apply function, whose parameters are the record's fields.
Op: TypeAlias = list[Any]

ENQUEUE = 1
LEASE = 2
ACK = 3
RELEASE = 4
EXTEND = 5
DEAD = 6
REDRIVE = 7
SESSION = 8
PURGE = 9
EPOCH = 10
PRIORITIES = 11
# Results and workflows (shardq/shard/results.py; docs/design.md "Workflows and results").
RESULT = 12
PROGRESS = 13
ARRIVE = 14
FIRED = 15
BARRIER_CANCEL = 16
WORKFLOW = 17      # a workflow's record (shardq/shard/workflows.py); checkpoints write it with its end
WORKFLOW_END = 18
# Checkpoint-only operations (a checkpoint is the live state written as operations).
META = 20
JOB = 21
DEDUP = 22
CLIENT = 23
BARRIER = 24
# Control operations (shardq/shard/control.py). Also written by checkpoints: a paused queue
# as its PAUSE, a cancelled lease as a CANCEL after its JOB.
PAUSE = 30
CANCEL = 31
LIMITS = 32  # also in checkpoints, per queue whose limits were changed at run time
PURGE_QUEUE = 33  # live only: a checkpoint holds no job it deleted
ENQUEUE_TIMES = 40  # checkpoint only

#: Lease tokens are (epoch << TOKEN_EPOCH_BITS) + a counter within the epoch.
TOKEN_EPOCH_BITS = 32

#: Where an operation on one job holds the job's id (``op[JOB_ID]``): first, after the
#: code, in every operation in :data:`JOB_OPS` (salvage relies on it too).
JOB_ID = 1


# ---------------------------------------------------------------------------- records
# The fields of each operation after its code, in log order. A field with a default may be
# missing from an older record (the apply function's parameter has the same default);
# :func:`encode` leaves off trailing fields at their default, as the live path always has.

class Enqueue(NamedTuple):
    job_id: int
    queue: str
    key: str | None
    body: bytes
    priority: int
    ready_at: float          # 0: ready now
    dedup_id: str | bytes | None
    created_at: float
    # Only with a dedup_id: when the id is forgotten, so a later change of dedup_window
    # moves nothing. Records of format 1 and shardq 0.1 lack it: today's window stands in.
    dedup_expires: float | None = None


class Lease(NamedTuple):  # attempts += 1
    job_id: int
    token: int
    expires_at: float


class Ack(NamedTuple):  # the job is deleted
    job_id: int


class Release(NamedTuple):  # nack: ready now (ready_at 0) or delayed until ready_at
    job_id: int
    ready_at: float
    error: str | None
    undelivered: bool = False  # the lease never reached a handler: attempts -= 1


class Extend(NamedTuple):
    job_id: int
    expires_at: float


class Dead(NamedTuple):  # moved to the dead-letter queue
    job_id: int
    error: str


class Redrive(NamedTuple):  # back to the tail of its key, attempts 0
    job_id: int


class Session(NamedTuple):  # a router's retry record: (client, seq) -> the ids it got
    client_id: int
    client_seq: int
    client_low: int          # the client's lowest unanswered seq: entries below it go
    job_ids: list[int]
    at: float


class Purge(NamedTuple):  # a dead letter deleted
    job_id: int


class Epoch(NamedTuple):
    # Every lease token from here on is >= epoch << TOKEN_EPOCH_BITS (logged and fsynced at
    # each shard start: no token is ever handed out twice).
    epoch: int


class Priorities(NamedTuple):
    # The queue uses priorities (sticky): routers compare shards (queue-wide priorities).
    queue: str


class Result(NamedTuple):  # a job's result, kept until expires_at (put_result)
    job_id: int
    value: bytes             # msgpack of the task's return value
    expires_at: float


class Progress(NamedTuple):  # a leased job's progress; dropped when the job leaves the shard
    job_id: int
    fraction: float | None   # 0..1
    note: str | None


class Arrive(NamedTuple):
    # A member of a barrier reported its value (index is counted once). The arrival that
    # completes the barrier carries the callback item ([body, key, queue, delay, priority]),
    # so a barrier found complete without its FIRED at start can still be fired; the others
    # carry None (a callback is written once, not once per member).
    barrier_id: str
    member: int              # the member's index, 0 <= member < total ("index" is a tuple method)
    total: int
    value: bytes
    # None, but on the completing arrival: the expiry its FIRED gets (an open barrier is
    # kept until it fires or is cancelled)
    expires_at: float | None
    callback: list[Any] | None = None


class Fired(NamedTuple):  # the callback was enqueued as job_id, in the same record
    barrier_id: str
    job_id: int
    expires_at: float        # the tombstone's end


class BarrierCancel(NamedTuple):
    # Cancelled: later arrivals are ignored. Applied to a barrier already fired or cancelled
    # (the live path logs that only once its tombstone expired) it starts a new, cancelled one.
    barrier_id: str
    expires_at: float


class Meta(NamedTuple):
    next_seq: int
    next_token: int
    epoch: int | None = None  # older checkpoints lack it: next_token's epoch stands in


class Job(NamedTuple):  # one live job of a checkpoint
    job_id: int
    queue: str
    key: str | None
    body: bytes
    priority: int
    ready_at: float
    attempts: int
    state: int               # a JobState: LEASED, DEAD, or READY for any other
    # LEASED: the live lease. Else the token of the job's lease that ran out while nothing
    # leased it again, which an ack may still use (0: none); versions before that wrote 0
    # and ignored it, so the format is unchanged.
    token: int
    expires_at: float        # the lease's, when LEASED (else 0)
    error: str | None


class Dedup(NamedTuple):
    queue: str
    key: str | None
    dedup_id: str | bytes
    job_id: int
    expires_at: float


class Client(NamedTuple):
    # A session from a checkpoint; one too large for a chunk is written as several in a
    # row, which replay merges.
    client_id: int
    last_seen: float
    requests: list[list[Any]]   # [[client_seq, [job_ids]], ...]


class Barrier(NamedTuple):
    # One barrier of a checkpoint. A barrier whose values pass a chunk is written as several
    # in a row, each with some of its values (the same other fields), which replay merges.
    barrier_id: str
    total: int
    indexes: list[int]
    values: list[bytes]
    fired_job: int | None
    cancelled: bool
    expires_at: float | None
    callback: list[Any] | None = None   # kept from the completing ARRIVE until FIRED


class Workflow(NamedTuple):
    # A workflow's record on its home shard: put when it is sent; checkpoints write it with
    # its end (state, error, ended_at, expires_at), a live one with those None.
    wf_id: str
    spec: bytes              # its steps: zlib-compressed msgpack (shardq/tasks/workflow.py)
    started_at: float
    state: str | None = None       # None: running; "succeeded", "failed" or "cancelled"
    error: str | None = None
    ended_at: float | None = None
    expires_at: float | None = None  # ended: forgotten then; running: kept for ever


class WorkflowEnd(NamedTuple):
    wf_id: str
    state: str
    error: str | None
    ended_at: float
    expires_at: float


class Pause(NamedTuple):
    queue: str
    paused_at: float | None  # None: resumed


class Cancel(NamedTuple):
    # A leased job not yet marked: marked cancelled; otherwise the job is deleted.
    job_id: int


class Limits(NamedTuple):
    # The limits of a placed queue changed at run time (`shardq queue limit`): these values
    # replace the config's (a key with None removes that limit); None: back to the config.
    queue: str
    values: dict[str, Any] | None


class PurgeQueue(NamedTuple):
    # Every job of the queue that is not a dead letter is deleted: waiting, delayed, ready
    # and leased (those leases are no longer current: a late ack gets JobGone).
    queue: str


class EnqueueTimes(NamedTuple):  # the sampled enqueue times (enqueue_times.py)
    seqs: list[int]
    times: list[float]


# ---------------------------------------------------------------------------- registry
class OpSpec(NamedTuple):
    code: int
    name: str
    record: type[NamedTuple]   # a NamedTuple naming the fields after the code
    apply: str     # the ShardState method that applies it, live and in replay


REGISTRY: dict[int, OpSpec] = {spec.code: spec for spec in (
    OpSpec(ENQUEUE, "enqueue", Enqueue, "_apply_enqueue"),
    OpSpec(LEASE, "lease", Lease, "_apply_lease"),
    OpSpec(ACK, "ack", Ack, "_apply_ack"),
    OpSpec(RELEASE, "release", Release, "_apply_release"),
    OpSpec(EXTEND, "extend", Extend, "_apply_extend"),
    OpSpec(DEAD, "dead", Dead, "_apply_dead"),
    OpSpec(REDRIVE, "redrive", Redrive, "_apply_redrive"),
    OpSpec(SESSION, "session", Session, "_apply_session"),
    OpSpec(PURGE, "purge", Purge, "_apply_purge"),
    OpSpec(EPOCH, "epoch", Epoch, "_apply_epoch"),
    OpSpec(PRIORITIES, "priorities", Priorities, "_apply_priorities"),
    OpSpec(RESULT, "result", Result, "_apply_result"),
    OpSpec(PROGRESS, "progress", Progress, "_apply_progress"),
    OpSpec(ARRIVE, "arrive", Arrive, "_apply_arrive"),
    OpSpec(FIRED, "fired", Fired, "_apply_fired"),
    OpSpec(BARRIER_CANCEL, "barrier_cancel", BarrierCancel, "_apply_barrier_cancel"),
    OpSpec(WORKFLOW, "workflow", Workflow, "_apply_workflow"),
    OpSpec(WORKFLOW_END, "workflow_end", WorkflowEnd, "_apply_workflow_end"),
    OpSpec(META, "meta", Meta, "_apply_meta"),
    OpSpec(JOB, "job", Job, "_apply_job"),
    OpSpec(DEDUP, "dedup", Dedup, "_apply_dedup"),
    OpSpec(CLIENT, "client", Client, "_apply_client"),
    OpSpec(BARRIER, "barrier", Barrier, "_apply_barrier"),
    OpSpec(PAUSE, "pause", Pause, "_apply_pause"),
    OpSpec(CANCEL, "cancel", Cancel, "_apply_cancel"),
    OpSpec(LIMITS, "limits", Limits, "_apply_limits"),
    OpSpec(PURGE_QUEUE, "purge_queue", PurgeQueue, "_apply_purge_queue"),
    OpSpec(ENQUEUE_TIMES, "enqueue_times", EnqueueTimes, "_apply_enqueue_times"),
)}

#: code -> name (derived from :data:`REGISTRY`)
NAMES = {code: spec.name for code, spec in REGISTRY.items()}
#: record type -> code (derived from :data:`REGISTRY`)
CODES: dict[type, int] = {spec.record: code for code, spec in REGISTRY.items()}
#: record type -> the defaults of its trailing fields, last first (what :func:`encode` may
#: leave off), for the records that have any
TRAILING_DEFAULTS: dict[type, tuple[Any, ...]] = {
    spec.record: tuple(spec.record._field_defaults[f] for f in reversed(spec.record._fields)
                       if f in spec.record._field_defaults)
    for spec in REGISTRY.values() if spec.record._field_defaults}
#: The codes of the operations on one job: their first field is the job id (:data:`JOB_ID`).
JOB_OPS = frozenset(code for code, spec in REGISTRY.items() if spec.record._fields[0] == "job_id")

R = TypeVar("R", bound=NamedTuple)

#: ``new(Record, (field, ...))``: a record (any NamedTuple) from a tuple of all its fields
#: in order, without the Python-level ``__new__`` of a NamedTuple (about ten bytecodes a
#: record). For the records every request builds (enqueue, lease, their replies); elsewhere
#: the record's own constructor reads better.
new = tuple.__new__


def encode(record: tuple[Any, ...]) -> Op:
    """``record`` (an operation the state emitted) as the log writes it: its code, then its
    fields, less the trailing ones at their default (``None`` or ``False``: a field added
    later, and only written when it says something)."""
    op = [CODES[type(record)], *record]
    for default in TRAILING_DEFAULTS.get(type(record), ()):
        if op[-1] is not default:
            break
        op.pop()
    return op


#: The index of Enqueue's one trailing field (``dedup_expires``, None but with a dedup id),
#: which :func:`encode_all` leaves off the usual enqueue in one step (as :func:`encode`
#: would: tests/shard/test_batch_enqueue.py).
_enqueue_trailing = Enqueue._fields.index("dedup_expires")


def encode_all(records: list[tuple[Any, ...]]) -> list[Op]:
    """:func:`encode` of each record (written out: it runs once per logged operation)."""
    codes, trailing = CODES, TRAILING_DEFAULTS
    enqueue, enqueue_code, last = Enqueue, CODES[Enqueue], _enqueue_trailing
    out = []
    for record in records:
        kind = type(record)
        if kind is enqueue and record[last] is None:  # a job without a dedup id: one per job of a batch
            out.append([enqueue_code, *record[:last]])
            continue
        op = [codes[kind], *record]
        if kind in trailing:
            for default in trailing[kind]:
                if op[-1] is not default:
                    break
                op.pop()
        out.append(op)
    return out


def replay_function(apply: Callable[..., None], record: type[NamedTuple]) -> Callable[[Op], None]:
    """``apply`` (the method that applies ``record``'s operation) as a function of a logged
    list: the replay fast path, generated from the record. It passes the fields by index,
    builds no record (that would cost a third of a replayed lease), gives a field an older
    record lacks its default, and ignores fields a later version appended. A list too
    short for a field without a default raises IndexError."""
    fields = record._fields
    args = []
    for i, name in enumerate(fields, start=1):
        if name in record._field_defaults:
            args.append(f"op[{i}] if len(op) > {i} else d{i}")
        else:
            args.append(f"op[{i}]")
    env: dict[str, Any] = {"apply": apply}
    env.update({f"d{i}": record._field_defaults[name] for i, name in enumerate(fields, start=1)
                if name in record._field_defaults})
    exec(f"def replay_{record.__name__.lower()}(op):\n    apply({', '.join(args)})\n", env)  # noqa: S102 - code built above from field indexes only
    fn: Callable[[Op], None] = env[f"replay_{record.__name__.lower()}"]
    return fn


def encode_whole(record: tuple[Any, ...]) -> Op:
    """``record`` with every field written, defaults too (checkpoints)."""
    return [CODES[type(record)], *record]


def read(record: type[R], op: Op) -> R:
    """The fields of ``op`` (a logged operation of ``record``'s code) by name: a field the
    record was written without reads as its default, fields a later version appended are
    ignored. TypeError when a field without a default is missing."""
    return record(*op[1:1 + len(record._fields)])


def field(record: type[NamedTuple], name: str) -> int:
    """Where ``record``'s field ``name`` sits in the logged list (the code is at 0)."""
    return 1 + record._fields.index(name)
