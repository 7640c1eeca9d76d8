"""``shardq backup``: a consistent copy of every shard of a running service.

Steps (docs/backup.md):

1. check DEST (new, or an empty directory nobody else may enter), read the data dir's key
   file, metadata and the scheduler's last ticks. The ticks are read *before* the cuts: a
   tick is enqueued before it is recorded, so every tick they name is in the copy; a later
   one is fired again by the restored service (its dedup id makes a repeat a no-op);
2. ask every shard for its cut at once (``backup_cut``): each drains its commits, syncs,
   and hard-links its checkpoint and segments into ``<shard dir>/backup-<pid>-<hex>/``,
   which compaction cannot take away;
3. copy each shard's files from there, the newest segment only up to its cut, reading
   every record as replay would (a damaged source fails the backup, naming file and
   offset) and hashing it; each copy is fsynced;
4. read the SQS API's catalog, if the data dir has one (:mod:`.sqs_catalog`), *after* the
   cuts: a queue is made before any message is sent to it, so every queue holding a
   message in the copy is in it (unless deleted during the backup), and every change of a
   queue acknowledged before the backup began;
5. remove the staging dirs (also on failure), write the key file (0600), the metadata,
   the ticks and the catalog, then the manifest, last, so a backup that did not finish
   has none.

Producers and workers see one pause per shard (a drain and at most one fdatasync, as
before a compaction), then only the I/O of the copy.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from importlib import metadata
from typing import Any

from ..client.router import Router
from ..clock import Clock, SystemClock
from ..datadir import DataDir
from ..errors import CorruptLog, ProtocolError, ServiceNotRunning, UsageError
from ..protocol.status_file import pid_alive
from ..shard.durable import BACKUP_STAGE
from ..wal.format import SEGMENT, parse_name
from . import sqs_catalog
from .logfiles import LogFile, WriteChain, sha256, sync_dir, write_private
from .manifest import KEY, MANIFEST, META, SCHEDULES, SQS_CATALOG, FileEntry, Manifest, ShardCut

log = logging.getLogger("shardq.backup")


def backup(data_dir: str, dest: str, clock: Clock | None = None) -> Manifest:
    """Copy every shard of the service running on ``data_dir`` into ``dest`` (a new or
    empty directory, created 0700). Returns the manifest written last.

    Guarantee: every enqueue acknowledged before this call began is in the copy; no enqueue
    a shard acknowledged after its cut is (the copy of its log ends exactly at the cut);
    a job acked during the backup may be in it (at-least-once). ServiceNotRunning or
    ShardUnavailable if a shard cannot be asked: a backup holds every shard or nothing.
    The SQS API's catalog, if the data dir has one, is copied as it was after the cuts.
    The manifest's start and end times are ``clock``'s wall readings (the system clock by
    default)."""
    clock = clock or SystemClock()
    dd = DataDir(data_dir)
    shards = dd.shards()
    if dd.service_running() is None:  # never served: no shard would answer, however long we waited
        raise ServiceNotRunning(f"no shardq service has run on {dd.path}: a backup copies a running service")
    dd.require_service()
    key = dd.authkey()  # checked as every client checks it: owner only, no symlink
    with open(os.path.join(dd.path, META), "rb") as f:
        meta = f.read()
    ticks = _read_if_there(os.path.join(dd.path, SCHEDULES))  # before the cuts: see the module docstring
    dest = os.path.abspath(dest)
    created = _prepare(dest)
    stage = f"backup-{os.getpid()}-{secrets.token_hex(4)}"
    _remove_stale_stages(dd, shards)
    started = clock.now()
    try:
        try:
            with Router(dd.path) as router:
                replies = router.backup_cuts(stage)
            cuts = tuple(_copy_shard(dd, dest, stage, reply) for reply in replies)
            catalog = sqs_catalog.snapshot(dd.path)  # after the cuts: see the module docstring
        finally:
            for i in range(shards):
                shutil.rmtree(os.path.join(dd.shard_dir(i), stage), ignore_errors=True)
        files = [_write(dest, KEY, key), _write(dest, META, meta)]
        if ticks is not None:
            files.append(_write(dest, SCHEDULES, ticks))
        if catalog is not None:
            os.mkdir(os.path.join(dest, os.path.dirname(SQS_CATALOG)), 0o700)
            files.append(_write(dest, SQS_CATALOG, catalog))
            sync_dir(os.path.join(dest, os.path.dirname(SQS_CATALOG)))
        manifest = Manifest(_version(), dd.service_id(), dd.path, shards, started, clock.now(), tuple(files), cuts)
        tmp = os.path.join(dest, MANIFEST + ".tmp")
        write_private(tmp, manifest.encode())
        os.rename(tmp, os.path.join(dest, MANIFEST))
        sync_dir(dest)
    except BaseException as e:
        # It was empty or new: a retry finds it so, and nothing half-made looks like a backup.
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        else:
            _empty(dest)
        if isinstance(e, OSError) and _inside(e.filename, dest):
            raise _writing_failed(e, dest, created) from e
        raise
    return manifest


def _inside(path: object, dest: str) -> bool:
    return isinstance(path, str) and (path == dest or path.startswith(dest + os.sep))


def _writing_failed(e: OSError, dest: str, created: bool) -> OSError:
    """A write into ``dest`` that failed (a full disk: ENOSPC), as the same error (class and
    errno) that names the file and ``dest``, and says what became of ``dest``."""
    return OSError(e.errno, f"{e.strerror}: {e.filename}: the backup into {dest} stopped and "
                            + (f"removed {dest}, which it had made" if created else "left it empty, as it was"))


def _prepare(dest: str) -> bool:
    """Check an existing ``dest`` or create it (0700); True if it was created."""
    if os.path.lexists(dest):
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise UsageError(f"{dest} exists and is not a directory")
        if os.listdir(dest):
            raise UsageError(f"{dest} is not empty: a backup goes into a new or empty directory")
        mode = stat.S_IMODE(os.stat(dest).st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"{dest} has mode {mode:04o}: a backup holds job bodies and the key file; "
                             f"run chmod 700 on it")
        return False
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise UsageError(f"{parent}: no such directory")
    os.mkdir(dest, 0o700)
    return True


def _empty(dest: str) -> None:
    for name in os.listdir(dest):
        path = os.path.join(dest, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _remove_stale_stages(dd: DataDir, shards: int) -> None:
    """Staging dirs left by a backup that was killed hold old segments on the disk: remove
    those whose backup process is gone."""
    for i in range(shards):
        shard_dir = dd.shard_dir(i)
        try:
            names = os.listdir(shard_dir)
        except FileNotFoundError:
            continue
        for name in names:
            if BACKUP_STAGE.fullmatch(name) and not pid_alive(int(name.split("-")[1])):
                log.warning("removing %s, left by a backup that did not finish", os.path.join(shard_dir, name))
                shutil.rmtree(os.path.join(shard_dir, name), ignore_errors=True)


def _copy_shard(dd: DataDir, dest: str, stage: str, reply: Any) -> ShardCut:
    """Copy one shard's staged files into ``dest/shard-<i>/``, the newest up to the cut."""
    try:
        shard, files = int(reply["shard"]), [(str(n), int(b)) for n, b in reply["files"]]
        segment, offset, write = str(reply["segment"]), int(reply["offset"]), int(reply["write"])
        when, job_seq = float(reply["time"]), int(reply["job_seq"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"backup_cut: a reply without {e}: {reply!r:.200}") from None
    if not files or files[-1] != (segment, offset) or any(parse_name(n) is None for n, _ in files):
        raise ProtocolError(f"backup_cut: shard {shard} staged {files!r:.200}, its cut is {segment} at {offset}")
    under = f"shard-{shard}"
    out = os.path.join(dest, under)
    os.mkdir(out, 0o700)
    chain, entries = WriteChain(), []
    for name, size in files:
        source = os.path.join(dd.shard_dir(shard), name)  # named in errors: the file that is damaged
        with open(os.path.join(dd.shard_dir(shard), stage, name), "rb") as f:
            data = f.read(size)
        if len(data) != size:
            raise CorruptLog(source, len(data), f"{size} bytes at the cut, {len(data)} now: cut shorter since "
                             "(a repair, or a torn tail cut at a restart during the backup)")
        kind = parse_name(name)[1]  # type: ignore[index]  # checked above
        lf = LogFile(source, data, kind, chain)
        lf.check()
        write_private(os.path.join(out, name), data)
        entries.append(FileEntry(f"{under}/{name}", size, sha256(data), lf.version, lf.records_read))
    if parse_name(segment)[1] != SEGMENT or chain.next_write - 1 != write:  # type: ignore[index]  # a segment's name, parsed when listed
        raise CorruptLog(os.path.join(dd.shard_dir(shard), segment), offset,
                         f"the copy ends at write {chain.next_write - 1}, the shard's cut at write {write}")
    sync_dir(out)
    return ShardCut(shard, when, segment, offset, write, job_seq, tuple(entries))


def _read_if_there(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write(dest: str, name: str, data: bytes) -> FileEntry:
    write_private(os.path.join(dest, name), data)
    return FileEntry(name, len(data), sha256(data))


def _version() -> str:
    try:
        return metadata.version("shardq")
    except metadata.PackageNotFoundError:
        return "unknown"
