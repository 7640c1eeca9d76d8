"""Control operations of a shard's state: pause and resume a queue, cancel a job, look a
job up, page through dead letters and purge chosen ones; and the figures metrics need
(per-queue counters, the age of the oldest ready job).

:class:`ControlOps` is a mixin of :class:`~shardq.shard.state.ShardState`, built on
:class:`~shardq.shard.core.StateCore` only. It is pure in the same way: no I/O, time
comes in as ``now``, and every change is a logged operation (:data:`ops.PAUSE`,
:data:`ops.CANCEL`, :data:`ops.PURGE`) applied by the same function live and in replay.
What an ack, nack or extend of a marked lease does is a rule of settling a lease
(``LeaseOps._settle_cancelled``, :mod:`.leases`); what a checkpoint keeps of paused queues,
marked leases and enqueue times is written by :mod:`.checkpoint`. ``COUNTERS`` is defined
in :mod:`.core` (each queue holds them) and read here by its importers.

Semantics (docs/operations.md, "Pause, resume, cancel"):

* **Pause** is durable and per queue (on this shard: the router pauses every shard). A
  paused queue leases nothing and wakes no waiting consumer; enqueue, ack, nack and extend
  keep working, leases run out as usual, delayed jobs come due. Stats show it paused.
* **Cancel** is idempotent. A ready, delayed or waiting job is deleted and the next job of
  its key moves up (per-key FIFO is kept: the cancelled job simply leaves the line). A dead
  letter is purged. A leased job is *marked*: the holder's next ``extend`` raises
  :class:`~shardq.errors.Cancelled` and changes nothing; its ``ack`` or ``nack`` raises
  ``Cancelled`` and deletes the job; otherwise the job is deleted when its lease ends. A
  marked job is never delivered again, and until it is deleted it still holds its key, so
  the key's next job is never leased while the cancelled one may still be running.
* **Purge of a queue** (``purge_queue``) deletes every job of the queue on this shard but
  its dead letters, in one logged operation: waiting, delayed, ready and leased alike. A
  purged lease is not current any more (its holder's ack, nack or extend gets
  :class:`~shardq.errors.JobGone`), and no key stays blocked.
* **Counters** (enqueued, leased, ...) count what this process did since it started; they
  are not logged, so a restart starts them at zero (Prometheus ``rate()`` handles resets).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import islice
from typing import Any, TypedDict

from .. import limits
from ..config import owner_shard
from ..errors import InvalidConfig, InvalidJob, NotFound, check
from ..types import DeadLetter
from . import ops
from ..protocol import validate
from .core import CANCELLED, Job, QueueState, StateCore
from .core import PURGED as PURGED_TOTAL  # (the counter's index; PURGED below: what a cancel did)
from .core import COUNTERS as COUNTERS  # re-exported: the metrics and the console read it from here
from .jobstate import STATE_NAMES, D, G, L, R, W, X
from .limiter import check_override

#: How far into a ready line the age of its first live job is looked for (entries of jobs
#: cancelled while ready stay in the line until a dequeue passes them).
HEAD_SCAN_MAX = 1000
DEAD_PAGE_MAX = 1000


# What cancel() did.
CANCELLED_NOW = "cancelled"    # deleted (it was ready, delayed or waiting)
PURGED = "purged"              # it was a dead letter: purged
CANCELLING = "cancelling"      # leased: marked; deleted at the holder's ack/nack or the lease's end
GONE = "gone"                  # no such job: finished, cancelled, purged, or never enqueued


class JobInfo(TypedDict):
    """What :meth:`ControlOps.job_info` says of one live job."""
    job_id: int
    queue: str
    key: str | None
    state: str                  # jobstate.STATE_NAMES
    attempts: int
    priority: int
    deadline: float | None      # the lease's, or the delay's end; None for other states
    error: str | None           # the last one
    position: int | None        # in its key's line (0: the head); None without a key, or dead
    cancelled: bool             # a lease marked cancelled
    queue_paused: bool
    enqueued_at: float | None   # estimated (enqueue_times.py); None if unknown
    body: bytes


class ControlOps(StateCore):
    """Pause, cancel, look-ups, metrics figures; a mixin of ShardState (see the module
    docstring)."""

    def _existing_queue(self, name: str) -> QueueState:
        """The queue (validating the name; an unused queue is created unregistered)."""
        return self.queues.get(name) or self._queue(name, create=False)

    # ------------------------------------------------------------------ pause / resume
    def pause(self, queue: str, now: float) -> bool:
        """Stop leasing from ``queue`` (durably). True if it was not paused already. A queue
        not held yet is made by the pause's record, so it counts against QUEUES_MAX as an
        enqueue's new queue does (QueueFull, nothing logged)."""
        self.advance(now)
        if queue not in self.queues:
            self._room_for_queues(1)
        q = self._existing_queue(queue)
        if q.paused is not None:
            return False
        self._emit(ops.Pause(queue, now))
        return True

    def resume(self, queue: str, now: float) -> bool:
        """Lease from ``queue`` again. True if it was paused."""
        self.advance(now)
        q = self._existing_queue(queue)
        if q.paused is None:
            return False
        self._emit(ops.Pause(queue, None))
        return True

    def _apply_pause(self, queue: str, paused_at: float | None) -> None:
        q = self.queues.get(queue) or self._logged_queue(queue)
        q.paused = paused_at

    # ------------------------------------------------------------------ limits
    def set_limits(self, queue: str, values: dict[str, Any] | None, now: float) -> dict[str, Any]:
        """Change the limits of a placed queue at run time, durably (docs/limits.md):
        ``values`` maps some of concurrency, rate, burst, group_concurrency, group_rate to
        a new value or None (no such limit); ``values`` None goes back to the config's.
        InvalidConfig names a bad value; a queue its config does not place is refused (its
        jobs are spread over the shards, where no shard-local counter is exact). Returns
        the queue's limit figures afterwards."""
        self.advance(now)
        q = self._existing_queue(queue)
        lim = q.lim
        if lim is None:
            raise InvalidConfig(f"queue {queue!r} declares no limit in its config, so its jobs are spread over "
                                "the shards and no limit on it could be exact: declare one in its config "
                                "(e.g. concurrency) and restart; later changes need no restart")
        if values is not None:
            values = check_override(values, q.cfg, lim.override, f"queues.{queue}")
        if queue not in self.queues:
            if owner_shard(queue, self.shard_count) != self.shard_index:
                return lim.figures(0, 0, now)  # it holds none of the queue's jobs, and never will
            self._room_for_queues(1)  # a queue with no job yet is kept, and the change with it
        self._emit(ops.Limits(queue, values))
        q = self.queues[queue]
        return q.lim.figures(q.counts[L], q.counts[R], now)  # type: ignore[union-attr]  # placed

    def _apply_limits(self, queue: str, values: dict[str, Any] | None) -> None:
        q = self.queues.get(queue) or self._logged_queue(queue)
        if q.lim is not None:
            q.lim.change(values)
        elif values:  # today's config no longer places the queue: nothing to limit, the change dropped
            self.unplaced_overrides.add(queue)
            return
        self.unplaced_overrides.discard(queue)

    def drop_unplaced_overrides(self) -> list[str]:
        """Log the drop of each run-time limit change that replay met for a queue today's
        config does not place (docs/limits.md: removing every limit from a queue's config
        drops it), so that a later config that places the queue again starts from its own
        values: the change's record stays in the log until a compaction, and a replay
        under such a config applied it again. At start, after replay; returns the queues."""
        dropped = sorted(self.unplaced_overrides)
        for queue in dropped:
            self._emit(ops.Limits(queue, None))
        return dropped

    # ------------------------------------------------------------------ cancel
    def cancel(self, job_id: int, now: float) -> str:
        """Cancel one job; returns what happened (:data:`CANCELLED_NOW`, :data:`PURGED`,
        :data:`CANCELLING`, :data:`GONE`). Idempotent. NotFound only for an id that does not
        belong to this shard."""
        self.advance(now)
        job = self._job_or_gone(job_id)
        if job is None:
            return GONE
        state = job.state
        if state == L:
            if job_id not in self.cancelled:
                self._emit(ops.Cancel(job_id))
                job.q.totals[CANCELLED] += 1
            return CANCELLING
        job.q.totals[CANCELLED] += 1
        if state == X:
            self._emit(ops.Purge(job_id))
            return PURGED
        self._emit(ops.Cancel(job_id))
        return CANCELLED_NOW

    def _job_or_gone(self, job_id: int) -> Job | None:
        validate.integer("job_id", job_id)
        job = self.jobs.get(job_id)
        if job is None and job_id & ((1 << limits.JOB_ID_SHARD_BITS) - 1) != self.shard_index:
            raise NotFound(f"job {job_id} does not belong to shard {self.shard_index}")
        return job

    def _apply_cancel(self, job_id: int) -> None:
        jid = job_id
        job = self.jobs[jid]
        if job.state == L and jid not in self.cancelled:
            self.cancelled.add(jid)
            return
        self.cancelled.discard(jid)
        state = job.state
        check(state in (W, D, R, L), f"cancel of job {jid} in state {state!r}")
        if state == W:
            # never the head: the line closes up behind it
            job.q.keys[job.key].remove(job)  # type: ignore[index]  # a waiting job has a key (not None)
        else:
            self._unlink_head(job)  # the next job of the key moves up
        del self.jobs[jid]
        self.inflight.pop(jid, None)
        self.lapsed.pop(jid, None)  # a ready job's lease that ran out: an ack of it gets JobGone now
        self.errors.pop(jid, None)
        if self.progress:
            self.progress.pop(jid, None)
        # A ready job's entry stays in its ready line; dequeue skips jobs that are not READY.
        self._set(job, G)

    # ------------------------------------------------------------------ purge a queue
    def purge_queue(self, queue: str, now: float) -> int:
        """Delete every job of ``queue`` on this shard that is not a dead letter: waiting,
        delayed, ready and leased. Their leases stop being current at once (a late ack,
        nack or extend gets JobGone), and the keys they held are free. Dead letters stay
        (``purge_dead``). Returns how many jobs went; none logs nothing. A re-sent purge
        would delete jobs enqueued since the first, so it is never re-sent (wire.UNKNOWN).
        Costs one pass over the shard's jobs: an operator's call, not a hot path."""
        self.advance(now)
        q = self._existing_queue(queue)
        live = q.counts[W] + q.counts[D] + q.counts[R] + q.counts[L]
        if live:
            self._emit(ops.PurgeQueue(queue))
            q.totals[PURGED_TOTAL] += live
        return live

    def _apply_purge_queue(self, queue: str) -> None:
        q = self.queues.get(queue)
        if q is None:
            return
        doomed = [job for job in self.jobs.values() if job.q is q and job.state is not X]
        for job in doomed:
            jid = job.id
            del self.jobs[jid]
            self.inflight.pop(jid, None)  # its entry in the lease heap is skipped when popped
            self.lapsed.pop(jid, None)
            self.errors.pop(jid, None)
            self.cancelled.discard(jid)
            if self.progress:
                self.progress.pop(jid, None)
            self._set(job, G)
        # Every job of every key went: no line is left. Entries in the ready lines (and a
        # grouped queue's group lines, the delayed heap) are skipped as stale when reached;
        # a plain queue's ready lines hold nothing else, so they go now.
        q.keys.clear()
        if type(q) is QueueState:
            q.ready.clear()
            q.prios.clear()

    # ------------------------------------------------------------------ look-up
    def job_info(self, job_id: int) -> JobInfo:
        """Everything known about one live job. NotFound if it is not (any more) here."""
        job = self._job_or_gone(job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found: finished, cancelled, purged or never enqueued")
        state = job.state
        q = job.q
        if state == L:
            deadline = self.inflight[job_id][1]
        elif state == D:
            deadline = job.ready_at
        else:
            deadline = None
        position = None
        if job.key is not None and state != X:
            kq = q.keys[job.key]
            position = 0 if kq[0] is job else kq.index(job)
        return {"job_id": job_id, "queue": q.name, "key": job.key,
                "state": STATE_NAMES[state],  # type: ignore[index]  # a job in self.jobs is placed: not None
                "attempts": job.attempts, "priority": job.priority, "deadline": deadline,
                "error": self.errors.get(job_id), "position": position,
                "cancelled": job_id in self.cancelled, "queue_paused": q.paused is not None,
                "enqueued_at": self.enqueue_times.at(job_id >> limits.JOB_ID_SHARD_BITS),
                "body": job.body}

    # ------------------------------------------------------------------ dead letters
    def dead_page(self, queue: str, after: int | None = None, limit: int = 100) -> list[DeadLetter]:
        """Dead letters of ``queue`` with ids greater than ``after``, lowest id first (a
        cursor that survives redrives and purges between pages), at most ``limit`` and as
        many as fit in one reply frame (``limits.REPLY_BYTES_MAX``; the first always does):
        fewer than asked says nothing of what is left, only none does. Costs a pass over
        the queue's dead letters: meant for people paging, not for a hot loop."""
        q = self._existing_queue(queue)
        after = -1 if after is None else validate.integer("after", after)
        limit = validate.count("limit", limit, DEAD_PAGE_MAX)
        dead, errors = q.dead, self.errors
        out: list[DeadLetter] = []
        reply_left = limits.REPLY_BYTES_MAX
        for j in heapq.nsmallest(limit, (j for j in dead if j > after)):
            job = dead[j]
            size = validate.job_bytes(job.body, job.key, "", error=errors.get(j))
            if out and size > reply_left:
                break
            reply_left -= size
            out.append(DeadLetter(j, job.key, job.body, queue, job.attempts, errors.get(j)))
        return out

    def purge_ids(self, queue: str, job_ids: Sequence[int], now: float) -> int:
        """Delete the given dead letters of ``queue``; ids that are not (any more) its dead
        letters are skipped, so a repeated purge is harmless. Returns how many went."""
        self.advance(now)
        q = self._existing_queue(queue)
        if type(job_ids) not in (list, tuple) or len(job_ids) > limits.BATCH_JOBS_MAX:
            raise InvalidJob(f"job_ids must be a list of at most {limits.BATCH_JOBS_MAX} ids")
        chosen = [j for j in dict.fromkeys(validate.integer("job_id", j) for j in job_ids) if j in q.dead]
        for jid in chosen:
            self._emit(ops.Purge(jid))
        q.totals[PURGED_TOTAL] += len(chosen)
        return len(chosen)

    # ------------------------------------------------------------------ figures
    def queue_metrics(self, now: float) -> dict[str, dict[str, float | None]]:
        """Per queue: paused (since when), the age of the oldest ready job, and the counters."""
        out = {}
        for name, q in self.queues.items():
            entry: dict[str, float | None] = dict(zip(COUNTERS, q.totals))
            entry["paused"] = q.paused is not None
            entry["paused_at"] = q.paused
            entry["oldest_ready_age_s"] = self._oldest_ready_age(q, now)
            out[name] = entry
        return out

    def _oldest_ready_age(self, q: QueueState, now: float) -> float | None:
        """How long the job first in line (per priority) has been due: since its enqueue or
        since its delay ended, whichever is later. Lines are in the order jobs became ready,
        so the first live entry of each line is the one waiting longest in it. None: nothing
        ready (or no enqueue time known)."""
        at = self.enqueue_times.at
        oldest = None
        for line in q.ready.values():
            for job in islice(line, HEAD_SCAN_MAX):
                if job.state == R:
                    since = max(at(job.id >> limits.JOB_ID_SHARD_BITS) or 0.0, job.ready_at or 0.0)
                    if not since:
                        continue  # enqueued before enqueue times were kept: the next one tells
                    if oldest is None or since < oldest:
                        oldest = since
                    break
        return None if oldest is None else max(now - oldest, 0.0)
