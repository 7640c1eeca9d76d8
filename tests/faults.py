"""Test doubles for the WAL's file-system calls (:class:`shardq.wal.fileio.Files`).

* :class:`FaultyFiles` counts the calls of chosen kinds and fails the Nth one: with an
  ``OSError`` (ENOSPC, EIO, ...), which the log must turn into ``LogFailed``; or with
  :class:`Crash`, which no code catches, so the files are left as a process killed at that
  point would leave them. A failing ``write`` first writes part of its data, as a full disk
  does. Every call is recorded, so a test can check that nothing (an fsync retry above all)
  happens after the failure.
* :class:`NoSyncFiles` skips fsync/fdatasync: for tests about what is written, not about
  when it is durable (compaction under churn), to keep them fast.
"""
from __future__ import annotations

import errno as errno_mod
import os

from shardq.wal.fileio import Files

#: Every call that changes the disk.
MUTATING = ("create", "open_append", "write", "datasync", "fsync", "rename", "unlink",
            "truncate", "sync_dir")
#: The calls whose failure a log must survive by failing loudly.
FAULTABLE = ("create", "write", "datasync", "fsync", "rename", "unlink", "sync_dir")


class Crash(BaseException):
    """The process 'died' at this call (BaseException, so no ``except Exception`` eats it)."""


class FaultyFiles(Files):
    """Fail the ``fail_at``-th call (1-based) among the calls named in ``kinds``.

    ``error`` is an errno (raise ``OSError``) or the class :class:`Crash`. With
    ``fail_at=None`` nothing fails and the object only counts (``count``) and records
    (``calls``). After the failure, ``failed`` names the call and ``calls_after`` lists
    every call made since.
    """

    def __init__(self, fail_at: int | None = None, *, kinds=FAULTABLE,
                 error: int | type[BaseException] = errno_mod.EIO, partial_write: bool = True):
        self.fail_at = fail_at
        self.kinds = frozenset(kinds)
        self.error = error
        self.partial_write = partial_write
        self.count = 0
        self.calls: list[tuple[str, str]] = []
        self.failed: tuple[str, str] | None = None
        self.calls_after: list[tuple[str, str]] = []

    def _gate(self, kind: str, detail: str) -> bool:
        """Record the call; True if it is the one that must fail."""
        self.calls.append((kind, detail))
        if self.failed is not None:
            self.calls_after.append((kind, detail))
        if kind not in self.kinds:
            return False
        self.count += 1
        return self.fail_at is not None and self.count == self.fail_at and self.failed is None

    def _raise(self, kind: str, detail: str):
        self.failed = (kind, detail)
        if isinstance(self.error, int):
            raise OSError(self.error, f"injected {errno_mod.errorcode[self.error]} in {kind}", detail)
        raise self.error(f"injected crash in {kind}({detail})")

    def create(self, path):
        if self._gate("create", path):
            self._raise("create", path)
        return super().create(path)

    def open_append(self, path, offset):
        if self._gate("open_append", path):
            self._raise("open_append", path)
        return super().open_append(path, offset)

    def write(self, fd, data):
        if self._gate("write", str(fd)):
            if self.partial_write and len(data) > 1:
                os.write(fd, bytes(data[: len(data) // 2]))
            self._raise("write", str(fd))
        super().write(fd, data)

    def datasync(self, fd):
        if self._gate("datasync", str(fd)):
            self._raise("datasync", str(fd))
        super().datasync(fd)

    def fsync(self, fd):
        if self._gate("fsync", str(fd)):
            self._raise("fsync", str(fd))
        super().fsync(fd)

    def rename(self, src, dst):
        if self._gate("rename", f"{src} -> {dst}"):
            self._raise("rename", src)
        super().rename(src, dst)

    def unlink(self, path):
        if self._gate("unlink", path):
            self._raise("unlink", path)
        super().unlink(path)

    def truncate(self, path, size):
        if self._gate("truncate", path):
            self._raise("truncate", path)
        super().truncate(path, size)

    def sync_dir(self, path):
        if self._gate("sync_dir", path):
            self._raise("sync_dir", path)
        super().sync_dir(path)

    def syncs_after_failure(self) -> list[tuple[str, str]]:
        """fsync/fdatasync calls made after the injected failure (must be none)."""
        return [c for c in self.calls_after if c[0] in ("datasync", "fsync")]


class NoSyncFiles(Files):
    """Real files, no fsync: durability is not what the test is about."""

    def datasync(self, fd):
        pass

    def fsync(self, fd):
        pass

    def sync_dir(self, path):
        pass
