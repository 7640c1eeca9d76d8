"""``shardq verify --disk-faults``: damage to log bytes that were synced before the fault.

A disk can lose or garble data long after it was written and fsynced: a sector that reads
back as zeros, a bit that flips, a page the firmware wrote at the wrong offset. None of it
is a torn write, so none of it may be cut silently: a shard must either replay every
acknowledged job or refuse to start with :class:`~shardq.errors.CorruptLog`.

The kinds (:data:`~.plan.DISK_KINDS`), each applied to one file of a stopped shard:

* ``zero_sector``: one aligned 512-byte sector reads as zeros;
* ``zero_page``: one aligned 4 KiB page reads as zeros;
* ``bit_flip``: one bit of one byte is inverted;
* ``misdirected``: an aligned 4 KiB page of the file is written over another aligned page
  of the same file; half the time (drawn) its own place also keeps zeros, the write never
  having got there (``lost_original``).

The targets (:data:`~.plan.DISK_TARGETS`) and which of their bytes are synced:

* ``newest_segment``: the prefix that the last fsync/fdatasync of the file covered, from
  the WAL's test hook (``SHARDQ_FAULT_SYNC_LOG``: ``<path> <inode> <synced bytes>`` per
  sync; see :mod:`shardq.wal.fileio`). A newest segment without a recorded sync is never
  chosen;
* ``sealed_segment``: the whole file (a segment is truncated to its last record and
  fsynced when it is sealed);
* ``checkpoint``: the whole file (written under a temp name, fsynced, then renamed).

Only bytes before the synced size change: a fault never touches what a power cut could
have taken anyway. A draw that would change nothing (zeros over zeros, a page copied over
an equal one) is drawn again.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

from ..wal.format import parse_name
from .plan import DISK_KINDS
from .powercut import synced_sizes

SECTOR_BYTES = 512
PAGE_BYTES = 4096
#: Fewer synced bytes than this and a file holds little more than its header: not chosen.
SYNCED_BYTES_MIN = {"zero_sector": SECTOR_BYTES, "zero_page": SECTOR_BYTES, "bit_flip": SECTOR_BYTES,
                    "misdirected": PAGE_BYTES + SECTOR_BYTES}
DRAWS_MAX = 64


@dataclass
class Damage:
    """One fault as applied: the byte ranges ``[start, end)`` it changed, in the file
    ``path`` whose first ``synced`` bytes were synced."""

    kind: str
    target: str
    path: str
    synced: int
    ranges: list[tuple[int, int]] = field(default_factory=list)
    bit: int | None = None               # bit_flip: which bit of the byte at ranges[0]
    source: int | None = None            # misdirected: where the page came from
    lost_original: bool = False          # misdirected: its own place reads as zeros

    @property
    def end(self) -> int:
        return max(e for _, e in self.ranges)

    def describe(self) -> str:
        where = ", ".join(f"[{s}, {e})" for s, e in self.ranges)
        extra = ""
        if self.bit is not None:
            extra = f" bit {self.bit}"
        if self.source is not None:
            extra = f" page from {self.source}" + (", its own place zeroed" if self.lost_original else "")
        return f"{self.kind} in {self.target} {os.path.basename(self.path)} at {where}{extra} " \
               f"({self.synced} bytes synced)"


def draw(kind: str, data: bytes, synced: int,
         rng: random.Random) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | None:
    """The writes that make ``kind`` of damage to ``data`` (the file's bytes, of which the
    first ``synced`` were synced): ``[(offset, new bytes)]`` inside ``[0, synced)``, and
    the details (``bit``, ``source``, ``lost_original``). None if no draw changes a byte."""
    synced = min(synced, len(data))
    if kind not in DISK_KINDS:
        raise ValueError(f"unknown disk fault kind {kind!r}")
    if synced < SYNCED_BYTES_MIN[kind]:
        return None
    for _ in range(DRAWS_MAX):
        if kind in ("zero_sector", "zero_page"):
            unit = SECTOR_BYTES if kind == "zero_sector" else PAGE_BYTES
            start = rng.randrange(0, synced, unit)
            end = min(start + unit, synced)
            if data.count(0, start, end) != end - start:
                return [(start, bytes(end - start))], {}
        elif kind == "bit_flip":
            at, bit = rng.randrange(synced), rng.randrange(8)
            return [(at, bytes([data[at] ^ (1 << bit)]))], {"bit": bit}
        else:
            pages = range(0, synced, PAGE_BYTES)
            source, target = rng.sample(pages, 2)
            lost = rng.random() < 0.5
            n = min(PAGE_BYTES, synced - source, synced - target)
            page = data[source:source + n]
            if page != data[target:target + n]:
                writes = [(target, page)]
                if lost and data.count(0, source, source + n) != n:
                    writes.append((source, bytes(n)))
                return writes, {"source": source, "lost_original": len(writes) == 2}
    return None


def apply(path: str, writes: list[tuple[int, bytes]]) -> None:
    """Overwrite bytes of ``path`` in place and fsync it (what a later reader finds)."""
    with open(path, "r+b") as f:
        for offset, data in writes:
            f.seek(offset)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def candidates(shard_dir: str, sizes: dict[int, int]) -> dict[str, list[tuple[str, int]]]:
    """Per target, the files of ``shard_dir`` and how many of their bytes are synced
    (``sizes``: inode -> synced size, from the hook's side file); the newest segment only
    if a sync of it is recorded."""
    out: dict[str, list[tuple[str, int]]] = {"newest_segment": [], "sealed_segment": [], "checkpoint": []}
    try:
        names = os.listdir(shard_dir)
    except FileNotFoundError:
        return out
    logs = sorted((p, n) for n in names if (p := parse_name(n)))
    segments = [n for (_, kind), n in logs if kind == "wal"]
    for (_, kind), name in logs:
        path = os.path.join(shard_dir, name)
        st = os.stat(path)
        if kind == "ckpt":
            out["checkpoint"].append((path, st.st_size))
        elif name != segments[-1]:
            out["sealed_segment"].append((path, st.st_size))
        elif st.st_ino in sizes:
            out["newest_segment"].append((path, min(sizes[st.st_ino], st.st_size)))
    return out


def choose(kind: str, target: str, shard_dirs: list[str], side_file: str,
           rng: random.Random) -> tuple[int, Damage, list[tuple[int, bytes]]] | None:
    """Draw a shard, a file of ``target`` in it and ``kind`` of damage to its synced bytes:
    (shard index, the damage, its writes), or None where no file of ``target`` can take it."""
    sizes = synced_sizes(side_file)
    options = [(i, path, synced) for i, d in enumerate(shard_dirs)
               for path, synced in candidates(d, sizes)[target] if synced >= SYNCED_BYTES_MIN[kind]]
    rng.shuffle(options)
    for shard, path, synced in options:
        with open(path, "rb") as f:
            data = f.read()
        drawn = draw(kind, data, synced, rng)
        if drawn is None:
            continue
        writes, details = drawn
        damage = Damage(kind, target, path, synced, [(o, o + len(b)) for o, b in writes], **details)
        return shard, damage, writes
    return None
