"""Offline inspection and explicit repair of a shard's log (``shardq wal check|repair``).

:func:`check` never writes. :func:`repair` is narrow and explicit: it takes the shard
directory's lock (a running shard holds it, so repair never races a live log); it refuses
without ``force``; it copies every file it changes or removes to ``<dir>/repair-<time>/``
(mode 0700, copies 0600: they hold job bodies) first. Then either:

* a file whose only fault is records over today's size limit, written whole by an earlier
  shardq (their checksums are valid), is rewritten with the same operations in records
  within the limit (temp file, fsync, rename, fsync dir): nothing is lost; or
* a damaged segment is truncated at the last good record and every later segment is moved
  aside (their records came after the damage, and replaying them without what was lost
  could resurrect or reorder jobs). A damaged checkpoint cannot be repaired this way: the
  data it held exists nowhere else.

Damage in a format-3 file, and files missing before the newest one (:mod:`.layout`), are
salvaged instead (``shard/salvage.py``, chosen by :func:`salvage_wanted`); segments missing
only by the last clean stop's record leave nothing to rebuild: the record is dropped.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from dataclasses import dataclass

import msgpack

from ..errors import CorruptLog, DataDirLocked, NewerFormat
from .format import CHECKPOINT, MAGICS, RECORD_BYTES_MAX, SEGMENT, frame_v2, pack_records, parse_name
from .layout import LOG_END, LogEnd, Missing, drop_log_end, holding_end, log_files, missing_files, read_log_end
from .log import _CHECKPOINT_END, decode
from .reader import ZERO_TAIL, FileScan

OK, TORN, CORRUPT, OVERSIZED = "ok", "torn", "corrupt", "oversized"


@dataclass
class FileReport:
    path: str
    records: int
    status: str            # ok | torn | corrupt | oversized
    offset: int | None = None
    reason: str | None = None
    version: int = 0       # the file's format
    last_write: int = 0    # format 3: the last write read
    missing: Missing | None = None  # files replay needs and lacks (``path``: the first one)


def _scan(path: str, kind: str, tail_may_tear: bool, first_write: int = 0, clean_end: int = 0) -> FileReport:
    with open(path, "rb") as f:
        data = f.read()
    scan = FileScan(path, data, kind, tail_may_tear=tail_may_tear, first_write=first_write, clean_end=clean_end)
    report = _outcome(path, data, kind, tail_may_tear, scan)
    report.version, report.last_write = scan.version, scan.last_write
    return report


def _outcome(path: str, data: bytes, kind: str, tail_may_tear: bool, scan: FileScan) -> FileReport:
    last = None
    try:
        for payload in scan:
            try:
                last = decode(payload)
            except Exception as e:  # noqa: BLE001 - whatever the decoder raises, the record is reported corrupt
                return FileReport(path, scan.records, CORRUPT, scan.valid_end, f"undecodable record: {e}")
    except NewerFormat:
        raise  # not damage: nothing here may rewrite it (docs/upgrades.md)
    except CorruptLog as e:
        if scan.version < 3 and _fits_without_limit(path, data, kind, tail_may_tear, scan.clean_end):
            return FileReport(path, scan.records, OVERSIZED, e.offset, e.reason)
        return FileReport(path, scan.records, CORRUPT, e.offset, e.reason)
    if scan.torn is not None:
        if scan.torn.reason == ZERO_TAIL:
            # The newest segment of a running (or killed) shard: preallocated space after
            # the last record. Nothing is lost; replay starts appending there.
            return FileReport(path, scan.records, OK, scan.torn.offset, "preallocated zeros after the last record")
        reason = scan.torn.reason
        if scan.torn.damage is not None:
            reason += f": {scan.torn.damage.describe()}"
        return FileReport(path, scan.records, TORN, scan.torn.offset, reason)
    if kind == CHECKPOINT and not (isinstance(last, list) and last[:1] == [_CHECKPOINT_END]):
        return FileReport(path, scan.records, CORRUPT, scan.valid_end, "checkpoint has no trailer")
    return FileReport(path, scan.records, OK)


def _fits_without_limit(path: str, data: bytes, kind: str, tail_may_tear: bool, clean_end: int = 0) -> bool:
    """True if the file reads clean once records may exceed today's limit."""
    try:
        for payload in FileScan(path, data, kind, tail_may_tear=tail_may_tear, limit=len(data), clean_end=clean_end):
            decode(payload)
    except Exception:  # noqa: BLE001 - any failure means the file does not fit
        return False
    return True


def check(directory: str) -> list[FileReport]:
    """Validate every log file of one shard directory, oldest first, without writing. The
    files replay needs and lacks (layout.py, the rules replay applies) are reported corrupt
    in their place, under the first one's name, at offset 0; as replay does, a log shorter
    than the last clean stop recorded (``log-end.json``) is corrupt."""
    names = os.listdir(directory)
    files = sorted((p, n) for n in names if (p := parse_name(n)))
    segments = [p[0] for p, _ in files if p[1] == SEGMENT]
    newest = segments[-1] if segments else None
    out: list[FileReport] = []
    end = _log_end(directory, out)
    found = log_files(names)
    missing = missing_files(directory, found, end)
    held = holding_end(found, end)
    clean_end = {held.segment: held.bytes} if held is not None else {}  # where its records must reach
    reports: list[tuple[tuple[int, int], FileReport]] = []
    gaps = {m.before: m for m in missing}
    next_write = 0  # format 3: each segment goes on from the previous one's last write
    for (seq, kind), name in files:
        if kind == SEGMENT and seq in gaps:
            next_write = 0  # what came before it is missing: its first write is unknown
        r = _scan(os.path.join(directory, name), kind, kind == SEGMENT and seq == newest,
                  next_write if kind == SEGMENT else 0, clean_end.get(seq, 0) if kind == SEGMENT else 0)
        if kind == SEGMENT:
            next_write = r.last_write + 1 if r.version >= 3 and r.last_write > 0 else 0
        reports.append(((seq, kind == SEGMENT), r))
    for m in missing:
        # Nothing of them is left to read: `repair` rebuilds the log around them (salvage),
        # or, missing only by the clean stop's record, accepts the loss (drops the record).
        reports.append(((m.first, True), FileReport(m.path, 0, CORRUPT, 0, m.reason, missing=m)))
    return out + [r for _, r in sorted(reports, key=lambda x: x[0])]


def _log_end(directory: str, out: list[FileReport]) -> LogEnd | None:
    """The last clean stop's record; None if there is none. A record that does not read
    is reported corrupt in ``out``."""
    try:
        return read_log_end(directory)
    except CorruptLog as e:
        out.append(FileReport(e.path, 0, CORRUPT, 0, e.reason))
        return None


def salvage_wanted(reports: list[FileReport]) -> bool:
    """True if a format-3 file is damaged, or files are missing before the newest one left:
    ``wal repair`` then rebuilds the log from every intact record (shard/salvage.py) instead
    of truncating at the first bad one."""
    return any(r.status in (CORRUPT, TORN) and (r.version >= 3 or (r.missing is not None and not r.missing.clean_end))
               for r in reports)


def _lock(directory: str) -> int:
    fd = os.open(os.path.join(directory, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"{directory} is in use by a running shard; stop the service "
                            "(or wait for the shard to exit) before repairing its log") from None
    return fd


def repair(directory: str, *, force: bool) -> list[str]:
    """Repair the log's bad files, oldest first; returns what was done, line by line."""
    lock_fd = _lock(directory)
    try:
        done: list[str] = []
        backup = os.path.join(directory, f"repair-{time.strftime('%Y%m%d-%H%M%S')}")
        while True:
            reports = check(directory)
            bad = next((r for r in reports if r.status != OK), None)
            if bad is None:
                return done or ["nothing to repair"]
            if bad.missing is not None and not bad.missing.clean_end:
                raise CorruptLog(bad.path, 0, f"{bad.reason}; the log is rebuilt around missing files by the "
                                 "salvage of `shardq wal repair <shard dir> --force` (shardq/shard/salvage.py)")
            if bad.missing is not None or os.path.basename(bad.path) == LOG_END:
                # Segments a clean stop wrote are gone (nothing is left to read or salvage),
                # or its record does not read: accept the log as it is, and say so.
                if not force:
                    raise PermissionError("repair changes the log: it accepts the loss of the segments the last "
                                          "clean stop recorded; pass force=True (--force)")
                if os.path.exists(bad.path):  # the record that does not read
                    os.makedirs(backup, mode=0o700, exist_ok=True)
                    _copy_private(bad.path, backup)
                    what = f"the log is taken as it is; original kept in {backup}"
                else:
                    what = "the jobs only the missing segments held are gone and cannot be named"
                drop_log_end(directory)
                _sync_dir(directory)
                done.append(f"{bad.path}: {bad.reason}; accepted: dropped {LOG_END}, the record of the last clean "
                            f"stop ({what})")
                continue
            if bad.status == CORRUPT and bad.path.endswith(".ckpt"):
                raise CorruptLog(bad.path, bad.offset or 0, f"{bad.reason}; a checkpoint cannot be repaired by "
                                 "truncation: restore the shard directory from a backup")
            if not force:
                raise PermissionError("repair changes the log: it rewrites records over the size limit, or "
                                      "drops every record from the bad one on; pass force=True (--force)")
            os.makedirs(backup, mode=0o700, exist_ok=True)
            _copy_private(bad.path, backup)
            if bad.status == OVERSIZED:
                done.append(_rewrite_in_bounds(bad, directory, backup))
                continue
            later = [r.path for r in reports if r.path > bad.path and r.path.endswith(".wal")]
            with open(bad.path, "r+b") as f:
                f.truncate(max(bad.offset or 0, len(MAGICS[(SEGMENT, 2)])))
                f.flush()
                os.fsync(f.fileno())
            done.append(f"truncated {bad.path} at offset {bad.offset} ({bad.reason}); original kept in {backup}")
            for path in later:
                shutil.move(path, backup)
                done.append(f"moved {path} (written after the damage) to {backup}")
            if drop_log_end(directory):  # the log no longer ends where the last clean stop left it
                done.append(f"dropped {LOG_END}: the log now ends at the cut")
            _sync_dir(directory)
            return done
    finally:
        os.close(lock_fd)


def _copy_private(path: str, backup_dir: str) -> None:
    dst = os.path.join(backup_dir, os.path.basename(path))
    with open(path, "rb") as src:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())


def _rewrite_in_bounds(bad: FileReport, directory: str, backup: str) -> str:
    """Rewrite ``bad.path`` (format 2) with every operation of every record, cut into
    records within the limit. Checkpoint: a new trailer counts the new records."""
    kind = CHECKPOINT if bad.path.endswith(".ckpt") else SEGMENT
    with open(bad.path, "rb") as f:
        data = f.read()
    limit = RECORD_BYTES_MAX[kind]
    pack = msgpack.Packer().pack
    records: list[bytes] = []
    for payload in FileScan(bad.path, data, kind, tail_may_tear=kind == SEGMENT, limit=len(data)):
        ops = decode(payload)
        if kind == CHECKPOINT and ops[:1] == [_CHECKPOINT_END]:
            continue
        records.extend(pack_records(ops, limit, pack=pack))
    if kind == CHECKPOINT:
        records.append(pack([_CHECKPOINT_END, len(records)]))
    tmp = bad.path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(MAGICS[(kind, 2)])  # only files of formats 1 and 2 hold records over the limit
        for r in records:
            out.write(frame_v2(r, kind))
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, bad.path)
    _sync_dir(directory)
    return (f"rewrote {bad.path} in {len(records)} records within the {limit}-byte limit "
            f"({(bad.reason or 'damaged').split(';')[0]}); nothing dropped; original kept in {backup}")


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
