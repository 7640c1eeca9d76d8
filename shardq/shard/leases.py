"""Leases: dequeue, settling a lease (ack, nack, bury, extend, the rule for a lease that
control marked cancelled, and the ack of a lease that ran out while nothing leased its job
again), dead letters (redrive, purge) and lease-token epochs. A
mixin of :class:`~shardq.shard.state.ShardState`, built on
:class:`~shardq.shard.core.StateCore` only; pure like it (no I/O, ``now`` from the caller,
every change a logged operation)."""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from .. import limits
from ..errors import Cancelled, LeaseLost, NotFound, check
from ..types import DeadLetter, Lease
from . import ops
from ..protocol import validate
from .core import ACKED, DEAD_LETTERED, LEASED, NACKED, PURGED, REDRIVEN, QueueState, StateCore
from .jobstate import D, G, L, R, X
from .limiter import Limiter

_EPOCH_BITS = ops.TOKEN_EPOCH_BITS
_Lease, _Dead, _Ack, _new = ops.Lease, ops.Dead, ops.Ack, ops.new
_BATCH_JOBS_MAX = limits.BATCH_JOBS_MAX


class LeaseOps(StateCore):
    """Leases, dead letters, token epochs; a mixin of ShardState (see the module docstring)."""

    # ------------------------------------------------------------------ dequeue
    def dequeue(self, queue: str, now: float, visibility: float | None = None, max_jobs: int = 1) -> list[Lease]:
        """Lease up to ``max_jobs`` ready jobs of ``queue``, highest priority first.

        Each lease is a logged operation (its delivery count and deadline). With
        ``lease_sync = "strict"`` the caller makes it durable before the lease is handed out;
        with ``"batched"`` (the default) the shard process hands out a lease whose job's
        enqueue is already durable once its record is written, before its fsync (it becomes
        durable with the next commit: :mod:`.committer`). A job already delivered
        ``max_deliveries`` times goes to the dead-letter queue instead of out. The leases
        returned fit in one reply frame (``limits.REPLY_BYTES_MAX``): fewer come when the
        bodies are large, never none while a job is ready.
        """
        if not (type(max_jobs) is int and 1 <= max_jobs <= _BATCH_JOBS_MAX):
            max_jobs = validate.count("max_jobs", max_jobs, limits.BATCH_JOBS_MAX)
        if visibility is not None:
            visibility = validate.seconds("visibility", visibility, hi=limits.VISIBILITY_TIMEOUT_S_MAX,
                                          positive=True)
        self.advance(now)
        q = self.queues.get(queue)
        if q is None:
            self._queue(queue, create=False)  # validates the name; an unused queue is empty
            return []
        if q.paused is not None:
            return []  # paused (control.py): nothing is leased
        vis = q.cfg.visibility_timeout if visibility is None else visibility
        lim = q.lim
        if lim is not None:
            return self._dequeue_limited(q, lim, now, vis, max_jobs)
        return self._lease_ready(q, now, vis, max_jobs)

    def _lease_ready(self, q: QueueState, now: float, vis: float, max_jobs: int) -> list[Lease]:
        """Lease up to ``max_jobs`` of ``q``'s ready jobs in queue order (priority, then FIFO)."""
        queue = q.name
        out: list[Lease] = []
        prios, ready = q.prios, q.ready
        max_deliveries = q.cfg.max_deliveries
        emit_ops = self._ops
        reply_left = limits.REPLY_BYTES_MAX
        while prios and len(out) < max_jobs:
            prio = -prios[0]  # re-read each time: dead-lettering a head can promote another
            dq = ready[prio]
            job = dq[0]
            size = len(job.body) + 4 * len(job.key or "") + limits.JOB_FIXED_BYTES_MAX
            if out and job.state is R and size > reply_left:
                break
            dq.popleft()
            if not dq:
                del ready[prio]
                del prios[bisect.bisect_left(prios, -prio)]
            if job.state is not R:
                continue  # stale entry left by replay
            if job.attempts >= max_deliveries:
                dead = _Dead(job.id, self.errors.get(job.id) or f"delivered {job.attempts} times")
                self._dead(*dead, popped=True)  # as _emit, written out: the job left its deque already
                emit_ops.append(dead)
                q.totals[DEAD_LETTERED] += 1
                continue
            token = self.next_token
            if token >> _EPOCH_BITS != self.epoch:  # a new epoch before any token in it
                self._emit(ops.Epoch(token >> _EPOCH_BITS))
            expires = now + vis
            lease = _new(_Lease, (job.id, token, expires))
            self._apply_lease(*lease)  # as _emit, written out: this runs once per lease
            emit_ops.append(lease)
            out.append(_new(Lease, (job.id, job.key, job.body, queue, job.attempts, token, expires)))
            reply_left -= size
        q.totals[LEASED] += len(out)
        return out

    def _dequeue_limited(self, q: QueueState, lim: Limiter, now: float, vis: float, max_jobs: int) -> list[Lease]:
        """A dequeue of a queue with limits (``lim``, its limiter; docs/limits.md): at most as
        many leases as its concurrency and its bucket allow now; of a grouped queue, the heads
        of the groups in queue order or in turn (``fair``), skipping the groups a limit holds
        back. A job held back is not touched: no delivery counted, nothing logged, its place kept."""
        n = min(max_jobs, lim.allowance(q.counts[L], now))
        if n <= 0:
            return []
        if lim.sep is None:
            out = self._lease_ready(q, now, vis, n)
        else:
            out = []
            max_deliveries = q.cfg.max_deliveries
            reply_left = limits.REPLY_BYTES_MAX
            while len(out) < n:
                line = lim.first(now)
                if line is None:
                    break
                job = line.heap[0][2]
                size = len(job.body) + 4 * len(job.key or "") + limits.JOB_FIXED_BYTES_MAX
                if out and size > reply_left:
                    break
                if job.attempts >= max_deliveries:
                    lim.take(line, now, leased=False)
                    dead = _Dead(job.id, self.errors.get(job.id) or f"delivered {job.attempts} times")
                    self._dead(*dead, popped=True)
                    self._ops.append(dead)
                    q.totals[DEAD_LETTERED] += 1
                    continue
                lim.take(line, now, leased=True)
                token = self.next_token
                if token >> _EPOCH_BITS != self.epoch:
                    self._emit(ops.Epoch(token >> _EPOCH_BITS))
                self._emit(_Lease(job.id, token, now + vis))
                out.append(Lease(job.id, job.key, job.body, q.name, job.attempts, token, now + vis))
                reply_left -= size
            q.totals[LEASED] += len(out)
        lim.spent(len(out), q.counts[L], now)
        return out

    def _apply_lease(self, job_id: int, token: int, expires_at: float) -> None:
        job = self.jobs[job_id]
        self._set(job, L)
        job.attempts += 1
        self.inflight[job_id] = (token, expires_at)
        lapsed = self.lapsed
        if lapsed:  # a new lease: the one that ran out can no longer be acked
            lapsed.pop(job_id, None)
        if token >= self.next_token:
            self.next_token = token + 1
        self._push_lease(expires_at, token, job_id)

    # ------------------------------------------------------------------ settle a lease
    # (StateCore._leased checks the token: results.py checks a worker's reports with it too)
    def ack(self, job_id: int, token: int, now: float) -> None:
        """Delete a job whose latest lease is ``token``: its live lease, or one whose
        deadline has passed while nothing leased the job again (as SQS's DeleteMessage with
        the most recent receipt handle; the job is ready again meanwhile, and this deletes
        it: its key's next job moves up). LeaseLost (and no change) for any other token: a
        newer lease fences the old one; JobGone once the job is gone (acked, cancelled,
        purged); a job dead-lettered when its lease ran out is refused too."""
        self.advance(now)
        try:
            job = self._leased(job_id, token)
        except LeaseLost:  # (JobGone too: a job gone has no lapsed lease)
            if self.lapsed.get(job_id) != token:
                raise
            job = self.jobs[job_id]  # ready again (never marked cancelled: marks are of live leases)
            check(job.state is R or job.state is D, f"ack of job {job_id}'s lapsed lease in state {job.state!r}")
        else:
            if self.cancelled:
                self._settle_cancelled(job_id, settle=True)
        self._apply_ack(job_id)  # as _emit, written out: this runs once per ack
        self._ops.append(_new(_Ack, (job_id,)))
        job.q.totals[ACKED] += 1

    def _apply_ack(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        self.inflight.pop(job.id, None)
        self.errors.pop(job.id, None)
        if self.progress:  # (a job's result outlives it; its progress does not)
            self.progress.pop(job.id, None)
        if job.state is not L:
            # The ack of a lease that ran out (ready since; delayed when a checkpoint's replay
            # made it so before the first advance). Replay finds such a job leased unless a
            # checkpoint came in between: its expiry is not logged.
            self.lapsed.pop(job.id, None)
            if job.state is R:
                self._drop_ready(job)
        self._unlink_head(job)
        self._set(job, G)

    def nack(self, job_id: int, token: int, now: float, delay: float = 0.0, error: str | None = None,
             delivered: bool = True) -> None:
        """End a lease early: the job is ready again now, or after ``delay`` (delayed state,
        never a long lease). A job with ``max_deliveries`` deliveries is dead-lettered.

        ``delivered=False`` says the job never reached a handler (a worker's unstarted
        prefetch): the lease is not counted as a delivery."""
        self.advance(now)
        job = self._leased(job_id, token)
        if self.cancelled:
            self._settle_cancelled(job_id, settle=True)
        if delivered is False:
            self._emit(ops.Release(job_id, 0, None, True))
            return
        delay = validate.seconds("delay", delay, hi=limits.DELAY_S_MAX) if type(delay) is not int or delay else 0
        error = validate.error_text(error)
        job.q.totals[NACKED] += 1
        if job.attempts >= job.q.cfg.max_deliveries:
            job.q.totals[DEAD_LETTERED] += 1
            self._emit(ops.Dead(job_id, error or self.errors.get(job_id)
                                or f"released after {job.attempts} deliveries"))
        else:
            self._emit(ops.Release(job_id, now + delay if delay else 0, error))

    def bury(self, job_id: int, token: int, now: float, error: str | None = None) -> None:
        """Move a leased job to its queue's dead-letter queue now, whatever its delivery
        count (a task that failed for good, or whose task name no worker knows)."""
        self.advance(now)
        job = self._leased(job_id, token)
        error = validate.error_text(error)
        self._emit(ops.Dead(job_id, error or self.errors.get(job_id) or "dead-lettered by the worker"))
        job.q.totals[DEAD_LETTERED] += 1  # (live path only: replay counts nothing again)

    def _apply_release(self, job_id: int, ready_at: float, error: str | None, undelivered: bool = False) -> None:
        jid = job_id
        job = self.jobs[jid]
        if undelivered:  # the lease does not count
            job.attempts -= 1
        job.ready_at = ready_at
        lease = self.inflight.pop(jid, None)
        if error is not None:
            self.errors[jid] = error
        self._make_available(job)
        if not ready_at and lease is not None and job.state is R:
            # visible again at once (SQS's ChangeMessageVisibility 0): an ack with its token still
            # deletes the job while nothing leases it again, as after an expiry (StateCore.lapsed)
            self.lapsed[jid] = lease[0]

    def extend(self, job_id: int, token: int, now: float, seconds: float) -> float:
        """Move a live lease's deadline to ``now + seconds``; returns the new deadline."""
        self.advance(now)
        seconds = validate.seconds("seconds", seconds, hi=limits.VISIBILITY_TIMEOUT_S_MAX, positive=True)
        self._leased(job_id, token)
        if self.cancelled:
            self._settle_cancelled(job_id, settle=False)
        expires = now + seconds
        self._emit(ops.Extend(job_id, expires))
        return expires

    def _apply_extend(self, job_id: int, expires_at: float) -> None:
        expires = expires_at
        job = self.jobs[job_id]
        check(job.state is L, f"extend of job {job.id} in state {job.state!r}")
        token = self.inflight[job.id][0]
        self.inflight[job.id] = (token, expires)
        self._push_lease(expires, token, job.id)

    def _settle_cancelled(self, job_id: int, settle: bool) -> None:
        """Called by ack/nack (``settle``) and extend once the token is known to be the live
        lease: Cancelled if the job is marked; an ack or nack deletes it first."""
        if job_id not in self.cancelled:
            return
        if settle:
            self._emit(ops.Cancel(job_id))
            raise Cancelled(f"job {job_id} was cancelled while leased; it has been removed")
        raise Cancelled(f"job {job_id} was cancelled while leased; stop working on it "
                        f"(ack or nack removes it now, else it goes when the lease ends)")

    # ------------------------------------------------------------------ dead letters
    def _apply_dead(self, job_id: int, error: str) -> None:
        self._dead(job_id, error, popped=False)

    def _dead(self, jid: int, error: str, popped: bool) -> None:
        """Dead-letter job ``jid``; ``popped``: the live lease path took it off its ready
        deque already (replay and the other paths find it there)."""
        job = self.jobs[jid]
        if job.state is R and not popped:  # replay only: the live path popped it from its deque already
            try:
                job.q.ready[job.priority].remove(job)
            except (KeyError, ValueError):
                pass
        self._unlink_head(job)
        self._set(job, X)
        self.inflight.pop(jid, None)
        if self.lapsed:  # a dead letter's lease is never acked (redrive starts it afresh)
            self.lapsed.pop(jid, None)
        self.errors[jid] = error
        job.q.dead[jid] = job

    def dead_letters(self, queue: str, limit: int = 1000) -> list[DeadLetter]:
        """Up to ``limit`` dead letters, oldest first, as many as fit in one reply frame."""
        q = self.queues.get(queue) or self._queue(queue, create=False)
        out: list[DeadLetter] = []
        reply_left = limits.REPLY_BYTES_MAX
        for job in q.dead.values():
            size = validate.job_bytes(job.body, job.key, "", error=self.errors.get(job.id))
            if len(out) >= limit or (out and size > reply_left):
                break
            reply_left -= size
            out.append(DeadLetter(job.id, job.key, job.body, queue, job.attempts, self.errors.get(job.id)))
        return out

    def redrive(self, queue: str, now: float, job_ids: Iterable[int] | None = None, limit: int | None = None) -> int:
        """Move dead letters back to the tail of their keys with a fresh delivery count.
        All of the queue's dead letters, or only ``job_ids``. Returns how many moved."""
        self.advance(now)
        q = self.queues.get(queue) or self._queue(queue, create=False)
        if job_ids is None:
            chosen = list(q.dead)[:limit] if limit else list(q.dead)
        else:
            chosen = list(dict.fromkeys(validate.integer("job_id", j) for j in job_ids))
            missing = [j for j in chosen if j not in q.dead]
            if missing:
                raise NotFound(f"not dead letters of {queue!r}: {missing[:5]}")
        for jid in chosen:
            self._emit(ops.Redrive(jid))
        q.totals[REDRIVEN] += len(chosen)
        return len(chosen)

    def _apply_redrive(self, job_id: int) -> None:
        job = self.jobs[job_id]
        del job.q.dead[job.id]
        job.attempts = 0
        job.ready_at = 0
        self._append_to_key(job)

    def purge_dead(self, queue: str, now: float) -> int:
        """Delete every dead letter of ``queue``; returns how many."""
        self.advance(now)
        q = self.queues.get(queue) or self._queue(queue, create=False)
        ids = list(q.dead)
        for jid in ids:
            self._emit(ops.Purge(jid))
        q.totals[PURGED] += len(ids)
        return len(ids)

    def _apply_purge(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        self.errors.pop(job.id, None)
        if self.progress:
            self.progress.pop(job.id, None)
        del job.q.dead[job.id]
        self._set(job, G)

    # ------------------------------------------------------------------ lease epochs
    def begin_epoch(self) -> int:
        """Start a new lease-token epoch (at each shard start, before serving; the caller
        makes it durable at once). Tokens of leases whose records a crash lost are all
        below it, so none is ever handed out again (with ``lease_sync = "batched"`` a lease
        may reach a worker before its record is durable)."""
        self._emit(ops.Epoch(max(self.epoch, self.next_token >> _EPOCH_BITS) + 1))
        return self.epoch

    def _apply_epoch(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)
        self.next_token = max(self.next_token, self.epoch << _EPOCH_BITS)
        self.sync_forced = True  # an epoch is durable before any of its tokens is handed out
