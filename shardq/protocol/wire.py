"""The wire between routers and shards: msgpack frames over ``multiprocessing.connection``.

Only ``send_bytes``/``recv_bytes`` are used, never ``send``/``recv`` (which pickle).

A request frame is a msgpack array of requests ``[request_id, op, args]``; a reply frame
is an array of ``[request_id, 0, result]`` or ``[request_id, 1, [error_name, message]]``.
Clients put many requests in one frame when they can (pipelining). A shard answers the
requests of one loop iteration of a connection in at most two frames: first those that
changed nothing (and leases that need not wait for the fsync), then, after the fsync, the
others; a ``watch`` answers when its queue has work. So a client matches replies to
requests by request id, never by position.

Ops and their args (a lease on the wire is ``[job_id, key, body, attempt, token, deadline]``):

=============  =====================================================  ====================
op             args                                                   result
=============  =====================================================  ====================
enqueue        [[[body, key, queue, delay, priority, dedup_id], ...],  [job_id, ...]
                session | None]  session = [client, seq, low]
dequeue        [queue, visibility | None, max_jobs]                   [lease + [priority,
                                                                      uses_priorities], ...]
peek           [queue, max_jobs]                                      [[priority, count], ...]
note_priorities [queue]                                               None
ack            [[job_id, token], ...]                                  [error | None, ...]
nack           [job_id, token, delay, error | None, delivered]        None
bury           [job_id, token, error | None]                          None (dead-lettered now)
extend         [job_id, token, seconds]                               deadline
watch          [queue, timeout_s]                                     True (work) | False
dequeue_wait   [queue, visibility | None, max_jobs, wait_s]           as dequeue; answered
                                                                      when it leases, or
                                                                      [] after wait_s
cancel_wait    [request_id of this connection's dequeue_wait]         True (withdrawn, no
                                                                      reply) | False
dead_letters   [queue, limit]                                         [[id, key, body, attempts, error]]
redrive        [queue, [job_id, ...] | None]                          count
purge_dead     [queue]                                                count
purge_queue    [queue]                                                count (every job but
                                                                      the dead letters)
queue_config   [queue]                                                {settings}
stats          []                                                     {...}
ping           []                                                     pid
set_limits     [queue, {concurrency, rate, burst, group_concurrency,  {limit figures}
                group_rate: value | None} | None (back to config)]
put_result     [job_id, token, value: bytes, ttl_s]                   None
progress       [job_id, token, fraction (0..1) | None, note | None]   None
result         [[job_id, ...]]                                        [[state, value, error,
                                                                      attempts, fraction,
                                                                      note, expires_at,
                                                                      withheld], ...]
result_sizes   [[job_id, ...]]                                        as result's, each value
                                                                      its length (an int)
arrive         [barrier_id, index, total, value: bytes, ttl_s,        "counted" | "repeated"
                callback: [body, key, queue, delay, priority]]        | "fired" | "cancelled"
arrive_many    [[[barrier_id, index, total, value, ttl_s, callback],  [outcome as arrive's
                 ...]]                                                 | error, ...]
barrier        [[barrier_id, ...]]                                    [{total, arrived,
                                                                      fired_job, cancelled,
                                                                      missing} | None, ...]
barrier_values [barrier_id]                                           [value, ...] (index
                                                                      order)
cancel_barrier [barrier_id, ttl_s]                                    "cancelled" | "fired"
put_workflow   [wf_id, spec: bytes]                                   "put" | "known"
end_workflow   [wf_id, "succeeded" | "failed" | "cancelled", error,   its state now
                ttl_s]
workflow       [wf_id]                                                {spec, state, error,
                                                                      started_at, ended_at,
                                                                      expires_at}
workflow_ids   [after_wf_id | None, limit]                            [wf_id, ...] (running)
pause          [queue]                                                True if it changed
resume         [queue]                                                True if it changed
cancel         [job_id]                                               "cancelled" | "purged"
                                                                      | "cancelling" | "gone"
job            [job_id]                                               {job}
dead_page      [queue, after_job_id | None, limit]                    [[id, key, body, attempts, error]]
purge_ids      [queue, [job_id, ...]]                                 count
metrics        []                                                     {stats + figures}
metrics_page   [start]                                                {stats + figures of
                                                                      one page, next, pid}
backup_cut     [staging dir name: backup-<pid>-<hex>]                 {files, segment,
                                                                      offset, write, time,
                                                                      job_seq, ...}
=============  =====================================================  ====================

put_result to workflow_ids are the results and workflow ops (``shardq/shard/results.py``
and ``shardq/shard/workflows.py``, docs/design.md "Workflows and results"): ``put_result``
and ``progress`` are fenced by the lease token like an ack; a ``result`` row is
:class:`ResultRow` (``withheld``: the value was left out to keep the reply within
``limits.REPLY_BYTES_MAX``: ask for that id alone), and a ``result_sizes`` row is the same
with the value's length in bytes in place of the value (never withheld); an ``arrive`` that completes its
barrier enqueues the callback in the same commit;
``arrive_many`` is that for each of up to ``limits.BATCH_JOBS_MAX`` arrivals, answered one
by one (an arrival refused leaves the others counted, as an ``ack`` of many does). Each may
be re-sent: put_result and progress set the same value again, a re-sent arrive finds its
index counted and answers "repeated" (also when the first one fired the barrier),
cancel_barrier is idempotent, a re-sent put_workflow finds its record ("known") and a
re-sent end_workflow its end (a record keeps its first), the others only read.

From pause on, they are the control and metrics ops (:data:`CONTROL_ARITY`,
``shardq/shard/control_handlers.py``). Each may be re-sent safely after a broken connection:
pause, resume, cancel and purge_ids are idempotent, the others only read; a re-sent
backup_cut takes a new cut and replaces the staging dir of the first (docs/backup.md).

``metrics`` answers a whole scrape in one reply, which at ``limits.QUEUES_MAX`` queues with
long names and limits is more than a frame holds; ``metrics_page`` is the same answer in
pages, which a client of this version asks for (``Calls.shard_metrics``). Its ``start`` is
a position in the order the shard's queues were made (0: the first page); a page holds the
queues from there until ``limits.METRICS_PAGE_BYTES`` (estimated, never measured by
encoding: control_handlers.py), at least one, as ``queues`` (their stats) and
``queue_metrics`` (their figures), with ``next`` (the next page's ``start``, None after the
last) and ``pid``. The first page also carries every shard-wide figure of ``metrics``. A
shard process only ever adds queues, to the end of that order, so the positions hold while
its pid does: a client that sees the pid change between pages drops what it read. An older
shard answers ``metrics_page`` with ``ProtocolError: unknown op``; the client then asks it
``metrics`` (docs/upgrades.md). ``metrics`` stays, unchanged, for older clients.

Each op is declared once, in :data:`REQUESTS`: its argument record (:class:`NackArgs`, ...),
its retry policy, and the state method it calls (the shard's one generic handler passes
the record's fields to it by name) or the shard handler of an op that does more; the lease,
dead-letter and result rows of the replies are :class:`LeaseRow`, :class:`DeadRow` and
:class:`ResultRow`.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from .. import limits
from ..errors import BY_NAME, ProtocolError, ShardqError
from ..wal.format import array_header

#: What a client may do when its connection breaks after a request was written and before
#: its reply came (a request never written may always be sent again):
RESEND = "resend"    # safe to send again: read-only, or made idempotent (see below)
UNKNOWN = "unknown"  # never re-sent: the caller gets OutcomeUnknown


# ---------------------------------------------------------------------------- arguments
# Each request's arguments, a msgpack array on the wire in its record's order. The types say
# what a well-formed request holds; the shard checks each value where it is used (the
# state's validators), so a record is built from whatever the wire decoded.

class EnqueueArgs(NamedTuple):
    items: list[list[Any]]               # [[body, key, queue, delay, priority, dedup_id], ...]
    session: list[int] | None            # [client, seq, low]


class DequeueArgs(NamedTuple):
    queue: str
    visibility: float | None
    max_jobs: int


class PeekArgs(NamedTuple):
    queue: str
    max_jobs: int


class QueueArgs(NamedTuple):             # an op on one queue (note_priorities, purge_dead, pause, ...)
    queue: str


class AckArgs(NamedTuple):
    pairs: list[list[int]]               # [[job_id, token], ...]


class NackArgs(NamedTuple):
    job_id: int
    token: int
    delay: float | None
    error: str | None
    delivered: bool


class BuryArgs(NamedTuple):
    job_id: int
    token: int
    error: str | None


class ExtendArgs(NamedTuple):
    job_id: int
    token: int
    seconds: float


class WatchArgs(NamedTuple):
    queue: str
    timeout_s: float


class DeadLettersArgs(NamedTuple):
    queue: str
    limit: int | None


class DequeueWaitArgs(NamedTuple):
    queue: str
    visibility: float | None
    max_jobs: int
    wait_s: float


class CancelWaitArgs(NamedTuple):
    request_id: int                      # of this connection's dequeue_wait


class RedriveArgs(NamedTuple):
    queue: str
    job_ids: list[int] | None


class NoArgs(NamedTuple):
    pass


class SetLimitsArgs(NamedTuple):
    queue: str
    values: dict[str, Any] | None        # None: back to the config's


class PutResultArgs(NamedTuple):
    job_id: int
    token: int
    value: bytes
    ttl_s: float


class ProgressArgs(NamedTuple):
    job_id: int
    token: int
    fraction: float | None
    note: str | None


class JobIdsArgs(NamedTuple):
    job_ids: list[int]


class ArriveArgs(NamedTuple):
    barrier_id: str
    member: int                          # its index ("index" is a tuple method)
    total: int
    value: bytes
    ttl_s: float
    callback: list[Any]                  # [body, key, queue, delay, priority]


class ArriveManyArgs(NamedTuple):
    arrivals: list[list[Any]]            # [[barrier_id, index, total, value, ttl_s, callback], ...]


class BarrierIdsArgs(NamedTuple):
    barrier_ids: list[str]


class BarrierArgs(NamedTuple):
    barrier_id: str


class CancelBarrierArgs(NamedTuple):
    barrier_id: str
    ttl_s: float


class PutWorkflowArgs(NamedTuple):
    wf_id: str
    spec: bytes


class EndWorkflowArgs(NamedTuple):
    wf_id: str
    state: str
    error: str | None
    ttl_s: float


class WorkflowArgs(NamedTuple):
    wf_id: str


class AfterLimitArgs(NamedTuple):
    after: str | None
    limit: int


class JobArgs(NamedTuple):
    job_id: int


class DeadPageArgs(NamedTuple):
    queue: str
    after: int | None
    limit: int


class PurgeIdsArgs(NamedTuple):
    queue: str
    job_ids: list[int]


class BackupCutArgs(NamedTuple):
    stage: str


class MetricsPageArgs(NamedTuple):
    start: int                           # the position of the page's first queue (0: the first page)


# ---------------------------------------------------------------------------- requests
class Request(NamedTuple):
    """One op of the wire, declared once in :data:`REQUESTS`: its argument record, its retry
    policy, and what serves it in the shard: ``calls``, the state method the shard's one
    generic handler calls with the record's fields by name (and ``now`` if it takes it),
    or else ``handler``, a ShardServer method of its own (process.py, control_handlers.py,
    result_handlers.py) for an op that does more than pass its arguments on."""
    name: str
    args: type[NamedTuple]  # its argument record (the arity is its field count)
    retry: str              # RESEND or UNKNOWN (above)
    calls: str | None = None     # the ShardState method it calls through the generic handler
    handler: str | None = None   # else: the ShardServer method that serves it
    control: bool = False   # a control or metrics op (the last ones of the table above, from pause on)
    reads: bool = False     # it only reads: given up at its deadline, nothing of it was applied


#: Every op: the one table from which :data:`OPS`, :data:`ARITY`, :data:`RETRY`,
#: :data:`CONTROL_ARITY` and the shard's handler table are derived. Each retry policy says
#: why next to it.
REQUESTS: dict[str, Request] = {r.name: r for r in (
    # the session entry makes a re-sent enqueue return the first ids
    Request("enqueue", EnqueueArgs, RESEND, handler="_enqueue"),
    # a second dequeue would lease (and count a delivery of) another job
    Request("dequeue", DequeueArgs, UNKNOWN, handler="_dequeue"),
    Request("peek", PeekArgs, RESEND, handler="_peek", reads=True),                           # read-only
    Request("note_priorities", QueueArgs, RESEND, "note_priorities"),             # sets a sticky flag
    # JobGone in answer to the re-sent ack means the first one landed
    Request("ack", AckArgs, RESEND, handler="_ack"),
    # a re-sent nack after the first landed gets LeaseLost: ambiguous
    Request("nack", NackArgs, UNKNOWN, handler="_nack"),
    # likewise: the job is dead (first landed) or the lease expired
    Request("bury", BuryArgs, UNKNOWN, "bury"),
    # sets the deadline again; LeaseLost if the lease is gone
    Request("extend", ExtendArgs, RESEND, "extend"),
    Request("watch", WatchArgs, RESEND, handler="_watch", reads=True),                        # read-only
    Request("dead_letters", DeadLettersArgs, RESEND, handler="_dead_letters", reads=True),    # read-only
    # likewise a second lease: never re-sent
    Request("dequeue_wait", DequeueWaitArgs, UNKNOWN, handler="_dequeue_wait"),
    # withdrawing twice changes nothing (a new connection has no waits)
    Request("cancel_wait", CancelWaitArgs, RESEND, handler="_cancel_wait"),
    # re-sent, it may move jobs that died after the first one
    Request("redrive", RedriveArgs, UNKNOWN, handler="_redrive"),
    # re-sent, it may purge dead letters that came after the first one
    Request("purge_dead", QueueArgs, UNKNOWN, "purge_dead"),
    # likewise: re-sent, it would delete jobs enqueued after the first one
    Request("purge_queue", QueueArgs, UNKNOWN, "purge_queue"),
    Request("queue_config", QueueArgs, RESEND, "queue_settings", reads=True),                 # read-only
    Request("stats", NoArgs, RESEND, handler="_stats", reads=True),                           # read-only
    Request("ping", NoArgs, RESEND, handler="_ping", reads=True),                             # read-only
    # sets the same values again (docs/limits.md): a re-sent change changes nothing more
    Request("set_limits", SetLimitsArgs, RESEND, "set_limits"),
    # Results and workflows (shardq/shard/results.py). put_result and progress set the same
    # value again; a re-sent arrive finds its index counted ("repeated") and changes nothing;
    # cancel_barrier is idempotent; result, result_sizes, barrier and barrier_values only read.
    Request("put_result", PutResultArgs, RESEND, "put_result"),
    Request("progress", ProgressArgs, RESEND, "set_progress"),
    Request("result", JobIdsArgs, RESEND, "results_of", reads=True),
    Request("result_sizes", JobIdsArgs, RESEND, "result_sizes", reads=True),
    Request("arrive", ArriveArgs, RESEND, "arrive"),
    Request("arrive_many", ArriveManyArgs, RESEND, handler="_arrive_many"),
    Request("barrier", BarrierIdsArgs, RESEND, "barrier_info", reads=True),
    Request("barrier_values", BarrierArgs, RESEND, "barrier_values", reads=True),
    Request("cancel_barrier", CancelBarrierArgs, RESEND, "cancel_barrier"),
    # a record is put once ("known" after) and ends once (its first end kept)
    Request("put_workflow", PutWorkflowArgs, RESEND, "put_workflow"),
    Request("end_workflow", EndWorkflowArgs, RESEND, "end_workflow"),
    Request("workflow", WorkflowArgs, RESEND, "workflow", reads=True),
    Request("workflow_ids", AfterLimitArgs, RESEND, "running_workflows", reads=True),
    # The control and metrics ops. pause, resume, cancel and purge_ids are idempotent (a
    # re-sent cancel of a lease already marked changes nothing); job, dead_page, metrics and
    # metrics_page only read.
    Request("pause", QueueArgs, RESEND, "pause", control=True),
    Request("resume", QueueArgs, RESEND, "resume", control=True),
    Request("cancel", JobArgs, RESEND, "cancel", control=True),
    Request("job", JobArgs, RESEND, "job_info", control=True, reads=True),
    Request("dead_page", DeadPageArgs, RESEND, handler="_dead_page", control=True, reads=True),
    Request("purge_ids", PurgeIdsArgs, RESEND, handler="_purge_ids", control=True),
    Request("metrics", NoArgs, RESEND, handler="_metrics", control=True, reads=True),
    Request("metrics_page", MetricsPageArgs, RESEND, handler="_metrics_page", control=True, reads=True),
    # a new cut replaces the first one's staging dir: the caller uses the reply it gets
    Request("backup_cut", BackupCutArgs, RESEND, handler="_backup_cut", control=True),
)}

#: Derived from :data:`REQUESTS`: every op name
OPS = frozenset(REQUESTS)
#: Derived from :data:`REQUESTS`: args arity per op
ARITY = {name: len(r.args._fields) for name, r in REQUESTS.items()}
#: Derived from :data:`REQUESTS`: the retry policy per op
RETRY = {name: r.retry for name, r in REQUESTS.items()}
#: Derived from :data:`REQUESTS`: the ops that only read (a caller that gave up on one got
#: ShardUnavailable, not OutcomeUnknown: there is nothing it may have applied)
READS = frozenset(name for name, r in REQUESTS.items() if r.reads)
#: Derived from :data:`REQUESTS`: the control and metrics ops and their arity
CONTROL_ARITY = {name: len(r.args._fields) for name, r in REQUESTS.items() if r.control}


class LeaseRow(NamedTuple):
    """A lease in a ``dequeue`` reply, a msgpack array in this order."""
    job_id: int
    key: str | None
    body: bytes
    attempt: int
    token: int
    deadline: float
    priority: int
    uses_priorities: bool   # the queue's sticky flag (docs/design.md, "Queue-wide priorities")


#: Where a lease row says its queue uses priorities (read without building a LeaseRow).
USES_PRIORITIES = LeaseRow._fields.index("uses_priorities")


class DeadRow(NamedTuple):
    """A dead letter in a ``dead_letters`` or ``dead_page`` reply, a msgpack array in this order."""
    job_id: int
    key: str | None
    body: bytes
    attempts: int
    error: str | None


class ResultRow(NamedTuple):
    """One job in a ``result`` reply, a msgpack array in this order."""
    state: str                 # "succeeded", a live job's state ("waiting", ..., "dead"), or "gone"
    value: bytes | int | None  # succeeded: the result (None when withheld; its length for result_sizes)
    error: str | None          # a live job: its last error
    attempts: int | None       # a live job: its deliveries so far
    fraction: float | None     # a live job: its progress
    note: str | None
    expires_at: float | None   # succeeded: when the result is forgotten
    withheld: bool             # the value was left out to keep the reply within its limit


OK = 0
ERR = 1

#: A frame's payload encoded: msgpack's C encoder itself, no Python frame around it (each
#: call of a lone request's path counts: docs/performance.md, "Figures L and W").
pack: Callable[[Any], bytes] = msgpack.Packer().pack


_LEN = struct.Struct("!i")
_LEN64 = struct.Struct("!Q")
READ_BYTES = 1 << 20  # one read takes at most this much (a larger frame takes several)


def read_frames(fd: int, buf: bytearray, scratch: bytearray) -> list[bytes] | list[memoryview]:
    """Read at most ``len(scratch)`` bytes from ``fd``, then take every complete frame off
    what ``buf`` holds with them (:func:`split_frames`). EOFError when the peer closed;
    ``BlockingIOError`` as from ``os.read``; ProtocolError as :func:`split_frames`.

    The bytes land in ``scratch``, a buffer its reader keeps: ``os.read(fd, 1 MiB)``
    allocates 1 MiB on every call, which glibc serves with mmap, mremap and munmap, under
    a lock shared by every thread of the process, whatever the read brings back.

    When the read brought exactly one whole frame and nothing was buffered before (a lone
    request or reply, the usual case), the frame is returned as a view of ``scratch``
    without a copy: it is valid only until the next read into ``scratch``, so the caller
    decodes it first."""
    n = os.readv(fd, (scratch,))
    if not n:
        raise EOFError
    if not buf and n >= 4:
        (size,) = _LEN.unpack_from(scratch)
        if size + 4 == n and size <= limits.FRAME_BYTES_MAX:
            return [memoryview(scratch)[4:n]]
    buf += memoryview(scratch)[:n]
    return split_frames(buf)


def split_frames(buf: bytearray) -> list[bytes]:
    """Take every complete frame off the front of ``buf`` (``multiprocessing.connection``
    framing: a 4-byte big-endian signed length, or -1 and an 8-byte length, then the
    payload). ProtocolError for an announced length over ``limits.FRAME_BYTES_MAX``,
    before anything is allocated for it."""
    frames = []
    pos, n = 0, len(buf)
    while n - pos >= 4:
        (size,) = _LEN.unpack_from(buf, pos)
        head = 4
        if size == -1:
            if n - pos < 12:
                break
            (size,) = _LEN64.unpack_from(buf, pos + 4)
            head = 12
        if size < 0 or size > limits.FRAME_BYTES_MAX:
            raise ProtocolError(f"frame of {size} bytes announced; limit {limits.FRAME_BYTES_MAX}")
        end = pos + head + size
        if end > n:
            break
        frames.append(bytes(buf[pos + head:end]))
        pos = end
    if pos:
        del buf[:pos]
    return frames


def pack_array(parts: list[bytes]) -> bytes:
    """A msgpack array of items already encoded one by one (to cut frames by size)."""
    return array_header(len(parts)) + b"".join(parts)


_LONG_ARRAYS = {0xDC: 3, 0xDD: 5}  # msgpack array 16 and 32: the end of their count
#: A frame of more than FRAME_REQUESTS_MAX requests takes at least this many bytes (a request
#: is an array of three, 4 bytes at least): a smaller one's header is not read (the usual one)
_FRAME_REQUESTS_BYTES_MIN = 4 * limits.FRAME_REQUESTS_MAX


def decode_requests(data: bytes | memoryview) -> list[list[Any]]:
    """Decode a request frame. ProtocolError if it is not an array of at most
    ``limits.FRAME_REQUESTS_MAX`` ``[int, str, array]``; the caller then drops the
    connection (it cannot be answered)."""
    if (len(data) > _FRAME_REQUESTS_BYTES_MIN and data[0] in _LONG_ARRAYS
            and (n := int.from_bytes(data[1:_LONG_ARRAYS[data[0]]], "big")) > limits.FRAME_REQUESTS_MAX):
        # (read from the array's header: nothing decoded)
        raise ProtocolError(f"a frame of {n} requests; at most {limits.FRAME_REQUESTS_MAX}")
    try:
        frame = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as e:  # noqa: BLE001 - any bytes a client sends: every decode failure is its ProtocolError
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if type(frame) is not list or not frame:
        raise ProtocolError("a frame must be a non-empty array of requests")
    for req in frame:
        if type(req) is not list or len(req) != 3 or type(req[0]) is not int or type(req[1]) is not str:
            raise ProtocolError("a request must be [request_id, op, args]")
    return frame


def check_request(op: str, args: object) -> None:
    """ProtocolError for an unknown op or wrong arity (answered as an error reply)."""
    if op not in OPS:
        raise ProtocolError(f"unknown op {op[:40]!r}")
    if type(args) is not list or len(args) != ARITY[op]:
        raise ProtocolError(f"{op}: expected {ARITY[op]} args")


def error_payload(exc: BaseException) -> list[str]:
    name = type(exc).__name__ if isinstance(exc, ShardqError) else "ShardqError"
    return [name, str(exc)[:2000]]


def error_from_payload(payload: Any) -> ShardqError:
    try:
        name, message = payload
        cls = BY_NAME.get(name, ShardqError)
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        return exc
    except Exception:  # noqa: BLE001 - a reply we cannot rebuild still becomes a typed error, never a crash
        return ShardqError(f"undecodable error reply: {payload!r:.200}")
