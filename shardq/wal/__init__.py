"""Write-ahead log: framed, checksummed, segmented, fsynced; see ``docs/design.md``.

* :mod:`.format` -- the byte layout of segments, checkpoints and records.
* :mod:`.fileio` -- the file-system calls the log makes, in one replaceable object
  (tests substitute one that injects ENOSPC/EIO).
* :mod:`.reader` -- scans a file into payloads; clean end, torn tail or CorruptLog.
* :mod:`.writer` -- appends records with one fsync per commit; rotates segments.
* :mod:`.layout` -- which files replay reads and which it lacks (one copy of the rules, for
  replay and ``shardq wal check``); the record of a clean stop (``log-end.json``).
* :mod:`.log` -- a shard's directory: replay (checkpoint + segments), commit, compaction.
* :mod:`.repair` -- explicit, offline truncation of a damaged log (``shardq wal repair``).
"""
from .log import Log, ReplayStats
from .reader import TornTail

__all__ = ["Log", "ReplayStats", "TornTail"]
