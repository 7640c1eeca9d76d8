"""Append records to one segment file; one write and one fdatasync per commit."""
from __future__ import annotations

import errno
import logging
import os

from .fileio import Files, SlowDiskFiles
from .format import LAST_IN_WRITE, MARK_PAYLOAD, SEGMENT, SEGMENT_MAGIC, SYNC_MARK, frame, frame_write

log = logging.getLogger("shardq.wal")


def _reserve(files: Files | SlowDiskFiles, fd: int, path: str, size: int) -> None:
    """Preallocate; on a disk without room for it, append without (and say so): a shard
    must not need a whole segment of free space to start or to rotate."""
    err = files.allocate(fd, size)
    if err is not None and err.errno in (errno.ENOSPC, errno.EDQUOT):
        log.warning("%s: no space to preallocate %d bytes (%s); appending without preallocation",
                    path, size, err.strerror)


class SegmentWriter:
    """The open, newest segment of a log (always the current format).

    Guarantee: when :meth:`commit` returns, the records passed to it are on disk (the data
    and the file size, by fdatasync). Each commit is one write, numbered (``written``)
    across segments; its records carry that number and the highest write an fdatasync had
    covered when it was issued (``synced``), so a reader can prove which bytes were synced.
    A new segment is created under a temporary name,
    fsynced, renamed, and its directory fsynced, so a crash never leaves a segment whose
    header is not durable under its final name. No record over the segment limit is ever
    written (:func:`~shardq.wal.format.frame` refuses it before the write).
    """

    def __init__(self, files: Files | SlowDiskFiles, path: str, seq: int, fd: int, size: int, last_write: int = 0):
        self.files = files
        self.path = path
        self.seq = seq
        self.fd = fd
        self.size = size
        # The last write issued, and the last one an fdatasync covers: numbers, not a flag,
        # so that a sync racing an append (the shard loop's, while the committer thread
        # syncs) never marks that append synced. Everything before ``last_write`` is synced
        # (a replayed log, or a sealed segment).
        self.written = last_write
        self.synced = last_write
        self.marked = -1  # the number of the last sync mark written

    @classmethod
    def create(cls, files: Files | SlowDiskFiles, directory: str, name: str, seq: int, preallocate: int = 0,
               last_write: int = 0) -> SegmentWriter:
        """A new segment, its space reserved (zeros) up to ``preallocate`` bytes."""
        path = os.path.join(directory, name)
        tmp = path + ".tmp"
        fd = files.create(tmp)
        try:
            files.write(fd, SEGMENT_MAGIC)
            if preallocate > len(SEGMENT_MAGIC):
                _reserve(files, fd, path, preallocate)
            files.fsync(fd)
        finally:
            files.close(fd)
        files.rename(tmp, path)
        files.sync_dir(directory)
        return cls(files, path, seq, files.open_append(path, len(SEGMENT_MAGIC)), len(SEGMENT_MAGIC), last_write)

    @classmethod
    def reopen(cls, files: Files | SlowDiskFiles, path: str, seq: int, size: int, preallocate: int = 0,
               last_write: int = 0) -> SegmentWriter:
        """The newest segment of a replayed log, appended to at ``size`` (its last record's
        end). Its space is reserved again, as for a new segment: without it every commit
        until the next rotation would also journal a new file size."""
        fd = files.open_append(path, size)
        if preallocate > size:
            _reserve(files, fd, path, preallocate)
        return cls(files, path, seq, fd, size, last_write)

    def seal(self) -> None:
        """Cut the preallocated zeros off (truncate to the last record, fsync): a sealed
        segment ends at its last record, so zeros are only ever found in the newest one."""
        self.files.truncate(self.path, self.size)

    @property
    def unsynced(self) -> bool:
        """Records written that no fdatasync covers yet."""
        return self.written != self.synced

    def commit(self, payloads: list[bytes], sync: bool = True) -> int:
        """Append one record per payload, then one fdatasync (``sync``; otherwise the next
        :meth:`sync` or synced commit makes them durable: fdatasync covers every earlier
        write of the file). Returns bytes written."""
        if not payloads:
            if sync:
                self.sync()
            return 0
        write, synced = self.written + 1, self.synced
        data = frame(payloads[0], SEGMENT, write, synced) if len(payloads) == 1 else \
            frame_write(payloads, write, synced)
        n = len(data)
        if sync:  # one call: the write, then an fdatasync of it and every write before it
            # (``written`` moves after both: the caller appends and syncs, so no other
            # thread syncs or appends meanwhile, and none reads a number in between)
            self.files.write_sync(self.fd, data)
            self.size += n
            self.written = self.synced = write
        else:
            self.files.write(self.fd, data)
            self.size += n
            self.written = write  # after the write: a sync that reads this covers it
        return n

    @property
    def mark_pending(self) -> bool:
        """The last write is not a sync mark: nothing after it vouches for it."""
        return self.written != self.marked

    @property
    def mark_wanted(self) -> bool:
        """A mark is pending and may be written now: every write is synced."""
        return self.written != self.marked and self.synced == self.written

    def mark(self) -> None:
        """Append a sync mark: a record with no operations stating that every write up to
        ``synced`` is on disk, so damage to them is never taken for a torn write. Written
        without an fdatasync: losing it in a power cut loses nothing but the proof."""
        write, synced = self.written + 1, self.synced
        data = frame(MARK_PAYLOAD, SEGMENT, write, synced, LAST_IN_WRITE | SYNC_MARK)
        self.files.write(self.fd, data)
        self.size += len(data)
        self.written = self.marked = write

    def sync(self) -> None:
        """fdatasync every record written before this call. One other thread may append
        meanwhile (one appender, one syncer at a time): what it writes stays unsynced."""
        target = self.written
        if target != self.synced:
            self.files.datasync(self.fd)
            self.synced = target

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.files.close(fd)
