"""The checkpoint codec: the live state written as checkpoint operations
(:meth:`~CheckpointCodec.snapshot`), and the functions that apply the checkpoint-only ones
(META, JOB, DEDUP, CLIENT, BARRIER, ENQUEUE_TIMES). A checkpoint also holds PRIORITIES,
PAUSE, CANCEL, LIMITS, RESULT and PROGRESS operations, applied by the same functions as
when they are logged live. A mixin of
:class:`~shardq.shard.state.ShardState`, built on :class:`~shardq.shard.core.StateCore`
only; pure (it encodes, it writes nothing)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

from .. import limits
from ..errors import check
from . import ops
from ..protocol import validate
from .core import OPEN, Barrier, Job, StateCore
from .jobstate import L, R, W, X
from .ops import Op

_EPOCH_BITS = ops.TOKEN_EPOCH_BITS
#: A checkpoint writes every field of its records, defaults too (as it always has).
_whole = ops.encode_whole
_JOB = ops.JOB


class CheckpointCodec(StateCore):
    """Write and read checkpoints; a mixin of ShardState (see the module docstring)."""

    def snapshot(self, chunk_bytes: int = limits.CHECKPOINT_CHUNK_BYTES) -> Iterator[bytes]:
        """Encoded lists of checkpoint operations that rebuild this state when applied to a
        new :class:`~shardq.shard.state.ShardState` (keys keep their order; leases keep token and deadline).

        Chunks are cut by size: each holds operations whose encoding is at most about
        ``chunk_bytes`` (one job with a larger body goes alone), so every chunk is within
        ``limits.CHECKPOINT_RECORD_BYTES_MAX`` whatever the bodies. Sizes are bounded from
        above without encoding twice (:func:`validate.job_bytes`)."""
        pack = msgpack.Packer().pack
        chunk: list[Op] = [_whole(ops.Meta(self.next_seq, self.next_token, self.epoch))]
        size = 64
        inflight, errors, lapsed = self.inflight, self.errors, self.lapsed

        def job_op(j: Job) -> Op:
            state = j.state if j.state in (L, X) else R
            # A leased job's token is its live lease's; a ready (or delayed) job's, that of its
            # lease that ran out while nothing leased it again (0: none), which an ack may
            # still use (StateCore.lapsed). Readers before that ignored a token unless LEASED.
            if state is L:
                token, expires = inflight.get(j.id, (0, 0.0))
            else:
                token, expires = (lapsed.get(j.id, 0) if lapsed and state is R else 0), 0.0
            # Encoded directly, in ops.Job's field order (this codec is the log's writer, and this
            # runs once per live job: a record built only to be unpacked again cost half the
            # snapshot's time); test_op_registry reads every checkpoint op back through its record.
            return [_JOB, j.id, j.q.name, j.key, j.body, j.priority, j.ready_at, j.attempts,
                    int(state), token, expires, errors.get(j.id)]

        def jobs_in_order() -> Iterator[Job]:
            for q in self.queues.values():
                for kq in q.keys.values():
                    yield from kq
            for j in self.jobs.values():
                if j.key is None and j.state is not X:
                    yield j
            for q in self.queues.values():
                yield from q.dead.values()

        job_bytes = validate.job_bytes
        for j in jobs_in_order():
            n = job_bytes(j.body, j.key, j.q.name, error=errors.get(j.id))
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(job_op(j))
            size += n
        for q in self.queues.values():
            for (key, did), (jid, expires) in q.dedup.items():
                n = 4 * (len(q.name) + len(key or "") + len(did)) + 64
                if size + n > chunk_bytes and chunk:
                    yield pack(chunk)
                    chunk, size = [], 0
                chunk.append(_whole(ops.Dedup(q.name, key, did, jid, expires)))
                size += n
        for cid, (seen, seqs) in self.sessions.items():
            # A client that sent hundreds of full batches before reading a reply keeps
            # millions of ids here: its requests go in as many CLIENT operations as the
            # chunks need (replay merges them), each request's ids whole (at most
            # BATCH_JOBS_MAX of them, far within a record).
            part: list[list[Any]] = []   # [[client_seq, [job_ids]], ...] (ops.Client)
            n = 64
            for cseq, ids in seqs.items():
                m = 16 + 10 * len(ids)
                if part and size + n + m > chunk_bytes:
                    chunk.append(_whole(ops.Client(cid, seen, part)))
                    yield pack(chunk)
                    chunk, size, part, n = [], 0, [], 64
                part.append([cseq, ids])
                n += m
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(_whole(ops.Client(cid, seen, part)))
            size += n
        for q in self.queues.values():
            if q.prioritized:  # a queue whose prioritized jobs are all gone still says so
                n = 16 + 4 * len(q.name)
                if size + n > chunk_bytes and chunk:
                    yield pack(chunk)
                    chunk, size = [], 0
                chunk.append(_whole(ops.Priorities(q.name)))
                size += n
        for record in self.control_checkpoint_ops():  # after the JOB operations they refer to
            op = _whole(record)
            n = len(pack(op))
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(op)
            size += n
        for record, n in self._workflow_checkpoint_ops(chunk_bytes):  # progress: after its JOB
            if size + n > chunk_bytes and chunk:
                yield pack(chunk)
                chunk, size = [], 0
            chunk.append(_whole(record))
            size += n
        if chunk:
            yield pack(chunk)

    def _apply_meta(self, next_seq: int, next_token: int, epoch: int | None = None) -> None:
        self.next_seq = max(self.next_seq, next_seq)
        self.next_token = max(self.next_token, next_token)
        self.epoch = max(self.epoch, next_token >> _EPOCH_BITS if epoch is None else epoch)

    def _apply_job(self, job_id: int, queue: str, key: str | None, body: bytes, priority: int, ready_at: float,
                   attempts: int, state: int, token: int, expires_at: float, error: str | None) -> None:
        jid, qname, prio, expires = job_id, queue, priority, expires_at
        q = self.queues.get(qname) or self._logged_queue(qname)
        job = Job(jid, q, key, body, prio, ready_at)
        job.attempts = attempts
        if prio:
            q.prioritized = True
        if error is not None:
            self.errors[jid] = error
        self.jobs[jid] = job
        if state == X:
            self._set(job, X)
            q.dead[jid] = job
            return
        if state == L:
            if key is not None:
                check(key not in q.keys, f"checkpoint: leased job {jid} is not the head of its key")
                q.keys[key] = [job]
            self._set(job, L)
            self.inflight[jid] = (token, expires)
            self._push_lease(expires, token, jid)
            return
        self._append_to_key(job)
        if token and job.state is not W:  # its lease ran out, and an ack with it still deletes the job
            self.lapsed[jid] = token

    def _apply_dedup(self, queue: str, key: str | None, dedup_id: str | bytes, job_id: int,
                     expires_at: float) -> None:
        q = self.queues.get(queue) or self._logged_queue(queue)
        q.dedup[(key, dedup_id)] = (job_id, expires_at)
        q.dedup_order.append((expires_at, (key, dedup_id)))
        self.dedup_held += 1

    def _apply_client(self, client_id: int, last_seen: float, requests: list[list[Any]]) -> None:
        """A client's session from a checkpoint; a session written as several operations
        (one per chunk of its requests, in a row) is merged back into one."""
        cid, seen, seqs = client_id, last_seen, requests
        entry = self.sessions.get(cid)
        if entry is None:
            self.sessions[cid] = [seen, {s: ids for s, ids in seqs}]
            if len(self.sessions) > limits.CLIENT_SESSIONS_MAX:
                self._sessions_due = float("-inf")  # the next advance() forgets the least recent
        else:
            entry[1].update(seqs)

    def _workflow_checkpoint_ops(self, chunk_bytes: int) -> Iterator[tuple[tuple[Any, ...], int]]:
        """(operation, an upper bound of its encoded size) for the results kept, the
        progress of live jobs and every barrier, leaving out what has expired as of the
        last ``advance``. A barrier whose values pass ``chunk_bytes`` is written as several
        BARRIER operations in a row, each with some of its values (the callback, up to a
        body at the ceiling, in the first alone), so that each fits a checkpoint record
        (``limits.CHECKPOINT_RECORD_BYTES_MAX``) whatever the barrier holds: values are at
        most ``limits.RESULT_BYTES_MAX`` each, ``limits.BARRIER_BYTES_MAX`` together."""
        now = self._now
        for jid, (value, expires_at) in self.results.items():
            if expires_at > now:
                yield ops.Result(jid, value, expires_at), len(value) + 32
        jobs = self.jobs
        for jid, (fraction, note) in self.progress.items():
            if jid in jobs:
                yield ops.Progress(jid, fraction, note), 4 * len(note or "") + 32
        for bid, b in self.barriers.items():
            if b.kind != OPEN and b.expires_at is not None and b.expires_at <= now:
                continue
            yield from self._barrier_ops(bid, b, chunk_bytes)
        yield from self.workflow_checkpoint_ops()

    def _barrier_ops(self, bid: str, b: Barrier, chunk_bytes: int) -> Iterator[tuple[ops.Barrier, int]]:
        head = 64 + 4 * len(bid)
        callback = b.callback
        part_bytes = head + (validate.job_bytes(callback[0], callback[1], callback[2]) if callback else 0)
        idxs: list[int] = []
        vals: list[bytes] = []
        for i in sorted(b.values):
            v = b.values[i]
            m = len(v) + 16
            if (idxs or callback) and part_bytes + m > chunk_bytes:
                yield ops.Barrier(bid, b.total, idxs, vals, b.fired_job, b.cancelled, b.expires_at,
                                  callback), part_bytes
                callback, idxs, vals, part_bytes = None, [], [], head
            idxs.append(i)
            vals.append(v)
            part_bytes += m
        if idxs or callback or not b.values:
            yield ops.Barrier(bid, b.total, idxs, vals, b.fired_job, b.cancelled, b.expires_at,
                              callback), part_bytes

    def _apply_barrier(self, barrier_id: str, total: int, indexes: list[int], values: list[bytes],
                       fired_job: int | None, cancelled: bool, expires_at: float | None,
                       callback: list[Any] | None = None) -> None:
        """A barrier from a checkpoint; one written as several operations (one per chunk
        of its values, in a row) is merged back into one."""
        bid, idxs, vals = barrier_id, indexes, values
        b = self.barriers.get(bid)
        if b is None:
            b = Barrier(total)
            b.fired_job, b.cancelled, b.expires_at = fired_job, cancelled, expires_at
            self._put_barrier(bid, b)
        for i, v in zip(idxs, vals):
            b.put(i, v)
        if callback is not None:
            b.callback = callback

    def control_checkpoint_ops(self) -> list[tuple[Any, ...]]:
        """What a checkpoint must add after the JOB operations: paused queues, cancelled
        leases, the enqueue-time samples, limits changed at run time."""
        out: list[tuple[Any, ...]] = [ops.EnqueueTimes(list(self.enqueue_times.seqs),
                                                       list(self.enqueue_times.times))]
        out += [ops.Pause(name, q.paused) for name, q in self.queues.items() if q.paused is not None]
        out += [ops.Cancel(jid) for jid in self.cancelled]
        out += [ops.Limits(name, q.lim.override) for name, q in self.queues.items()
                if q.lim is not None and q.lim.override]
        return out

    def _apply_enqueue_times(self, seqs: list[int], times: list[float]) -> None:
        self.enqueue_times.load(seqs, times)
