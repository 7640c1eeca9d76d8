"""Test doubles for the WAL's file-system calls (:class:`shardq.wal.fileio.Files`).

* :class:`FaultyFiles` counts the calls of chosen kinds and fails the Nth one: with an
  ``OSError`` (ENOSPC, EIO, ...), which the log must turn into ``LogFailed``; or with
  :class:`Crash`, which no code catches, so the files are left as a process killed at that
  point would leave them. A failing ``write`` first writes part of its data, as a full disk
  does. Every call is recorded, so a test can check that nothing (an fsync retry above all)
  happens after the failure.
* :class:`NoSyncFiles` skips fsync/fdatasync: for tests about what is written, not about
  when it is durable (compaction under churn), to keep them fast.
* :class:`PowerCutFiles` models a power cut: what was not fsynced may be lost, page by
  page (4 KiB), and directory entries not yet synced may be undone.
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


# ---------------------------------------------------------------------------- power cuts
PAGE_BYTES = 4096
KEEP, DROP, ZERO = "keep", "drop", "zero"
FATES = (KEEP, DROP, ZERO)


class PowerCutFiles(Files):
    """Real files, and a model of what a power cut leaves of them (no real fsync is made).

    The model (SQLite's crash tests, Jepsen's "lose unfsynced writes", ext4's ordered
    metadata journal):

    * **file data**: each file (inode) has a *durable image*, its content as of its last
      fsync/fdatasync (``truncate`` fsyncs too); a new file's is empty. At a power cut every
      4 KiB page where the file differs from its image is, independently, *kept* (what was
      written), *dropped* (the page's old content: zeros in a preallocated segment, nothing
      past the old end) or *zeroed* (the bytes written since the sync read as zeros). A
      file that grew may also fall back to its durable size. Synced bytes never change.
    * **directory entries**: creations, renames and unlinks in a directory become durable at
      its ``sync_dir``; a power cut keeps a prefix of those made since (metadata is
      journaled in order) and undoes the rest, newest first (an unlinked file comes back
      with its content).

    A process kill is not a power cut: :meth:`kill` only closes the dead process's
    descriptors; what it wrote stays in the "page cache" (the files), still unsynced, and
    the next process reads it. :meth:`power_cut` then decides what reaches the disk.

    ``arm(n)`` makes the ``n``-th next call among :data:`MUTATING` raise :class:`Crash`
    (``arm(kind="datasync")``: the next call of that kind; a ``write`` first lands in full
    or not at all, as ``write_first`` says), and every call after it too, until
    :meth:`kill`: the process is dead.
    """

    def __init__(self):
        self.count = 0            # MUTATING calls made
        self.crash_at: int | None = None
        self.crash_kind: str | None = None
        self.write_first = True
        self.dead = False
        self.crashed_in: str | None = None
        self.fds: dict[int, int] = {}                 # open descriptor -> inode
        self.durable: dict[int, bytes] = {}           # inode -> content as of its last sync
        self.dirops: dict[str, list[tuple]] = {}      # directory -> entry changes since its sync
        self.known_dirs: set[str] = set()

    # ---------------------------------------------------------------- arming and events
    def arm(self, calls_from_now: int = 1, *, kind: str | None = None, write_first: bool = True) -> None:
        """Crash at the ``calls_from_now``-th next call, or at the next call of ``kind``."""
        self.crash_at = self.count + calls_from_now
        self.crash_kind = kind
        self.write_first = write_first

    def disarm(self) -> None:
        self.crash_at = None

    def _gate(self, kind: str) -> bool:
        """Count the call; raise Crash if the process is dead or this is the armed call. For
        a write, True means: crash right after writing."""
        if self.dead:
            raise Crash(f"{kind} after the crash")
        self.count += 1
        armed = self.crash_at is not None and (
            kind == self.crash_kind if self.crash_kind else self.count >= self.crash_at)
        if armed:
            self.crash_at, self.dead, self.crashed_in = None, True, kind
            if kind == "write" and self.write_first:
                return True
            raise Crash(f"injected crash at {kind}")
        return False

    def kill(self) -> None:
        """The process died (after a Crash, or between calls): close its descriptors. The
        files keep what it wrote, synced or not."""
        for fd in list(self.fds):
            os.close(fd)
        self.fds.clear()
        self.dead = False
        self.crash_at = None

    # ---------------------------------------------------------------- bookkeeping
    @staticmethod
    def _content(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def _track(self, fd: int, path: str, *, new: bool) -> int:
        ino = os.fstat(fd).st_ino
        self.fds[fd] = ino
        self.known_dirs.add(os.path.dirname(path))
        if new:
            self.durable[ino] = b""
        elif ino not in self.durable:   # on disk before we saw it: durable as it is
            self.durable[ino] = self._content(path)
        return fd

    def _synced(self, fd: int) -> None:
        self.durable[self.fds[fd]] = self._content(f"/proc/self/fd/{fd}")

    def _dirop(self, path: str, op: tuple) -> None:
        d = os.path.dirname(path)
        self.known_dirs.add(d)
        self.dirops.setdefault(d, []).append(op)

    # ---------------------------------------------------------------- the Files calls
    def create(self, path):
        self._gate("create")
        fd = super().create(path)
        self._dirop(path, ("create", path))
        return self._track(fd, path, new=True)

    def open_append(self, path, offset):
        self._gate("open_append")
        return self._track(super().open_append(path, offset), path, new=False)

    def allocate(self, fd, size):
        if self.dead:
            raise Crash("allocate after the crash")
        super().allocate(fd, size)

    def write(self, fd, data):
        crash_after = self._gate("write")
        super().write(fd, data)
        if crash_after:
            raise Crash("injected crash after a write")

    def datasync(self, fd):
        self._gate("datasync")
        self._synced(fd)

    def fsync(self, fd):
        self._gate("fsync")
        self._synced(fd)

    def close(self, fd):
        if self.dead:
            raise Crash("close after the crash")
        self.fds.pop(fd, None)
        super().close(fd)

    def rename(self, src, dst):
        self._gate("rename")
        super().rename(src, dst)
        self._dirop(dst, ("rename", src, dst))

    def unlink(self, path):
        self._gate("unlink")
        ino = os.stat(path).st_ino
        saved = (self._content(path), self.durable.pop(ino, None))
        super().unlink(path)
        self._dirop(path, ("unlink", path, saved))

    def truncate(self, path, size):
        self._gate("truncate")
        os.truncate(path, size)  # Files.truncate fsyncs: durable at once
        self.durable[os.stat(path).st_ino] = self._content(path)

    def sync_dir(self, path):
        self._gate("sync_dir")
        self.known_dirs.add(path)
        self.dirops.pop(path, None)

    def read(self, path):
        if self.dead:
            raise Crash("read after the crash")
        return super().read(path)

    # ---------------------------------------------------------------- the power cut
    def unsynced(self) -> dict[str, tuple[bytes, bytes]]:
        """path -> (content now, durable image) of every file that differs from its image."""
        out = {}
        for d in self.known_dirs:
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                path = os.path.join(d, name)
                ino = os.stat(path).st_ino
                if ino in self.durable:
                    now = self._content(path)
                    if now != self.durable[ino]:
                        out[path] = (now, self.durable[ino])
        return out

    def power_cut(self, rng, fate=None, keep_dirops=None) -> dict:
        """Leave on disk what a power cut now could leave; returns what it did.

        ``fate(path, page_index) -> "keep"|"drop"|"zero"`` decides each unsynced page
        (default: ``rng``); ``keep_dirops(directory, ops) -> int`` how many unsynced entry
        changes survive (default: ``rng``). Afterwards everything on disk is durable.
        """
        self.kill()
        done = {"pages": {KEEP: 0, DROP: 0, ZERO: 0}, "files": [], "dirops_undone": 0, "shrunk": 0}
        # Directory entries first: an undone unlink brings a file (and its image) back.
        for d, ops in list(self.dirops.items()):
            keep = rng.randint(0, len(ops)) if keep_dirops is None else keep_dirops(d, ops)
            for op in reversed(ops[keep:]):
                done["dirops_undone"] += 1
                if op[0] == "create":
                    os.unlink(op[1])
                elif op[0] == "rename":
                    os.rename(op[2], op[1])
                else:
                    _, path, (content, image) = op
                    with open(path, "wb") as f:
                        f.write(content)
                    self.durable[os.stat(path).st_ino] = content if image is None else image
        for path, (now, image) in sorted(self.unsynced().items()):
            out = bytearray(now)
            grown_kept = False
            for p in range(0, max(len(now), len(image)), PAGE_BYTES):
                new, old = now[p:p + PAGE_BYTES], image[p:p + PAGE_BYTES]
                if new == old:
                    continue
                choice = fate(path, p // PAGE_BYTES) if fate else rng.choice(FATES)
                done["pages"][choice] += 1
                if choice == KEEP:
                    grown_kept |= p + len(new) > len(image)
                    continue
                if choice == DROP:
                    page = old + bytes(max(len(new) - len(old), 0))
                else:
                    page = bytes(b if i < len(old) and b == old[i] else 0 for i, b in enumerate(new))
                out[p:p + len(new)] = page[:len(new)]
            if len(out) > len(image) and not grown_kept and (fate is None and rng.random() < 0.5):
                del out[len(image):]   # the file's new size never reached the disk either
                done["shrunk"] += 1
            with open(path, "wb") as f:
                f.write(out)
            done["files"].append(os.path.basename(path))
        self.durable.clear()
        self.dirops.clear()
        return done
