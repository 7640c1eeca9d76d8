"""The client engine: every call of both clients, written once, as generators that do no I/O.

The effects an operation yields, and the loops that run one, are :mod:`.effects`'s.

**How the executors are built.** The threaded :class:`~shardq.client.router.Router` and the
asyncio :class:`~shardq.client.aio.AsyncQueue` each run an operation with one small loop
(``_drive``) that does what an effect says, with threads or with coroutines; the public calls
of both come from one table, :class:`Calls`: each entry is an :class:`operation`, which both
clients inherit, so neither can lack a call the other has (the threaded client returns its
value, the asyncio one a coroutine of it). Below them, the asyncio connection to a shard
(:class:`~.aioconn.ShardConn`) is a shell around one sans-I/O state machine,
:class:`~.channel.Channel`: request ids, the pending table, frames, the merging of single
enqueues and acks, deadlines, what a break means for each request, orphaned leases and
withdrawals are decided there, once; the shell moves bytes, keeps the clock and wakes its
callers. The router hands every effect it cannot do alone to an asyncio client on its I/O
thread; what it does alone is a lone call on its shard's lane (:class:`~.connection.Lane`:
sent and read by its caller, with a busy poll), a special case inside the threaded executor.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import os
import weakref
from operator import itemgetter
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from .. import limits
from ..errors import Closed, InvalidJob, OutcomeUnknown, ProtocolError, ShardqError, ShardUnavailable, UnknownQueue
from ..datadir import DataDir
from ..protocol import status_file, validate
from ..types import DeadLetter, DeadLetterPage, JobId, Lease
from . import results as res
from .channel import Channel
from .core import (DOWN_PROBE_S, DOWN_RECHECK_S, HELD_STEP_S, LEFTOVERS_RECHECK_S, QUEUE_CONFIG_MAX_AGE_S,
                   STATS_WAIT_S, UNSENT, WAIT_REPLY_MARGIN_S, Call, LeaseRound, Polling, ack_many_outcome,
                   acks_by_shard, check_dequeue, missed_notes, nack_delay, note_calls, release_call, wait_outcome)
from .effects import AsyncExecutor, Op, Owner, Send, Sleep, SyncExecutor, call, call_all, wait_any
from .routing import (batch_ids, batch_queues, cut_requests, dead_letters_of, job_shard, lease_shard, leases_of, listed,
                      placed_owner, purge_calls, queue_name, queue_totals, redrive_calls, shard_for_dedup_id,
                      shard_for_key, split_by_shard)

log = logging.getLogger("shardq.router")
P = ParamSpec("P")
T = TypeVar("T")
_QUEUE_OF, _BODY_OF = itemgetter(2), itemgetter(0)  # of a job's wire item (routing.job_item)


class operation(Generic[P, T]):  # noqa: N801 - used as a decorator, like property
    """An entry of the table: a generator method that becomes a method of each client,
    which returns its value (threads) or a coroutine of it (asyncio). The bound method is
    made once per client and kept on it."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Op[T]]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        sig = inspect.signature(fn)
        self.signature = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> operation[P, T]: ...
    @overload
    def __get__(self, obj: SyncExecutor, owner: type) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncExecutor, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        bound = obj._bind(self.fn)
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(bound, attr, getattr(self.fn, attr))
        bound.__signature__ = self.signature
        obj.__dict__[self.name] = bound  # the next look-up finds it: no descriptor call
        return bound


_CLIENTS: weakref.WeakSet[Calls] = weakref.WeakSet()  # the clients told of a fork (Calls._watch_forks)


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        if not client._closed:
            client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def new_client_id() -> int:
    """A client's id for its enqueue sessions (:class:`~.core.Sessions`): random, so that
    clients (and the children a client's process forks) never share one."""
    return int.from_bytes(os.urandom(8), "little") >> 1


# ---------------------------------------------------------------------- the table
class Calls:
    """The calls both clients make, each once. An executor sets these attributes
    (:meth:`_init_calls`)."""

    shards: int
    retry_s: float
    request_timeout_s: float
    _queue_cfg: dict[str, tuple[float, dict[str, Any]]]  # queue -> (when asked, its settings)
    _owners: dict[str, int | None]  # queue -> the shard of all its jobs if placed (docs/limits.md)
    _prioritized: set[str]  # queues known to use priorities (sticky)
    _rr: Iterator[int]      # where the next keyless job goes, and the next lease round starts

    _noted: set[str]        # queues every shard was told use priorities (note_priorities)
    _idle: set[str]         # queues whose last dequeue of this client got nothing
    _down_until: dict[int, float]  # shard -> until when lease rounds leave it out (found down; _now's clock)
    _absent: dict[str, list[int]]  # queue -> the shards whose last round said they hold no such queue
    #: (placed queue, another shard) -> until when lease rounds leave that shard out: it had
    #: none of the jobs it held when a restart placed the queue ready (_now's clock)
    _drained: dict[tuple[str, int], float]
    _chans: list[Channel]   # each shard's connection state (its enqueue sessions)

    def _init_calls(self, dd: DataDir, retry_s: float, request_timeout_s: float) -> None:
        """The client of the service in ``dd``, and the table's state: set by each
        executor's constructor."""
        self.data_dir, self.service_id, self.shards = dd.path, dd.service_id(), dd.shards()
        self.retry_s, self.request_timeout_s = retry_s, request_timeout_s
        self.client_id = new_client_id()  # its enqueue sessions' (core.Sessions)
        self._closed = False
        self._rr = itertools.count()
        self._queue_cfg, self._owners = {}, {}
        self._prioritized, self._noted, self._idle = set(), set(), set()
        self._down_until = {}
        self._absent = {}
        self._drained = {}

    def _now(self) -> float:
        """The executor's monotonic clock (seconds)."""
        raise NotImplementedError

    def _watch_forks(self) -> None:
        """From now on (the executor's state set), :meth:`_forked` in a child forked from
        this process, unless the client was closed."""
        _CLIENTS.add(self)

    def _forked(self) -> None:
        """In a child forked from this client's process (gunicorn's ``--preload``, a
        ``multiprocessing`` pool on ``fork``): the copy shares the parent's sockets and
        enqueue sessions, so a call there would take the parent's replies or session
        numbers (a job lost: the shard answers the parent's next enqueue as a re-send of
        the child's). The executor makes it the child's own, or refuses its calls."""
        raise NotImplementedError

    # What does not wait is done by these methods, called by the operations themselves;
    # what waits is an effect (:mod:`.effects`).
    def _session(self, shard: int) -> list[int]:
        """Open an enqueue session of ``shard`` (:class:`~.core.Sessions`)."""
        return self._chans[shard].sessions.open()

    def _done(self, shard: int, session: list[int]) -> None:
        """Close ``session``: its enqueue's outcome is known."""
        self._chans[shard].sessions.close(session)

    def _release(self, leases: list[Lease]) -> None:
        """Hand ``leases`` back unstarted (a ``nack`` that is not a delivery), without waiting
        for the replies: one that cannot be sent expires by itself."""
        raise NotImplementedError

    def _release_rows(self, rows: list[Any]) -> None:
        """:meth:`_release` the leases of wire rows nobody takes (an orphaned reply's)."""
        self._release([lease for _, lease in leases_of("", rows)])  # a release needs no queue name

    def _settled(self, leases: list[Lease]) -> None:
        """``leases`` are settled (acked, nacked, buried) through this client (``consume``
        counts them)."""

    def _extending(self, lease: Lease) -> Callable[[float | None], None] | None:
        """An extend of ``lease`` is sent: a function to tell the deadline it set (None: it
        failed), or None when nobody wants to know (``consume`` counts leases)."""
        return None

    def _add_status(self, shards: list[dict[str, Any]]) -> None:
        """Add the supervisor's view to each of ``shards`` (``stats()``'s rows), in place:
        from the status file of ``shardq serve`` (:mod:`shardq.protocol.status_file`)."""
        status_file.add_to(shards, DataDir(self.data_dir).run_dir)

    def _placed(self, queue: str, key: str | None, priority: int, dedup_id: str | bytes | None = None) -> int | None:
        """:func:`place`'s answer on the hot path, when nothing must be asked first (None:
        run :func:`place`)."""
        if priority and queue not in self._noted or queue not in self._owners:
            return None
        owner = self._owners[queue]
        return self._shard_for(key, dedup_id) if owner is None else owner

    def _shard_for(self, key: str | None, dedup_id: str | bytes | None = None) -> int:
        """A job's shard by its key (a stable hash); a keyless one by its dedup id's, so that a
        repeat meets the first where its dedup window is kept; any other keyless one goes
        round-robin."""
        if key is not None:
            return shard_for_key(key, self.shards)
        return next(self._rr) % self.shards if dedup_id is None else shard_for_dedup_id(dedup_id, self.shards)

    # ---------------------------------------------------------------- producing
    @operation
    def enqueue_many(self, jobs: Iterable[dict[str, Any]], queue: str = "default") -> Op[list[JobId]]:
        """Enqueue many jobs (dicts with ``body`` and optionally ``key``, ``queue``, ``delay``,
        ``priority``, ``dedup_id``) in one request per shard (more where a shard's part passes
        ``BATCH_JOBS_MAX`` jobs or ``REQUEST_BYTES_MAX`` bytes, sent in order); ids come back
        in input order.

        Each request is all-or-nothing. Across requests it is not atomic: if one is refused
        (e.g. QueueFull) the error is raised and the other requests' jobs may be in. A body
        over its queue's ``max_body_bytes`` is refused before any request is sent. Each
        request carries an enqueue session (filled in by the executor when it is sent), so
        one re-sent after a broken connection never adds its jobs twice."""
        jobs = listed(jobs, "jobs")
        for name in batch_queues(jobs, queue) - self._owners.keys():
            yield Owner(name, self._shard_for(None))
        per_shard, shard_ids, prioritized = split_by_shard(jobs, queue, self._shard_for, self.shards, self._owners)
        new = prioritized - self._noted
        if new:
            yield from tell_priorities(self, sorted(new))
        calls = [Call(s, "enqueue", [chunk, None]) for s, items in per_shard.items() for chunk in cut_requests(items)]
        if len(calls) > 1:  # (one request is all or nothing on its shard)
            yield from _check_bodies(self, calls)
        got = (yield Send(calls)) if calls else []
        return batch_ids(calls, got, shard_ids)

    # ---------------------------------------------------------------- consuming
    @operation
    def dequeue(self, queue: str = "default", wait: float = 0.0, visibility: float | None = None) -> Op[Lease | None]:
        """Lease one job, waiting up to ``wait`` seconds for one. None if none came."""
        leases = yield from _dequeue_many(self, queue, 1, wait, visibility)
        return leases[0] if leases else None

    @operation
    def dequeue_many(self, queue: str = "default", max_jobs: int = 100, wait: float = 0.0,
                     visibility: float | None = None) -> Op[list[Lease]]:
        """Lease up to ``max_jobs`` jobs across shards, waiting up to ``wait`` seconds for
        the first. Each lease is logged, with its delivery count, before it is returned; it
        is fsynced first only on a queue with ``lease_sync = "strict"`` (the default,
        ``batched``, makes it durable with the next commit: docs/guarantees.md, "Lease
        durability"). A job is leased only once its enqueue is durable."""
        return (yield from _dequeue_many(self, queue, max_jobs, wait, visibility))

    # ---------------------------------------------------------------- settling
    @operation
    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
             delivered: bool = True) -> Op[None]:
        """Release the lease now (delay 0) or make the job delayed for ``delay`` seconds.
        ``error`` is kept as the job's last error (shown in dead letters).
        ``delivered=False``: the job never reached a handler (an unstarted prefetch), so this
        lease does not count towards ``max_deliveries``."""
        shard = lease_shard(lease, self.shards)
        delay = nack_delay(delay)
        try:
            yield from call(shard, "nack", [lease.job_id, lease.token, delay, error, delivered])
        finally:
            self._settled([lease])

    @operation
    def bury(self, lease: Lease, error: str | None = None) -> Op[None]:
        """Move the leased job to the dead-letter queue now, with ``error`` as its error,
        whatever its delivery count. LeaseLost if the lease is no longer current."""
        shard = lease_shard(lease, self.shards)
        try:
            yield from call(shard, "bury", [lease.job_id, lease.token, error])
        finally:
            self._settled([lease])

    @operation
    def extend(self, lease: Lease, seconds: float) -> Op[Lease]:
        """Heartbeat: the lease now ends ``seconds`` from now. LeaseLost if already lost.
        An asyncio ``consume()`` loop holding the lease counts it until the new deadline
        (and while the extend is out: its reply may move the deadline)."""
        extended, deadline = self._extending(lease), None
        try:
            deadline = yield from call(lease_shard(lease, self.shards), "extend", [lease.job_id, lease.token, seconds])
        finally:
            if extended is not None:
                extended(deadline)
        return lease._replace(deadline=deadline)

    @operation
    def ack_many(self, leases: Iterable[Lease]) -> Op[list[BaseException | None]]:
        """Ack many leases, one request per shard. Returns, per lease, None or the error."""
        leases = listed(leases, "leases")
        indexes, calls = acks_by_shard(leases, self.shards)
        try:
            replies = (yield Send(calls)) if calls else []
        finally:
            self._settled(leases)
        return ack_many_outcome(len(leases), indexes, replies)

    @operation
    def note_priorities(self, queues: list[str]) -> Op[None]:
        """Tell every shard that ``queues`` use priorities, as the first enqueue of a priority
        other than 0 to a queue does first (docs/design.md, "Queue-wide priorities"): for
        jobs that others enqueue later, a workflow's later steps, which their barriers'
        shards enqueue. A shard that is down is told with this client's next prioritized
        enqueue."""
        new = {queue_name(queue) for queue in listed(queues, "queues")} - self._noted
        if new:
            yield from tell_priorities(self, sorted(new))

    # ---------------------------------------------------------------- admin
    @operation
    def dead_letters(self, queue: str = "default", limit: int = 1000) -> Op[list[DeadLetter]]:
        """Dead letters of ``queue`` with their errors, at most ``limit``."""
        queue = queue_name(queue)  # not hashed by the shard as it is: a list was a ProtocolError
        rows = yield from call_all([Call(s, "dead_letters", [queue, limit]) for s in range(self.shards)], absent=[])
        return [d for got in rows for d in dead_letters_of(queue, got)][:limit]

    @operation
    def redrive(self, queue: str = "default", job_ids: list[JobId] | None = None) -> Op[int]:
        """Move dead letters back into the queue with a fresh delivery count: all, or only
        ``job_ids`` (checked first: ``InvalidJob`` for anything but integer ids of this
        service's shards, and nothing is sent). Returns how many."""
        return sum((yield from call_all(redrive_calls(self.shards, queue, job_ids), absent=0)))

    @operation
    def purge_dead_letters(self, queue: str = "default", job_ids: list[JobId] | None = None) -> Op[int]:
        """Delete dead letters of ``queue``: all, or only ``job_ids`` (ids that are not, or
        no longer, its dead letters are skipped: repeating it is harmless). Returns how many."""
        return sum((yield from call_all(purge_calls(self.shards, queue, job_ids), absent=0)))

    @operation
    def purge(self, queue: str) -> Op[int]:
        """Delete every job of ``queue`` on every shard but its dead letters: waiting,
        delayed, ready and leased (a purged lease's ack, nack or extend raises
        :class:`~shardq.errors.JobGone`). Returns how many went. Like ``redrive``, it is
        never re-sent: a connection lost meanwhile raises ``OutcomeUnknown``, and calling
        again finishes the job (it may then also delete jobs enqueued since)."""
        if type(queue) is not str:
            raise InvalidJob(f"queue must be a string, got {type(queue).__name__}")
        return sum((yield from call_all([Call(s, "purge_queue", [queue]) for s in range(self.shards)], absent=0)))

    @operation
    def queue_config(self, queue: str = "default") -> Op[dict[str, Any]]:
        """The service's settings for ``queue`` (visibility_timeout, max_deliveries, ...),
        as asked at most ``QUEUE_CONFIG_MAX_AGE_S`` ago: a reload of the config (SIGHUP)
        reaches a long-lived client within that."""
        return (yield from _queue_config(self, queue))

    @operation
    def stats(self) -> Op[dict[str, Any]]:
        """Per shard (pid, WAL bytes, jobs, per-queue counts) and totals per queue over the
        shards that answered (``"available": True``). A shard that is down appears as
        ``{"shard": i, "available": False, "error": ...}`` instead of failing the call, and
        so does one that does not answer within :data:`~.core.STATS_WAIT_S` (hung).
        Each shard also carries its supervisor's view (``status``, ``restarts``,
        ``last_exit``; for one not ready, ``reason`` and ``restart_in_s``), from the embedded
        supervisor or from the one of ``shardq serve`` (:mod:`shardq.protocol.status_file`)."""
        calls = [Call(s, "stats", []) for s in range(self.shards)]
        got = yield Send(calls, min(self.retry_s, DOWN_PROBE_S), min(self.request_timeout_s, STATS_WAIT_S), errors=True)
        shards: list[dict[str, Any]] = []
        for s, r in enumerate(got):
            if isinstance(r, ShardUnavailable):
                shards.append({"shard": s, "available": False, "error": str(r), "queues": {}})
            elif isinstance(r, BaseException):
                raise r
            else:
                shards.append(dict(r[0], available=True))
        queues = queue_totals(shards)
        self._add_status(shards)
        return {"shards": shards, "queues": queues}

    @operation
    def ping(self) -> Op[list[int]]:
        """Every shard's answer to a ping (its pid)."""
        return (yield from call_all([Call(s, "ping", []) for s in range(self.shards)]))

    # ---------------------------------------------------------------- control (this backend)
    # Pause, cancel, look-up and dead-letter paging are calls of the local shards' clients,
    # not of the Queue protocol: a backend that cannot do them (SQS) raises Unsupported.
    @operation
    def pause(self, queue: str = "default") -> Op[int]:
        """Stop leasing from ``queue``, durably, on every shard (it stays paused across
        restarts). Enqueue, ack, nack and extend keep working. Returns how many shards were
        not paused yet. ShardUnavailable if a shard is down: the others are paused, and
        calling again once it is back finishes the job (idempotent)."""
        return (yield from _on_every_shard(self, "pause", queue))

    @operation
    def resume(self, queue: str = "default") -> Op[int]:
        """Lease from ``queue`` again; returns how many shards were paused."""
        return (yield from _on_every_shard(self, "resume", queue))

    @operation
    def cancel(self, job_id: int) -> Op[str]:
        """Cancel a job; idempotent. Returns ``"cancelled"`` (it was ready, delayed or
        waiting: deleted, and the next job of its key moved up), ``"purged"`` (a dead
        letter), ``"cancelling"`` (leased: the holder's next extend/ack/nack raises
        :class:`~shardq.errors.Cancelled`; it is never delivered again) or ``"gone"`` (no
        such job any more: finished, cancelled, purged, or never enqueued). NotFound for an
        id that names a shard this service does not have (no shard of it made that id)."""
        got: str = yield from call(job_shard(job_id, self.shards), "cancel", [job_id])
        return got

    @operation
    def job(self, job_id: int) -> Op[dict[str, Any]]:
        """What the service knows of a live job: ``state`` (waiting, delayed, ready, leased,
        dead), ``queue``, ``key``, ``attempts``, ``deadline`` (lease end, or when a delayed
        job is due), ``error`` (the last one), ``position`` (jobs ahead of it in its key's
        line; 0: it is the head), ``cancelled``, ``enqueued_at`` (to about a second),
        ``body``, ``shard``. NotFound if it is not live (acked, cancelled, purged)."""
        shard = job_shard(job_id, self.shards)
        return dict((yield from call(shard, "job", [job_id])), shard=shard)

    @operation
    def dead_letters_page(self, queue: str = "default", limit: int = 100, cursor: str | None = None, *,
                          skip_unavailable: bool = False) -> Op[DeadLetterPage]:
        """One page of dead letters with their errors, shard by shard, lowest id first within
        a shard. Pass the returned ``cursor`` back for the next page (None: no more). A
        redrive or purge between pages never makes the walk skip or repeat a letter.
        ``skip_unavailable``: leave out a shard that is down (listed in ``skipped_shards``)
        instead of raising ShardUnavailable."""
        limit = validate.count("limit", limit, 1000)
        shard, after = parse_cursor(cursor, self.shards)
        items: list[DeadLetter] = []
        skipped: list[int] = []
        retry_s = min(self.retry_s, DOWN_PROBE_S) if skip_unavailable else None
        unknown: list[UnknownQueue] = []  # the shards that hold no such queue (see call_all's absent)
        while shard < self.shards and len(items) < limit:
            want = limit - len(items)
            try:
                rows = yield from call(shard, "dead_page", [queue, after, want], retry_s)
            except UnknownQueue as e:
                unknown.append(e)
                rows = []
            except ShardUnavailable:
                if not skip_unavailable:
                    raise
                skipped.append(shard)
                rows = []
            items.extend(dead_letters_of(queue, rows))
            if not rows:  # (fewer than asked may be a page cut to its reply frame: ask on)
                shard, after = shard + 1, None
            else:
                after = rows[-1][0]
        if unknown and len(unknown) == self.shards:
            raise unknown[0]
        next_cursor = None if shard >= self.shards else f"{shard}:{'' if after is None else after}"
        return DeadLetterPage(items, next_cursor, skipped)

    @operation
    def set_limits(self, queue: str, values: dict[str, Any] | None) -> Op[dict[str, Any]]:
        """Change the limits of a queue that declares some, at run time and durably
        (docs/limits.md): ``values`` maps some of concurrency, rate ("50/s"), burst,
        group_concurrency, group_rate to a new value or None (that limit removed); None
        goes back to the config's. Told to every shard (ShardUnavailable if one is down:
        call again once it is back). Returns the limit figures of the queue's owner shard."""
        replies = yield from call_all([Call(s, "set_limits", [queue, values]) for s in range(self.shards)])
        owner = placed_owner((yield from _queue_config(self, queue)))
        figures: dict[str, Any] = replies[owner if owner is not None else 0]
        return figures

    @operation
    def shard_metrics(self, timeout_s: float = 2.0) -> Op[list[dict[str, Any]]]:
        """Every shard's ``metrics`` (a scrape), read in pages (``metrics_page``: wire.py):
        the first page of every shard asked at once, then the next page of each shard that
        has one, all at once, and so on; each round waited for at most ``timeout_s``. A
        shard that is down, leaves a page unanswered for ``timeout_s``, or restarted
        between its pages (its pid changed) appears as ``{"shard": i, "available": False,
        "error": ...}``: this never raises ShardUnavailable. A shard of a version before
        ``metrics_page`` is asked ``metrics``, whole (docs/upgrades.md)."""
        return (yield from _metrics_pages(self, timeout_s))

    @operation
    def backup_cuts(self, stage: str) -> Op[list[dict[str, Any]]]:
        """Every shard's backup cut, asked of all at once (``backup_cut``; docs/backup.md):
        per shard, the log files hard-linked into ``<shard dir>/<stage>/`` and where the copy
        of its newest segment ends. ShardUnavailable if a shard is down: a backup needs
        every shard (the staging dirs of the others are the caller's to remove)."""
        return (yield from call_all([Call(s, "backup_cut", [stage]) for s in range(self.shards)]))

    # ---------------------------------------------------------------- results and workflows
    # Calls of the local shards' clients (docs/workflows.md); the tasks layer builds
    # workflows on them. The requests and their replies are client/results.py's.
    @operation
    def put_result(self, lease: Lease, value: bytes, ttl_s: float) -> Op[None]:
        """Keep ``value`` (msgpack bytes) as the result of ``lease``'s job for ``ttl_s``
        seconds; fenced like an ack (LeaseLost if the lease is no longer current)."""
        yield from call(*res.put_result_call(lease, value, ttl_s, self.shards))

    @operation
    def report_many(self, reports: list[tuple[Lease, Any]]) -> Op[list[BaseException | None]]:
        """Make finished jobs' reports (``(lease, (op, args))``, ``op`` an ``arrive`` or a
        ``put_result``; a worker collects them with ``ctx.report``), pipelined, one frame
        per shard: per report None (landed) or its error, in order. Each may be re-sent
        (an arrival is counted once per index), so a broken connection only re-sends."""
        return (yield from _settle_many(self, [], reports))[1]

    @operation
    def settle_many(self, acks: Iterable[Lease], reports: list[tuple[Lease, Any]]
                    ) -> Op[tuple[list[BaseException | None], list[BaseException | None]]]:
        """Ack ``acks`` and make ``reports`` (as :meth:`report_many`) in one pipelined
        round, one frame per shard: per ack and per report, None or its error (an
        unavailable shard's for each call it did not answer). A worker sends the reports of
        the jobs just finished with the acks of those whose reports landed before."""
        return (yield from _settle_many(self, acks, reports))

    @operation
    def progress(self, lease: Lease, fraction: float | None, note: str | None) -> Op[None]:
        """Record how far ``lease``'s job got (durably; shown by ``results`` and ``job``)."""
        yield from call(*res.progress_call(lease, fraction, note, self.shards))

    @operation
    def results(self, job_ids: list[int], sizes: bool = False, *,
                retry_s: float | None = None) -> Op[list[res.JobResult]]:
        """Each job's outcome (:class:`~shardq.client.results.JobResult`), in order: one
        call per shard; a value left out to keep a reply under the frame limit is asked
        for again alone. With ``sizes``, only each value's length is read (``value_bytes``;
        ``value`` is None). ``retry_s``, here and in the reading calls below: how long a
        shard that is down is tried (None: the client's), so that a caller with a deadline
        (``result(timeout)``) is answered by it."""
        job_ids = list(job_ids)
        calls, where = res.result_calls(job_ids, self.shards, sizes)
        entries = res.in_order(len(job_ids), where, (yield from call_all(calls, retry_s)))
        out = []
        for job_id, entry in zip(job_ids, entries):
            got, withheld = res.job_result(job_id, entry, sizes)
            if withheld:
                alone = yield from call(job_shard(job_id, self.shards), "result", [[job_id]], retry_s)
                got, _ = res.job_result(job_id, alone[0])
            out.append(got)
        return out

    @operation
    def route(self, queue: str, key: str | None, barrier: str) -> Op[int]:
        """The shard a job of ``queue`` with ``key`` is enqueued on: its queue's owner if
        placed, else its key's shard; a keyless one goes where ``barrier`` hashes."""
        shard = res.barrier_shard(self.shards, barrier) if key is None else shard_for_key(key, self.shards)
        owner: int | None = self._owners[queue] if queue in self._owners else (yield Owner(queue, shard))
        return shard if owner is None else owner

    @operation
    def arrive(self, shard: int, barrier: str, index: int, total: int, value: bytes, ttl_s: float,
               callback: list[Any]) -> Op[str]:
        """Report member ``index`` of ``total`` of ``barrier`` (on ``shard``) done with
        ``value``; the last one makes that shard enqueue ``callback`` (an enqueue item),
        once. ``"counted"``, ``"repeated"`` (already counted: nothing changed), ``"fired"``
        or ``"cancelled"``."""
        got: str = yield from call(*res.arrive_call(shard, barrier, index, total, value, ttl_s, callback,
                                                    self.shards))
        return got

    @operation
    def barriers(self, refs: list[tuple[int, str]], *,
                 retry_s: float | None = None) -> Op[list[dict[str, Any] | None]]:
        """The state of each ``(shard, barrier id)``, in order (None: not known there)."""
        calls, where = res.barrier_calls(refs, self.shards)
        return res.in_order(len(refs), where, (yield from call_all(calls, retry_s)))

    @operation
    def barrier_values(self, shard: int, barrier: str) -> Op[list[bytes]]:
        """The values of a complete barrier, in member order."""
        got: list[bytes] = yield from call(shard, "barrier_values", [res.barrier_id(barrier)])
        return got

    @operation
    def cancel_barrier(self, shard: int, barrier: str, ttl_s: float) -> Op[str]:
        """Mark ``barrier`` cancelled (its callback is never enqueued): ``"cancelled"``, or
        ``"fired"`` if it already was."""
        got: str = yield from call(shard, "cancel_barrier", [res.barrier_id(barrier), res.ttl(ttl_s)])
        return got

    @operation
    def put_workflow(self, wf_id: str, spec: bytes) -> Op[str]:
        """Keep the record of workflow ``wf_id`` (its steps) on its home shard: ``"put"``,
        or ``"known"`` if it is kept already (docs/design.md, "Workflow records")."""
        got: str = yield from call(*res.workflow_call("put_workflow", wf_id, [spec], self.shards))
        return got

    @operation
    def end_workflow(self, wf_id: str, state: str, error: str | None, ttl_s: float, *,
                     retry_s: float | None = None) -> Op[str]:
        """Record how ``wf_id`` ended (``succeeded``, ``failed``, ``cancelled``); the record
        is kept ``ttl_s`` more seconds. Returns its state now (a first end is kept)."""
        got: str = yield from call(*res.workflow_call("end_workflow", wf_id, [state, error, res.ttl(ttl_s)],
                                                      self.shards), retry_s)
        return got

    @operation
    def workflow(self, wf_id: str, *, retry_s: float | None = None) -> Op[dict[str, Any]]:
        """The record of ``wf_id``: ``spec``, ``state`` (``running`` or how it ended),
        ``error``, ``started_at``, ``ended_at``, ``expires_at``. NotFound if none is kept."""
        got: dict[str, Any] = yield from call(*res.workflow_call("workflow", wf_id, [], self.shards), retry_s)
        return got

    @operation
    def workflow_ids(self, shard: int, after: str | None = None, limit: int = limits.BATCH_JOBS_MAX) -> Op[list[str]]:
        """Up to ``limit`` ids of the running workflows whose records ``shard`` keeps, in
        id order, after ``after``."""
        got: list[str] = yield from call(shard, "workflow_ids", [after, limit])
        return got


# ---------------------------------------------------------------------- producing
def place(c: Calls, queue: str, key: str | None, priority: int, dedup_id: str | bytes | None = None) -> Op[int]:
    """The shard of one job (the hot ``enqueue`` of both clients): its queue's owner if the
    queue is placed because it declares limits (docs/limits.md), else by key (by dedup id,
    keyless: :meth:`Calls._shard_for`). What must be
    known first is asked first: a priority's note to every shard (:func:`tell_priorities`)
    and the queue's placement, asked once, of the shard its job would go to by key (so a
    shard that is down stops only its own jobs)."""
    if priority and queue not in c._noted:
        yield from tell_priorities(c, [queue])
    shard = c._shard_for(key, dedup_id)
    owner = c._owners[queue] if queue in c._owners else (yield Owner(queue, shard))
    return shard if owner is None else owner


def release(c: Calls, leases: list[Lease]) -> Op[None]:
    """Hand ``leases`` back unstarted, each a ``nack`` that is not a delivery
    (:func:`~.core.release_call`); one that cannot be sent expires by itself."""
    try:
        yield Send([release_call(lease) for lease in leases], errors=True)
    except ShardqError:
        pass  # (Closed, the client's own refusal: each expires by itself)


def combined(shard: int, op: str, items: list[Any]) -> Op[list[Any]]:
    """A round of single enqueues or acks combined into one request (the threaded router's,
    :mod:`.combine`), an enqueue's with a session of its own (:func:`~.effects.deliver` opens
    it), so a re-send after a break is answered with the first ids. One the shard refuses as a
    whole (all-or-nothing: nothing was applied) is made again item by item, so one caller's bad
    item never fails another's; an outcome that may be unknown (ShardUnavailable, Closed) is
    never made again. Each item's job id, or ``(error payload, resent)`` for an ack, or its
    error in its place."""
    enqueue = op == "enqueue"
    try:
        ((values, resent),) = yield Send([Call(shard, op, [items, None] if enqueue else [items])])
        return values if enqueue else [(err, resent) for err in values]
    except (ShardUnavailable, Closed):
        raise
    except ShardqError:
        if len(items) == 1:
            raise
    out: list[Any] = []
    for item in items:
        try:
            out.append((yield from combined(shard, op, [item]))[0])
        except ShardqError as e:
            out.append(e)
    return out


def learn_owner(c: Calls, queue: str, ask: int) -> Op[int | None]:
    """What an :class:`~.effects.Owner` asks: ``queue``'s config, of shard ``ask``, kept
    with its owner shard (None: not placed)."""
    cfg = yield from _config_of_any(c, queue, ask)
    c._queue_cfg.setdefault(queue, (c._now(), cfg))
    return c._owners.setdefault(queue, placed_owner(cfg))


def tell_priorities(c: Calls, queues: list[str]) -> Op[None]:
    """Tell every shard that ``queues`` use priorities, before the first enqueue of a
    priority other than 0 to them, so that once it returns a lease from any shard says
    so (see design.md, "Queue-wide priorities"). A shard that is down is told with the
    next such enqueue; a typed refusal (an undeclared queue) is raised."""
    if c.shards == 1:
        c._noted.update(queues)
        return
    calls = note_calls(queues, c.shards)
    missed = missed_notes(calls, (yield Send(calls, min(c.retry_s, DOWN_PROBE_S), errors=True)))
    if missed:
        log.info("note_priorities: a shard did not answer for %s; told again with the next "
                 "prioritized enqueue", sorted(missed))
    c._noted.update(q for q in queues if q not in missed)
    c._prioritized.update(queues)


# ---------------------------------------------------------------------- the dequeue loop
def _dequeue_many(c: Calls, queue: str, max_jobs: int, wait: float, visibility: float | None) -> Op[list[Lease]]:
    """Lease rounds until leases come, every shard is down past ``retry_s``, or the wait
    ends; between rounds, a waiting dequeue at every shard (a queue with priorities
    watches instead, then compares the shards)."""
    queue = queue_name(queue)
    wait = check_dequeue(max_jobs, wait, visibility)
    polling = Polling(c.shards, c.retry_s, c._now() + wait, waits=wait > 0)
    first = next(c._rr) % c.shards
    # A shard answers a waiting dequeue at once when it has a job ready, so one that follows
    # an empty answer waits at once: no plain round before it. One that follows a lease starts
    # with the round: on a busy queue a plain dequeue's reply is busy-polled for (figure C);
    # a wait's is not (the threaded lone-call path takes a lone wait too, without the poll).
    if wait and queue not in c._prioritized and queue in c._idle:
        out = yield from _wait_lease(c, queue, visibility, max_jobs, wait)
        if out or c._now() >= polling.deadline:
            (c._idle.add if out == [] else c._idle.discard)(queue)  # noted for the next dequeue
            return out or []
    while True:
        out, down, unknown = yield from _lease_round(c, queue, visibility, max_jobs, first)
        now = c._now()
        step = polling.after_round(out, down, unknown, now)
        if step is Polling.RETURN:
            (c._idle.discard if out else c._idle.add)(queue)  # (no function call: the hot path)
            return out
        if step is Polling.PROBE:  # every shard down: ask again until retry_s or the wait ends
            yield Sleep(DOWN_PROBE_S)
            continue
        remaining = polling.deadline - now
        if queue not in c._prioritized:
            out = yield from _wait_lease(c, queue, visibility, max_jobs, remaining)
            if out or c._now() >= polling.deadline:
                (c._idle.add if out == [] else c._idle.discard)(queue)
                return out or []
            continue  # a shard's connection broke, or one was not asked: a lease round finds what is up
        woke = yield from _watch(c, queue, remaining)
        if woke is None:
            if c._now() >= polling.deadline:
                return []
        else:
            first = woke


def _lease_round(c: Calls, queue: str, visibility: float | None, max_jobs: int,
                 first: int) -> Op[tuple[list[Lease], list[ShardUnavailable], list[OutcomeUnknown]]]:
    """One :class:`~.core.LeaseRound` (which shards, peeks, what to keep and release). A
    shard that is down gets a short try, not the full retry window: its jobs can wait, the
    other shards' should not. A round that fails, for any error (a cancelled caller
    included), hands back every lease it took, unstarted."""
    down = c._down_until
    if down:  # the shards a recent round found down are left out until DOWN_RECHECK_S after
        now = c._now()
        for shard in [s for s, until in down.items() if until <= now]:
            del down[shard]
    owner = c._owners.get(queue)
    rnd = LeaseRound(queue, visibility, max_jobs, first, c.shards, queue in c._prioritized, owner, down,
                     () if owner is None else _leftovers(c, queue, owner))
    probe = min(c.retry_s, DOWN_PROBE_S)
    try:
        calls = rnd.start()
        while calls:
            got = yield Send(calls, probe, min(c.request_timeout_s, HELD_STEP_S) if rnd.taken else None, errors=True)
            calls = rnd.receive([r if isinstance(r, BaseException) else r[0] for r in got])
    except GeneratorExit:
        raise
    except BaseException:
        taken = rnd.abandon()
        if taken:
            c._release(taken)
        raise
    finally:
        if rnd.uses_priorities:
            c._prioritized.add(queue)
        if rnd.down_shards:
            until = c._now() + DOWN_RECHECK_S
            for shard in rnd.down_shards:
                down[shard] = until
        if owner is not None and rnd.empty:
            until = c._now() + LEFTOVERS_RECHECK_S
            for shard in rnd.empty:
                if shard != owner:
                    c._drained[(queue, shard)] = until
        if rnd.absent:  # a queue no longer declared, held by other shards: no wait is left here
            c._absent[queue] = rnd.absent
        elif c._absent:
            c._absent.pop(queue, None)
    return rnd.leases, rnd.down, rnd.unknown


def _leftovers(c: Calls, queue: str, owner: int) -> list[int]:
    """The shards besides ``owner`` that a lease of placed ``queue`` asks too: a shard keeps
    and serves the jobs it held when a restart placed the queue (docs/limits.md), so each
    is asked until it has none ready, then left out for LEFTOVERS_RECHECK_S (a job of them
    may come back: a nack, a lease that ran out, a delay that ended)."""
    if c.shards == 1:
        return []
    now = c._now()
    drained = c._drained
    return [s for s in range(c.shards) if s != owner and drained.get((queue, s), 0.0) <= now]


def _wait_lease(c: Calls, queue: str, visibility: float | None, max_jobs: int,
                timeout: float) -> Op[list[Lease] | None]:
    """Leave a waiting dequeue at every shard that is up (a placed queue: at its owner and
    the shards ``_leftovers`` names) and return the leases of the first to answer with any
    (with those of any other that
    has by then, up to ``max_jobs``; the rest released unstarted). [] when none came
    within ``timeout``, or when a connection broke (that shard's lease, if it made one,
    expires unheld); None when none came and a shard was not asked (not connected): the
    queue is not known to be empty, and the caller's next dequeue begins with a lease
    round, which reaches (and connects to) every shard. (A consumer of a queue placed on a
    shard that restarted waited at the other shard only, and got nothing, for ever.)"""
    owner = c._owners.get(queue)
    asked = range(c.shards) if owner is None else [owner, *_leftovers(c, queue, owner)]
    if c._absent and queue in c._absent:
        asked = [s for s in asked if s not in c._absent[queue]]
    calls = [Call(s, "dequeue_wait", [queue, visibility, max_jobs, timeout]) for s in asked]
    got = yield from wait_any(c, calls, timeout + WAIT_REPLY_MARGIN_S, min(timeout, DOWN_RECHECK_S))
    if got is None:
        yield Sleep(min(timeout, 0.1))  # every shard down: back off, the caller retries
        return None
    keep, release, uses_priorities, error = wait_outcome(queue, got, max_jobs)
    if uses_priorities:
        c._prioritized.add(queue)  # from now on, leases compare the shards
    if release:
        c._release(release)
    if error is not None:
        if type(error) is UnknownQueue:
            return None  # undeclared meanwhile: the next lease round tells which shards still hold it
        raise error
    if not keep and UNSENT in got:  # (identity first: no value equals it)
        return None
    return keep


def _watch(c: Calls, queue: str, timeout: float) -> Op[int | None]:
    """Wait until some shard reports ready work in ``queue`` (its index) or ``timeout``."""
    calls = [Call(s, "watch", [queue, timeout]) for s in range(c.shards)]
    got = yield from wait_any(c, calls, timeout + 0.5, timeout + 0.5, first=True)
    if got is None:
        yield Sleep(min(timeout, 0.1))  # every shard down: back off, the caller retries
        return None
    for shard, a in enumerate(got):
        if a is True:
            return shard
    for a in got:
        if isinstance(a, BaseException):
            raise a
    return None


# ---------------------------------------------------------------------- parts of the table
def _queue_config(c: Calls, queue: str, max_age_s: float = QUEUE_CONFIG_MAX_AGE_S) -> Op[dict[str, Any]]:
    """``queue``'s settings, asked again when what this client holds is older than
    ``max_age_s`` (its placement is kept: it changes only with a restart of the service)."""
    queue = queue_name(queue)
    held = c._queue_cfg.get(queue)
    if held is not None and c._now() - held[0] <= max_age_s:
        return held[1]
    try:
        cfg: dict[str, Any] = yield from _config_of_any(c, queue, 0)
    except UnknownQueue:
        # not declared (declare_queues) and not held by the shard asked: a queue taken out of
        # the config is still held by the shards with its jobs, which answer with its settings
        every = yield from call_all([Call(s, "queue_config", [queue]) for s in range(c.shards)], absent=None)
        held_by = [got for got in every if got is not None]
        if not held_by:
            raise
        cfg = held_by[0]
    c._queue_cfg[queue] = (c._now(), cfg)
    c._owners.setdefault(queue, placed_owner(cfg))
    return cfg


def _config_of_any(c: Calls, queue: str, first: int) -> Op[dict[str, Any]]:
    """``queue``'s settings, of any shard (each holds the whole config): of ``first``, or at
    once of the next where one is down, not waited for (asked of shard 0 alone, a worker
    could not start, nor a new client enqueue a batch, while shard 0 was down, whatever
    shards their jobs were on); only when none answers at once, of ``first`` until the
    client's ``retry_s`` (the service restarting)."""
    for i in range(c.shards):
        try:
            got: dict[str, Any] = yield from call((first + i) % c.shards, "queue_config", [queue], retry_s=0)
            return got
        except ShardUnavailable:
            continue
    got = yield from call(first, "queue_config", [queue])
    return got


def _check_bodies(c: Calls, calls: list[Call]) -> Op[None]:
    """Refuse, before any is sent, a batch of several requests with a body over its queue's
    ``max_body_bytes``: the shard holding it would refuse its request after the others were
    taken, leaving the batch half in. A limit that seems passed is asked again first (a
    reload may have raised it); one a reload lowered since is met by the shard, as a single
    request's is."""
    biggest: dict[str, int] = {}
    for _, _, (items, _) in calls:
        queues = set(map(_QUEUE_OF, items))
        if len(queues) == 1:  # (the usual batch: C loops)
            (name,) = queues
            biggest[name] = max(biggest.get(name, 0), max(map(len, map(_BODY_OF, items))))
            continue
        for item in items:
            biggest[item[2]] = max(biggest.get(item[2], 0), len(item[0]))
    for name, size in biggest.items():
        held = c._queue_cfg.get(name)
        if held is None or size <= held[1].get("max_body_bytes", size):
            continue
        limit = (yield from _queue_config(c, name, 0.0)).get("max_body_bytes", size)
        if size > limit:
            raise InvalidJob(f"a body of queue {name!r} is {size} bytes, over the queue's limit of {limit} "
                             "(nothing of the batch was sent)")


def _metrics_pages(c: Calls, timeout_s: float) -> Op[list[dict[str, Any]]]:
    """:meth:`Calls.shard_metrics`: each shard's pages merged into one ``metrics`` reply, or
    its error in its place (a shard is up for a scrape only with every page of one process).

    ``timeout_s`` bounds the wait for each round of pages, not the whole read: a shard that
    answers each page in time is up, however many pages its queues take (at
    ``limits.QUEUES_MAX`` queues with long names and limits, 16 pages: docs/operations.md,
    "Metrics"); one that stops answering costs the scrape ``timeout_s`` once."""
    retry_s = min(c.retry_s, DOWN_PROBE_S)
    got: dict[int, dict[str, Any] | BaseException] = {}
    asking = [Call(s, "metrics_page", [0]) for s in range(c.shards)]
    while asking:
        try:
            replies = yield Send(asking, retry_s, timeout_s, errors=True)
        except ShardqError as e:
            replies = [e] * len(asking)
        again = []
        for (s, op, args), r in zip(asking, replies):
            if isinstance(r, ProtocolError) and op == "metrics_page" and args == [0]:
                again.append(Call(s, "metrics", []))  # an older shard: one reply, whole
                continue
            if isinstance(r, BaseException):
                got[s] = r
                continue
            page = dict(r[0])
            after = page.pop("next", None) if op == "metrics_page" else None
            if after is not None and not (type(after) is int and after > args[0]):
                got[s] = ShardUnavailable(f"shard {s} answered metrics page {args[0]} with next page {after!r:.40}")
                continue
            held = got.get(s)
            if isinstance(held, dict):
                if page.get("pid") != held.get("pid"):
                    got[s] = ShardUnavailable(f"shard {s} restarted during the scrape (pid {held.get('pid')} "
                                              f"then {page.get('pid')})")
                    continue
                held.setdefault("queues", {}).update(page.get("queues", {}))
                held.setdefault("queue_metrics", {}).update(page.get("queue_metrics", {}))
            else:
                got[s] = page
            if after is not None:
                again.append(Call(s, "metrics_page", [after]))
        asking = again
    return [{"shard": s, "available": False, "error": str(r), "queues": {}} if isinstance(r, BaseException)
            else dict(r, available=True) for s, r in sorted(got.items())]


def _on_every_shard(c: Calls, op: str, queue: str) -> Op[int]:
    if type(queue) is not str:
        raise InvalidJob(f"queue must be a string, got {type(queue).__name__}")
    changed = yield from call_all([Call(s, op, [queue]) for s in range(c.shards)])
    return sum(bool(x) for x in changed)


def _settle_many(c: Calls, acks: Iterable[Lease], reports: list[tuple[Lease, Any]]
                 ) -> Op[tuple[list[BaseException | None], list[BaseException | None]]]:
    acks = listed(acks, "leases")
    indexes, ack_calls = acks_by_shard(acks, c.shards)
    calls, where, answers = res.report_calls(list(reports), c.shards)
    try:
        got = (yield Send(ack_calls + calls, errors=True)) if ack_calls or calls else []
    finally:
        if acks:
            c._settled(acks)
    return res.round_outcome(len(acks), indexes, got[:len(ack_calls)], calls, where, got[len(ack_calls):], answers)


def parse_cursor(cursor: object, shards: int) -> tuple[int, int | None]:
    """A ``dead_letters_page`` cursor: (the shard to go on at, the id after which)."""
    if cursor is None:
        return 0, None
    try:
        shard_text, _, after_text = str(cursor).partition(":")
        shard, after = int(shard_text), (int(after_text) if after_text else None)
    except ValueError:
        raise InvalidJob(f"not a dead-letter cursor: {cursor!r:.60}") from None
    if not 0 <= shard <= shards:
        raise InvalidJob(f"not a dead-letter cursor of this service: {cursor!r:.60}")
    return shard, after
