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
from ..errors import InvalidJob, InvariantViolation, Unsupported, check
from ..wal import Log, ReplayStats
from ..wal.fileio import Files
from ..wal.format import CHECKPOINT, checkpoint_name, pack_records, parse_name, segment_name
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
                 clock: Clock | None = None):
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

    def open(self, now: float | None = None) -> ReplayStats:
        """Replay checkpoint and segments into the state; afterwards commits append.

        Before anything is served, in the commit that makes the new token epoch durable,
        every barrier whose members have all arrived but whose FIRED is not in the log is
        fired (``ResultOps.fire_complete``, as of ``now``: the system clock's if None)."""
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
        self.replay_stats = self.log.stats
        if now is None:
            now = self.clock.now()
        for line in self.state.fire_complete(now):
            log.warning("shard %d at start: %s", self.shard_index, line)
        self.state.begin_epoch()  # durable before anything is served: tokens are never reused
        self.commit()
        self.state.sync_forced = False
        for name in sorted(self.state.undeclared):
            c = self.state.stats()[name]
            log.warning("queue %r is not declared in the config (declare_queues = true) but its log holds "
                        "%d jobs (%d ready, %d delayed, %d waiting, %d leased, %d dead): they stay reachable "
                        "(stats, dead letters, dequeue by name); new enqueues to it are refused",
                        name, sum(c[k] for k in ("ready", "delayed", "waiting", "in_flight", "dead")),
                        c["ready"], c["delayed"], c["waiting"], c["in_flight"], c["dead"])
        log.info("shard %d replayed %d records in %.3f s (%d jobs)", self.shard_index,
                 self.log.stats.records, self.log.stats.seconds, len(self.state.jobs))
        return self.log.stats

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
        lg = self.log
        return (lg.bytes_since_checkpoint > self._compact_min_bytes
                and lg.bytes_since_checkpoint > 2 * lg.checkpoint_bytes)

    def compact(self) -> None:
        """Write a checkpoint of the live state and drop the history it replaces."""
        t0 = self.clock.monotonic()
        self.log.compact(self.state.snapshot)
        self.compactions += 1
        log.info("shard %d compacted: checkpoint %d bytes in %.3f s", self.shard_index,
                 self.log.checkpoint_bytes, self.clock.monotonic() - t0)

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

    def compact(self) -> None:
        self.shard.compact()

    def close(self) -> None:
        self.shard.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
