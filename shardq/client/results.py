"""Results, progress and barriers on the wire (docs/design.md, "Workflows and results"):
the requests both clients send and what their replies mean, with no I/O, so the threaded
and the asyncio router cannot differ.

Every call here may be re-sent after a broken connection: a result or a progress stored
twice is the same, an arrival is counted once per index, the others read.
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

from .. import limits
from ..errors import InvalidJob, NotFound, ProtocolError
from ..protocol import validate
from ..types import Lease
from .core import Call
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


def result_calls(job_ids: list[Any], shards: int) -> tuple[list[Call], list[list[int]]]:
    """One ``result`` call per shard (at most ``BATCH_JOBS_MAX`` ids each) and, per call,
    the positions in ``job_ids`` its entries answer."""
    by_shard: dict[int, list[int]] = {}
    for i, job_id in enumerate(job_ids):
        by_shard.setdefault(job_shard(job_id, shards), []).append(i)
    calls, where = [], []
    for shard, positions in sorted(by_shard.items()):
        for start in range(0, len(positions), limits.BATCH_JOBS_MAX):
            part = positions[start:start + limits.BATCH_JOBS_MAX]
            calls.append(Call(shard, "result", [[job_ids[i] for i in part]]))
            where.append(part)
    return calls, where


def job_result(job_id: int, entry: Any) -> tuple[JobResult, bool]:
    """One reply entry as a JobResult, and whether its value was withheld (ask again for
    that job alone)."""
    if type(entry) is not list or len(entry) != len(RESULT_FIELDS):
        raise ProtocolError(f"result: malformed entry for job {job_id}")
    state, value, error, attempts, fraction, note, expires_at, withheld = entry
    return JobResult(job_id, state, value, error, attempts, fraction, note, expires_at), bool(withheld)


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


def look_up(router: Any, job_id: int) -> tuple[dict | None, JobResult | None]:
    """A job as ``shardq job show`` and the console show it: the live job (``router.job``,
    None once it is not live) and its outcome (None from a backend that keeps no results).
    NotFound if the job is neither live nor has a result kept."""
    try:
        info = router.job(job_id)
    except NotFound:
        info = None
    outcome = router.results([job_id])[0] if hasattr(router, "results") else None
    if info is None and (outcome is None or outcome.state != "succeeded"):
        raise NotFound(f"job {job_id} not found: not live (finished, cancelled, purged or never enqueued) "
                       "and no result kept")
    return info, outcome
