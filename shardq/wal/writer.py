"""Append records to one segment file; one write and one fdatasync per commit."""
from __future__ import annotations

import os

from .fileio import Files
from .format import frame


class SegmentWriter:
    """The open, newest segment of a log.

    Guarantee: when :meth:`commit` returns, the records passed to it are on disk (the data
    and the file size, by fdatasync). A new segment is created under a temporary name,
    fsynced, renamed, and its directory fsynced, so a crash never leaves a segment whose
    header is not durable under its final name.
    """

    def __init__(self, files: Files, path: str, seq: int, fd: int, size: int):
        self.files = files
        self.path = path
        self.seq = seq
        self.fd = fd
        self.size = size

    @classmethod
    def create(cls, files: Files, directory: str, name: str, seq: int, magic: bytes,
               preallocate: int = 0) -> "SegmentWriter":
        """A new segment, its space reserved (zeros) up to ``preallocate`` bytes."""
        path = os.path.join(directory, name)
        tmp = path + ".tmp"
        fd = files.create(tmp)
        try:
            files.write(fd, magic)
            if preallocate > len(magic):
                files.allocate(fd, preallocate)
            files.fsync(fd)
        finally:
            files.close(fd)
        files.rename(tmp, path)
        files.sync_dir(directory)
        return cls(files, path, seq, files.open_append(path, len(magic)), len(magic))

    @classmethod
    def reopen(cls, files: Files, path: str, seq: int, size: int) -> "SegmentWriter":
        return cls(files, path, seq, files.open_append(path, size), size)

    def seal(self) -> None:
        """Cut the preallocated zeros off (truncate to the last record, fsync): a sealed
        segment ends at its last record, so zeros are only ever found in the newest one."""
        self.files.truncate(self.path, self.size)

    def commit(self, payloads: list[bytes]) -> int:
        """Append one record per payload, then one fdatasync. Returns bytes written."""
        data = frame(payloads[0]) if len(payloads) == 1 else b"".join(map(frame, payloads))
        self.files.write(self.fd, data)
        self.files.datasync(self.fd)
        self.size += len(data)
        return len(data)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self.files.close(fd)
