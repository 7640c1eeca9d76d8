"""Offline inspection and explicit repair of a shard's log (``shardq wal check|repair``).

:func:`check` never writes. :func:`repair` is narrow and explicit: it refuses without
``force``; it copies every file it changes or removes to ``<dir>/repair-<time>/`` first;
it truncates the damaged file at the last good record and moves every later segment
aside (their records came after the damage, and replaying them without what was lost
could resurrect or reorder jobs), then fsyncs. A damaged checkpoint cannot be repaired
this way: the data it held exists nowhere else.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from ..errors import CorruptLog
from .format import CHECKPOINT_MAGIC, SEGMENT_MAGIC, parse_name
from .log import _CHECKPOINT_END, decode
from .reader import ZERO_TAIL, FileScan


@dataclass
class FileReport:
    path: str
    records: int
    status: str            # ok | torn | corrupt
    offset: int | None = None
    reason: str | None = None


def _scan(path: str, magic: bytes, tail_may_tear: bool) -> FileReport:
    with open(path, "rb") as f:
        data = f.read()
    scan = FileScan(path, data, magic, tail_may_tear=tail_may_tear)
    last = None
    try:
        for payload in scan:
            try:
                last = decode(payload)
            except Exception as e:
                return FileReport(path, scan.records, "corrupt", scan.valid_end, f"undecodable record: {e}")
    except CorruptLog as e:
        return FileReport(path, scan.records, "corrupt", e.offset, e.reason)
    if scan.torn is not None:
        if scan.torn.reason == ZERO_TAIL:
            # The newest segment of a running (or killed) shard: preallocated space after
            # the last record. Nothing is lost; replay cuts it off.
            return FileReport(path, scan.records, "ok", scan.torn.offset, "preallocated zeros after the last record")
        return FileReport(path, scan.records, "torn", scan.torn.offset, scan.torn.reason)
    if magic == CHECKPOINT_MAGIC and not (isinstance(last, list) and last[:1] == [_CHECKPOINT_END]):
        return FileReport(path, scan.records, "corrupt", scan.valid_end, "checkpoint has no trailer")
    return FileReport(path, scan.records, "ok")


def check(directory: str) -> list[FileReport]:
    """Validate every log file of one shard directory, oldest first, without writing."""
    files = sorted((p, n) for n in os.listdir(directory) if (p := parse_name(n)))
    segments = [p[0] for p, _ in files if p[1] == "wal"]
    newest = segments[-1] if segments else None
    out = []
    for (seq, kind), name in files:
        path = os.path.join(directory, name)
        if kind == "ckpt":
            out.append(_scan(path, CHECKPOINT_MAGIC, False))
        else:
            out.append(_scan(path, SEGMENT_MAGIC, seq == newest))
    return out


def repair(directory: str, *, force: bool) -> list[str]:
    """Truncate the log at its first bad record; returns what was done, line by line."""
    reports = check(directory)
    bad = next((r for r in reports if r.status != "ok"), None)
    if bad is None:
        return ["nothing to repair"]
    if bad.path.endswith(".ckpt"):
        raise CorruptLog(bad.path, bad.offset or 0, f"{bad.reason}; a checkpoint cannot be repaired by "
                         "truncation: restore the shard directory from a backup")
    if not force:
        raise PermissionError("repair drops every record from the bad one on; pass force=True (--force)")
    backup = os.path.join(directory, f"repair-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(backup, exist_ok=True)
    done = []
    later = [r.path for r in reports if r.path > bad.path and r.path.endswith(".wal")]
    shutil.copy2(bad.path, backup)
    with open(bad.path, "r+b") as f:
        f.truncate(max(bad.offset or 0, len(SEGMENT_MAGIC)))
        f.flush()
        os.fsync(f.fileno())
    done.append(f"truncated {bad.path} at offset {bad.offset} ({bad.reason}); original kept in {backup}")
    for path in later:
        shutil.move(path, backup)
        done.append(f"moved {path} (written after the damage) to {backup}")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return done
