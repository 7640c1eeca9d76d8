"""The queue contract: what producers, workers, the task layer and the CLI may rely on.

:class:`Queue` names the calls the router already implements. Every backend (the local
shards' :class:`~shardq.client.router.Router`; ``shardq.backends.*``) implements it, and
every consumer of a queue (worker runner, idempotency binding, tasks, CLI client commands)
depends on this protocol only, never on a backend module. ``shardq.connect(target)`` picks
the backend from the target.

Job ids and lease tokens are opaque: ``int`` on the local shards, ``str`` on backends whose
ids are strings (an SQS message id, a receipt handle). Compare them, store them, pass them
back; never do arithmetic on them.

The guarantees every backend keeps (tested by one contract suite, ``tests/consumer/test_contract.py``):

* ``enqueue`` returns only once the job is durable; a retried call with the same
  ``dedup_id`` within the queue's dedup window returns the first job's id and adds nothing.
* ``dequeue`` leases: the job stays invisible until ``lease.deadline``; only ``ack`` deletes
  it; an expired lease makes it visible again (**at-least-once** delivery).
* Per key, jobs are delivered in enqueue order with at most one lease per key at a time.
* ``ack``/``nack``/``extend`` with a lease that is no longer current raise
  :class:`~shardq.errors.LeaseLost` and change nothing.
* After ``max_deliveries`` deliveries a job moves to the dead-letter queue.
* A feature a backend cannot provide faithfully raises :class:`~shardq.errors.Unsupported`
  naming the feature and the backend; an argument is never silently ignored.

Control calls (``pause``, ``resume``, ``purge``, ``cancel``, ``job``, ``dead_letters_page``,
``shard_metrics``) are not part of this protocol: the local shards' router has them; a
backend may define them and raise ``Unsupported``, and the CLI reports ``Unsupported`` for a
backend that lacks them (``shardq.cli.common.control_call``). They, the asyncio queue and the
results and workflow calls are declared in :mod:`shardq.client.contracts`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable
from collections.abc import Iterable

from ..types import DeadLetter, JobId, Lease


@runtime_checkable
class Queue(Protocol):
    """A client of one queue service (all its named queues).

    The guarantees above, on the local service (a doctest run by tests/project/test_docs.py from the
    repo root with ``shardq serve`` running)::

        >>> import shardq
        >>> q = shardq.connect("var/shardq")
        >>> isinstance(q, shardq.Queue)
        True
        >>> a = q.enqueue(b"invoice 1", key="acct-7", queue="mail", dedup_id="inv-1")
        >>> q.enqueue(b"invoice 1", key="acct-7", queue="mail", dedup_id="inv-1") == a  # a retry
        True
        >>> b = q.enqueue(b"invoice 2", key="acct-7", queue="mail")
        >>> leases = q.dequeue_many("mail", max_jobs=10)     # one lease per key at a time
        >>> [(lease.job_id == a, lease.body, lease.attempt) for lease in leases]
        [(True, b'invoice 1', 1)]
        >>> q.ack(leases[0])
        >>> q.ack(leases[0])                                  # no longer current: nothing changes
        Traceback (most recent call last):
          ...
        shardq.errors.JobGone: job ... is gone (already acked)
        >>> lease = q.dequeue("mail")                         # the key's next job
        >>> lease.job_id == b
        True
        >>> q.nack(lease, delay=60, error="smtp timeout")     # visible again in 60 s
        >>> q.dequeue("mail") is None
        True
        >>> q.stats()["queues"]["mail"]["delayed"]
        1
        >>> q.close()
    """

    #: A stable id of the service behind this client (the local data dir's id, or the SQS
    #: account/region/prefix). Idempotency stores bind to it: job ids are only unique
    #: within one service. Read-only here (a property of the SQS backend; an attribute of the
    #: local clients), so every backend is a Queue to the type checker.
    @property
    def service_id(self) -> str | None: ...

    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0,
                priority: int = 0, dedup_id: str | None = None) -> JobId:
        """Durably add a job; returns its id."""
        ...

    def enqueue_many(self, jobs: Iterable[dict[str, Any]], queue: str = "default") -> list[JobId]:
        """Add jobs given as dicts (``body`` and optionally ``key``, ``queue``, ``delay``,
        ``priority``, ``dedup_id``); ids in input order. Not atomic across shards/batches."""
        ...

    def dequeue(self, queue: str = "default", wait: float = 0.0,
                visibility: float | None = None) -> Lease | None:
        """Lease one job, waiting up to ``wait`` seconds; None if none came."""
        ...

    def dequeue_many(self, queue: str = "default", max_jobs: int = 100, wait: float = 0.0,
                     visibility: float | None = None) -> list[Lease]:
        """Lease up to ``max_jobs`` jobs, waiting up to ``wait`` seconds for the first."""
        ...

    def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if it was leased again since (an ack past the lease's
        deadline still deletes it while nobody leased it since)."""
        ...

    def ack_many(self, leases: Iterable[Lease]) -> list[BaseException | None]:
        """Ack many; per lease, None or the error (never raises for one lease's error)."""
        ...

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
             delivered: bool = True) -> None:
        """End the lease: visible again now, or after ``delay`` seconds. ``error`` is kept
        as the job's last error. ``delivered=False``: the job never reached a handler."""
        ...

    def bury(self, lease: Lease, error: str | None = None) -> None:
        """Move the leased job to the dead-letter queue now (whatever its delivery count),
        with ``error`` as its error. Tasks use it for ``Fail``, exhausted ``retries`` and
        unknown task names."""
        ...

    def extend(self, lease: Lease, seconds: float) -> Lease:
        """Heartbeat: the lease now ends ``seconds`` from now; the returned lease has the
        new deadline (and, on some backends, a new token: use it from then on)."""
        ...

    def queue_config(self, queue: str = "default") -> dict[str, Any]:
        """The settings of ``queue``: at least ``visibility_timeout`` and ``max_deliveries``."""
        ...

    def dead_letters(self, queue: str = "default", limit: int = 1000) -> list[DeadLetter]:
        ...

    def redrive(self, queue: str = "default", job_ids: list[JobId] | None = None) -> int:
        """Move dead letters (all, or ``job_ids``) back with a fresh delivery count."""
        ...

    def purge_dead_letters(self, queue: str = "default", job_ids: list[JobId] | None = None) -> int:
        """Delete dead letters (all, or only ``job_ids``; ids that are not dead letters are
        skipped); returns how many. A backend that cannot pick them by id (SQS) raises
        :class:`~shardq.errors.Unsupported` when ``job_ids`` is given."""
        ...

    def stats(self) -> dict[str, Any]:
        """``{"queues": {name: {counts}}, ...}``; backends may add their own keys and say
        when counts are approximate (``"approximate": True``)."""
        ...

    def close(self) -> None:
        ...
