"""One relay batch's sends, and what became of each row: in the queue, refused, or never
taken by it. No database here; the relay (``relay.py``) acts on the :class:`Outcome`.

The relay marks its rows in ``<table>_attempts`` before it sends them, and a mark is what
makes a row count as *sent* (its age is then checked against the dedup window before any
resend). A mark is dropped again for a row that no request which may have reached the queue
carried (docs/guarantees.md, "The dedup window and a relay that was down"). What proves that:

* the row was in no request: the batch stopped before its group (below);
* on the local shards (the router: :mod:`shardq.client.core`'s retry table), the one
  request that carried it failed with an error the router raises only for a request it
  never wrote, or that the shard refused whole (``not_taken``): ``ShardUnavailable``
  that is not ``OutcomeUnknown`` (``TooManyConnections`` and ``ServiceNotRunning``
  included), ``Closed``, ``QueueFull``.

``OutcomeUnknown`` (written, then no reply) proves nothing; nor does any error of another
backend (SQS raises ``ShardUnavailable`` for a request lost on the network after it left).

**One request per group.** ``enqueue_many`` makes one request per shard and raises the
first failed request's error only, so a batch over several shards that fails says nothing of
its other requests (some may be in). The rows are therefore sent one shard at a time,
grouped by the router's own placement (its ``route``), each group in one request: a relay
batch fits one (``BATCH_JOBS_MAX`` rows, 32 MiB of bodies; tests/outbox checks it against
the router's cut). The ids that come back name their shard and are checked against the
group's. Groups go in the order of their first row, a group's rows in row order, and all
rows of a key are in one group, so per-key order holds. A group that fails stops the batch:
the groups before it are in the queue, the ones after it were never sent. A queue that
cannot say where a job goes (another backend) gets the whole batch as one group, whose
failure proves nothing.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..client.queue import Queue
from ..client.routing import shard_of_job
from ..errors import (Closed, InvalidJob, InvariantViolation, OutcomeUnknown, QueueFull, ShardUnavailable,
                      UnknownQueue, Unsupported)

# What the queue says about one row, not about itself: such a row is rejected, not retried.
REFUSALS = (InvalidJob, Unsupported)
# What the queue says about itself: the batch stops, and the relay tries again after a backoff.
RETRIED = (ShardUnavailable, QueueFull, Closed)


class Outcome(NamedTuple):
    """What became of a batch's jobs, by index: ``sent`` (the queue has them), ``rejected``
    (refused, with the error), ``unsent`` (no request that may have reached the queue
    carried them), and ``error``: what stopped the sends (None: every job was sent or
    refused). A job in none of the three lists may be in the queue."""
    sent: list[int]
    rejected: list[tuple[int, Exception]]
    unsent: list[int]
    error: Exception | None


def not_taken(shard: int | None, exc: BaseException) -> bool:
    """Whether ``exc``, raised by one request to ``shard`` of the local shards (None: a
    queue that cannot say), proves the queue did not take that request's jobs."""
    return shard is not None and (isinstance(exc, (Closed, QueueFull)) or
                                  isinstance(exc, ShardUnavailable) and not isinstance(exc, OutcomeUnknown))


def placement(queue: Queue, jobs: list[dict[str, Any]]) -> list[tuple[int | None, list[int]]]:
    """The jobs' indexes grouped by shard, in order of each group's first job: ``[(None,
    all)]`` for a queue that is not the local shards. A job whose queue the service refuses
    goes to a group of shard None (its enqueue is refused: the row is rejected). Asks the
    service only for a queue's placement the router does not know yet: a
    :data:`RETRIED` error then is raised before anything was sent."""
    route = getattr(queue, "route", None)
    if getattr(queue, "backend", "shards") != "shards" or route is None:
        return [(None, list(range(len(jobs))))]
    unknown: set[str] = set()  # queues the service does not hold: asked once a batch
    groups: dict[int | None, list[int]] = {}
    for i, job in enumerate(jobs):
        shard: int | None = None
        if job["queue"] not in unknown:
            try:  # a keyless job goes where its dedup id hashes, as a barrier's id does
                shard = route(job["queue"], job["key"], job["dedup_id"])
            except UnknownQueue:
                unknown.add(job["queue"])
            except REFUSALS:
                pass  # (a key that is not valid text: every row of it fails the same way)
        groups.setdefault(shard, []).append(i)
    return list(groups.items())


def send(queue: Queue, jobs: list[dict[str, Any]]) -> Outcome:
    """Enqueue ``jobs`` (``enqueue_many``'s dicts, each with its ``dedup_id``) one shard's
    group at a time (see the module doc). A group the queue refuses (:data:`REFUSALS`) is
    sent again one job at a time, in order, to find the jobs it refuses. Stops at the first
    :data:`RETRIED` error, which the outcome holds; any other error is raised."""
    sent: list[int] = []
    rejected: list[tuple[int, Exception]] = []
    try:
        groups = placement(queue, jobs)
    except RETRIED as exc:
        return Outcome(sent, rejected, list(range(len(jobs))), exc)  # nothing was sent
    for n, (shard, group) in enumerate(groups):
        later = [i for _, g in groups[n + 1:] for i in g]
        try:
            _enqueue(queue, shard, [jobs[i] for i in group])
            sent += group
            continue
        except REFUSALS:
            pass  # on the local shards one request, refused whole (or before it was sent): none is in
        except RETRIED as exc:
            return Outcome(sent, rejected, (group if not_taken(shard, exc) else []) + later, exc)
        for k, i in enumerate(group):
            try:
                _enqueue(queue, shard, [jobs[i]])
                sent.append(i)
            except REFUSALS as exc:
                rejected.append((i, exc))
            except RETRIED as exc:
                # a queue that cannot say may have taken any of the group's jobs before it refused
                rest = [] if shard is None else group[k:] if not_taken(shard, exc) else group[k + 1:]
                return Outcome(sent, rejected, rest + later, exc)
    return Outcome(sent, rejected, [], None)


def _enqueue(queue: Queue, shard: int | None, jobs: list[dict[str, Any]]) -> None:
    ids = queue.enqueue_many(jobs)
    if shard is None:
        return
    placed = {shard_of_job(j) if type(j) is int else j for j in ids}
    if placed - {shard}:
        # the relay's grouping and the router's placement differ: a failure of a group could
        # then hide a request that reached another shard
        raise InvariantViolation(f"outbox relay: jobs sent as a group of shard {shard} were placed on "
                                 f"{sorted(map(str, placed))}")
