"""Results, progress and barriers on the wire (docs/design.md, "Workflows and results"):
the requests both clients send and what their replies mean, with no I/O, so the threaded
and the asyncio router cannot differ.

Every call here may be re-sent after a broken connection: a result or a progress stored
twice is the same, an arrival is counted once per index, the others read.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import limits
from ..errors import InvalidJob, NotFound, ProtocolError, ShardqError
from ..protocol import validate, wire
from ..types import Lease
from .core import Call, ack_error
from .routing import job_shard, lease_shard

#: The fields of one ``result`` reply entry, in order (docs/design.md).
RESULT_FIELDS = ("state", "value", "error", "attempts", "fraction", "note", "expires_at", "withheld")


class JobResult(NamedTuple):
    """What the service says of one job's outcome. ``state``: ``"succeeded"`` (``value``:
    the msgpack bytes its task returned, kept until ``expires_at``), or the live job's
    state (``"ready"``, ``"delayed"``, ``"waiting"``, ``"leased"``, ``"dead"`` with
    ``error``), or ``"gone"`` (acked without a kept result, its result expired, cancelled
    or purged)."""
    job_id: int
    state: str
    value: bytes | None
    error: str | None
    attempts: int | None
    fraction: float | None
    note: str | None
    expires_at: float | None
    value_bytes: int | None = None  # the value's length (also when only sizes were read: value None)


def barrier_shard(shards: int, barrier_id: str) -> int:
    """Where a barrier whose callback has no key (and a queue not placed) lives: a stable
    hash of its id, as keys are routed."""
    return zlib.crc32(barrier_id.encode("utf-8")) % shards


def ttl(value: Any, what: str = "ttl_s") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limits.KEEP_RESULT_S_MAX:
        raise InvalidJob(f"{what} must be a number of seconds in (0, {limits.KEEP_RESULT_S_MAX:.0f}], got {value!r}")
    return float(value)


def put_result_call(lease: Lease, value: bytes, ttl_s: float, shards: int) -> Call:
    if type(value) is not bytes or len(value) > limits.RESULT_BYTES_MAX:
        raise InvalidJob(f"a result must be bytes of at most {limits.RESULT_BYTES_MAX} (msgpack-encoded)")
    return Call(lease_shard(lease, shards), "put_result", [lease.job_id, lease.token, value, ttl(ttl_s)])


def progress_call(lease: Lease, fraction: float | None, note: str | None, shards: int) -> Call:
    return Call(lease_shard(lease, shards), "progress", [lease.job_id, lease.token, fraction, note])


def result_calls(job_ids: list[Any], shards: int, sizes: bool = False) -> tuple[list[Call], list[list[int]]]:
    """One ``result`` call per shard (at most ``BATCH_JOBS_MAX`` ids each; ``result_sizes``
    with ``sizes``) and, per call, the positions in ``job_ids`` its entries answer."""
    by_shard: dict[int, list[int]] = {}
    for i, job_id in enumerate(job_ids):
        by_shard.setdefault(job_shard(job_id, shards), []).append(i)
    calls, where = [], []
    for shard, positions in sorted(by_shard.items()):
        for start in range(0, len(positions), limits.BATCH_JOBS_MAX):
            part = positions[start:start + limits.BATCH_JOBS_MAX]
            calls.append(Call(shard, "result_sizes" if sizes else "result", [[job_ids[i] for i in part]]))
            where.append(part)
    return calls, where


def job_result(job_id: int, entry: Any, sizes: bool = False) -> tuple[JobResult, bool]:
    """One reply entry (of ``result``, or of ``result_sizes`` with ``sizes``) as a
    JobResult, and whether its value was withheld (ask again for that job alone)."""
    if type(entry) is not list or len(entry) != len(RESULT_FIELDS):
        raise ProtocolError(f"result: malformed entry for job {job_id}")
    state, value, error, attempts, fraction, note, expires_at, withheld = entry
    if sizes:
        if value is not None and (type(value) is not int or value < 0):
            raise ProtocolError(f"result_sizes: malformed size for job {job_id}")
        return JobResult(job_id, state, None, error, attempts, fraction, note, expires_at, value), False
    return (JobResult(job_id, state, value, error, attempts, fraction, note, expires_at,
                      None if value is None else len(value)), bool(withheld))


def barrier_id(value: Any) -> str:
    if type(value) is not str or not value or len(value.encode("utf-8", "surrogatepass")) > limits.BARRIER_ID_BYTES_MAX:
        raise InvalidJob(f"a barrier id must be a string of 1..{limits.BARRIER_ID_BYTES_MAX} bytes")
    return value


def arrive_call(shard: int, barrier: str, index: int, total: int, value: bytes, ttl_s: float,
                callback: list[Any], shards: int) -> Call:
    validate.integer("shard", shard)
    if not 0 <= shard < shards:
        raise InvalidJob(f"barrier {barrier}: shard {shard} is not one of this service's {shards}")
    return Call(shard, "arrive", [barrier_id(barrier), index, total, value, ttl(ttl_s), callback])


def report_calls(reports: list[tuple[Lease, Any]], shards: int) -> tuple[list[Call], list[list[int]], list[Any]]:
    """The requests of jobs' reports (``(lease, (op, args))``: a worker's
    :class:`~shardq.consumer.handling.Report`, an ``arrive`` or a ``put_result``), each
    checked as its one-call method checks it: ``(calls, where, answers)``. The arrivals
    for one shard go in ``arrive_many`` calls, cut as a shard accepts them
    (:func:`cut_arrivals`); ``where`` says which reports each call answers, in order;
    ``answers`` has one entry per report, the error of one refused before it was sent
    (else None)."""
    calls: list[Call] = []
    where: list[list[int]] = []
    answers: list[Any] = [None] * len(reports)
    arrivals: dict[int, list[tuple[int, list[Any]]]] = {}
    for i, (lease, (op, args)) in enumerate(reports):
        try:
            if op == "arrive":
                shard, barrier, index, total, value, ttl_s, callback = args
                call = arrive_call(shard, barrier, index, total, value, ttl_s, callback, shards)
                arrivals.setdefault(call.shard, []).append((i, call.args))
                continue
            if op != "put_result":
                raise InvalidJob(f"unknown report {op!r}: arrive or put_result")
            value, ttl_s = args
            calls.append(put_result_call(lease, value, ttl_s, shards))
            where.append([i])
        except (ShardqError, TypeError, ValueError) as exc:  # ValueError: not as many args as the op takes
            answers[i] = exc if isinstance(exc, ShardqError) else InvalidJob(f"{op}: {exc}")
    for shard, items in sorted(arrivals.items()):
        for part in cut_arrivals(items):
            calls.append(Call(shard, "arrive_many", [[item for _, item in part]]))
            where.append([i for i, _ in part])
    return calls, where, answers


def arrival_bytes(item: list[Any]) -> int:
    """An upper bound of one ``arrive_many`` item's encoding in a frame, and of what it
    logs (its arrival, and the callback job it may enqueue), without encoding it."""
    barrier, _, _, value, _, callback = item
    body, key, queue = (list(callback) + [None] * 3)[:3] if type(callback) in (list, tuple) else (None,) * 3
    return (len(value) if type(value) is bytes else 0) + 8 * len(barrier) + 64 + validate.job_bytes(
        body if type(body) is bytes else b"", key if type(key) is str else None, queue if type(queue) is str else "")


def cut_arrivals(items: list[tuple[int, list[Any]]]) -> list[list[tuple[int, list[Any]]]]:
    """One shard's arrivals cut into requests a shard accepts: at most BATCH_JOBS_MAX
    arrivals and REQUEST_BYTES_MAX bytes each (so each fits one frame and one log record)."""
    parts: list[list[tuple[int, list[Any]]]] = []
    part: list[tuple[int, list[Any]]] = []
    size = 64
    for entry in items:
        n = arrival_bytes(entry[1]) + 16
        if part and (len(part) >= limits.BATCH_JOBS_MAX or size + n > limits.REQUEST_BYTES_MAX):
            parts.append(part)
            part, size = [], 64
        part.append(entry)
        size += n
    if part:
        parts.append(part)
    return parts


def round_outcome(acks: int, ack_indexes: list[list[int]], ack_replies: list[Any], calls: list[Call],
                  where: list[list[int]], report_replies: list[Any], answers: list[Any]
                  ) -> tuple[list[Any], list[Any]]:
    """Per ack and per report of a ``settle_many`` round, None or its error, from each
    call's reply or error (``acks_by_shard``'s indexes; ``report_calls``' where and
    answers). A call that failed (an unavailable shard) fails every ack or report it
    carried; an ``arrive_many`` answers each arrival (its outcome, or an error)."""
    acked: list[Any] = [None] * acks
    for idx, reply in zip(ack_indexes, ack_replies):
        if isinstance(reply, BaseException):
            for i in idx:
                acked[i] = reply
            continue
        errs, resent = reply
        for i, payload in zip(idx, errs):
            if payload is not None:
                acked[i] = ack_error(payload, resent)
    for call, positions, reply in zip(calls, where, report_replies):
        if isinstance(reply, BaseException):
            for i in positions:
                answers[i] = reply
            continue
        if call.op != "arrive_many":
            continue  # a put_result: it landed
        value, _ = reply
        if type(value) is not list or len(value) != len(positions):
            for i in positions:
                answers[i] = ProtocolError("arrive_many: the reply has not one entry per arrival")
            continue
        for i, entry in zip(positions, value):
            if type(entry) is list:
                answers[i] = wire.error_from_payload(entry)
    return acked, answers


def workflow_call(op: str, wf_id: Any, args: list[Any], shards: int) -> Call:
    """A request about the record of workflow ``wf_id``, to its home shard (a stable hash of
    its id, as a barrier's): ``put_workflow``, ``end_workflow`` or ``workflow``."""
    wf_id = barrier_id(wf_id)
    return Call(barrier_shard(shards, wf_id), op, [wf_id] + args)


def barrier_calls(refs: list[tuple[int, str]], shards: int) -> tuple[list[Call], list[list[int]]]:
    """One ``barrier`` call per shard for ``(shard, barrier id)`` pairs and, per call, the
    positions in ``refs`` its states answer."""
    by_shard: dict[int, list[int]] = {}
    for i, (shard, bid) in enumerate(refs):
        validate.integer("shard", shard)
        if shard >= shards:
            raise InvalidJob(f"barrier {bid}: shard {shard} is not one of this service's {shards}")
        barrier_id(bid)
        by_shard.setdefault(shard, []).append(i)
    calls, where = [], []
    for shard, positions in sorted(by_shard.items()):
        for start in range(0, len(positions), limits.BATCH_JOBS_MAX):
            part = positions[start:start + limits.BATCH_JOBS_MAX]
            calls.append(Call(shard, "barrier", [[refs[i][1] for i in part]]))
            where.append(part)
    return calls, where


def in_order(count: int, where: list[list[int]], replies: list[list[Any]]) -> list[Any]:
    """The entries of per-call ``replies`` put back at the positions ``where`` says."""
    out: list[Any] = [None] * count
    for positions, entries in zip(where, replies):
        if type(entries) is not list or len(entries) != len(positions):
            raise ProtocolError("a reply has not one entry per item asked")
        for i, entry in zip(positions, entries):
            out[i] = entry
    return out


def look_up(job: Callable[[int], dict[str, Any]], results: Callable[[list[int]], list[JobResult]] | None,
            job_id: int) -> tuple[dict[str, Any] | None, JobResult | None]:
    """A job as ``shardq job show`` and the console show it: the live job (``job``, a
    router's ``job`` call: None once it is not live) and its outcome (``results``: None for a
    backend that keeps none). NotFound if the job is neither live nor has a result kept."""
    try:
        info = job(job_id)
    except NotFound:
        info = None
    outcome = results([job_id])[0] if results is not None else None
    if info is None and (outcome is None or outcome.state != "succeeded"):
        raise NotFound(f"job {job_id} not found: not live (finished, cancelled, purged or never enqueued) "
                       "and no result kept")
    return info, outcome
