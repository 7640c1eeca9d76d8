"""A shard's state paired with its write-ahead log.

:class:`DurableShard` holds a shard's state (:attr:`state`) and its log. Its owner calls
state methods, then persists the operations they produced, in one of two ways:

* The shard process (:mod:`.process`) takes them with :meth:`take_payloads` and hands them
  to its pipelined :class:`~.committer.Committer`, which sends a reply only after the
  fdatasync that covers it, except a lease of a ``lease_sync = "batched"`` queue whose
  job's enqueue is already durable: that one leaves once its record is written, before
  the fsync.
* :meth:`commit` writes and fsyncs them itself (one fdatasync) and returns only then.
  :meth:`open` uses it for the new token epoch, before anything is served; :class:`Engine`
  wraps a DurableShard for library use and tests and commits after every call, so each
  call returns only once durable, leases included.

Compaction (:meth:`DurableShard.compact`) is an optimisation, never a condition to serve: a
checkpoint that finds no space is given up, the log is left as it was (what the attempt
created is removed) and the shard goes on from it, trying again once the file system has
room (:attr:`DurableShard.compaction_deferred`; docs/operations.md, "Disk full").
"""
from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NotRequired, ParamSpec, TypedDict, TypeVar

import msgpack

from .. import limits
from ..clock import Clock, SystemClock
from ..config import Config
from ..errors import CorruptLog, InvalidJob, InvariantViolation, LogFailed, Unsupported, check
from ..wal import Log, ReplayStats
from ..wal.fileio import Files
from ..wal.format import (CHECKPOINT, HEADER_BYTES, MAGIC_BYTES, checkpoint_name, pack_records, parse_name,
                          segment_name)
from .report import NO_SPACE
from .state import ShardState

if TYPE_CHECKING:
    from ..types import DeadLetter, Lease
    from .queues import QueueStats

log = logging.getLogger("shardq.shard")

#: The name of a backup's staging directory in a shard directory: ``backup-<pid>-<hex>``
#: (the pid of the ``shardq backup`` that asked for it; docs/backup.md).
BACKUP_STAGE = re.compile(r"backup-[0-9]{1,10}-[0-9a-f]{1,32}")  # fullmatch: "$" would let a final "\n" by

P = ParamSpec("P")
T = TypeVar("T")

#: While compaction is put off for want of space, the shard looks this often (at least)
#: whether the file system has room for a checkpoint now, and compacts once it has.
COMPACT_LOOK_S = 5.0
#: ... at most this share of the time goes to measuring the checkpoint a look needs (the
#: live state encoded without being written): a look that measured for ``m`` seconds waits
#: at least ``m / COMPACT_MEASURE_SHARE`` for the next.
COMPACT_MEASURE_SHARE = 0.05
#: After an attempt that found no space although the free space said it would fit (a quota,
#: another writer meanwhile), the wait before the next doubles, from COMPACT_LOOK_S up to this.
COMPACT_BACKOFF_MAX_S = 300.0
#: Free space a checkpoint needs beside its bytes (with 1/32 of them): blocks and metadata
#: of the file system, the new segment's first page. No more: the compaction is what frees
#: the space (a checkpoint of a few KiB may replace a log of gigabytes).
COMPACT_SPARE_BYTES = 64 * 1024


def free_bytes(directory: str) -> int | None:
    """Bytes a writer without privileges may still take on the file system of ``directory``
    (statvfs); None if it cannot tell (then a compaction is simply tried). A quota is not
    seen here: a compaction that meets one fails with EDQUOT and is put off like one that
    meets a full disk."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class BackupCut(TypedDict):
    """A shard's backup cut (:meth:`DurableShard.stage_backup`; docs/backup.md)."""
    stage: str                     # the staging dir's name
    files: list[list[str | int]]   # [name, bytes of it in the copy], in replay order
    segment: str                   # the newest segment's name
    offset: int                    # where its records end
    write: int                     # its last write number
    synced: int                    # ... and the last synced one
    # added by the shard loop (control_handlers.py): which shard, when, and the last job
    # number in the copy
    shard: NotRequired[int]
    time: NotRequired[float]
    job_seq: NotRequired[int]


class DurableShard:
    """State + log of one shard directory.

    Guarantee: :meth:`commit` returns only once every operation the state produced since
    the last commit is on disk (one record, one fdatasync). If it raises, nothing since the
    last successful commit may be reported as done, and the instance is unusable: the owner
    must reopen, which replays the log to the last durable state.
    """

    def __init__(self, directory: str, shard_index: int, config: Config, *, files: Files | None = None,
                 clock: Clock | None = None, free_space: Callable[[str], int | None] | None = None):
        self.directory = directory
        #: times replay and compaction (what the log says they took); state times come from the caller
        self.clock = clock or SystemClock()
        self.shard_index = shard_index
        self.config = config
        self._compact_min_bytes = config.limits.compact_min_bytes  # (read on every commit)
        self.state = ShardState(shard_index, config)
        self.log = Log(directory, segment_bytes=config.limits.segment_bytes, files=files, clock=self.clock)
        self.replay_stats: ReplayStats | None = None
        self._pack = msgpack.Packer().pack
        self.compactions = 0
        #: why compaction is put off (its checkpoint found no space), None while it is not:
        #: the shard serves meanwhile from the log as it is, which grows (stats, the log)
        self.compaction_deferred: str | None = None
        #: directory -> free bytes or None (default: :func:`free_bytes`; tests fake it)
        self._free_space = free_space if free_space is not None else free_bytes
        self._look_at = 0.0             # (monotonic) while deferred: compaction_due() is False before
        self._backoff_s = COMPACT_LOOK_S
        self._measured: tuple[int, int] | None = None  # (bytes a checkpoint needed, jobs then) at the last measure
        self._measure_s = 0.0

    def open(self, now: float | None = None, *, compact: bool = True) -> ReplayStats:
        """Replay checkpoint and segments into the state; afterwards commits append.

        Before anything is served, in the commit that makes the new token epoch durable,
        every barrier whose members have all arrived but whose FIRED is not in the log is
        fired (``ResultOps.fire_complete``, as of ``now``: the system clock's if None).

        Then, if the log is due for compaction and ``compact``, it compacts (:meth:`compact`:
        for want of space it does not, and the shard starts from the log as it is). The
        shard process passes False and compacts itself (it tells its supervisor nothing
        of a compaction that finds no space: not a reason to exit)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        # Replay allocates millions of long-lived objects and frees none: the cyclic GC
        # would rescan them again and again for nothing (about 40% of replay time).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.state.replay(self.log.replay())
        finally:
            if gc_was_enabled:
                gc.enable()
        self.state.drop_stale_ready()  # what replay leased or deleted leaves its ready lines (peeks count them)
        for queue in self.state.drop_unplaced_overrides():  # (logged with the start's record, below)
            log.info("shard %d: queue %r has no limit in the config now: its run-time limit change is dropped",
                     self.shard_index, queue)
        self.replay_stats = self.log.stats
        if now is None:
            now = self.clock.now()
        for line in self.state.fire_complete(now):
            log.warning("shard %d at start: %s", self.shard_index, line)
        self.state.begin_epoch()  # durable before anything is served: tokens are never reused
        payloads = self.take_payloads()
        if payloads:
            self.log.commit(payloads)  # (not self.commit(): compaction comes after, below)
        self.state.sync_forced = False
        for name in sorted(self.state.undeclared):
            c = self.state.stats()[name]
            log.warning("queue %r is not declared in the config (declare_queues = true) but its log holds "
                        "%d jobs (%d ready, %d delayed, %d waiting, %d leased, %d dead): they stay reachable "
                        "(stats, dead letters, dequeue by name); new enqueues to it are refused",
                        name, sum(c[k] for k in ("ready", "delayed", "waiting", "in_flight", "dead")),
                        c["ready"], c["delayed"], c["waiting"], c["in_flight"], c["dead"])
        stats = self.log.stats
        log.info("shard %d replayed %d records in %.3f s (%d jobs)", self.shard_index,
                 stats.records, stats.seconds, len(self.state.jobs))
        if compact and self.compaction_due():
            self.compact()
        return stats  # (the first replay's, whatever a compaction that found no space did)

    def take_payloads(self) -> list[bytes]:
        """The record payloads of every operation since the last call (usually one); for a
        caller that commits them itself (the shard process's pipelined committer).

        One record unless the operations exceed ``limits.SEGMENT_RECORD_BYTES_MAX`` (many
        large requests in one loop iteration): then they are cut between requests, each
        request's operations kept in one record, so a batch stays all or nothing."""
        ops, atomic = self.state.take_batch()
        if not ops:
            return []
        payload = self._pack(ops)
        if len(payload) <= limits.SEGMENT_RECORD_BYTES_MAX:
            return [payload]
        return pack_records(ops, limits.SEGMENT_RECORD_BYTES_MAX, atomic, self._pack)

    def commit(self) -> int:
        """Persist pending operations (one fdatasync); returns how many records. Compacts
        when the log is due."""
        payloads = self.take_payloads()
        if payloads:
            self.log.commit(payloads)
            if self.compaction_due():
                self.compact()
        return len(payloads)

    def compaction_due(self) -> bool:
        """The log has grown enough since its last checkpoint for a new one; while
        compaction is put off (:attr:`compaction_deferred`), only once its next look is due
        (:meth:`compact` then looks whether there is room)."""
        lg = self.log
        if not (lg.bytes_since_checkpoint > self._compact_min_bytes
                and lg.bytes_since_checkpoint > 2 * lg.checkpoint_bytes):
            return False
        return self.compaction_deferred is None or self.clock.monotonic() >= self._look_at

    def compact(self) -> bool:
        """Write a checkpoint of the live state and drop the history it replaces. Returns
        False if it did not for want of space; raises LogFailed for any other failure (the
        log is then unusable, as after a failed commit).

        Compaction is an optimisation, never a condition to serve. When the file system has
        too little free space for the checkpoint (:meth:`_no_room`), nothing is tried; when
        the attempt finds no space (ENOSPC, EDQUOT) before its checkpoint is in place, what
        it created (the new segment, the temporary checkpoint) is removed and the log opened
        again as it was (:meth:`_put_log_back`). Either way the shard goes on appending to
        the log as it is, :attr:`compaction_deferred` says why, and :meth:`compaction_due`
        asks for another try at the next look (every COMPACT_LOOK_S or more)."""
        t0 = self.clock.monotonic()
        no_room = self._no_room()
        if no_room is not None:
            self._defer(no_room, t0, tried=False)
            return False
        lg = self.log
        before = set(lg.files.listdir(lg.directory))
        last = lg.segments[-1]
        try:
            lg.compact(self.state.snapshot)
        except LogFailed as e:
            cause = e.__cause__
            if not (isinstance(cause, OSError) and cause.errno in NO_SPACE):
                raise
            self._put_log_back(before, last, e)
            self._defer(f"no space for a checkpoint: {cause.strerror} ({errno.errorcode.get(cause.errno, '')}, "
                        f"{cause.filename or lg.directory})", t0, tried=True)
            return False
        self.compactions += 1
        if self.compaction_deferred is not None:
            log.warning("shard %d: compacted, no longer put off (it was: %s)", self.shard_index,
                        self.compaction_deferred)
        self.compaction_deferred, self._measured, self._backoff_s = None, None, COMPACT_LOOK_S
        log.info("shard %d compacted: checkpoint %d bytes in %.3f s", self.shard_index,
                 self.log.checkpoint_bytes, self.clock.monotonic() - t0)
        return True

    def checkpoint_bytes_needed(self) -> int:
        """What a checkpoint of the state now takes on disk, measured (each record encoded,
        nothing written), with COMPACT_SPARE_BYTES and a 1/32 margin for the file system."""
        n = MAGIC_BYTES + HEADER_BYTES + 64  # the magic, the trailer
        for payload in self.state.snapshot():
            n += HEADER_BYTES + len(payload)
        return n + n // 32 + COMPACT_SPARE_BYTES

    def _no_room(self) -> str | None:
        """Why a checkpoint would not fit the free space now, or None. A file system with
        room for twice the log (the live state comes from it) needs no measure; otherwise
        the checkpoint is measured, unless there is no more space than at the last measure
        and no fewer jobs (it would not fit now either)."""
        free = self._free_space(self.directory)
        if free is None or free >= 2 * self.log.disk_bytes + COMPACT_SPARE_BYTES:
            return None
        jobs = len(self.state.jobs)
        if self._measured is None or free >= self._measured[0] or jobs < self._measured[1]:
            t0 = self.clock.monotonic()
            self._measured = (self.checkpoint_bytes_needed(), jobs)
            self._measure_s = self.clock.monotonic() - t0
        need = self._measured[0]
        if free >= need:
            return None
        return f"no room for a checkpoint: {free} bytes free, about {need} needed"

    def _defer(self, why: str, now: float, *, tried: bool) -> None:
        """Put compaction off: the next look in COMPACT_LOOK_S (more if measuring took long),
        or after an attempt that failed, in twice the wait before (up to COMPACT_BACKOFF_MAX_S)."""
        first = self.compaction_deferred is None
        if tried:
            wait = self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, COMPACT_BACKOFF_MAX_S)
        else:
            wait = COMPACT_LOOK_S
        self._look_at = now + max(wait, self._measure_s / COMPACT_MEASURE_SHARE)
        self.compaction_deferred = why
        if first or tried:
            log.warning("shard %d: compaction put off (%s); serving from the log as it is (%d bytes since the "
                        "last checkpoint, growing until it compacts); trying again once there is room",
                        self.shard_index, why, self.log.bytes_since_checkpoint)

    def _put_log_back(self, before: set[str], last: int, failure: LogFailed) -> None:
        """After a compaction that found no space before its checkpoint was in place: remove
        the files it created (log files numbered after ``last``, the newest segment before
        it, and their ``.tmp``), then open the log again as it was, by a replay whose records
        the state already holds. Nothing it removes holds a record: the
        compaction had sealed segment ``last`` (all synced) and nothing was appended since.
        Raises ``failure`` if the checkpoint was in place (the history it replaces may be
        partly deleted: a restart's replay finishes the job), LogFailed if the log cannot
        be put back."""
        lg = self.log
        files, directory = lg.files, lg.directory
        writer = lg.writer
        check(writer is None or writer.seq <= last or writer.size <= MAGIC_BYTES,
              "compaction: records in the segment it started")
        lg.close()  # failed: writes nothing, closes its descriptor
        try:
            created = sorted(set(files.listdir(directory)) - before)
            for name in created:
                p = parse_name(name)
                if p is not None and p[1] == CHECKPOINT:
                    raise failure
            for name in created:
                p = parse_name(name.removesuffix(".tmp"))
                if p is not None and p[0] > last:
                    files.unlink(os.path.join(directory, name))
            files.sync_dir(directory)
            self.log = Log(directory, segment_bytes=self.config.limits.segment_bytes, clock=self.clock,
                           files=files)  # type: ignore[arg-type]  # the log's own (a SlowDiskFiles delegates)
            gc_was_enabled = gc.isenabled()
            gc.disable()  # (as open(): what the replay decodes is freed as it goes, no cycle among it)
            try:
                for _ in self.log.replay():
                    pass  # already in the state
            finally:
                if gc_was_enabled:
                    gc.enable()
        except (OSError, CorruptLog) as e:  # (CorruptLog: a log that replayed at start; the next start says more)
            raise LogFailed(f"{failure}; then putting the log back as it was failed: {e}") from e

    def stage_backup(self, name: str) -> BackupCut:
        """Hard-link the files replay reads (the newest checkpoint, the segments after it)
        into ``<shard dir>/<name>/`` and say where the newest segment's records end.

        Guarantee: the links keep each file as it is now, whatever compaction deletes
        later, and the bytes of the newest segment before the returned ``offset`` never
        change (appends go after it; sealing truncates after it). The caller sees to it
        that no write is in flight and every one is synced (the shard loop, after draining
        its committer: control_handlers.py). A staging dir of that name is replaced (a cut
        sent again after a broken connection)."""
        if type(name) is not str or not BACKUP_STAGE.fullmatch(name):
            raise InvalidJob("backup_cut: the staging name must be backup-<pid>-<hex>")
        lg, writer = self.log, self.log.writer
        if writer is None or lg.segments[-1] != writer.seq:
            raise InvariantViolation("backup_cut: the newest segment is not the open one")
        checkpoints = [p[0] for n in lg.files.listdir(lg.directory) if (p := parse_name(n)) and p[1] == CHECKPOINT]
        base = max(checkpoints, default=None)
        check(base is None or lg.segments[0] == base, "backup_cut: the segments do not start at the checkpoint")
        names = ([checkpoint_name(base)] if base is not None else []) + [segment_name(s) for s in lg.segments]
        stage = os.path.join(lg.directory, name)
        files: list[list[str | int]] = []
        try:
            shutil.rmtree(stage, ignore_errors=True)
            os.mkdir(stage, 0o700)
            for n in names:
                src = os.path.join(lg.directory, n)
                os.link(src, os.path.join(stage, n))
                files.append([n, writer.size if n == names[-1] else os.stat(src).st_size])
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            why = ("; a backup needs a file system with hard links"
                   if e.errno in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK) else "")
            raise Unsupported(f"backup_cut: cannot hard-link the log files of {lg.directory} into {stage} "
                              f"({e.strerror}){why}") from None
        return {"stage": name, "files": files, "segment": names[-1], "offset": writer.size,
                "write": writer.written, "synced": writer.synced}

    def close(self) -> None:
        self.log.close()


class Engine:
    """One shard as a library: each call validates, applies, and commits (fsync) before it
    returns. Raises the typed errors of :mod:`shardq.errors`; a rejected call changes
    nothing. After :class:`~shardq.errors.LogFailed` the engine must be reopened."""

    def __init__(self, directory: str, config: Config | None = None, *, shard_index: int = 0,
                 files: Files | None = None, clock: Clock | None = None):
        self.clock = clock or SystemClock()
        self.shard = DurableShard(directory, shard_index, config or Config(), files=files)
        self.shard.open(self.clock.now())
        self.state = self.shard.state

    def _run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            # Ops of a call that raised half-way are never produced: calls validate first.
            self.shard.commit()

    def enqueue(self, body: bytes, key: str | None = None, queue: str = "default", delay: float = 0.0,
                priority: int = 0, dedup_id: str | bytes | None = None) -> int:
        return self._run(self.state.enqueue, body, self.clock.now(), key, queue, delay, priority, dedup_id)

    def enqueue_many(self, items: Sequence[Sequence[Any]], session: Sequence[int] | None = None) -> list[int]:
        return self._run(self.state.enqueue_many, items, self.clock.now(), session)

    def dequeue(self, queue: str = "default", visibility: float | None = None, max_jobs: int = 1) -> list[Lease]:
        return self._run(self.state.dequeue, queue, self.clock.now(), visibility, max_jobs)

    def ack(self, job_id: int, token: int) -> None:
        return self._run(self.state.ack, job_id, token, self.clock.now())

    def nack(self, job_id: int, token: int, delay: float = 0.0, error: str | None = None,
             delivered: bool = True) -> None:
        return self._run(self.state.nack, job_id, token, self.clock.now(), delay, error, delivered)

    def bury(self, job_id: int, token: int, error: str | None = None) -> None:
        return self._run(self.state.bury, job_id, token, self.clock.now(), error)

    def extend(self, job_id: int, token: int, seconds: float) -> float:
        return self._run(self.state.extend, job_id, token, self.clock.now(), seconds)

    def redrive(self, queue: str = "default", job_ids: Iterable[int] | None = None) -> int:
        return self._run(self.state.redrive, queue, self.clock.now(), job_ids)

    def dead_letters(self, queue: str = "default", limit: int = 1000) -> list[DeadLetter]:
        self.state.advance(self.clock.now())  # expired leases past max_deliveries die now
        self.shard.commit()
        return self.state.dead_letters(queue, limit)

    def stats(self) -> dict[str, QueueStats]:
        self.state.advance(self.clock.now())
        self.shard.commit()
        return self.state.stats()

    def compact(self) -> bool:
        return self.shard.compact()

    def close(self) -> None:
        self.shard.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
