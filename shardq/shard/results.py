"""Results, progress and workflow barriers (docs/design.md, "Workflows and results"). A
mixin of :class:`~shardq.shard.state.ShardState`, built on
:class:`~shardq.shard.core.StateCore` only; pure like it (no I/O, ``now`` from the caller,
every change a logged operation applied by the same function live and in replay).

* **Results**: a worker stores a job's result while it holds the lease
  (:meth:`ResultOps.put_result`, fenced by the token like an ack); it is kept until its
  expiry, whether or not the job is acked since. :meth:`ResultOps.results_of` answers per
  job: ``succeeded`` with the value, else the live job's state (``dead`` with its error),
  else ``gone``.
* **Progress**: a leased job's fraction and note, dropped when the job leaves the shard.
* **Barriers**: :meth:`ResultOps.arrive` counts each member index once; the arrival that
  completes a barrier enqueues its callback job (dedup id ``wf:<barrier id>``) and logs
  FIRED with its id, in the same record: fired once, whatever is killed in between. A
  fired or cancelled barrier is kept, values and all, until its expiry, at least
  ``limits.BARRIER_TOMBSTONE_S``, so that a member delivered again late is answered
  ``"repeated"``; an open one is kept for ever. A barrier found complete without its FIRED
  at start (only a log built by hand, or a salvage, can hold one: the completing arrival,
  the callback's enqueue and FIRED share one record) is fired by :meth:`ResultOps.fire_complete`
  before the shard serves.

Everything that expires (a result, a fired or cancelled barrier) reads as absent from its
expiry on; memory is freed by ``advance`` and checkpoints leave it out.
"""
from __future__ import annotations

from typing import Any, TypedDict

from .. import limits
from ..errors import InvalidJob, NotFound, ShardqError
from ..protocol import validate
from ..protocol.wire import ResultRow
from . import ops
from .core import (BARRIERS_CANCELLED, BARRIERS_FIRED, CANCELLED_BARRIER, FIRED, OPEN, RESULTS_STORED,
                   WORKFLOW_COUNTERS, Barrier, StateCore)
from .jobstate import STATE_NAMES

# What arrive() answers.
COUNTED = "counted"        # logged; the barrier waits for more members
REPEATED = "repeated"      # this index had arrived already (or the barrier fired): nothing changed
FIRED_NOW = "fired"        # the last member: the callback is enqueued (and cancel_barrier: too late)
CANCELLED = "cancelled"    # the barrier is cancelled: nothing changed (and cancel_barrier's answer)

SUCCEEDED = "succeeded"    # results_of: a result is kept
GONE = "gone"              # results_of: no result, no live job

#: barrier_info lists at most this many of the indexes that have not arrived
MISSING_SHOWN = 20
#: What one result row takes in a reply besides its value, its error and its note (the
#: state, numbers and msgpack headers), at most.
_ROW_FIXED_BYTES = 64
_SHARD_MASK = (1 << limits.JOB_ID_SHARD_BITS) - 1
_KIND_NAMES = {OPEN: "open", FIRED: "fired", CANCELLED_BARRIER: "cancelled"}


class BarrierInfo(TypedDict):
    """What :meth:`ResultOps.barrier_info` says of one barrier."""
    total: int
    arrived: int
    fired_job: int | None
    cancelled: bool
    missing: list[int]      # the first MISSING_SHOWN indexes not arrived, lowest first


class WorkflowStats(TypedDict):
    results: int                 # results kept
    barriers: dict[str, int]     # {"open": n, "fired": n, "cancelled": n}


def _text_bytes(text: str) -> int:
    """An upper bound of ``text``'s UTF-8 length, without encoding it."""
    return len(text) if text.isascii() else 4 * len(text)


def _checked_text(name: str, value: object, most: int, *, empty: bool = True) -> str:
    """``value`` if it is a string of at most ``most`` UTF-8 bytes (InvalidJob otherwise)."""
    if type(value) is not str or (not value and not empty):
        raise InvalidJob(f"{name} must be a {'' if empty else 'non-empty '}string, got {value!r:.60}")
    if len(value) * 4 > most:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidJob(f"{name} is not valid text (it holds a lone surrogate)") from None
        if size > most:
            raise InvalidJob(f"{name} is {size} bytes (UTF-8), over the limit of {most}")
    return value


def _barrier_id(value: object) -> str:
    return _checked_text("barrier_id", value, limits.BARRIER_ID_BYTES_MAX, empty=False)


def _value(value: object) -> bytes:
    if type(value) is not bytes:
        raise InvalidJob(f"value must be bytes (msgpack), got {type(value).__name__}")
    if len(value) > limits.RESULT_BYTES_MAX:
        raise InvalidJob(f"value is {len(value)} bytes, over the limit of {limits.RESULT_BYTES_MAX} "
                         "(limits.RESULT_BYTES_MAX)")
    return value


def _ttl(value: object, *, positive: bool = True) -> float:
    return validate.seconds("ttl_s", value, hi=limits.KEEP_RESULT_S_MAX, positive=positive)


def _tombstone_expiry(now: float, ttl: float) -> float:
    return now + max(ttl, limits.BARRIER_TOMBSTONE_S)


class ResultOps(StateCore):
    """Results, progress, barriers; a mixin of ShardState (see the module docstring)."""

    # ------------------------------------------------------------------ results
    def put_result(self, job_id: int, token: int, value: bytes, ttl_s: float, now: float) -> None:
        """Keep ``value`` as the result of the leased job ``job_id`` for ``ttl_s`` seconds
        (``0 < ttl_s <= limits.KEEP_RESULT_S_MAX``; at most ``limits.RESULT_BYTES_MAX``
        bytes). The lease is checked as an ack checks it (LeaseLost, JobGone, NotFound);
        a second call replaces the first."""
        self.advance(now)
        value = _value(value)
        ttl = _ttl(ttl_s)
        self._leased(job_id, token)
        self._emit(ops.Result(job_id, value, now + ttl))
        self.workflow_totals[RESULTS_STORED] += 1

    def _apply_result(self, job_id: int, value: bytes, expires_at: float) -> None:
        self.results[job_id] = (value, expires_at)
        self._result_expires(job_id, expires_at)

    def set_progress(self, job_id: int, token: int, fraction: float | None, note: str | None, now: float) -> None:
        """Note the leased job's progress: ``fraction`` in [0, 1] or None, ``note`` text of
        at most ``limits.PROGRESS_NOTE_BYTES_MAX`` UTF-8 bytes or None. Checked as an ack
        is; kept until the job leaves the shard."""
        self.advance(now)
        if fraction is not None:
            if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                    or not 0 <= fraction <= 1):  # (NaN fails the comparison)
                raise InvalidJob(f"fraction must be a number in [0, 1] or None, got {fraction!r:.60}")
            fraction = float(fraction)
        if note is not None:
            note = _checked_text("note", note, limits.PROGRESS_NOTE_BYTES_MAX)
        self._leased(job_id, token)
        self._emit(ops.Progress(job_id, fraction, note))

    def _apply_progress(self, job_id: int, fraction: float | None, note: str | None) -> None:
        if job_id in self.jobs:  # (a salvaged log may hold the progress of a job it lost)
            self.progress[job_id] = (fraction, note)

    def result_sizes(self, job_ids: list[int], now: float) -> list[ResultRow]:
        """:meth:`results_of` with each value's length in bytes in place of the value."""
        return self.results_of(job_ids, now, sizes=True)

    def results_of(self, job_ids: list[int], now: float, sizes: bool = False) -> list[ResultRow]:
        """One row per id, in order: ``succeeded`` with the value while a result is kept
        (also for a job not yet acked), else the live job's state with its last error, its
        deliveries and its progress, else ``gone``. The values together stay within
        ``limits.REPLY_BYTES_MAX``: one that would pass it is left out (``withheld``; its
        caller asks for that id alone, and one value always fits). With ``sizes`` a row
        holds its value's length in bytes instead of the value (the ``result_sizes``
        request: a look at a workflow of many large results reads none of them), and
        nothing is withheld. InvalidJob for more than ``limits.BATCH_JOBS_MAX`` ids, or an
        id that is not an int of this shard."""
        if type(job_ids) not in (list, tuple) or len(job_ids) > limits.BATCH_JOBS_MAX:
            raise InvalidJob(f"result: expected a list of at most {limits.BATCH_JOBS_MAX} job ids")
        for jid in job_ids:
            if isinstance(jid, bool) or not isinstance(jid, int) or not 0 <= jid < 1 << 63:
                raise InvalidJob(f"result: job ids are non-negative integers, got {jid!r:.60}")
            if jid & _SHARD_MASK != self.shard_index:
                raise InvalidJob(f"result: job {jid} does not belong to shard {self.shard_index}")
        rows: list[ResultRow] = []
        room = limits.REPLY_BYTES_MAX
        results, jobs, errors, progress = self.results, self.jobs, self.errors, self.progress
        for jid in job_ids:
            kept = results.get(jid)
            job = jobs.get(jid)
            if kept is not None and kept[1] > now:
                rows.append(ResultRow(SUCCEEDED, len(kept[0]) if sizes else kept[0], None, None, None, None,
                                      kept[1], False))
                room -= _ROW_FIXED_BYTES
            elif job is not None and job.state is not None:
                error = errors.get(jid)
                fraction, note = progress.get(jid, (None, None))
                rows.append(ResultRow(STATE_NAMES[job.state], None, error, job.attempts, fraction, note, None, False))
                room -= _ROW_FIXED_BYTES + _text_bytes(error or "") + _text_bytes(note or "")
            else:
                rows.append(ResultRow(GONE, None, None, None, None, None, None, False))
                room -= _ROW_FIXED_BYTES
        # The rows without their values always fit (BATCH_JOBS_MAX rows with every text at its
        # limit take about 26 MiB); the values fill what is left, in order.
        for i, row in enumerate(rows):
            if type(row.value) is bytes:
                if len(row.value) <= room:
                    room -= len(row.value)
                else:
                    rows[i] = row._replace(value=None, withheld=True)
        return rows

    # ------------------------------------------------------------------ barriers
    def _live_barrier(self, barrier_id: str, now: float) -> Barrier | None:
        """The barrier, or None if unknown or fired or cancelled and past its expiry."""
        b = self.barriers.get(barrier_id)
        if b is not None and b.kind != OPEN and b.expires_at is not None and b.expires_at <= now:
            return None
        return b

    def arrive(self, barrier_id: str, member: int, total: int, value: bytes, ttl_s: float,
               callback: list[Any], now: float) -> str:
        """Member ``member`` (its index) of barrier ``barrier_id`` (of ``total`` members) reports
        ``value``. Returns COUNTED, REPEATED (the index had arrived, or the barrier fired:
        nothing changes), CANCELLED (nothing changes) or FIRED_NOW: the last member, whose
        arrival enqueues ``callback`` (``[body, key, queue, delay, priority]``, an enqueue
        item of this shard, dedup id ``wf:<barrier_id>``) and logs FIRED with the job's id,
        expiring ``max(ttl_s, limits.BARRIER_TOMBSTONE_S)`` from now, in the same record.

        Everything is checked before anything changes (InvalidJob, nothing logged): the
        id, ``0 <= index < total <= limits.BARRIER_MEMBERS_MAX``, ``total`` against the
        barrier's, the value (``limits.RESULT_BYTES_MAX``; the barrier's values within
        ``limits.BARRIER_BYTES_MAX``), ``ttl_s``, and the callback as an enqueue checks an
        item. A last arrival whose callback the enqueue refuses (QueueFull, ...) raises
        that error and logs nothing."""
        index = member  # ("index" is a tuple method: the argument records name it member, as ops.Arrive does)
        self.advance(now)
        barrier_id = _barrier_id(barrier_id)
        total = validate.count("total", total, limits.BARRIER_MEMBERS_MAX)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise InvalidJob(f"index must be an integer in [0, {total}), got {index!r:.60}")
        value = _value(value)
        ttl = _ttl(ttl_s)
        b = self._live_barrier(barrier_id, now)
        arrived = 0
        if b is not None:
            if b.fired_job is not None:
                return REPEATED
            if b.cancelled:
                return CANCELLED
            if b.total != total:
                raise InvalidJob(f"barrier {barrier_id!r} has {b.total} members; this arrival says {total}")
            if index in b.values:
                return REPEATED
            if b.size + len(value) > limits.BARRIER_BYTES_MAX:
                raise InvalidJob(f"barrier {barrier_id!r}: its values would take {b.size + len(value)} bytes, "
                                 f"over the limit of {limits.BARRIER_BYTES_MAX} (limits.BARRIER_BYTES_MAX)")
            arrived = len(b.values)
        item = self._callback_item(barrier_id, callback)
        first = len(self._ops)
        if arrived + 1 < total:
            self._emit(ops.Arrive(barrier_id, index, total, value, None))
            return COUNTED
        # The last member: the enqueue goes first, so that a refusal leaves nothing logged.
        job_id = self._enqueue_callback(item, now)
        expires_at = _tombstone_expiry(now, ttl)
        self._emit(ops.Arrive(barrier_id, index, total, value, expires_at, list(item[:5])))
        self._emit(ops.Fired(barrier_id, job_id, expires_at))
        self._atomic.append((first, len(self._ops)))  # one record: fired with its last arrival
        self.workflow_totals[BARRIERS_FIRED] += 1
        return FIRED_NOW

    def _callback_item(self, barrier_id: str, callback: Any) -> tuple[Any, ...]:
        """The callback as an enqueue item ``(body, key, queue, delay, priority, dedup_id)``,
        checked as the enqueue path checks one (InvalidJob, UnknownQueue)."""
        if type(callback) not in (list, tuple) or len(callback) != 5:
            raise InvalidJob("callback must be [body, key, queue, delay, priority]")
        checked = self._check_item((*callback, "wf:" + barrier_id), {})
        return checked[:6]

    def _apply_arrive(self, barrier_id: str, member: int, total: int, value: bytes, expires_at: float | None,
                      callback: list[Any] | None = None) -> None:
        bid, index = barrier_id, member
        b = self.barriers.get(bid)
        if b is None or b.kind != OPEN:
            # The live path logs an arrival at a fired or cancelled barrier only once it has
            # expired: this one starts a new barrier.
            b = Barrier(total)
            self._put_barrier(bid, b)
        b.put(index, value)
        if callback is not None:  # the completing arrival
            b.callback = callback
            b.expires_at = expires_at

    def _apply_fired(self, barrier_id: str, job_id: int, expires_at: float) -> None:
        bid = barrier_id
        b = self.barriers.get(bid)
        if b is None:  # its arrivals were lost (a salvaged log): the tombstone still counts
            b = Barrier(0)
            b.fired_job, b.expires_at = job_id, expires_at
            self._put_barrier(bid, b)
            return
        self.barrier_kinds[b.kind] -= 1
        b.fired_job, b.expires_at, b.callback = job_id, expires_at, None
        self.barrier_kinds[FIRED] += 1
        self._barrier_expires(bid, b)

    def fire_complete(self, now: float) -> list[str]:
        """Fire every open barrier whose members have all arrived but whose FIRED is not in
        the log: enqueue its callback and log FIRED (the shard's start, before it serves).
        Returns a line per barrier, fired or not (a callback the enqueue refuses stays
        unfired, and is tried again at the next start)."""
        due = [(bid, b) for bid, b in self.barriers.items()
               if b.kind == OPEN and b.total and len(b.values) == b.total]
        if not due:
            return []
        self.advance(now)
        done = []
        for bid, b in due:
            if b.callback is None:
                done.append(f"barrier {bid!r}: every member arrived but no callback was logged; not fired")
                continue
            try:
                job_id = self._enqueue_callback((*b.callback, "wf:" + bid), now)
            except ShardqError as e:
                done.append(f"barrier {bid!r}: every member arrived; its callback was refused ({type(e).__name__}: "
                            f"{e}); not fired, tried again at the next start")
                continue
            expires_at = max(b.expires_at or 0.0, now + limits.BARRIER_TOMBSTONE_S)
            self._emit(ops.Fired(bid, job_id, expires_at))
            self.workflow_totals[BARRIERS_FIRED] += 1
            done.append(f"barrier {bid!r}: every member had arrived, its FIRED was not logged: "
                        f"fired now as job {job_id}")
        return done

    def barrier_info(self, barrier_ids: list[str], now: float) -> list[BarrierInfo | None]:
        """Per id, in order: None if unknown (or expired), else its total, how many arrived,
        the callback's job id once fired, whether cancelled, and the first missing indexes."""
        if type(barrier_ids) not in (list, tuple) or len(barrier_ids) > limits.BATCH_JOBS_MAX:
            raise InvalidJob(f"barrier: expected a list of at most {limits.BATCH_JOBS_MAX} barrier ids")
        out: list[BarrierInfo | None] = []
        for bid in [_barrier_id(b) for b in barrier_ids]:
            b = self._live_barrier(bid, now)
            if b is None:
                out.append(None)
                continue
            missing: list[int] = []
            if len(b.values) < b.total:
                values = b.values
                for i in range(b.total):  # at most the arrivals before the MISSING_SHOWN-th gap
                    if i not in values:
                        missing.append(i)
                        if len(missing) == MISSING_SHOWN:
                            break
            out.append({"total": b.total, "arrived": len(b.values), "fired_job": b.fired_job,
                        "cancelled": b.cancelled, "missing": missing})
        return out

    def barrier_values(self, barrier_id: str, now: float) -> list[bytes]:
        """The values of a complete barrier in index order (fired ones too, until they
        expire). NotFound if unknown; InvalidJob while members are missing."""
        bid = _barrier_id(barrier_id)
        b = self._live_barrier(bid, now)
        if b is None:
            raise NotFound(f"barrier {bid!r} not found: never arrived at, or expired")
        if not b.total:  # created by cancel_barrier (or, in a salvaged log, fired without its arrivals)
            raise InvalidJob(f"barrier {bid!r}: {'cancelled' if b.cancelled else 'fired'} before any member "
                             "arrived: it holds no values")
        if len(b.values) < b.total:
            raise InvalidJob(f"barrier {bid!r}: {len(b.values)} of {b.total} members arrived")
        values = b.values
        return [values[i] for i in range(b.total)]

    def cancel_barrier(self, barrier_id: str, ttl_s: float, now: float) -> str:
        """Cancel a barrier not yet fired: later arrivals are answered CANCELLED and its
        callback is never enqueued. Returns CANCELLED (now, or already) or FIRED_NOW (too
        late). An unknown barrier is created cancelled (total 0). Kept
        ``max(ttl_s, limits.BARRIER_TOMBSTONE_S)`` from now."""
        self.advance(now)
        bid = _barrier_id(barrier_id)
        ttl = _ttl(ttl_s, positive=False)
        b = self._live_barrier(bid, now)
        if b is not None and b.fired_job is not None:
            return FIRED_NOW
        if b is not None and b.cancelled:
            return CANCELLED
        self._emit(ops.BarrierCancel(bid, _tombstone_expiry(now, ttl)))
        self.workflow_totals[BARRIERS_CANCELLED] += 1
        return CANCELLED

    def _apply_barrier_cancel(self, barrier_id: str, expires_at: float) -> None:
        bid = barrier_id
        b = self.barriers.get(bid)
        if b is None or b.kind != OPEN:
            # Unknown, or (logged only then) a fired or cancelled one that expired: a new one.
            b = Barrier(0)
            b.cancelled, b.expires_at = True, expires_at
            self._put_barrier(bid, b)
            return
        self.barrier_kinds[OPEN] -= 1
        b.cancelled, b.expires_at, b.callback = True, expires_at, None
        self.barrier_kinds[CANCELLED_BARRIER] += 1
        self._barrier_expires(bid, b)

    # ------------------------------------------------------------------ figures
    def workflow_stats(self) -> WorkflowStats:
        """Results kept and barriers by kind (as of the last ``advance``)."""
        return {"results": len(self.results),
                "barriers": {name: self.barrier_kinds[kind] for kind, name in _KIND_NAMES.items()}}

    def workflow_counters(self) -> dict[str, int]:
        """Since this process started (not logged, so a restart starts them at zero and
        replay counts nothing): ``results_stored`` (results a worker stored; one stored
        again, by a second delivery or a re-sent request, counts again), ``barriers_fired``
        (callbacks enqueued: workflow steps started by their barrier, at start too) and
        ``barriers_cancelled`` (barriers cancelled before they fired)."""
        return dict(zip(WORKFLOW_COUNTERS, self.workflow_totals))
