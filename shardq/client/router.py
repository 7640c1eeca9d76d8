"""The router: the client object producer and worker apps embed (``shardq.connect``).

A threaded driver of the client core (:mod:`.core`, :mod:`.routing`): the rules below (routing,
lease rounds, retries, frames, what is released) are decided there, once for this router
and the asyncio client; this module moves the requests and waits, with threads.

* Keys map to shards by a stable hash (CRC-32 of the UTF-8 key, mod N): the same key goes to
  the same shard in every process and every run. Keyless jobs are spread round-robin.
* A job id names its shard in its low bits, so ack/nack/extend need no lookup.
* Every enqueue carries a session ``(client id, request seq, lowest unanswered seq)``. If the
  shard dies with the request in flight, the router reconnects and resends it unchanged;
  the shard recognises the session entry and answers with the ids of the first execution,
  so a retry never creates a duplicate. A shard that does not come back within
  ``retry_s`` gives :class:`~shardq.errors.ShardUnavailable`, never a silent loss.
* Each op has an explicit retry policy (:data:`shardq.protocol.wire.RETRY`): a request never
  written is always sent again; one that was written is re-sent only if that is safe
  (enqueue, ack, extend, reads, pause, resume, cancel, ``purge_dead_letters`` of chosen
  ids, withdrawing a wait). ``dequeue``, ``nack``, ``bury``, ``redrive`` and
  ``purge_dead_letters`` of all dead letters are never re-sent: a broken connection raises
  :class:`~shardq.errors.OutcomeUnknown`. Nor is a waiting dequeue (``dequeue_wait``): a
  broken connection ends that shard's wait.
* ``dequeue(wait=...)`` long-polls: it asks each shard once (starting at a rotating shard,
  for fairness), then leaves a waiting dequeue (``dequeue_wait``) at every shard and takes
  the leases of the first that answers with any; the others are withdrawn, and leases
  they made before the withdrawal arrived are released unstarted. The lease comes with
  the commit of the enqueue that made its job ready, so the consumer wakes once, with the
  job. A queue that uses priorities ``watch``es instead, then compares the shards.
* One router can be shared by many threads; their requests are pipelined per shard.
"""
from __future__ import annotations

from typing import Any

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable

from .. import limits
from ..protocol import status_file
from . import results as res
from .connection import SHARED, ConnectionLost, Future, ShardClient, lead_any
from ..busypoll import BUSY_POLL_US_DEFAULT
from ..datadir import DataDir
from ..errors import Closed, InvalidJob, ShardUnavailable
from ..protocol import validate
from ..types import DeadLetter, DeadLetterPage, Lease
from .core import (DOWN_PROBE_S, DOWN_RECHECK_S, WAIT_REPLY_MARGIN_S, WITHDRAW_SETTLE_S, LeaseRound, Polling,
                   ack_error, ack_many_outcome, acks_by_shard, after_break, check_dequeue, missed_notes, nack_delay,
                   note_calls, release_call, wait_outcome)
# Routing lives in .routing; these names are imported from here too (tests, tools).
from .routing import (_usual_batch, batch_ids, cut_requests, group_by_shard, in_input_order, job_item,  # noqa: F401 - re-exported: these names are imported from here too (tests, tools)
                      batch_queues, dead_letters_of, job_shard, lease_shard, leases_of, listed, placed_owner,
                      purge_calls, queue_name, queue_totals, redrive_calls, shard_for_key, shard_of_job, split_by_shard)

log = logging.getLogger("shardq.router")



class Router:
    """Client of a running shardq service. See the module docstring for the guarantees."""

    def __init__(self, data_dir, *, retry_s: float = 15.0, request_timeout_s: float = 30.0,
                 busy_poll_us: int = BUSY_POLL_US_DEFAULT, supervisor=None, _role: str = "client"):
        # _role "service": a part of shardq serve itself (HTTP listener, schedules), whose
        # connections a shard holds apart from its clients' limit (protocol/sockio.py)
        # busy_poll_us: how long a lone call polls for its reply before it sleeps (shardq/busypoll.py)
        dd = DataDir(data_dir)
        self.data_dir = dd.path
        self.shards = dd.shards()
        self.service_id = dd.service_id()
        key = dd.authkey()
        if supervisor is None:
            dd.require_service()  # fail now, not after retry_s, when no service runs at all
        if _role == "service":
            busy_poll_us = 0  # serve's own calls are not latency-bound: no CPU spent on them
        self.clients = [ShardClient(i, dd.socket_path(i), key, _role, busy_poll_us)
                        for i in range(self.shards)]
        self.retry_s = retry_s
        self.request_timeout_s = request_timeout_s
        self.client_id = int.from_bytes(os.urandom(8), "little") >> 1
        self._seq = itertools.count(1)
        self._outstanding: list[dict[int, None]] = [{} for _ in range(self.shards)]
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._supervisor = supervisor
        self._closed = False
        self._queue_cfg: dict[str, dict] = {}
        self._owners: dict[str, int | None] = {}  # queue -> the shard of all its jobs if placed (docs/limits.md)
        self._prioritized: set[str] = set()  # queues known to use priorities (sticky)
        self._noted: set[str] = set()        # queues every shard was told so (note_priorities)
        self._withdrawing = 0                # withdrawn waits whose outcome is not known yet
        self._withdrawn = threading.Condition()

    # ------------------------------------------------------------------ plumbing
    def _send(self, shard: int, op: str, args: list, deadline: float, *, lead: bool = True) -> Future:
        """Submit one request, connecting first. Only a request that was never written is
        submitted again here; what to do with one that was is :meth:`_call_many`'s call.
        ``lead``: the caller waits with ``ShardClient.wait`` (reading its reply itself)."""
        client = self.clients[shard]
        while True:
            if self._closed:
                raise Closed("router is closed")
            client.ensure_connected(deadline)
            fut = client.submit(op, args, lead=lead)
            if not (fut.done and isinstance(fut.error, ConnectionLost) and not fut.error.sent):
                return fut
            if time.monotonic() >= deadline:
                raise ShardUnavailable(f"shard {shard}: {fut.error}")

    def _call_many(self, calls: list[tuple[int, str, list]], *, timeout: float | None = None,
                   retry_s: float | None = None) -> list:
        """Send requests to their shards (pipelined) and wait for all. A request whose
        connection broke is sent again, for up to ``retry_s`` (default: the router's), if it
        was never written or its op may be re-sent (:data:`~shardq.protocol.wire.RETRY`);
        otherwise its outcome is unknown and :class:`OutcomeUnknown` is raised. Returns
        ``(value, was_resent)`` per call, in order; the first error is raised."""
        out = []
        for result in self._gather(calls, timeout=timeout, retry_s=retry_s):
            if isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    def _gather(self, calls: list[tuple[int, str, list]], *, timeout: float | None = None,
                retry_s: float | None = None) -> list:
        """Like :meth:`_call_many`, but each call's error is returned in its place instead of
        raised: ``(value, was_resent)`` or the exception, per call, in order.

        The calls to one shard reach it in their order, also across a broken connection (a
        batch cut into several requests keeps its per-key order): the first is sent as
        :meth:`_send` does; the later ones only on the connection it went on. One that
        finds that connection gone waits, unsent, and is sent again in its turn below,
        after every call before it has been answered or has failed."""
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        wait_s = timeout or self.request_timeout_s
        futs: list = []
        first_on: dict[int, Future | BaseException] = {}  # shard -> its first call's future or error
        for s, op, args in calls:
            first = first_on.get(s)
            if first is None:
                try:
                    first_on[s] = fut = self._send(s, op, args, deadline)
                except ShardUnavailable as e:
                    first_on[s] = fut = e
            elif isinstance(first, BaseException):
                fut = ShardUnavailable(str(first))  # as its first call: nothing to send it on
            else:
                fut = self.clients[s].submit(op, args, lead=True, on=first.conn)
            futs.append(fut)
        results: list = []
        try:
            for i, (s, op, args) in enumerate(calls):
                resent = False
                while not isinstance(futs[i], BaseException):
                    fut = futs[i]
                    if not self.clients[s].wait(fut, wait_s):
                        futs[i] = ShardUnavailable(f"shard {s} did not answer {op} within {wait_s:.1f} s")
                        self.clients[s].forget(fut)  # nobody will read its reply
                        break
                    lost = fut.error
                    if not isinstance(lost, ConnectionLost):
                        break
                    error = after_break(s, op, lost.sent, time.monotonic() >= deadline, lost)
                    if error is not None:
                        futs[i] = error
                    else:
                        resent = resent or lost.sent
                        try:
                            futs[i] = self._send(s, op, args, deadline)
                        except ShardUnavailable as e:
                            futs[i] = e
                f = futs[i]
                if isinstance(f, BaseException):
                    results.append(f)
                elif f.error is not None:
                    results.append(f.error)
                else:
                    results.append((f.value, resent))
        finally:
            for (s, _, _), fut in zip(calls, futs):
                if not isinstance(fut, BaseException) and not fut.done:
                    self.clients[s].forget(fut)
        return results

    def _call(self, shard: int, op: str, args: list, *, retry_s: float | None = None,
              with_resent: bool = False):
        """One request, its value or its error: :meth:`_gather`'s rules for a single call,
        on the shortest path (most calls are one job at a time). ``with_resent``: return
        ``(value, was_resent)``, as :meth:`_gather` does."""
        client = self.clients[shard]
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        resent = False
        while True:
            # Alone on the connection: no future (call_solo answers SHARED when not connected).
            solo = SHARED if self._closed else client.call_solo(op, args, self.request_timeout_s)
            if solo is SHARED:
                fut = self._send(shard, op, args, deadline)
                if not client.wait(fut, self.request_timeout_s):
                    client.forget(fut)
                    lost = TimeoutError()
                else:
                    value, lost = fut.value, fut.error
            else:
                value, lost = solo
            if lost is None:
                return (value, resent) if with_resent else value
            if type(lost) is TimeoutError:
                raise ShardUnavailable(f"shard {shard} did not answer {op} within {self.request_timeout_s:.1f} s")
            if not isinstance(lost, ConnectionLost):
                raise lost
            error = after_break(shard, op, lost.sent, time.monotonic() >= deadline, lost)
            if error is not None:
                raise error
            resent = resent or lost.sent

    # ------------------------------------------------------------------ producing
    def _shard_for(self, key) -> int:
        if key is None:
            return next(self._rr) % self.shards
        return shard_for_key(key, self.shards)

    def _route(self, queue: str, key) -> int:
        """The shard of a job: its queue's owner if the queue declares limits (placed:
        docs/limits.md), else by key. A queue's placement is asked once, of the shard its
        job would go to by key (so a shard that is down stops only its own jobs)."""
        shard = self._shard_for(key)
        owner = self._owners[queue] if queue in self._owners else self._learn_owner(queue, shard)
        return shard if owner is None else owner

    def _learn_owner(self, queue: str, ask: int) -> int | None:
        cfg = self._call(ask, "queue_config", [queue])
        self._queue_cfg.setdefault(queue, cfg)
        return self._owners.setdefault(queue, placed_owner(cfg))

    def _session(self, shard: int) -> list:
        with self._lock:
            seq = next(self._seq)
            pending = self._outstanding[shard]
            low = next(iter(pending), seq)
            pending[seq] = None
        return [self.client_id, seq, low]

    def _done(self, shard: int, session: list) -> None:
        with self._lock:
            self._outstanding[shard].pop(session[1], None)

    def enqueue(self, body, key=None, queue="default", delay=0, priority=0, dedup_id=None) -> int:
        """Durably add a job; returns its id once the owning shard has fsynced it.

        ``dedup_id``: a second enqueue with the same id (same queue and key) within the
        queue's dedup window returns the first job's id and adds nothing."""
        item = job_item(body, key, queue, delay, priority, dedup_id)
        if priority and queue not in self._noted:
            self._note_priorities([queue])
        shard = self._route(queue, key)
        session = self._session(shard)
        try:
            return self._call(shard, "enqueue", [[item], session])[0]
        finally:
            self._done(shard, session)

    def enqueue_many(self, jobs: Iterable[dict], queue: str = "default") -> list[int]:
        """Enqueue many jobs (dicts with ``body`` and optionally ``key``, ``queue``, ``delay``,
        ``priority``, ``dedup_id``) in one request per shard (more where a shard's part passes
        ``BATCH_JOBS_MAX`` jobs or ``REQUEST_BYTES_MAX`` bytes, sent in order); ids come back
        in input order.

        Each request is all-or-nothing. Across requests it is not atomic: if one is refused
        (e.g. QueueFull) the error is raised and the other requests' jobs may be in."""
        jobs = jobs if type(jobs) is list else list(jobs)
        for name in batch_queues(jobs, queue) - self._owners.keys():
            self._learn_owner(name, self._shard_for(None))
        per_shard, shard_ids, prioritized = split_by_shard(jobs, queue, self._shard_for, self.shards, self._owners)
        new = prioritized - self._noted
        if new:
            self._note_priorities(sorted(new))
        calls, sessions = [], []
        for shard, items in per_shard.items():
            for chunk in cut_requests(items):
                s = self._session(shard)
                sessions.append((shard, s))
                calls.append((shard, "enqueue", [chunk, s]))
        try:
            results = self._call_many(calls)
        finally:
            for shard, s in sessions:
                self._done(shard, s)
        return batch_ids(calls, results, shard_ids)

    def _note_priorities(self, queues: list[str]) -> None:
        """Tell every shard that ``queues`` use priorities, before the first enqueue of a
        priority other than 0 to them, so that once it returns a lease from any shard says
        so (see design.md, "Queue-wide priorities"). A shard that is down is told with the
        next such enqueue; a typed refusal (an undeclared queue) is raised."""
        if self.shards == 1:
            self._noted.update(queues)
            return
        calls = note_calls(queues, self.shards)
        missed = missed_notes(calls, self._gather(calls, retry_s=min(self.retry_s, DOWN_PROBE_S)))
        if missed:
            log.info("note_priorities: a shard did not answer for %s; told again with the next "
                     "prioritized enqueue", sorted(missed))
        self._noted.update(q for q in queues if q not in missed)
        self._prioritized.update(queues)

    # ------------------------------------------------------------------ consuming
    def dequeue(self, queue: str = "default", wait: float = 0.0, visibility: float | None = None) -> Lease | None:
        """Lease one job, waiting up to ``wait`` seconds for one. None if none came."""
        leases = self.dequeue_many(queue, max_jobs=1, wait=wait, visibility=visibility)
        return leases[0] if leases else None

    def dequeue_many(self, queue: str = "default", max_jobs: int = 100, wait: float = 0.0,
                     visibility: float | None = None) -> list[Lease]:
        """Lease up to ``max_jobs`` jobs across shards. Each lease is logged, with its
        delivery count, before it is returned; it is fsynced first only on a queue with
        ``lease_sync = "strict"`` (the default, ``batched``, makes it durable with the next
        commit: docs/guarantees.md, "Lease durability"). A job is leased only once its
        enqueue is durable."""
        queue = queue_name(queue)
        wait = check_dequeue(max_jobs, wait, visibility)
        polling = Polling(self.shards, self.retry_s, time.monotonic() + wait)
        first = next(self._rr) % self.shards
        while True:
            out, down, unknown = self._lease_round(queue, visibility, max_jobs, first)
            now = time.monotonic()
            step = polling.after_round(out, down, unknown, now)
            if step is Polling.RETURN:
                return out
            if step is Polling.PROBE:  # every shard down: ask again until retry_s or the wait ends
                time.sleep(DOWN_PROBE_S)
                continue
            remaining = polling.deadline - now
            if queue not in self._prioritized:
                out = self._wait_lease(queue, visibility, max_jobs, remaining)
                if out or time.monotonic() >= polling.deadline:
                    return out
                continue  # a shard's connection broke: a lease round finds what is up
            woke = self._watch(queue, remaining)
            if woke is None:
                if time.monotonic() >= polling.deadline:
                    return []
            else:
                first = woke

    def _lease_round(self, queue: str, visibility, max_jobs: int, first: int):
        """Drive one :class:`~shardq.client.core.LeaseRound` (which shards, peeks, what to
        keep and release). A shard that is down gets a short try, not the full retry
        window: its jobs can wait, the other shards' should not. A round that fails hands
        back every lease it took, unstarted. Returns (leases, down errors, unknown-outcome
        errors)."""
        rnd = LeaseRound(queue, visibility, max_jobs, first, self.shards, queue in self._prioritized,
                         self._owners.get(queue))
        probe = min(self.retry_s, DOWN_PROBE_S)
        try:
            calls = rnd.start()
            while calls:
                calls = rnd.receive(self._results(calls, probe))
        except BaseException:
            self._release(rnd.abandon())
            raise
        finally:
            if rnd.uses_priorities:
                self._prioritized.add(queue)
        return rnd.leases, rnd.down, rnd.unknown

    def _results(self, calls: list, retry_s: float) -> list:
        """Make ``calls``; per call its value or its error. One call takes the shortest path
        (:meth:`_call`); several are pipelined (:meth:`_gather`)."""
        if len(calls) == 1:
            shard, op, args = calls[0]
            try:
                return [self._call(shard, op, args, retry_s=retry_s)]
            except Exception as e:  # noqa: BLE001 - the round decides what an error means
                return [e]
        return [r if isinstance(r, BaseException) else r[0] for r in self._gather(calls, retry_s=retry_s)]

    def _wait_lease(self, queue: str, visibility, max_jobs: int, timeout: float) -> list[Lease]:
        """Leave a waiting dequeue at every shard that is up and return the leases of the
        first to answer with any (of each that has by then, up to ``max_jobs``). The others
        are withdrawn (``cancel_wait``); a lease one made before its withdrawal arrived is
        released unstarted when its reply comes. [] when none came within ``timeout``, or
        when a connection broke (that shard's lease, if it made one, expires unheld)."""
        event = threading.Event()
        now = time.monotonic()
        parked: list[tuple[int, Future]] = []
        owner = self._owners.get(queue)
        asked = range(self.shards) if owner is None else [owner]  # a placed queue: its owner only
        for shard in asked:
            try:
                fut = self._send(shard, "dequeue_wait", [queue, visibility, max_jobs, timeout], now)
            except ShardUnavailable:
                continue  # down: the others serve
            fut.callback = lambda f: event.set()
            parked.append((shard, fut))
        if not parked:
            time.sleep(min(timeout, 0.1))  # every shard down: back off, the caller retries
            return []
        clients = [self.clients[shard] for shard, _ in parked]
        deadline = now + timeout + WAIT_REPLY_MARGIN_S
        if len(parked) < len(asked):  # a shard is down: withdraw and look again soon
            deadline = now + min(timeout, DOWN_RECHECK_S)
        while True:
            event.clear()
            done = [fut for _, fut in parked if fut.done]
            # A lease, an error or a broken connection ends the wait (the caller's next
            # round reaches a restarted shard again); so does the end of every shard's wait.
            if (any(f.error is not None or f.value for f in done) or len(done) == len(parked)
                    or time.monotonic() >= deadline):
                break
            if not lead_any(clients, deadline - time.monotonic()):
                for c in clients:  # another thread reads one of the sockets: be woken
                    c.hand_off()
                event.wait(deadline - time.monotonic())
        answers: list = []
        for shard, fut in parked:
            if not fut.done:
                self._withdraw(shard, fut, queue)
            elif fut.error is None or not isinstance(fut.error, ConnectionLost):
                answers.append(fut.value if fut.error is None else fut.error)
        keep, release, uses_priorities, error = wait_outcome(queue, answers, max_jobs)
        if uses_priorities:
            self._prioritized.add(queue)  # from now on, leases compare the shards
        self._release(release)
        for c in clients:
            c.hand_off()
        if error is not None:
            raise error
        return keep

    def _withdraw(self, shard: int, fut: Future, queue: str) -> None:
        """Withdraw a waiting dequeue nobody waits for now; release what it leases anyway.
        Until the shard says which (withdrawn, or answered first), :meth:`close` waits."""
        once = threading.Lock()

        def settle(f: Future) -> None:
            if once.acquire(blocking=False):
                if f.error is None and f.value:
                    self._release([lease for _, lease in leases_of(queue, f.value)])
                self._withdraw_settled()

        with self._withdrawn:
            self._withdrawing += 1
        fut.callback = settle
        if fut.done:
            settle(fut)
            return
        client = self.clients[shard]

        def answered(c: Future) -> None:
            if c.error is None and c.value is True:  # withdrawn: no reply will come
                client.forget(fut)
                if once.acquire(blocking=False):
                    self._withdraw_settled()
            # otherwise its reply (or its connection's end) is on the way: settle() runs

        try:
            cancel = self._send(shard, "cancel_wait", [fut.rid], time.monotonic(), lead=False)
        except (ShardUnavailable, Closed):
            # Its connection broke (or the router closed): the waiting dequeue went with it.
            if once.acquire(blocking=False):
                self._withdraw_settled()
            return
        cancel.callback = answered
        if cancel.done:
            answered(cancel)

    def _withdraw_settled(self) -> None:
        with self._withdrawn:
            self._withdrawing -= 1
            if self._withdrawing <= 0:
                self._withdrawn.notify_all()

    def _release(self, leases: list[Lease]) -> None:
        """Give leases back unstarted (their delivery not counted), without waiting; one
        that cannot be sent expires by itself."""
        for lease in leases:
            try:
                self._send(*release_call(lease), time.monotonic(), lead=False)
            except (ShardUnavailable, Closed) as e:
                log.info("releasing lease %s failed (%s); it expires by itself", lease.job_id, e)

    def _watch(self, queue: str, timeout: float) -> int | None:
        """Block until some shard reports ready work in ``queue`` (its index) or timeout."""
        event = threading.Event()
        futs: list[tuple[int, Future]] = []
        for shard in range(self.shards):
            try:
                # A shard that is down is skipped at once (no retry wait): the others serve.
                futs.append((shard, self._send(shard, "watch", [queue, timeout], time.monotonic(), lead=False)))
            except ShardUnavailable:
                continue
        if not futs:
            time.sleep(min(timeout, 0.1))  # every shard down: back off, the caller retries
            return None
        for _, fut in futs:
            fut.callback = lambda f: event.set()
            if fut.done:
                event.set()
        event.wait(timeout + 0.5)
        for shard, fut in futs:
            if not fut.done:
                self.clients[shard].forget(fut)  # its reply, if it ever comes, is dropped
        for shard, fut in futs:
            if fut.done and fut.error is None and fut.value is True:
                return shard
        for _, fut in futs:
            if fut.done and fut.error is not None and not isinstance(fut.error, ConnectionLost):
                raise fut.error
        return None

    def ack(self, lease: Lease) -> None:
        """Delete the job. LeaseLost if the lease is no longer current (nothing changes)."""
        errs, retried = self._call(lease_shard(lease, self.shards), "ack", [[[lease.job_id, lease.token]]],
                                   with_resent=True)
        if errs[0] is not None and (err := ack_error(errs[0], retried)) is not None:
            raise err

    def ack_many(self, leases: Iterable[Lease]) -> list[BaseException | None]:
        """Ack many leases, one request per shard. Returns, per lease, None or the error."""
        leases = listed(leases, "leases")
        indexes, calls = acks_by_shard(leases, self.shards)
        return ack_many_outcome(len(leases), indexes, self._call_many(calls))

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None, *,
             delivered: bool = True) -> None:
        """Release the lease now (delay 0) or make the job delayed for ``delay`` seconds.
        ``error`` is kept as the job's last error (shown in dead letters).
        ``delivered=False``: the job never reached a handler (an unstarted prefetch), so this
        lease does not count towards ``max_deliveries``."""
        shard = lease_shard(lease, self.shards)
        delay = nack_delay(delay)
        self._call(shard, "nack", [lease.job_id, lease.token, delay, error, delivered])

    def bury(self, lease: Lease, error: str | None = None) -> None:
        """Move the leased job to the dead-letter queue now, with ``error`` as its error,
        whatever its delivery count. LeaseLost if the lease is no longer current."""
        self._call(lease_shard(lease, self.shards), "bury", [lease.job_id, lease.token, error])

    def extend(self, lease: Lease, seconds: float) -> Lease:
        """Heartbeat: the lease now ends ``seconds`` from now. LeaseLost if already lost."""
        deadline = self._call(lease_shard(lease, self.shards), "extend", [lease.job_id, lease.token, seconds])
        return lease._replace(deadline=deadline)

    # ------------------------------------------------------------------ admin
    def dead_letters(self, queue: str = "default", limit: int = 1000) -> list[DeadLetter]:
        queue = queue_name(queue)
        rows = self._call_many([(s, "dead_letters", [queue, limit]) for s in range(self.shards)])
        return [d for res, _ in rows for d in dead_letters_of(queue, res)][:limit]

    def redrive(self, queue: str = "default", job_ids: list[int] | None = None) -> int:
        """Move dead letters back into the queue with a fresh delivery count: all, or only
        ``job_ids`` (checked first: ``InvalidJob`` for anything but integer ids of this
        service's shards, and nothing is sent). Returns how many."""
        return sum(n for n, _ in self._call_many(redrive_calls(self.shards, queue, job_ids)))

    def purge_dead_letters(self, queue: str = "default", job_ids: list[int] | None = None) -> int:
        """Delete dead letters of ``queue``: all, or only ``job_ids`` (ids that are not, or
        no longer, its dead letters are skipped: repeating it is harmless). Returns how many."""
        calls = purge_calls(self.shards, queue, job_ids)
        return sum(n for n, _ in self._call_many(calls)) if calls else 0

    def queue_config(self, queue: str = "default") -> dict:
        """The service's settings for ``queue`` (visibility_timeout, max_deliveries, ...)."""
        queue = queue_name(queue)
        cfg = self._queue_cfg.get(queue)
        if cfg is None:
            cfg = self._queue_cfg[queue] = self._call(0, "queue_config", [queue])
            self._owners.setdefault(queue, placed_owner(cfg))
        return cfg

    def set_limits(self, queue: str, values: dict | None) -> dict:
        """Change the limits of a queue that declares some, at run time and durably
        (docs/limits.md): ``values`` maps some of concurrency, rate ("50/s"), burst,
        group_concurrency, group_rate to a new value or None (that limit removed); None
        goes back to the config's. Told to every shard (ShardUnavailable if one is down:
        call again once it is back). Returns the limit figures of the queue's owner shard."""
        replies = self._call_many([(s, "set_limits", [queue, values]) for s in range(self.shards)])
        owner = placed_owner(self.queue_config(queue))
        return replies[owner if owner is not None else 0][0]

    def stats(self) -> dict:
        """Per shard (pid, WAL bytes, jobs, per-queue counts) and totals per queue over the
        shards that answered (``"available": True``). A shard that is down appears as
        ``{"shard": i, "available": False, "error": ...}`` instead of failing the call.
        Each shard also carries its supervisor's view (``status``, ``restarts``,
        ``last_exit``; for one not ready, ``reason`` and ``restart_in_s``), from the embedded
        supervisor or from the one of ``shardq serve`` (:mod:`shardq.protocol.status_file`)."""
        shards = []
        for s in range(self.shards):
            try:
                sh = self._call(s, "stats", [], retry_s=min(self.retry_s, DOWN_PROBE_S))
                sh["available"] = True
            except ShardUnavailable as e:
                sh = {"shard": s, "available": False, "error": str(e), "queues": {}}
            shards.append(sh)
        queues = queue_totals(shards)
        if self._supervisor is not None:
            for sh in shards:
                sh.update(self._supervisor.process_stats(sh["shard"]))
        else:
            status_file.add_to(shards, DataDir(self.data_dir).run_dir)
        return {"shards": shards, "queues": queues}

    # ------------------------------------------------------------------ control (this backend)
    # Pause, cancel, look-up and dead-letter paging are calls of the local shards' router,
    # not of the Queue protocol: a backend that cannot do them (SQS) raises Unsupported.
    def pause(self, queue: str = "default") -> int:
        """Stop leasing from ``queue``, durably, on every shard (it stays paused across
        restarts). Enqueue, ack, nack and extend keep working. Returns how many shards were
        not paused yet. ShardUnavailable if a shard is down: the others are paused, and
        calling again once it is back finishes the job (idempotent)."""
        return self._on_every_shard("pause", queue)

    def resume(self, queue: str = "default") -> int:
        """Lease from ``queue`` again; returns how many shards were paused."""
        return self._on_every_shard("resume", queue)

    def _on_every_shard(self, op: str, queue: str) -> int:
        if type(queue) is not str:
            raise InvalidJob(f"queue must be a string, got {type(queue).__name__}")
        return sum(bool(changed) for changed, _ in self._call_many([(s, op, [queue]) for s in range(self.shards)]))

    def cancel(self, job_id: int) -> str:
        """Cancel a job; idempotent. Returns ``"cancelled"`` (it was ready, delayed or
        waiting: deleted, and the next job of its key moved up), ``"purged"`` (a dead
        letter), ``"cancelling"`` (leased: the holder's next extend/ack/nack raises
        :class:`~shardq.errors.Cancelled`; it is never delivered again) or ``"gone"`` (no
        such job any more: finished, cancelled, purged, or never enqueued)."""
        return self._call(job_shard(job_id, self.shards), "cancel", [job_id])

    def job(self, job_id: int) -> dict:
        """What the service knows of a live job: ``state`` (waiting, delayed, ready, leased,
        dead), ``queue``, ``key``, ``attempts``, ``deadline`` (lease end, or when a delayed
        job is due), ``error`` (the last one), ``position`` (jobs ahead of it in its key's
        line; 0: it is the head), ``cancelled``, ``enqueued_at`` (to about a second),
        ``body``, ``shard``. NotFound if it is not live (acked, cancelled, purged)."""
        shard = job_shard(job_id, self.shards)
        return dict(self._call(shard, "job", [job_id]), shard=shard)

    def dead_letters_page(self, queue: str = "default", limit: int = 100, cursor: str | None = None, *,
                          skip_unavailable: bool = False) -> DeadLetterPage:
        """One page of dead letters with their errors, shard by shard, lowest id first within
        a shard. Pass the returned ``cursor`` back for the next page (None: no more). A
        redrive or purge between pages never makes the walk skip or repeat a letter.
        ``skip_unavailable``: leave out a shard that is down (listed in ``skipped_shards``)
        instead of raising ShardUnavailable."""
        from ..types import DeadLetterPage
        limit = validate.count("limit", limit, 1000)
        shard, after = self._parse_cursor(cursor)
        items: list[DeadLetter] = []
        skipped: list[int] = []
        while shard < self.shards and len(items) < limit:
            want = limit - len(items)
            try:
                rows = self._call(shard, "dead_page", [queue, after, want],
                                  **({"retry_s": min(self.retry_s, DOWN_PROBE_S)} if skip_unavailable else {}))
            except ShardUnavailable:
                if not skip_unavailable:
                    raise
                skipped.append(shard)
                rows = []
            items.extend(dead_letters_of(queue, rows))
            if len(rows) < want:
                shard, after = shard + 1, None
            else:
                after = rows[-1][0]
        next_cursor = None if shard >= self.shards else f"{shard}:{'' if after is None else after}"
        return DeadLetterPage(items, next_cursor, skipped)

    def _parse_cursor(self, cursor) -> tuple[int, int | None]:
        if cursor is None:
            return 0, None
        try:
            shard_text, _, after_text = str(cursor).partition(":")
            shard, after = int(shard_text), (int(after_text) if after_text else None)
        except ValueError:
            raise InvalidJob(f"not a dead-letter cursor: {cursor!r:.60}") from None
        if not 0 <= shard <= self.shards:
            raise InvalidJob(f"not a dead-letter cursor of this service: {cursor!r:.60}")
        return shard, after

    def shard_metrics(self, timeout_s: float = 2.0) -> list[dict]:
        """One ``metrics`` call per shard, all sent at once, waited for at most ``timeout_s``
        in all (a scrape). A shard that is down or slow appears as ``{"shard": i,
        "available": False, "error": ...}``: this never raises ShardUnavailable."""
        from ..errors import ShardqError
        deadline = time.monotonic() + timeout_s
        sent: list = []
        for s in range(self.shards):
            try:
                sent.append(self._send(s, "metrics", [], min(deadline, time.monotonic() + DOWN_PROBE_S)))
            except ShardqError as e:
                sent.append(e)
        out = []
        for s, fut in enumerate(sent):
            if isinstance(fut, BaseException):
                error = fut
            elif not self.clients[s].wait(fut, max(deadline - time.monotonic(), 0.0)):
                error = f"no answer within {timeout_s:.1f} s"
            else:
                error = fut.error
            if error is None:
                out.append(dict(fut.value, available=True))
            else:
                out.append({"shard": s, "available": False, "error": str(error), "queues": {}})
        return out

    def ping(self) -> list[int]:
        return [r for r, _ in self._call_many([(s, "ping", []) for s in range(self.shards)])]

    def backup_cuts(self, stage: str) -> list[dict]:
        """Every shard's backup cut, asked of all at once (``backup_cut``; docs/backup.md):
        per shard, the log files hard-linked into ``<shard dir>/<stage>/`` and where the copy
        of its newest segment ends. ShardUnavailable if a shard is down: a backup needs
        every shard (the staging dirs of the others are the caller's to remove)."""
        return [cut for cut, _ in self._call_many([(s, "backup_cut", [stage]) for s in range(self.shards)])]

    # ------------------------------------------------------------------ results and workflows
    # Calls of the local shards' router (docs/workflows.md); the tasks layer builds
    # workflows on them. The requests and their replies are client/results.py's.
    def put_result(self, lease: Lease, value: bytes, ttl_s: float) -> None:
        """Keep ``value`` (msgpack bytes) as the result of ``lease``'s job for ``ttl_s``
        seconds; fenced like an ack (LeaseLost if the lease is no longer current)."""
        self._call(*res.put_result_call(lease, value, ttl_s, self.shards))

    def report_many(self, reports: list[tuple[Lease, Any]]) -> list[BaseException | None]:
        """Make finished jobs' reports (``(lease, (op, args))``, ``op`` an ``arrive`` or a
        ``put_result``; a worker collects them with ``ctx.report``), pipelined, one frame
        per shard: per report None (landed) or its error, in order. Each may be re-sent
        (an arrival is counted once per index), so a broken connection only re-sends."""
        return self.settle_many([], reports)[1]

    def settle_many(self, acks: Iterable[Lease], reports: list[tuple[Lease, Any]]
                    ) -> tuple[list[BaseException | None], list[BaseException | None]]:
        """Ack ``acks`` and make ``reports`` (as :meth:`report_many`) in one pipelined
        round, one frame per shard: per ack and per report, None or its error (an
        unavailable shard's for each call it did not answer). A worker sends the reports of
        the jobs just finished with the acks of those whose reports landed before."""
        acks = listed(acks, "leases")
        indexes, ack_calls = acks_by_shard(acks, self.shards)
        calls, where, answers = res.report_calls(list(reports), self.shards)
        got = self._gather(ack_calls + calls) if ack_calls or calls else []
        return res.round_outcome(len(acks), indexes, got[:len(ack_calls)], calls, where, got[len(ack_calls):],
                                 answers)

    def progress(self, lease: Lease, fraction: float | None, note: str | None) -> None:
        """Record how far ``lease``'s job got (durably; shown by ``results`` and ``job``)."""
        self._call(*res.progress_call(lease, fraction, note, self.shards))

    def results(self, job_ids: list[int], sizes: bool = False) -> list[res.JobResult]:
        """Each job's outcome (:class:`~shardq.client.results.JobResult`), in order: one
        call per shard; a value left out to keep a reply under the frame limit is asked
        for again alone. With ``sizes``, only each value's length is read (``value_bytes``;
        ``value`` is None)."""
        job_ids = list(job_ids)
        calls, where = res.result_calls(job_ids, self.shards, sizes)
        entries = res.in_order(len(job_ids), where, [v for v, _ in self._call_many(calls)] if calls else [])
        out = []
        for job_id, entry in zip(job_ids, entries):
            got, withheld = res.job_result(job_id, entry, sizes)
            if withheld:
                got, _ = res.job_result(job_id, self._call(job_shard(job_id, self.shards), "result", [[job_id]])[0])
            out.append(got)
        return out

    def route(self, queue: str, key: str | None, barrier: str) -> int:
        """The shard a job of ``queue`` with ``key`` is enqueued on: its queue's owner if
        placed, else its key's shard; a keyless one goes where ``barrier`` hashes."""
        shard = res.barrier_shard(self.shards, barrier) if key is None else shard_for_key(key, self.shards)
        owner = self._owners[queue] if queue in self._owners else self._learn_owner(queue, shard)
        return shard if owner is None else owner

    def arrive(self, shard: int, barrier: str, index: int, total: int, value: bytes, ttl_s: float,
               callback: list) -> str:
        """Report member ``index`` of ``total`` of ``barrier`` (on ``shard``) done with
        ``value``; the last one makes that shard enqueue ``callback`` (an enqueue item),
        once. ``"counted"``, ``"repeated"`` (already counted: nothing changed), ``"fired"``
        or ``"cancelled"``."""
        return self._call(*res.arrive_call(shard, barrier, index, total, value, ttl_s, callback,
                                               self.shards))

    def barriers(self, refs: list[tuple[int, str]]) -> list[dict | None]:
        """The state of each ``(shard, barrier id)``, in order (None: not known there)."""
        calls, where = res.barrier_calls(refs, self.shards)
        return res.in_order(len(refs), where, [v for v, _ in self._call_many(calls)] if calls else [])

    def barrier_values(self, shard: int, barrier: str) -> list[bytes]:
        """The values of a complete barrier, in member order."""
        return self._call(shard, "barrier_values", [res.barrier_id(barrier)])

    def cancel_barrier(self, shard: int, barrier: str, ttl_s: float) -> str:
        """Mark ``barrier`` cancelled (its callback is never enqueued): ``"cancelled"``, or
        ``"fired"`` if it already was."""
        return self._call(shard, "cancel_barrier", [res.barrier_id(barrier), res.ttl(ttl_s)])

    def put_workflow(self, wf_id: str, spec: bytes) -> str:
        """Keep the record of workflow ``wf_id`` (its steps) on its home shard: ``"put"``,
        or ``"known"`` if it is kept already (docs/design.md, "Workflow records")."""
        return self._call(*res.workflow_call("put_workflow", wf_id, [spec], self.shards))

    def end_workflow(self, wf_id: str, state: str, error: str | None, ttl_s: float) -> str:
        """Record how ``wf_id`` ended (``succeeded``, ``failed``, ``cancelled``); the record
        is kept ``ttl_s`` more seconds. Returns its state now (a first end is kept)."""
        return self._call(*res.workflow_call("end_workflow", wf_id, [state, error, res.ttl(ttl_s)], self.shards))

    def workflow(self, wf_id: str) -> dict:
        """The record of ``wf_id``: ``spec``, ``state`` (``running`` or how it ended),
        ``error``, ``started_at``, ``ended_at``, ``expires_at``. NotFound if none is kept."""
        return self._call(*res.workflow_call("workflow", wf_id, [], self.shards))

    def workflow_ids(self, shard: int, after: str | None = None, limit: int = limits.BATCH_JOBS_MAX) -> list[str]:
        """Up to ``limit`` ids of the running workflows whose records ``shard`` keeps, in
        id order, after ``after``."""
        return self._call(shard, "workflow_ids", [after, limit])

    def close(self) -> None:
        """Close connections; an embedded service (``shardq.open``) is stopped too."""
        if self._closed:
            return
        # A withdrawn wait's lease may still be on its way: let it come and be released
        # (unstarted), rather than expire held by nobody with its delivery counted.
        with self._withdrawn:
            self._withdrawn.wait_for(lambda: self._withdrawing <= 0, WITHDRAW_SETTLE_S)
        self._closed = True
        for c in self.clients:
            c.close()
        if self._supervisor is not None:
            self._supervisor.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
