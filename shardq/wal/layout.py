"""The files of a shard's log directory: which ones replay reads, and which it needs but lacks.

One copy of the rules, applied by :meth:`~shardq.wal.log.Log.replay` (a missing file
refuses the start), ``shardq wal check`` (each run of missing files is reported ``corrupt``
under the first one's name, at offset 0) and ``shardq wal repair`` (shard/salvage.py
rebuilds the log from the files left, naming what the missing ones held):

* replay reads the newest checkpoint ``N.ckpt`` and the segments from ``N.wal`` on, else
  (no checkpoint) every segment from ``0000000000000001.wal`` on; older checkpoints and
  segments before ``N`` are what the checkpoint replaced (a crash during compaction left them);
* segments are numbered without gaps, and the first is the checkpoint's own number (a
  compaction creates segment ``N`` before checkpoint ``N``, so a checkpoint is never
  without it), else 1;
* after a clean stop (``log-end.json``, :class:`LogEnd`) they reach at least the segment it
  recorded, unless the record is stale (older than the checkpoint: compacted since by a
  shardq that does not keep it) or no log file is left at all (a new log: ``wal repair``'s
  salvage rebuilds one so).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CorruptLog
from .fileio import Files, SlowDiskFiles
from .format import CHECKPOINT, SEGMENT, checkpoint_name, parse_name, segment_name

#: The record of where a clean close left the log (:class:`LogEnd`), in the shard directory.
LOG_END = "log-end.json"
_LOG_END_FORMAT = 1
_RECOVERY = "docs/design.md, \"Recovery\""


@dataclass(frozen=True)
class LogEnd:
    """Where a clean close left the log: the newest segment's number, the length of that
    segment (the end of its last record, the close's sync mark; everything before it synced)
    and the number of its last write."""

    segment: int
    bytes: int
    write: int

    def describe(self) -> str:
        return (f"the last clean stop left the log ending in {segment_name(self.segment)} at offset {self.bytes} "
                f"(write {self.write}; recorded in {LOG_END})")


def read_log_end(directory: str, files: Files | SlowDiskFiles | None = None) -> LogEnd | None:
    """The record of the last clean close in ``directory``; None if there is none (a log
    that a crash stopped, a new one, or one written before this record existed). A record
    that does not read is :class:`CorruptLog`: it is written whole (temporary file, fsync,
    rename), so only damage makes it so, and the log's end is then unknown."""
    path = os.path.join(directory, LOG_END)
    try:
        raw = (files or Files()).read(path)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
        end = LogEnd(d["segment"], d["bytes"], d["write"])
        if d["format"] != _LOG_END_FORMAT or not all(type(v) is int and v >= 0 for v in (end.segment, end.bytes,
                                                                                        end.write)):
            raise ValueError(f"unexpected values {d!r:.200}")
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptLog(path, 0, f"not a record of a clean stop ({type(e).__name__}: {e}); the log's end "
                         "is unknown: `shardq wal repair <shard dir> --force` drops it") from None
    return end


def write_log_end(directory: str, end: LogEnd, files: Files | SlowDiskFiles | None = None) -> None:
    """Write the record whole: a crash leaves none or this one."""
    files = files or Files()
    path = os.path.join(directory, LOG_END)
    tmp = path + ".tmp"
    fd = files.create(tmp)
    try:
        files.write(fd, json.dumps({"format": _LOG_END_FORMAT, "segment": end.segment, "bytes": end.bytes,
                                    "write": end.write}).encode())
        files.fsync(fd)
    finally:
        files.close(fd)
    files.rename(tmp, path)
    files.sync_dir(directory)


def drop_log_end(directory: str, files: Files | SlowDiskFiles | None = None) -> bool:
    """Delete the record (the log is about to change, or was rebuilt); True if there was one.
    Durable once the directory is fsynced (the caller's)."""
    try:
        (files or Files()).unlink(os.path.join(directory, LOG_END))
    except FileNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class LogFiles:
    """The log files of one shard directory as replay takes them."""

    checkpoint: int | None   # the newest checkpoint's number
    segments: list[int]      # the segments replay reads, oldest first: from the checkpoint's number on
    replaced: list[str]      # the names of the older checkpoints and segments the newest checkpoint replaces

    @property
    def empty(self) -> bool:
        """No log file at all: a new log."""
        return self.checkpoint is None and not self.segments


def log_files(names: Iterable[str]) -> LogFiles:
    """Sort a directory's names into the files replay reads and those the checkpoint replaced."""
    entries = [p for n in names if (p := parse_name(n))]
    checkpoints = sorted(seq for seq, kind in entries if kind == CHECKPOINT)
    segments = sorted(seq for seq, kind in entries if kind == SEGMENT)
    base = checkpoints[-1] if checkpoints else None
    replaced: list[str] = []
    if base is not None:
        replaced = [checkpoint_name(s) for s in checkpoints[:-1]] + [segment_name(s) for s in segments if s < base]
        segments = [s for s in segments if s >= base]
    return LogFiles(base, segments, replaced)


@dataclass(frozen=True)
class Missing:
    """Segments ``first``..``last`` that replay needs and lacks. ``before``: the segment
    that follows them, None if none does. ``clean_end``: they are missing only by the last
    clean stop's record (they were the newest), so accepting the log as it is (dropping the
    record) is all a repair can do; otherwise the log is rebuilt from the files around them."""

    path: str        # the first one's: the name CorruptLog and `wal check` give
    first: int
    last: int
    before: int | None
    clean_end: bool
    what: str        # which files, and how replay knows they are missing
    remedy: str      # what they held, and what to do

    @property
    def reason(self) -> str:
        return f"{self.what}; {self.remedy}"

    def error(self) -> CorruptLog:
        return CorruptLog(self.path, 0, self.reason)


def holding_end(files: LogFiles, end: LogEnd | None) -> LogEnd | None:
    """``end`` if the clean stop's record holds this log to it; None if there is none, if it
    is stale (older than the checkpoint: the log went on and was compacted since, by a shardq
    that does not keep the record) or if no log file is left (a new log)."""
    if end is None or files.empty or (files.checkpoint is not None and end.segment < files.checkpoint):
        return None
    return end


def missing_files(directory: str, files: LogFiles, end: LogEnd | None) -> list[Missing]:
    """Every run of segments that replay needs and ``directory`` lacks, oldest first (the
    rules: the module docstring). Replay refuses the first; ``wal check`` reports each."""
    base, have = files.checkpoint, files.segments
    if files.empty:
        return []  # a new log (with a record of a clean stop: repair's salvage rebuilds a log so)
    end = holding_end(files, end)
    out: list[Missing] = []
    expected = base if base is not None else 1
    prev: int | None = None
    for seq in have:
        if seq > expected:
            out.append(_run(directory, expected, seq - 1, seq, prev, base, end, clean_end=False))
        prev, expected = seq, seq + 1
    # After the newest one left: the segments up to the one the clean stop recorded; with
    # no segment left, the checkpoint's own (its compaction created it first).
    last = end.segment if end is not None else (base if base is not None and not have else 0)
    if last >= expected:
        out.append(_run(directory, expected, last, None, prev, base, end, clean_end=bool(have)))
    return out


def _run(directory: str, first: int, last: int, before: int | None, prev: int | None, base: int | None,
         end: LogEnd | None, *, clean_end: bool) -> Missing:
    one = first == last
    gone = f"{segment_name(first)} is" if one else f"segments {segment_name(first)}..{segment_name(last)} are"
    held = f"every job only {'it' if one else 'they'} held is gone"
    remedy = (f"{held}: restore the shard directory from a backup, or `shardq wal repair <shard dir> --force` "
              f"rebuilds the log from the files left and names the jobs lost ({_RECOVERY})")
    if clean_end and end is not None and prev is not None:
        what = f"segment missing: {end.describe()}, and the newest segment is {segment_name(prev)}: {gone} gone"
        remedy = f"{held} ({_RECOVERY})"
    elif prev is not None and before is not None:
        what = f"segment missing between {segment_name(prev)} and {segment_name(before)}: {gone} missing"
    elif base is not None:
        after = f"the oldest segment after it is {segment_name(before)}" if before is not None else "no segment is left"
        clean = f" ({end.describe()})" if end is not None else ""
        what = (f"segment missing after the checkpoint {checkpoint_name(base)}, which starts at {segment_name(base)}: "
                f"{after}{clean}: {gone} missing")
    else:  # no checkpoint: replay starts at 1; or a checkpoint that replaced them is missing
        oldest = segment_name(before if before is not None else last + 1)
        which = segment_name(1) if one else f"{segment_name(1)}..{segment_name(last)}"
        what = (f"no checkpoint and the oldest segment is {oldest}: earlier segments are missing ({which}, or a "
                f"checkpoint that replaced {'it' if one else 'them'}, such as {checkpoint_name(last + 1)})")
    return Missing(os.path.join(directory, segment_name(first)), first, last, before, clean_end, what, remedy)
