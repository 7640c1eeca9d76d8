"""Pipelined group commit: the shard loop applies batch N+1 while batch N is being fsynced.

The loop hands each iteration's log payloads and reply frames to :class:`Committer`, whose
thread takes everything queued so far, writes it with **one** fdatasync, and only then
sends the replies that wait for it ("late": anything that changed state), in order. So such
a reply never leaves before the fsync that covers it, and one that depends on an earlier
batch is sent after that batch's fsync too, because fsyncs happen in order.

"Early" replies go after the write, before the fdatasync: those that changed nothing
(reads, errors, watch answers) and leases of ``lease_sync = "batched"`` queues whose jobs
are already durable (:attr:`durable_seq`). A batch with no late reply (only such leases,
or lease expiries) is written without an fdatasync; the next synced commit covers it, or
an fdatasync at most ``UNSYNCED_S_MAX`` later (the shard loop wakes for it:
:meth:`Committer.sync_due`). Written, it survives a crash of the process; only a crash of
the machine can lose it, and it holds only delivery counts and lease deadlines.

While the committer thread waits in an fdatasync, an iteration with early replies does
not queue behind it: the loop appends its records itself and sends its early replies at
once, and leaves only its fdatasync and late replies to the thread. So a consumer's lease
never waits for another client's fsync. The log has one appender at a time (the thread
while it writes what it took, else the loop) and one syncer (the thread, or the loop
committing inline while the thread is idle); an fdatasync covers what was written before
it began, and :attr:`durable_seq` moves only to what that was (``SegmentWriter.sync``).

Replies are written without blocking. What a client's socket does not take at once waits
in that connection's backlog, in order, and the committer thread writes it as the client
reads (checking every ``FLUSH_POLL_S``); a client that takes nothing for
``conn.SEND_TIMEOUT_S`` is dropped. The thread sleeps only when no backlog is left, so
whoever leaves a reply in one while it may sleep (the loop, after its own sends) wakes it:
whether a backlog was there before the send says nothing, the thread may have flushed it
and gone to sleep meanwhile. So one slow reader never delays the replies of others,
and no call here depends on descriptor numbers (``select()`` fails above 1024).

The committer also owns closing client sockets: a descriptor is closed only after the
replies queued before the close were sent (or skipped), so a reused descriptor number can
never receive another client's replies.

A failed write or fsync ends the process at once (``os._exit``) without sending any reply
it covered: the supervisor restarts the shard, which replays what is on disk.
"""
from __future__ import annotations

import logging
import os
import threading
from bisect import bisect_left as _bisect_left
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from ..clock import Clock, SystemClock
from ..conditions import CountedCondition
from ..errors import LogFailed
from .conn import SEND_TIMEOUT_S, FrameConn
from .histogram import COMMIT_OPS_BUCKETS, COMMIT_SECONDS_BUCKETS, Histogram

if TYPE_CHECKING:
    from ..wal import Log

log = logging.getLogger("shardq.shard")

PENDING_BATCHES_MAX = 16  # the loop waits when the disk falls this far behind
FLUSH_POLL_S = 0.005      # how often replies waiting for a slow reader are tried again
UNSYNCED_S_MAX = 0.01     # longest a written, unsynced batch (batched leases) waits for its fsync

#: A reply to send: (connection, frame).
Send: TypeAlias = tuple[FrameConn, bytes]
#: One submitted iteration: (payloads, late sends, closes, early sends, sync, seq, ops); see submit.
Batch: TypeAlias = tuple[list[bytes], list[Send], list[FrameConn], Sequence[Send], bool, int, int]


class Committer:
    def __init__(self, log_: Log, exit_code: int, clock: Clock | None = None):
        self.log = log_
        self.exit_code = exit_code
        self._items: deque[Batch] = deque()
        lock = self._lock = threading.Lock()  # taken bare where nobody waits (the loop's hot path)
        # Two conditions on one lock, so that nobody is woken for nothing (each wake-up is a
        # futex call and a thread switch): the committer thread waits for work; drain() and
        # a submit held back by PENDING_BATCHES_MAX wait for the committer to be idle.
        self._work = threading.Condition(lock)
        self._idle = CountedCondition(lock)  # notified only when someone waits on it
        self._stopping = False
        self._busy = False
        self._writing = False  # the thread is writing what it took: the loop must not append
        self._send_lock = threading.Lock()  # replies and closes, from the loop and the thread
        self._backlog: dict[FrameConn, None] = {}  # connections with replies their socket has not taken
        self._monotonic = (clock or SystemClock()).monotonic  # sync deadlines and fsync times
        self.durable_seq = 0      # every job with a sequence number up to this is durable
        self._written_seq = 0
        #: when written, unsynced records must be fsynced at the latest (monotonic), or None:
        #: an attribute, as the shard loop reads it every iteration (:meth:`sync_due`)
        self.sync_due_at: float | None = None
        self._unsynced_ops = 0  # log operations written since the last fdatasync (metrics)
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)  # write + fdatasync, for metrics
        self.commit_ops = Histogram(COMMIT_OPS_BUCKETS)          # log operations per fsync
        self._thread = threading.Thread(target=self._run, name="shardq-committer", daemon=True)
        self._thread.start()

    def submit(self, payloads: list[bytes], sends: list[Send], closes: list[FrameConn], *, inline: bool = False,
               early: Sequence[Send] = (), sync: bool = True, seq: int = 0, ops: int = 0) -> None:
        """Queue one iteration's log payloads (often none or one), its ``(conn, frame)``
        replies (``early``: sent once the payloads are written; ``sends``: after their
        fsync), connections to close after them, whether the batch must be fsynced
        (``sync``), the highest job sequence number it may hold (``seq``), and how many log
        operations the payloads hold (``ops``: the caller counted them as it made them; the
        ``commit_ops`` metric counts them per fdatasync, and reads no payload for it).

        ``inline``: if nothing is queued or being written, do the work on the calling thread
        now. A light load gains nothing from the pipeline and saves a thread hand-off (tens
        of microseconds) on every request's latency. An iteration with early replies that
        finds the thread past its writes (syncing, sending) appends and answers them here
        too, and queues only its fsync and late replies."""
        with self._lock:
            if inline and not self._items and not self._busy:
                self._busy = alone = True
            elif (early and self._busy and not self._items and not self._writing
                    and not self.log.rotation_due):
                alone = False  # beside the thread's fdatasync (below): it never starts a segment
            else:
                self._queue((payloads, sends, closes, early, sync, seq, ops))
                return
        if not alone:  # beside the thread's fdatasync
            if payloads:
                self._write(payloads, seq, ops)
            self._send(early)
            with self._lock:
                if sync or sends or closes:
                    self._queue(([], sends, closes, (), sync, seq, 0))
                elif self._backlog:
                    self._work.notify()  # the thread may have flushed the rest and gone to sleep
            return
        try:
            if sync:
                if payloads and not early:
                    self._commit_alone(payloads, sends, closes, seq, ops)
                else:
                    self._process([(payloads, sends, closes, early, sync, seq, ops)])
            elif sends or closes:
                self._process([(payloads, sends, closes, early, sync, seq, ops)])
            else:  # early replies only (batched leases, reads): written, answered, synced later
                if payloads:
                    self._write_alone(payloads, seq, ops)
                self._send(early)
                if self._backlog:
                    with self._work:
                        self._work.notify()  # the committer thread flushes it (see _run)
        finally:
            # No lock to let go: only the loop's own calls (drain, a held-back submit,
            # write_mark) ever wait on _idle, and this is the loop, so none waits now; and
            # the thread never reads _busy, it only takes it for a backlog flush, which
            # nothing here depends on.
            self._busy = False
            if self._idle.waiters:
                with self._lock:
                    self._idle.notify_all()

    def _queue(self, item: Batch) -> None:
        """For the committer thread (with the lock held)."""
        while len(self._items) >= PENDING_BATCHES_MAX:
            self._idle.wait()
        self._items.append(item)
        self._work.notify()

    def drain(self) -> None:
        """Wait until everything submitted is durable and answered (before compaction)."""
        with self._lock:
            while self._items or self._busy:
                self._idle.wait()

    def stop(self) -> None:
        self.drain()
        with self._work:
            self._stopping = True
            self._work.notify()
        self._thread.join()

    def _run(self) -> None:
        """The thread: a bug here must not leave the shard alive with nobody sending its
        replies (every client would hang until the supervisor's health check): fail-stop."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - any escape is a bug; the supervisor restarts us
            log.exception("the committer thread failed")
            self._fail(e)

    def _serve(self) -> None:
        while True:
            with self._work:
                while not self._items and not self._stopping and not self._backlog:
                    self._work.wait()
                if not self._items and self._backlog and not self._stopping:
                    self._work.wait(FLUSH_POLL_S)  # a submit wakes it at once
                if (not self._items and self._stopping and not self._backlog
                        and self.sync_due_at is None):
                    return
                items = list(self._items)
                self._items.clear()
                self._busy = True
                self._writing = bool(items)
                if self._idle.waiters:
                    self._idle.notify_all()  # a submit held back may queue again
            if items:
                self._process(items)
            elif self.sync_due_at is not None and self._stopping:
                synced = self._sync()
                if synced is not None:
                    self._synced(*synced)
            self._flush_backlog(final=self._stopping and not items)
            with self._lock:
                self._busy = False
                if self._idle.waiters:
                    self._idle.notify_all()

    def write_mark(self) -> bool:
        """Append a sync mark (``Log.mark``) if one is wanted (every write synced: the log's
        ``mark_wanted``, tested here, so a caller need not) and the thread is idle. True once
        no mark is pending (this one written, or none due); False if the thread is busy or a
        write is not synced yet (try again shortly). The loop calls it before it sleeps, so
        the writes of an idle shard are vouched for: damage to them later is refused as
        corruption, never cut as a torn write (wal/reader.py)."""
        with self._lock:
            if self._items or self._busy:
                return False
            self._busy = True  # the appender now: submits queue behind it
        log_ = self.log
        try:
            if not log_.mark_wanted:
                return not log_.mark_pending
            try:
                log_.mark()
            except (LogFailed, Exception) as e:  # noqa: BLE001 - any failure here is fatal
                self._fail(e)
        finally:
            with self._lock:
                self._busy = False
                if self._idle.waiters:
                    self._idle.notify_all()
        return True

    def sync_due(self) -> float | None:
        """When written, unsynced records must be fsynced at the latest (monotonic), or
        None. The shard loop wakes for it and submits a synced batch: no thread hand-off."""
        return self.sync_due_at

    def _flush_backlog(self, final: bool = False) -> None:
        """Write what waits for slow readers; drop those that took nothing for
        SEND_TIMEOUT_S (at the final flush, when stopping, drop what still waits)."""
        if not self._backlog:
            return
        now = self._monotonic()
        with self._send_lock:
            for conn in list(self._backlog):
                if conn.closed or conn.dead:
                    del self._backlog[conn]
                    continue
                before = conn.out_bytes
                try:
                    done = conn.flush()
                except OSError as e:
                    self._drop(conn, f"send failed: {e}")
                    continue
                if done:
                    del self._backlog[conn]
                    if conn.close_when_sent:
                        conn.close()
                elif conn.out_bytes < before:
                    conn.progress_at = now
                elif final or now - conn.progress_at > SEND_TIMEOUT_S:
                    self._drop(conn, f"client took none of its replies for {SEND_TIMEOUT_S} s "
                                     f"({conn.out_bytes} bytes waiting)")

    def _drop(self, conn: FrameConn, why: str) -> None:
        """(With the send lock held.)"""
        log.warning("dropping client: %s", why)
        self._backlog.pop(conn, None)
        conn.out.clear()
        conn.shut()  # the loop reads EOF and drops it; the close comes through the committer
        if conn.close_when_sent:
            conn.close()

    def _process(self, items: list[Batch]) -> None:
        """Write the payloads, send the early replies, fdatasync (when any batch needs it),
        then send the late replies and close what was asked, in order. Written before any
        reply leaves, a record survives a crash of this process whatever its reply said."""
        if len(items) == 1:  # the loop's inline commit: most iterations at light load
            payloads, late, closes, one_early, sync, seq, ops = items[0]
            if payloads:
                self._write(payloads, seq, ops)
            if one_early:
                self._send(one_early)
        else:
            payloads = [p for it in items for p in it[0]]
            sync = any(it[4] for it in items)
            seq = max(it[5] for it in items)
            if payloads:
                self._write(payloads, seq, sum(it[6] for it in items))
            for it in items:
                if it[3]:
                    self._send(it[3])
        if self._writing:
            with self._lock:
                self._writing = False  # the loop may append from here, beside the fdatasync
        synced = self._sync() if sync else None
        if len(items) == 1:
            if late:
                self._send(late)
            if closes:
                self._close(closes)
        else:
            for _, late, closes, _, _, _, _ in items:
                self._send(late)
                if closes:
                    self._close(closes)
        if synced is not None:
            self._synced(*synced)  # after the replies: no caller waits for the bookkeeping
        if self._backlog:
            with self._work:
                self._work.notify()  # the committer thread flushes it (see _run)

    def _commit_alone(self, payloads: list[bytes], sends: list[Send], closes: list[FrameConn], seq: int,
                      ops: int) -> None:
        """:meth:`_process` of one synced batch with no early reply, on the loop thread while
        the committer thread is idle (a lone caller's request: the usual inline commit):
        the same steps in the same order, its write and fdatasync in one call of the log.
        The caller holds ``_busy``, so nobody else reads or writes the bookkeeping meanwhile
        (the thread waits for work, and a commit beside it needs it busy): no lock. The
        fdatasync covers every earlier unsynced write too, so they become durable with it."""
        t0 = self._monotonic()
        try:
            self.log.commit(payloads, True)
        except (LogFailed, Exception) as e:  # noqa: BLE001 - any failure here is fatal
            self._fail(e)
        seconds = self._monotonic() - t0
        self._send(sends)
        if closes:
            self._close(closes)
        if seq < self._written_seq:  # an earlier unsynced write (a batched lease's) reached further
            seq = self._written_seq
        self._written_seq = seq
        if seq > self.durable_seq:
            self.durable_seq = seq
        self.sync_due_at = None
        unsynced = self._unsynced_ops
        if unsynced:
            self._unsynced_ops = 0
            ops += unsynced
        self._observe(seconds, ops)
        if self._backlog:
            with self._work:
                self._work.notify()  # the committer thread flushes it (see _run)

    def _write(self, payloads: list[bytes], seq: int, ops: int) -> None:
        """Append ``payloads`` (``ops`` log operations) unsynced (the loop or the thread: one
        appender at a time)."""
        try:
            self.log.commit(payloads, False)
        except (LogFailed, Exception) as e:  # noqa: BLE001 - any failure here is fatal
            self._fail(e)
        with self._lock:  # against _sync's bookkeeping on the other thread
            if seq > self._written_seq:
                self._written_seq = seq
            if self.sync_due_at is None:
                self.sync_due_at = self._monotonic() + UNSYNCED_S_MAX
            self._unsynced_ops += ops

    def _write_alone(self, payloads: list[bytes], seq: int, ops: int) -> None:
        """:meth:`_write` by the loop committing inline: the caller holds ``_busy``, so the
        thread is idle and no ``_sync`` reads the bookkeeping meanwhile (as in
        :meth:`_commit_alone`): no lock."""
        try:
            self.log.commit(payloads, False)
        except (LogFailed, Exception) as e:  # noqa: BLE001 - any failure here is fatal
            self._fail(e)
        if seq > self._written_seq:
            self._written_seq = seq
        if self.sync_due_at is None:
            self.sync_due_at = self._monotonic() + UNSYNCED_S_MAX
        self._unsynced_ops += ops

    def _sync(self) -> tuple[int, float, int] | None:
        """fdatasync what was written before this call, if anything is unsynced; return what
        :meth:`_synced` notes once the replies it covers are sent (the highest job sequence
        number it covers, its seconds, its log operations): nothing but those replies waits for it,
        and a reply that waits for an fdatasync waits for nothing else."""
        if not self.log.unsynced:
            # Synced by other means (a rotation seals its segment with an fdatasync): nothing
            # is due. Left set, sync_due would stay in the past and the loop spin on it.
            with self._lock:
                if not self.log.unsynced:
                    self.sync_due_at = None
            return None
        with self._lock:
            # Read before the fdatasync: every job up to seq is written, so it covers them.
            seq = self._written_seq
            ops, self._unsynced_ops = self._unsynced_ops, 0
        t0 = self._monotonic()
        try:
            self.log.sync()
        except (LogFailed, Exception) as e:  # noqa: BLE001 - any failure here is fatal
            self._fail(e)
        return seq, self._monotonic() - t0, ops

    def _synced(self, seq: int, seconds: float, ops: int) -> None:
        """The bookkeeping of an fdatasync (:meth:`_sync`), after the replies it covers: jobs
        up to ``seq`` are durable (a lease of one may go before its own fsync from now on:
        until now it waited for the next, which is only later, never wrong), nothing is due
        unless an append raced the fdatasync, and the metrics."""
        with self._lock:
            if seq > self.durable_seq:
                self.durable_seq = seq
            if not self.log.unsynced:  # else an append raced the fdatasync: still due
                self.sync_due_at = None
        self._observe(seconds, ops)

    @property
    def fsyncs(self) -> int:
        """fdatasyncs made: each is one observation of ``commit_seconds`` (not counted apart)."""
        return sum(self.commit_seconds.counts)

    def _fail(self, e: BaseException) -> None:
        log.error("log commit failed; exiting without replying so the supervisor "
                  "restarts and replays: %s", e)
        logging.shutdown()
        os._exit(self.exit_code)

    def _observe(self, seconds: float, ops: int) -> None:
        """The metrics of one fdatasync (its seconds, the log operations it made durable),
        the last of its bookkeeping; Histogram.observe written out for both, as this runs
        once per fdatasync."""
        h = self.commit_seconds
        h.counts[_bisect_left(h.bounds, seconds)] += 1
        h.sum += seconds
        h = self.commit_ops
        h.counts[_bisect_left(h.bounds, ops)] += 1
        h.sum += ops

    def _send(self, sends: Sequence[Send]) -> None:
        with self._send_lock:  # the loop's early replies and the thread's, never interleaved
            backlog = self._backlog
            for conn, frame in sends:
                if conn.closed or conn.dead:
                    continue
                try:
                    if not conn.send(frame) and conn not in backlog:
                        backlog[conn] = None
                        conn.progress_at = self._monotonic()
                except OSError as e:
                    self._drop(conn, f"send failed: {e}")

    def _close(self, closes: list[FrameConn]) -> None:
        with self._send_lock:
            backlog = self._backlog
            for conn in closes:
                if conn in backlog:
                    conn.close_when_sent = True  # its replies first
                else:
                    conn.close()

