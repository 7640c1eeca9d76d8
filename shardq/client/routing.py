"""Where requests go, without I/O: the part of the client core both drivers (the threaded
:class:`~shardq.client.router.Router` and the asyncio :class:`~shardq.client.aio.AsyncQueue`)
share for routing.

* Keys map to shards by a stable hash (CRC-32 of the UTF-8 key, mod N); a job id names its
  shard in its low bits (:func:`shard_of_job`).
* A job is checked once, here, before a batch is split (:func:`job_item`), so no shard gets
  half of a bad batch; a batch is grouped by shard (:func:`split_by_shard`) and each shard's
  part cut into requests a shard accepts (:func:`cut_requests`).
* Ids, acks, redrives and purges are grouped by the shard that holds each job.
"""
from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .. import limits
from ..errors import InvalidJob, NotFound
from ..protocol import validate
from ..types import DeadLetter, Lease

_JOB_FIELDS = frozenset({"body", "key", "queue", "delay", "priority", "dedup_id"})
_SHARD_MASK = (1 << limits.JOB_ID_SHARD_BITS) - 1
_BODY_CEILING = limits.BODY_BYTES_MAX_CEILING
_KEY_FAST_CHARS = limits.KEY_BYTES_MAX // 4  # this many characters fit in the limit as UTF-8
_QUEUE_MAX = limits.QUEUE_NAME_BYTES_MAX
_COUNT_KEYS = ("ready", "delayed", "waiting", "in_flight", "dead", "keys")  # a queue's stats counts


def shard_for_key(key: str, shards: int) -> int:
    """The shard of ``key``: stable across processes, runs and Python versions."""
    try:
        return zlib.crc32(key.encode("utf-8")) % shards
    except UnicodeEncodeError:
        raise InvalidJob("key is not valid text (it holds a lone surrogate)") from None


def shard_for_dedup_id(dedup_id: str | bytes, shards: int) -> int:
    """The shard of a keyless job with ``dedup_id`` (a checked one: text or bytes): stable as
    :func:`shard_for_key`, so that every repeat of the id meets the first on the one shard
    that keeps its dedup window."""
    return zlib.crc32(dedup_id.encode("utf-8") if isinstance(dedup_id, str) else dedup_id) % shards


def shard_of_job(job_id: int) -> int:
    return job_id & _SHARD_MASK


def lease_shard(lease: Any, shards: int | None) -> int:
    """The shard of ``lease``'s job, checked before anything is sent (ack, nack, extend,
    bury): InvalidJob for what is not a :class:`~shardq.types.Lease` or whose job id is no
    non-negative integer, and, when ``shards`` is given, for a lease whose id names a shard
    a service of that many shards does not have (it cannot be one of its leases).
    Unchecked, each failed inside a driver as an AttributeError, a TypeError or an
    IndexError. (An id too large is left to the frame encoder and the shard, which refuse
    it typed.)"""
    job_id = lease.job_id if isinstance(lease, Lease) else None
    if type(job_id) is not int or job_id < 0:  # not the usual lease
        if not isinstance(lease, Lease):
            raise InvalidJob(f"expected a Lease, got {type(lease).__name__}")
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
            raise InvalidJob(f"job_id must be a non-negative integer, got {job_id!r:.40}")
    shard: int = job_id & _SHARD_MASK
    if shards is not None and shard >= shards:
        raise InvalidJob(f"not a lease of this service: job {job_id} names shard {shard}, "
                         f"and it has {shards}")
    return shard


def listed(values: Any, what: str) -> list[Any]:
    """``values`` as a list; InvalidJob for what cannot be iterated (``None``, a number)."""
    if type(values) is list:
        return values
    try:
        return list(values)
    except TypeError:
        raise InvalidJob(f"{what} must be an iterable, got {type(values).__name__}") from None


def queue_name(value: Any) -> str:
    """``value`` if it is a string (its length and text are checked by the shard); InvalidJob
    for anything else, before a driver hashes it (an unhashable list raised TypeError)."""
    if type(value) is not str:
        raise InvalidJob(f"queue must be a string, got {type(value).__name__}")
    return value


def job_shard(job_id: Any, shards: int) -> int:
    """The shard of ``job_id`` on a service of ``shards`` shards. The one check of a job id
    that names a job by itself (cancel, job look-up), for the router, the console and the
    CLI: InvalidJob for what is not a job id, NotFound for an id of a shard the service
    does not have (it cannot be one of its jobs)."""
    validate.integer("job_id", job_id)
    shard: int = job_id & _SHARD_MASK
    if shard >= shards:
        raise NotFound(f"job {job_id} names shard {shard}; this service has {shards}")
    return shard


def job_id_from_text(text: Any) -> int:
    """A job id written as text (a console request, a command line): ASCII digits only
    (``str.isdigit`` also takes "²" and other digits ``int`` refuses), within 63 bits."""
    if not (isinstance(text, str) and 0 < len(text) <= 19 and text.isascii() and text.isdigit()):
        raise InvalidJob(f"not a job id: {text!r:.40}")
    value = int(text)
    validate.integer("job_id", value)
    return value


def cut_requests(items: list[list[Any]]) -> Iterator[list[list[Any]]]:
    """Cut one shard's wire items into requests a shard accepts: at most BATCH_JOBS_MAX
    jobs and REQUEST_BYTES_MAX bytes each (so each fits one frame and one log record)."""
    job_bytes, count_max, bytes_max = validate.job_bytes, limits.BATCH_JOBS_MAX, limits.REQUEST_BYTES_MAX
    if 0 < len(items) <= count_max and 64 + 16 * len(items) + validate.jobs_bytes(items) <= bytes_max:
        yield items  # the usual batch: one request, measured without a Python step per job
        return
    start, size = 0, 64
    for i, (body, key, queue, _, _, dedup_id) in enumerate(items):
        n = job_bytes(body, key, queue, dedup_id) + 16
        if i > start and (i - start >= count_max or size + n > bytes_max):
            yield items[start:i]
            start, size = i, 64
        size += n
    if start < len(items):
        yield items[start:]


def placed_owner(settings: Any) -> int | None:
    """The shard a queue's ``queue_config`` reply says holds all its jobs (it declares
    limits: docs/limits.md), or None: its jobs go by key."""
    owner = settings.get("shard") if type(settings) is dict else None
    return owner if type(owner) is int else None


def batch_queues(jobs: list[Any], queue: Any) -> set[Any]:
    """The queue names a batch of job dicts names (the router learns each one's placement
    before it routes the batch; the jobs are checked later, in :func:`split_by_shard`)."""
    # only strings: a name of another type is refused later, and may not even be hashable
    names = {queue} if type(queue) is str else set()
    for job in jobs:
        if type(job) is dict and type(job.get("queue")) is str:
            names.add(job["queue"])
    return names


def split_by_shard(jobs: Iterable[dict[str, Any]], queue: str, shard_for: Callable[[str | None, Any], int],
                   shards: int, owners: dict[str, int | None] | None = None,
                   ) -> tuple[dict[int, list[list[Any]]], list[int], set[str]]:
    """Check a batch of job dicts (all of them before any is sent) and group their wire
    items by shard: ``({shard: [item, ...]}, the shard of each job in input order, the
    queues given a priority other than 0)``. ``shard_for`` routes one job by its key and dedup id; ``shards`` is
    how many there are; ``owners`` maps a placed queue to the shard that holds all its jobs
    (:func:`placed_owner`)."""
    jobs = listed(jobs, "jobs")
    owners = owners if owners and any(o is not None for o in owners.values()) else None
    # the usual batch has jobs of ``queue`` only (no job names its own)
    usual = _usual_batch(jobs, queue, shards) if owners is None or owners.get(queue) is None else None
    if usual is not None:
        return usual
    per_shard: dict[int, list[list[Any]]] = {}
    shard_ids: list[int] = []
    prioritized: set[str] = set()
    item_of, fields = job_item, _JOB_FIELDS
    for job in jobs:
        if type(job) is not dict or "body" not in job or not job.keys() <= fields:
            raise InvalidJob(f"each job is a dict with 'body' and optional {sorted(fields - {'body'})}")
        get = job.get
        key = get("key")
        item = item_of(job["body"], key, get("queue", queue), get("delay", 0), get("priority", 0),
                       get("dedup_id"))
        if item[4]:
            prioritized.add(item[2])
        owner = owners.get(item[2]) if owners is not None else None
        shard = shard_for(key, item[5]) if owner is None else owner
        bucket = per_shard.get(shard)
        if bucket is None:
            bucket = per_shard[shard] = []
        shard_ids.append(shard)
        bucket.append(item)
    return per_shard, shard_ids, prioritized


_ZEROS, _NONES = itertools.repeat(0), itertools.repeat(None)  # a usual job's delay, priority, dedup id


def _usual_batch(jobs: list[Any], queue: object,
                 shards: int) -> tuple[dict[int, list[list[Any]]], list[int], set[str]] | None:
    """:func:`split_by_shard` of the usual batch, every job ``{"body": bytes, "key": str}``
    within the limits :func:`job_item` checks, with C loops (``map``, ``compress``)
    instead of Python steps per job; the same items and shards. None for any other batch,
    which the loop in split_by_shard then checks job by job, naming the first error."""
    if type(queue) is not str or not 0 < len(queue) <= _QUEUE_MAX or not queue.isascii():
        return None  # job_item checks the name (and names the error)
    if not jobs or set(map(type, jobs)) != {dict} or set(map(len, jobs)) != {2}:
        return None
    bodies: list[Any] = list(map(dict.get, jobs, itertools.repeat("body")))
    keys: list[Any] = list(map(dict.get, jobs, itertools.repeat("key")))  # None where a job has no key
    if set(map(type, bodies)) != {bytes} or set(map(type, keys)) != {str}:
        return None
    if not 0 < min(map(len, bodies)) <= max(map(len, bodies)) <= _BODY_CEILING:
        return None
    if "" in keys or max(map(len, keys)) > _KEY_FAST_CHARS:
        return None
    try:  # shard_for_key, mapped
        shard_ids = list(map(operator.mod, map(zlib.crc32, map(str.encode, keys)), itertools.repeat(shards)))
    except UnicodeEncodeError:
        return None
    items = list(map(list, zip(bodies, keys, itertools.repeat(queue), _ZEROS, _ZEROS, _NONES)))
    if shards == 1:
        return {0: items}, shard_ids, set()
    per_shard: dict[int, list[list[Any]]] = {}
    for s in range(shards):
        bucket = list(itertools.compress(items, map(operator.eq, shard_ids, itertools.repeat(s))))
        if bucket:
            per_shard[s] = bucket
    return per_shard, shard_ids, set()


def in_input_order(ids_by_shard: dict[int, list[Any]], shard_ids: list[int]) -> list[Any]:
    """The ids of a batch in input order: each shard answered its jobs in the order sent,
    and ``shard_ids`` says which shard each job went to."""
    answers = {s: iter(ids) for s, ids in ids_by_shard.items()}
    return list(map(next, map(answers.__getitem__, shard_ids)))


def leases_of(queue: str, rows: Iterable[list[Any]]) -> list[tuple[int, Lease]]:
    """``(priority, lease)`` for each lease row of a dequeue reply."""
    # unpacked by name in wire.LeaseRow's order: a row is an array on the wire
    return [(priority, Lease(job_id, key, body, queue, attempt, token, deadline))
            for job_id, key, body, attempt, token, deadline, priority, _uses_priorities in rows]


def dead_letters_of(queue: str, rows: Iterable[list[Any]]) -> list[DeadLetter]:
    """The dead letters of ``dead_letters`` / ``dead_page`` reply rows (wire.DeadRow's order)."""
    return [DeadLetter(job_id, key, body, queue, attempts, error) for job_id, key, body, attempts, error in rows]


def batch_ids(calls: Sequence[tuple[int, str, list[Any]]], results: list[Any], shard_ids: list[int]) -> list[Any]:
    """The ids of a batch sent as ``calls`` (``(shard, "enqueue", args)``, a shard's in
    order), from each call's ``(ids, resent)``, in input order."""
    ids_by_shard: dict[int, list[Any]] = {}
    for (shard, _, _), (ids, _) in zip(calls, results):
        ids_by_shard.setdefault(shard, []).extend(ids)
    return in_input_order(ids_by_shard, shard_ids)


def group_by_shard(shards: int, job_ids: Any) -> dict[int, list[int]]:
    """``job_ids`` grouped by the shard that holds each, checked: a list of integer ids of
    this service's shards."""
    if isinstance(job_ids, (str, bytes)) or not hasattr(job_ids, "__iter__"):
        raise InvalidJob("job_ids must be a list of job ids")
    per: dict[int, list[int]] = {}
    for j in job_ids:
        validate.integer("job_id", j)
        per.setdefault(shard_of_job(j), []).append(j)
    if any(s >= shards for s in per):
        raise InvalidJob(f"job ids name shards this service does not have ({shards} shards)")
    return per


def redrive_calls(shards: int, queue: str, job_ids: Any) -> list[tuple[int, str, list[Any]]]:
    """The redrive requests: every shard (all dead letters), or the shards of ``job_ids``."""
    queue = queue_name(queue)
    if job_ids is None:
        return [(s, "redrive", [queue, None]) for s in range(shards)]
    return [(s, "redrive", [queue, ids]) for s, ids in group_by_shard(shards, job_ids).items()]


def purge_calls(shards: int, queue: str, job_ids: Any) -> list[tuple[int, str, list[Any]]]:
    """The purge requests: every shard (all dead letters), or the shards of ``job_ids``
    (checked: a list of integer ids of this service's shards), ``BATCH_JOBS_MAX`` a request."""
    queue = queue_name(queue)
    if job_ids is None:
        return [(s, "purge_dead", [queue]) for s in range(shards)]
    step = limits.BATCH_JOBS_MAX  # a shard's purge_ids takes at most this many: more go in several
    return [(s, "purge_ids", [queue, ids[k:k + step]]) for s, ids in group_by_shard(shards, job_ids).items()
            for k in range(0, len(ids), step)]


def queue_totals(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-queue counts summed over the shards' stats: ``shards`` is every shard's, in shard
    order, a down one included (``"available": False``; it has no queues).

    A placed queue's ``limits`` (docs/limits.md) are its owner shard's figures, never a sum
    nor another shard's (one that still holds jobs from before the queue was placed, or an
    idle one an every-shard call such as pause made it on), with ``"owner"``: the shard. Its
    owner down, or holding no figures of it yet, they are ``{"owner": N, "owner_down": bool}``
    and no figures. A limited queue that no shard that answered holds is listed too while its
    owner is down (its counts 0: none of the shards that answered holds a job of it): each
    shard's ``placed`` names the queues its config declares with limits. ``stats`` and the
    console's overview both count with this."""
    from ..config import owner_shard  # here, not at the top: this function alone is the change

    queues: dict[str, dict[str, Any]] = {}
    placed: set[str] = set()
    by_shard = {sh.get("shard", i): sh for i, sh in enumerate(shards)}
    for sh in shards:
        for name, counts in (sh.get("queues") or {}).items():
            agg = queues.setdefault(name, {})
            for k, v in counts.items():
                if k == "limits":
                    placed.add(name)
                elif isinstance(v, bool):
                    agg[k] = agg.get(k) or v  # flags (paused, undeclared): any shard
                else:
                    agg[k] = agg.get(k, 0) + v
    for sh in shards:
        for name in sh.get("placed") or ():
            if name not in queues and not by_shard.get(owner_shard(name, len(shards)), {}).get("available", False):
                queues[name] = dict.fromkeys(_COUNT_KEYS, 0)
                placed.add(name)
    for name in placed:
        owner = owner_shard(name, len(shards))
        sh = by_shard.get(owner, {})
        figures = ((sh.get("queues") or {}).get(name) or {}).get("limits")
        queues[name]["limits"] = (dict(figures, owner=owner) if isinstance(figures, dict) else
                                  {"owner": owner, "owner_down": not sh.get("available", False)})
    return queues



def _text_within(what: str, value: str, max_bytes: int) -> None:
    """InvalidJob unless ``value`` is 1 to ``max_bytes`` bytes of valid text as UTF-8."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidJob(f"{what} is not valid text (it holds a lone surrogate)") from None
    if not 0 < size <= max_bytes:
        raise InvalidJob(f"{what} must be 1 to {max_bytes} bytes (UTF-8), got {value!r:.60}")


def job_item(body: Any, key: Any, queue: Any, delay: Any, priority: Any, dedup_id: Any) -> list[Any]:
    """The wire form of one job, checked (the shard checks again; this catches errors
    before a multi-shard batch is split, so no shard gets half of a bad batch: the queue
    name's length and every text's encoding included, which the shard alone would find)."""
    # Fast path for the common shape; anything unusual goes through the validators,
    # which raise the precise error.
    if not (type(body) is bytes and 0 < len(body) <= _BODY_CEILING):
        body = validate.body(body, _BODY_CEILING)
    if key is not None and not (type(key) is str and 0 < len(key) <= _KEY_FAST_CHARS):
        validate.key(key)
    if type(queue) is not str:
        raise InvalidJob(f"queue must be a string, got {type(queue).__name__}")
    if not (0 < len(queue) <= _QUEUE_MAX and queue.isascii()):
        _text_within("queue name", queue, _QUEUE_MAX)
    if type(delay) is not int or delay:
        validate.seconds("delay", delay, hi=limits.DELAY_S_MAX)
    if type(priority) is not int or priority:
        validate.priority(priority)
    if dedup_id is not None:
        validate.dedup_id(dedup_id)
        if type(dedup_id) is str and not dedup_id.isascii():
            _text_within("dedup_id", dedup_id, limits.DEDUP_ID_BYTES_MAX)
    return [body, key, queue, delay or 0, priority or 0, dedup_id]
