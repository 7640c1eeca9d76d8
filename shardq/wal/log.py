"""A shard's log directory: replay, commit, compaction.

Files in the directory (names in :mod:`.format`):

* ``N.ckpt`` -- a checkpoint: the live state as of the start of segment ``N``;
* ``N.wal``, ``N+1.wal``, ... -- segments appended since, numbered without gaps;
* ``log-end.json`` -- where a clean close left the log (:class:`LogEnd`): the next replay
  refuses a log that ends before it, then deletes it before anything is appended.

Replay reads the newest checkpoint, then every segment from its number on. Only the newest
segment may end in a torn tail; it is cut off (torn data is kept beside it in
``N.wal.torn-<offset>``, then ``.1``, ``.2``... if that offset tore before; mode 0600) and
reported. A bad record anywhere else raises :class:`~shardq.errors.CorruptLog`. Files that
the newest checkpoint replaces (left by a crash during compaction) are deleted only after
the whole replay succeeded, and replay ends with an fdatasync of the newest segment and an
fsync of the directory: what it read is durable before anything is acknowledged on top of
it. Compaction cuts a new segment, writes the checkpoint for it (temp file, fsync, rename,
fsync dir) and only then deletes what it replaces, so a crash at any step replays to the
same state.

A torn tail is what a crash leaves; after a clean close the log's end is known. So
:meth:`Log.close`, once the newest segment is synced and sealed, records its number, its
length and the last write in ``log-end.json``, and the next replay refuses with
:class:`~shardq.errors.CorruptLog` a log shorter than that: a segment missing (named), or the
newest one cut or damaged before that length (file and offset), however its bytes read.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Generator, Iterable, Iterator

import msgpack

from .. import limits
from ..clock import Clock, SystemClock
from ..errors import Closed, CorruptLog, LogFailed
from .fileio import Files, files_from_env
from .format import (CHECKPOINT, CHECKPOINT_MAGIC, FORMAT, MAGIC_BYTES, SEGMENT, checkpoint_name, frame,
                     parse_name, segment_name)
# The clean stop's record lives in layout.py with the other rules of the directory; its names
# are importable from here as before.
from .layout import LOG_END as LOG_END, LogEnd as LogEnd, drop_log_end as drop_log_end, read_log_end as read_log_end
from .layout import holding_end, log_files, missing_files, write_log_end
from .reader import FileScan, TornTail
from .salvage import format_ids, readable_job_ids
from .writer import SegmentWriter

log = logging.getLogger("shardq.wal")

_CHECKPOINT_END = "shardq-checkpoint-end"

@dataclass
class ReplayStats:
    checkpoint: str | None = None
    segments: int = 0
    records: int = 0
    seconds: float = 0.0
    torn: TornTail | None = None
    removed: list[str] = field(default_factory=list)


def decode(payload: bytes | memoryview) -> list[Any]:
    ops: list[Any] = msgpack.unpackb(payload, raw=False, use_list=True)
    return ops


def write_private(path: str, data: bytes | memoryview) -> None:
    """Write ``data`` to a new file readable by the owner only (it holds job bodies), fsynced.
    If that fails (a full disk), no part of the file is left behind: a partial copy would
    make the next attempt, after space is freed, fail on the existing name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


class Log:
    """The write-ahead log of one shard directory.

    Use: ``for ops in log.replay(): ...`` once, then :meth:`commit`. Any failed write or
    fsync makes the instance unusable (:class:`LogFailed` from then on): success is never
    reported for what may not be on disk, and the fsync is never retried, because after a
    failed fsync the kernel may have dropped the dirty pages (PostgreSQL's lesson).
    """

    def __init__(self, directory: str, *, segment_bytes: int, files: Files | None = None,
                 clock: Clock | None = None):
        self.directory = directory
        self.clock = clock or SystemClock()  # times replay (stats.seconds)
        self.segment_bytes = segment_bytes
        self.files = files or files_from_env()
        self.writer: SegmentWriter | None = None
        self.failed: BaseException | None = None
        self.closed = False
        # The writer while this log may write: set once replay has made what it read durable
        # (and by each rotation), None once a call failed or the log closed. The hot calls
        # (commit, sync, the sync mark's) test this one attribute; when it is None,
        # _check_usable says why, from the three above.
        self._usable: SegmentWriter | None = None
        self.stats = ReplayStats()
        self.checkpoint_bytes = 0
        self.segments: list[int] = []  # sequence numbers of segments after the checkpoint
        self.bytes_since_checkpoint = 0
        #: segment -> where the last clean close recorded its records ending (replay checks it)
        self._clean_end: dict[int, int] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    # ------------------------------------------------------------------ replay
    def replay(self) -> Iterator[list[Any]]:
        """Yield each record's decoded payload (a list of operations), oldest first.

        Guarantee: yields exactly the records that were committed, in commit order, and
        none after a torn tail. Raises CorruptLog (file, offset) rather than skip a record.
        Deletes nothing until every record has been read.
        """
        t0 = self.clock.monotonic()
        files = self.files
        os.makedirs(self.directory, exist_ok=True)
        names = sorted(files.listdir(self.directory))
        for name in names:
            if name.endswith(".tmp"):  # an unfinished segment or checkpoint: never acknowledged
                self._remove(name)
        found = log_files(names)
        base, segments, replaced = found.checkpoint, found.segments, found.replaced
        # A clean close recorded where the log ends: a log shorter than that lost segments
        # or bytes since, which a crash cannot explain (a torn tail is a crash's).
        end = read_log_end(self.directory, files) if LOG_END in names else None
        # Every segment from the checkpoint's (else from 1) to the newest, and to the one
        # the clean stop recorded (layout.py: the rules `wal check` applies too).
        missing = missing_files(self.directory, found, end)
        if missing:
            raise missing[0].error()
        held = holding_end(found, end)
        self._clean_end = {held.segment: held.bytes} if held is not None else {}
        if end is not None and found.empty:
            # No log file at all: a new log. `wal repair` rebuilds a log so (it moves
            # every file aside first); the record speaks of the one it replaced.
            log.warning("%s: no log file, but %s; a new log begins", self.directory, end.describe())
        # The number of the next write (format 3): the checkpoint's, else 1; then after the
        # last write of each segment. The reader needs it to say which write damaged bytes
        # belong to (reader.py), and the writer goes on from it.
        self._next_write = 1
        if base is not None:
            yield from self._replay_checkpoint(self._path(checkpoint_name(base)))
        last_scan = None
        for i, seq in enumerate(segments):
            last_scan = yield from self._replay_segment(seq, last=(i == len(segments) - 1))
        if end is not None:
            # Checked: from here on the log is appended to, and its end moves. Deleted
            # before the first append (the directory is fsynced below, before any commit).
            files.unlink(self._path(LOG_END))
        for name in replaced:
            self._remove(name)
        self.segments = segments
        if last_scan is not None:  # there are segments: the last one was scanned
            last = segments[-1]
            path = self._path(segment_name(last))
            if last_scan.version < FORMAT:
                # A segment of an earlier version: seal it and append to a new one.
                SegmentWriter(files, path, last, files.open_append(path, last_scan.valid_end),
                              last_scan.valid_end).seal()
                self.writer = self._create_segment(last + 1, self._next_write - 1)
                self.segments.append(self.writer.seq)
            else:
                self.writer = SegmentWriter.reopen(files, path, last, last_scan.valid_end,
                                                   preallocate=self.segment_bytes,
                                                   last_write=self._next_write - 1)
        else:
            self.writer = self._create_segment(base if base is not None else 1, self._next_write - 1)
            self.segments = [self.writer.seq]
        # What was just replayed may not be durable: a process killed after its write and
        # before its fsync leaves the records in the page cache, and a directory entry (a
        # new segment, a compaction's checkpoint) may not have been synced yet. From now on
        # this state is served, and may be acknowledged without a new record (a resent
        # batch answered from its session); a power cut must not take it back.
        files.datasync(self.writer.fd)
        files.sync_dir(self.directory)
        self._usable = self.writer
        self.stats.segments = len(segments)
        self.stats.seconds = self.clock.monotonic() - t0

    def _remove(self, name: str) -> None:
        self.files.unlink(self._path(name))
        self.stats.removed.append(name)

    def _replay_checkpoint(self, path: str) -> Iterator[list[Any]]:
        data = self.files.read(path)
        self.checkpoint_bytes = len(data)
        scan = FileScan(path, data, CHECKPOINT, tail_may_tear=False)
        payloads = list(scan)  # every CRC checked before the first record is applied
        if not payloads:
            raise CorruptLog(path, scan.valid_end, "checkpoint has no trailer (incomplete)")
        trailer = decode(payloads[-1])
        if not (isinstance(trailer, list) and len(trailer) in (2, 3) and trailer[0] == _CHECKPOINT_END):
            raise CorruptLog(path, scan.valid_end, "checkpoint has no trailer (incomplete)")
        if len(trailer) == 3:  # format 3: the number of the first write after it
            self._next_write = trailer[2]
        if trailer[1] != len(payloads) - 1:
            raise CorruptLog(path, scan.valid_end, f"trailer counts {trailer[1]} records, found {len(payloads) - 1}")
        for i in range(len(payloads) - 1):
            self.stats.records += 1
            yield decode(payloads[i])
        self.stats.checkpoint = os.path.basename(path)

    def _replay_segment(self, seq: int, *, last: bool) -> Generator[Any, None, FileScan]:
        path = self._path(segment_name(seq))
        data = self.files.read(path)
        scan = FileScan(path, data, SEGMENT, tail_may_tear=last, first_write=self._next_write,
                        clean_end=self._clean_end.get(seq, 0))
        unpackb = msgpack.unpackb
        records = 0
        try:
            for payload in scan:
                try:
                    ops = unpackb(payload)
                except Exception as e:  # noqa: BLE001 - a CRC-valid record that does not decode: a bug or tampering
                    raise CorruptLog(path, scan.valid_end, f"undecodable record: {e}") from None
                records += 1
                yield ops
        finally:
            self.stats.records += records
        self.bytes_since_checkpoint += scan.valid_end
        if 0 < scan.version < FORMAT:
            self._next_write = 1  # the writes of format 3 start after it, from 1
        elif scan.last_write >= self._next_write:
            self._next_write = scan.last_write + 1
        if scan.torn is not None:
            self._cut_torn_tail(scan.torn, data, scan)
        return scan

    def _cut_torn_tail(self, torn: TornTail, data: bytes, scan: FileScan) -> None:
        if torn.zeros_only:
            # The preallocated space of the newest segment (or pages a crash never wrote):
            # nothing to cut or keep; the writer appends at the last record's end.
            log.info("%s: last record ends at offset %d; the %d bytes after it are preallocated "
                     "zeros (normal after a crash or kill)", torn.path, torn.offset, torn.dropped_bytes)
            return
        keep = max(torn.offset, 0)
        tail = memoryview(data)[keep:]
        if tail.tobytes().count(0) == len(tail):
            kept = "only zeros: nothing to keep"
        else:
            backup = f"{torn.path}.torn-{keep}"
            n = 0
            while os.path.exists(backup):  # torn there before: the same append, cut by another crash
                n += 1
                backup = f"{torn.path}.torn-{keep}.{n}"
            try:
                write_private(backup, tail)
                kept = f"kept in {backup}"
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # Not proven synced, so not kept rather than a shard that cannot start
                # until someone frees space (the disk filled during this very write).
                kept = f"NOT kept: no space for a copy ({e.strerror})"
        if keep < MAGIC_BYTES:
            # Even the file header is incomplete: rewrite the segment as a fresh, empty one.
            self.files.unlink(torn.path)
            parsed = parse_name(os.path.basename(torn.path))
            assert parsed is not None, torn.path  # a segment this log named and scanned
            seq = parsed[0]
            SegmentWriter.create(self.files, self.directory, segment_name(seq), seq).close()
            scan.valid_end, scan.version = MAGIC_BYTES, FORMAT
        else:
            self.files.truncate(torn.path, keep)
        self.files.sync_dir(self.directory)
        self.stats.torn = torn
        if torn.damage is None:  # formats 1 and 2: the earlier rule (reader.py), which proves nothing
            what = ("what the rule of log formats 1 and 2 takes for a torn last write (those formats cannot "
                    "prove it unsynced; the segment is sealed and format 3 begins after it)")
        else:
            ids = readable_job_ids(data, torn.offset)
            what = (f"{torn.damage.describe()}; enqueues readable in the cut bytes: "
                    f"{format_ids(ids)}; these writes were not proven synced, so they were in flight at a "
                    "crash (never acknowledged) unless the disk damaged the last synced write before its "
                    "sync mark (docs/design.md, 'Damage and torn writes')")
        log.warning("torn tail cut: %s at offset %d (%s): %d bytes of %s; %s", torn.path, torn.offset,
                    torn.reason, torn.dropped_bytes, what, kept)

    # ------------------------------------------------------------------ append
    def _create_segment(self, seq: int, last_write: int) -> SegmentWriter:
        return SegmentWriter.create(self.files, self.directory, segment_name(seq), seq,
                                    preallocate=self.segment_bytes, last_write=last_write)

    def _fail(self, e: OSError, what: str) -> LogFailed:
        """Mark the log unusable after a failed call (the fsync is never retried)."""
        self.failed = e
        self._usable = None
        return LogFailed(f"{what} failed: {e}")

    def _check_usable(self) -> SegmentWriter:
        """The newest segment's writer; LogFailed or Closed if this log may not write."""
        if self.failed is not None:
            raise LogFailed(f"log {self.directory} failed earlier ({self.failed}); reopen to recover")
        if self.closed:
            raise Closed(f"log {self.directory} is closed")
        if self.writer is None:
            raise Closed("replay() must run before commit()")
        return self.writer

    def commit(self, payloads: list[bytes], sync: bool = True) -> None:
        """Append ``payloads`` as records and make them durable with one fdatasync, together
        with any records written unsynced before them.

        Guarantee: returns only once all of them are on disk; raises LogFailed otherwise,
        after which this instance refuses all work. ``sync=False`` writes without the
        fdatasync: they survive a crash of the process (the kernel holds them) but not of
        the machine until the next synced commit or :meth:`sync`.
        """
        writer = self._usable
        if writer is None:
            writer = self._check_usable()  # raises why
        try:
            if writer.size >= self.segment_bytes:
                writer = self._rotate()
            self.bytes_since_checkpoint += writer.commit(payloads, sync)
        except OSError as e:
            raise self._fail(e, f"write to {writer.path}") from e

    @property
    def unsynced(self) -> bool:
        """Records written that no fdatasync covers yet."""
        return self.writer is not None and self.writer.unsynced

    @property
    def rotation_due(self) -> bool:
        """The next :meth:`commit` of records starts a new segment."""
        return self.writer is not None and self.writer.size >= self.segment_bytes

    def sync(self) -> None:
        """Make every record written before this call durable (one fdatasync if any is not).
        It never starts a segment, so one other thread may commit unsynced records meanwhile
        (the shard loop, while its committer thread syncs: shard/committer.py); they stay
        unsynced."""
        writer = self._usable
        if writer is None:
            writer = self._check_usable()  # raises why
        try:
            writer.sync()
        except OSError as e:
            raise self._fail(e, f"sync of {writer.path}") from e

    def _rotate(self) -> SegmentWriter:
        """Seal the newest segment and start the next; returns the new writer."""
        old = self._check_usable()
        old.seal()  # before the next segment exists: only the newest may end in zeros
        new = self.writer = self._usable = self._create_segment(old.seq + 1, old.written)  # sealed: all synced
        self.segments.append(new.seq)
        old.close()
        return new

    # ------------------------------------------------------------------ compaction
    @property
    def disk_bytes(self) -> int:
        """Bytes of log records written: the checkpoint and the segments since it (what
        compaction weighs). Not the space on disk: see :meth:`allocated_bytes`."""
        return self.checkpoint_bytes + self.bytes_since_checkpoint

    def allocated_bytes(self) -> int:
        """Bytes the log's files take on disk (allocated blocks): the newest segment's
        preallocated space counts whole, as it does against a full disk."""
        total = 0
        for name in self.files.listdir(self.directory):
            if parse_name(name):
                try:
                    total += os.stat(self._path(name)).st_blocks * 512
                except FileNotFoundError:
                    pass  # removed by a compaction meanwhile
        return total

    def compact(self, snapshot: Callable[[], Iterable[bytes]]) -> None:
        """Replace everything written so far with a checkpoint of the live state.

        ``snapshot()`` yields payloads (encoded lists of operations, each within
        ``limits.CHECKPOINT_RECORD_BYTES_MAX``) that rebuild the state as of this call.
        Steps: cut a new segment; write the checkpoint under a temp name, fsync, rename,
        fsync dir; delete older segments and checkpoints; fsync dir.
        """
        self._check_usable()
        try:
            writer = self._rotate()
            base = writer.seq
            final = self._path(checkpoint_name(base))
            tmp = final + ".tmp"
            fd = self.files.create(tmp)
            written, count, buf, buffered = 0, 0, [], 0
            try:
                self.files.write(fd, CHECKPOINT_MAGIC)
                written += len(CHECKPOINT_MAGIC)
                for payload in snapshot():
                    record = frame(payload, CHECKPOINT)
                    buf.append(record)
                    buffered += len(record)
                    count += 1
                    if buffered >= limits.CHECKPOINT_WRITE_BYTES:
                        chunk = b"".join(buf)
                        self.files.write(fd, chunk)
                        written += len(chunk)
                        buf, buffered = [], 0
                buf.append(frame(msgpack.packb([_CHECKPOINT_END, count, writer.written + 1]), CHECKPOINT))
                chunk = b"".join(buf)
                self.files.write(fd, chunk)
                written += len(chunk)
                self.files.fsync(fd)
            finally:
                self.files.close(fd)
            self.files.rename(tmp, final)
            self.files.sync_dir(self.directory)
            for name in sorted(self.files.listdir(self.directory)):
                p = parse_name(name)
                if p and p[0] < base:
                    self.files.unlink(self._path(name))
            self.files.sync_dir(self.directory)
        except OSError as e:
            raise self._fail(e, f"compaction of {self.directory}") from e
        self.segments = [base]
        self.checkpoint_bytes = written
        self.bytes_since_checkpoint = writer.size

    @property
    def mark_pending(self) -> bool:
        """No record vouches for the last write yet: a sync mark is due once it is synced."""
        writer = self._usable
        return writer is not None and writer.mark_pending

    @property
    def mark_wanted(self) -> bool:
        """A sync mark is pending and every write is synced: :meth:`mark` may run now."""
        writer = self._usable
        return writer is not None and writer.mark_wanted

    def mark(self) -> None:
        """Append a sync mark (no fdatasync): from then on, damage to the writes before it
        reads as damage (CorruptLog), never as a torn write. The shard writes one when it
        goes idle. Never starts a segment; same caller rules as :meth:`commit`."""
        writer = self._usable
        if writer is None:
            writer = self._check_usable()  # raises why
        try:
            writer.mark()
        except OSError as e:
            raise self._fail(e, f"write to {writer.path}") from e

    def close(self) -> None:
        """Close; after a clean close the newest segment ends at its last record, a sync
        mark that vouches for every write before it, and ``log-end.json`` says where that
        is (:class:`LogEnd`: the next replay refuses a log shorter than that)."""
        self._usable = None
        if self.writer is not None:
            try:
                if self.failed is None and not self.closed:
                    writer = self.writer
                    writer.sync()
                    if writer.mark_wanted:
                        writer.mark()
                    writer.seal()  # truncate and fsync: the mark is on disk too
                    write_log_end(self.directory, LogEnd(writer.seq, writer.size, writer.written), self.files)
            except OSError:
                pass  # no record: the next replay takes this stop for a crash's
            try:
                self.writer.close()
            except OSError:
                pass
        self.closed = True
