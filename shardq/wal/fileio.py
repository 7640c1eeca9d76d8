"""The file-system calls the log makes, behind one object.

Everything the WAL does to disk goes through a :class:`Files` instance, so tests can
substitute one that fails with ENOSPC or EIO at any chosen call (see
``tests/support/faults.py``). Each method is a thin wrapper with the guarantee of the syscall.

Test hook, never set in production: when the environment variable
:data:`FAULT_SYNC_LOG_ENV` (``SHARDQ_FAULT_SYNC_LOG``) names a file, a log opened without
explicit ``files`` uses :class:`SyncLoggingFiles`, which appends ``<path> <inode> <synced
bytes>`` to that file after every successful fsync/fdatasync (and truncate, which fsyncs).
``shardq verify --power-cuts`` sets it, so that after SIGKILLing the service it knows which
bytes of each shard's newest segment were durable, and drops or zeroes pages written after
them (a power cut). Unset, the plain :class:`Files` is used: nothing is added to the
commit path.

Second test hook, never set in production: :data:`FAULT_SLOW_DISK_ENV`
(``SHARDQ_FAULT_SLOW_DISK``) names a file; while that file exists and holds a number of
seconds, every fsync/fdatasync waits that long first (:class:`SlowDiskFiles`), as a disk
stalled by other writers does. Tests use it to check that a shard waiting for its disk is
not taken for a hung one.
"""
from __future__ import annotations

import os
import time
from typing import Any


class Files:
    """Real file-system access.

    :meth:`write_sync` is :meth:`write` then :meth:`datasync` in one call (a synced commit's
    two calls). A subclass that changes either of them (a test double, a hook) gets a
    ``write_sync`` that calls both of its own (:meth:`__init_subclass__`), so no fault or
    hook is passed by."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if ("write" in cls.__dict__ or "datasync" in cls.__dict__) and "write_sync" not in cls.__dict__:
            cls.write_sync = Files._write_then_datasync  # type: ignore[method-assign]  # its own two calls

    def open_append(self, path: str, offset: int) -> int:
        """Open for writing at ``offset``, the end of the records (a preallocated run of
        zeros may follow it, so not O_APPEND)."""
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        os.lseek(fd, offset, os.SEEK_SET)
        return fd

    def allocate(self, fd: int, size: int) -> OSError | None:
        """Reserve ``size`` bytes for the file, so later fdatasyncs have no file size to
        journal (about 25% cheaper on ext4 here). Best effort: an optimisation only. Returns
        the error when nothing was reserved (no space, or a file system without fallocate);
        whatever a failed call reserved is given back (the file keeps its size), so a nearly
        full disk is not filled by a reservation."""
        before = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, size)
            return None
        except OSError as e:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            return e

    def create(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)

    def write(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` (os.write may write less than asked)."""
        n = os.write(fd, data)
        if n == len(data):
            return  # the usual case: a file takes the whole write
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view):]

    def datasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def write_sync(self, fd: int, data: bytes) -> None:
        """All of ``data`` written, then fdatasynced (write and datasync written out: a
        synced commit makes this call)."""
        n = os.write(fd, data)
        if n != len(data):
            view = memoryview(data)[n:]
            while view:
                view = view[os.write(fd, view):]
        os.fdatasync(fd)

    def _write_then_datasync(self, fd: int, data: bytes) -> None:
        """``write_sync`` of a subclass that changes :meth:`write` or :meth:`datasync`."""
        self.write(fd, data)
        self.datasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dir(self, path: str) -> None:
        """Make creations, renames and unlinks in ``path`` durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)


#: Names the side file of :class:`SyncLoggingFiles` (a test hook; see the module docstring).
FAULT_SYNC_LOG_ENV = "SHARDQ_FAULT_SYNC_LOG"
#: Names the switch file of :class:`SlowDiskFiles` (a test hook; see the module docstring).
FAULT_SLOW_DISK_ENV = "SHARDQ_FAULT_SLOW_DISK"


def files_from_env() -> Files | SlowDiskFiles:
    """:class:`Files`, or the test hooks' classes when their variables are set."""
    path = os.environ.get(FAULT_SYNC_LOG_ENV)
    files = SyncLoggingFiles(path) if path else Files()
    switch = os.environ.get(FAULT_SLOW_DISK_ENV)
    return SlowDiskFiles(files, switch) if switch else files


class SyncLoggingFiles(Files):
    """Test hook: after each successful fsync/fdatasync, append ``<path> <inode> <synced
    bytes>`` (the write position: the end of what was written) to a side file, with one
    O_APPEND write (whole lines, also from several processes). The inode identifies a file
    across its rename from ``.tmp``."""

    def __init__(self, side_file: str):
        self._side = os.open(side_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _note(self, path: str, inode: int, size: int) -> None:
        os.write(self._side, f"{path} {inode} {size}\n".encode())

    def _note_fd(self, fd: int, position: int) -> None:
        self._note(os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino, position)

    # The write position is taken before the sync: a write another thread makes while it
    # runs (the shard loop appends while its committer syncs) is not known to be covered.
    def datasync(self, fd: int) -> None:
        position = os.lseek(fd, 0, os.SEEK_CUR)
        super().datasync(fd)
        self._note_fd(fd, position)

    def fsync(self, fd: int) -> None:
        position = os.lseek(fd, 0, os.SEEK_CUR)
        super().fsync(fd)
        self._note_fd(fd, position)

    def truncate(self, path: str, size: int) -> None:
        super().truncate(path, size)
        self._note(os.path.abspath(path), os.stat(path).st_ino, size)


class SlowDiskFiles:
    """Test hook: while ``switch`` exists, each fsync/fdatasync first sleeps the seconds it
    holds (read at every call, so a test turns the stall on and off while the shard runs);
    every call then goes on to ``inner``."""

    def __init__(self, inner: Files, switch: str):
        self.inner = inner
        self.switch = switch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # every call but the syncs

    def _stall(self) -> None:
        try:
            with open(self.switch) as f:
                seconds = float(f.read() or 0)
        except (OSError, ValueError):
            return
        time.sleep(seconds)

    def datasync(self, fd: int) -> None:
        self._stall()
        self.inner.datasync(fd)

    def write_sync(self, fd: int, data: bytes) -> None:
        self.inner.write(fd, data)
        self._stall()
        self.inner.datasync(fd)

    def fsync(self, fd: int) -> None:
        self._stall()
        self.inner.fsync(fd)
