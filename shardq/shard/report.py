"""What a shard process tells its supervisor: one line at a time on its stdout pipe.

The supervisor (:mod:`shardq.service.supervisor`) reads these lines; everything meant for
a person goes to the shard's log (stderr) instead.

* ``progress <phase> <count>`` -- busy with something long, not hung: ``replay`` (at start;
  ``count``: records replayed and bytes read so far) or ``compact`` (``count``: checkpoint
  bytes written). Sent every ``interval`` seconds while the phase lasts, by a thread of its
  own, so neither the supervisor's start timeout nor its health check (whose pings the
  shard loop cannot answer while it compacts) kills a shard that is working. Also
  ``progress disk <bytes written>``, from :meth:`SupervisorPipe.watch_disk`, while one
  call to the disk (a write or an fsync, on the loop or the committer thread) has lasted
  longer than half an interval: a commit waits for a slow disk, and a ping's reply waits
  for that commit. Killing the shard would not make the disk faster, and its restart
  would replay on the same disk. A stopped process (SIGSTOP) or a deadlocked loop outside
  these phases still sends nothing.
* ``ready <pid> <records> <seconds> <jobs>`` -- replayed and listening.
* ``pong <jobs> <ready>`` -- the answer to a health ping, with the jobs the shard holds
  (every job not yet acked, dead letters included) and those ready to lease: the queue
  depth that ``serve`` reports to systemd (``STATUS=``). A bare ``pong`` is read too.
* ``reloaded`` -- took the queue settings of :data:`RELOAD_FILE` (see below).
* ``corrupt {"path", "offset", "reason"}`` -- refused to start: a corrupt log. Not retried.
* ``failed {"kind", "detail", "path"}`` -- why the shard is about to exit: ``disk_full``, a
  log write found no space (ENOSPC, EDQUOT; reported by :class:`ReportingFiles` as it
  happens, before the failed commit ends the process without a reply), or ``io_error``, the
  log could not be opened, or the start's own record written, at start. The supervisor
  restarts it with backoff until it works. A compaction that finds no space is no reason
  to exit (the shard puts it off and goes on: :meth:`ReportingFiles.expecting_no_space`),
  so it sends no such line.

The other way, the supervisor writes single bytes on the shard's stdin pipe, which the
shard's loop reads between iterations: :data:`PING` (answer with ``pong``) and
:data:`RELOAD` (take the queue settings of ``<data>/run/``:data:`RELOAD_FILE`, written by
the supervisor just before, then answer ``reloaded``; see :mod:`shardq.service.reload`).
A byte, not the settings: a pipe write of a few bytes never blocks the supervisor, and a
shard that is starting finds it waiting when its loop begins.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator
from typing import Any, TextIO, TypeVar

from ..clock import Clock, SystemClock
from ..wal.fileio import Files, files_from_env

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: The longest line, newline excluded, a shard writes and its supervisor reads. The
#: supervisor holds at most this much of an unfinished line per shard and drops a longer one
#: (logged), so the only lines that can be long (``corrupt`` and ``failed``, which carry an
#: error's text) are cut to fit here, where they are written.
LINE_BYTES_MAX = 64 * 1024
PING = b"p"
RELOAD = b"c"
RELOAD_FILE = "config.json"

T = TypeVar("T")


def fitted(word: str, fields: dict[str, object], text_key: str, text: str) -> str:
    """``<word> <JSON of fields and text>``, at most :data:`LINE_BYTES_MAX` bytes: ``text``
    is cut (marked ``[cut]``) if the whole would be longer; the other fields are short."""
    line = f"{word} {json.dumps({**fields, text_key: text})}"
    # json.dumps writes ASCII, so characters are bytes; each character cut from the text
    # takes at least one byte off its JSON form.
    excess = len(line) - LINE_BYTES_MAX
    if excess > 0:
        text = text[:max(len(text) - excess - len(" [cut]"), 0)] + " [cut]"
        line = f"{word} {json.dumps({**fields, text_key: text})}"
    return line


class SupervisorPipe:
    """The shard's end of the pipe; safe to use from any thread (one lock, whole lines)."""

    def __init__(self, out: TextIO | None = None, interval_s: float = 1.0):
        self.out = out or sys.stdout
        self.interval_s = max(interval_s, 0.02)
        self._lock = threading.Lock()
        self._phases = 0  # busy() blocks running: they report for the disk calls in them too

    def _line(self, text: str) -> None:
        with self._lock:
            try:
                self.out.write(text + "\n")
                self.out.flush()
            except (OSError, ValueError):
                pass  # the supervisor is gone; PDEATHSIG ends us next

    def pong(self, jobs: int, ready: int, workflows: int = 0) -> None:
        """The answer to a health ping (a byte on stdin), from the loop's own thread, with
        the jobs held and ready (the queue depth) and the running workflow records (the
        service's watcher looks at a shard only while it holds some)."""
        self._line(f"pong {jobs} {ready} {workflows}")

    def reloaded(self) -> None:
        """The queue settings of :data:`RELOAD_FILE` are in force."""
        self._line("reloaded")

    def ready(self, records: int, seconds: float, jobs: int) -> None:
        self._line(f"ready {os.getpid()} {records} {seconds:.6f} {jobs}")

    def corrupt(self, path: str, offset: int, reason: str) -> None:
        self._line(fitted("corrupt", {"path": path, "offset": offset}, "reason", reason))

    def failed(self, kind: str, detail: str, path: str | None) -> None:
        """Why the shard is about to exit: ``disk_full`` or ``io_error``."""
        self._line(fitted("failed", {"kind": kind, "path": path}, "detail", detail))

    @contextmanager
    def busy(self, phase: str, count: Callable[[], int]) -> Iterator[None]:
        """Report ``progress <phase> <count()>`` now and every ``interval_s`` until the block ends."""
        done = threading.Event()

        def beat() -> None:
            while True:
                self._line(f"progress {phase} {count()}")
                if done.wait(self.interval_s):
                    return

        t = threading.Thread(target=beat, name=f"shardq-progress-{phase}", daemon=True)
        t.start()
        self._phases += 1
        try:
            yield
        finally:
            self._phases -= 1
            done.set()
            t.join()

    def watch_disk(self, files: ReportingFiles) -> None:
        """From now on, for the life of the process, report ``progress disk`` every
        ``interval_s`` while a call of ``files`` to the disk has lasted longer than
        ``interval_s / 2``, unless a :meth:`busy` phase reports meanwhile (one phase at a
        time: the supervisor times each phase from its first line)."""
        half = self.interval_s / 2

        def watch() -> None:
            while True:
                time.sleep(half)  # a period, not synchronisation: it samples disk_call_since
                since = files.disk_call_since
                if since is not None and not self._phases and files.monotonic() - since > half:
                    self._line(f"progress disk {files.bytes_written}")
                    time.sleep(half)  # one line per interval is enough

        threading.Thread(target=watch, name="shardq-disk-watch", daemon=True).start()


class ReportingFiles:
    """The log's file calls, counting bytes (progress) and telling the supervisor when a
    write finds the disk full, before the error goes on to fail the commit (which ends the
    process without a reply). Errors are re-raised unchanged. Every call goes on to
    ``inner`` (default: what the environment selects, so the WAL's test hook for power
    cuts, :class:`~shardq.wal.fileio.SyncLoggingFiles`, still sees every sync).

    ``disk_call_since`` is the monotonic time the oldest write or sync now in progress
    began (None between calls): :meth:`SupervisorPipe.watch_disk` reads it. A write and a
    sync may run at once (the shard loop appends while its committer thread syncs), so each
    kind keeps its own start."""

    def __init__(self, pipe: SupervisorPipe, inner: Files | None = None, clock: Clock | None = None):
        self.pipe = pipe
        self.monotonic = (clock or SystemClock()).monotonic  # when each disk call began
        self.inner = inner if inner is not None else files_from_env()
        self.bytes_written = 0
        self.bytes_read = 0
        self._write_since: float | None = None
        self._sync_since: float | None = None  # also the rarer calls, never beside another
        self._quiet = 0  # expecting_no_space() blocks running

    @contextmanager
    def expecting_no_space(self) -> Iterator[None]:
        """While the block runs, a call that finds no space is not reported: what it is
        part of (a compaction: DurableShard.compact) gives up and the shard goes on, so it
        is no reason to exit. For the loop's own thread, while no commit runs beside it."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    @property
    def disk_call_since(self) -> float | None:
        w, s = self._write_since, self._sync_since
        return s if w is None else w if s is None else min(w, s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the calls not counted here

    def _call(self, fn: Callable[..., T], *args: object, fd: int | None = None, path: str | None = None) -> T:
        try:
            return fn(*args)
        except OSError as e:
            if e.errno in NO_SPACE:
                self._report_no_space(e, fd, path)
            raise

    def _report_no_space(self, e: OSError, fd: int | None, path: str | None) -> None:
        if self._quiet:
            return
        if path is None and fd is not None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = None
        code = e.errno if e.errno is None else errno.errorcode.get(e.errno, e.errno)  # its name if known
        self.pipe.failed("disk_full", f"{e.strerror or e} ({code})", path)

    def create(self, path: str) -> int:
        fd: int = self._call(self.inner.create, path, path=path)  # typed: a SlowDiskFiles inner gives Any
        return fd

    # write, datasync and write_sync run on every commit: _call's work written out, one call less.
    def write(self, fd: int, data: bytes) -> None:
        self._write_since = self.monotonic()
        try:
            self.inner.write(fd, data)
        except OSError as e:
            if e.errno in NO_SPACE:
                self._report_no_space(e, fd, None)
            raise
        finally:
            self._write_since = None
        self.bytes_written += len(data)

    def datasync(self, fd: int) -> None:
        self._sync_since = self.monotonic()
        try:
            self.inner.datasync(fd)
        except OSError as e:
            if e.errno in NO_SPACE:
                self._report_no_space(e, fd, None)
            raise
        finally:
            self._sync_since = None

    def write_sync(self, fd: int, data: bytes) -> None:
        """:meth:`write` and :meth:`datasync` in one call (a synced commit), timed as one
        disk call."""
        self._write_since = self.monotonic()
        try:
            self.inner.write_sync(fd, data)
        except OSError as e:
            if e.errno in NO_SPACE:
                self._report_no_space(e, fd, None)
            raise
        finally:
            self._write_since = None
        self.bytes_written += len(data)

    def fsync(self, fd: int) -> None:
        self._timed(self.inner.fsync, fd, fd=fd)

    def allocate(self, fd: int, size: int) -> OSError | None:
        failed: OSError | None = self._timed(self.inner.allocate, fd, size, fd=fd)  # typed, likewise
        return failed

    def truncate(self, path: str, size: int) -> None:
        self._timed(self.inner.truncate, path, size, path=path)

    def sync_dir(self, path: str) -> None:
        self._timed(self.inner.sync_dir, path, path=path)

    def _timed(self, fn: Callable[..., T], *args: object, fd: int | None = None, path: str | None = None) -> T:
        self._sync_since = self.monotonic()
        try:
            return self._call(fn, *args, fd=fd, path=path)
        finally:
            self._sync_since = None

    def read(self, path: str) -> bytes:
        data = self.inner.read(path)
        self.bytes_read += len(data)
        return data
