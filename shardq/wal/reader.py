"""Scan one log file into record payloads.

Three outcomes, each typed (as in etcd's decoder):

* clean end: every byte after the magic is a valid record, up to the end of the file or a
  run of zeros to its end (the newest segment's preallocated space);
* torn tail (:class:`TornTail`): the *newest* segment ends in bytes that a crash during its
  last, never-synced writes explains. :class:`~shardq.wal.log.Log` cuts it off, keeps it,
  and says what it held;
* :class:`~shardq.errors.CorruptLog` with file and offset: anything else. Never dropped.

**Format 3: damage is refused unless it is proven unsynced.** Each record carries the
number of its write and the highest write whose fdatasync had returned when it was issued
(:mod:`.format`). When bytes fail to read at offset X, the reader finds every intact record
after them. The damaged bytes belong to write ``d`` or later, where ``d`` is the write
after the last intact record before X when that record ended its write, else that record's
own. If an intact record after X says write ``d`` was synced, the damage is in synced data:
``CorruptLog`` naming the damaged range, the intact records after it and the record that
proves it. Only when no intact record vouches for write ``d`` is it torn: the bytes of the
writes in flight at a crash, which no reader can tell from damage to them
(docs/design.md, "Damage and torn writes": an idle shard writes a sync mark so that this
window closes once the log is quiet).

Formats 1 and 2 lack that information: their newest segment keeps the earlier rule (a bad
record with zeros after it, or with an all-zero disk sector, is taken for a torn write:
etcd's ``isTornEntry``). A segment of those formats is sealed at the next start, so the
rule applies only to logs written by earlier versions, once.

Lengths are checked against the limit and against the bytes left before anything is
allocated for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

from ..errors import CorruptLog, NewerFormat
from .format import (FORMAT, SEGMENT, HEADERS, LAST_IN_WRITE, MAGIC_BYTES, MAGICS, RECORD_BYTES_MAX, RECORD_MARK,
                     SECTOR_BYTES, SYNC_MARK, crc32, header_crc)


@dataclass(frozen=True)
class Intact:
    """A record that reads whole (format 3): where it is and which write it belongs to."""

    offset: int
    end: int
    write: int
    synced: int
    flags: int


@dataclass(frozen=True)
class Damage:
    """Bytes of a format-3 file that do not read, and what the reader knows around them.

    ``start``..``end``: the damaged range (``end``: the first intact record after it, or the
    end of the data); ``write``: the first write the damaged bytes can belong to;
    ``after``: every intact record after the range; ``proof``: the first of them issued
    after write ``write`` was synced (None: nothing proves it was)."""

    start: int
    end: int
    write: int
    after: tuple[Intact, ...]
    proof: Intact | None

    def describe(self) -> str:
        if self.start == self.end and self.after:
            out = (f"the record at offset {self.start} reads whole but is write {self.after[0].write}, "
                   f"not the write {self.write} due there")
        else:
            out = f"bytes {self.start}..{self.end} do not read (write {self.write} or later)"
        if self.after:
            a, b = self.after[0], self.after[-1]
            out += (f"; {len(self.after)} intact records after them, at offsets {a.offset}..{b.offset} "
                    f"(writes {a.write}..{b.write})")
        else:
            out += "; no intact record after them"
        if self.proof is not None:
            out += (f"; the record at offset {self.proof.offset} was written after write "
                    f"{self.proof.synced} was fsynced, so these bytes were synced: damage on the disk, "
                    "not a torn write")
        return out


@dataclass(frozen=True)
class TornTail:
    """Where a torn tail starts, how many bytes it has, and why it is torn. ``damage``:
    what a format-3 reader found (None for formats 1 and 2, and for a plain zero tail)."""

    path: str
    offset: int
    dropped_bytes: int
    reason: str
    damage: Damage | None = None

    @property
    def zeros_only(self) -> bool:
        return self.reason == ZERO_TAIL


#: Why a tail of zeros ends the newest segment: its preallocated space, or a write whose
#: data never reached the disk. Either way nothing acknowledged is in it.
ZERO_TAIL = "zero-filled tail"


_H3 = HEADERS[3]
_HB3 = _H3.size


def _zeros(view: memoryview) -> bool:
    return view.tobytes().count(0) == len(view)


def lost_sector(data: bytes, start: int, end: int) -> bool:
    """True if a disk sector that overlaps ``[start, end)`` reads as zeros from where the
    record starts (or the sector starts) to where the sector ends (or the file ends): what a
    lost page of an unsynced write leaves. Stricter than etcd, which also counts a partial
    sector at the record's end (a body ending in zeros would then look torn)."""
    n = len(data)
    s = start - start % SECTOR_BYTES
    while s < min(end, n):
        lo, hi = max(start, s), min(s + SECTOR_BYTES, n)
        if hi > lo and data.count(0, lo, hi) == hi - lo:
            return True
        s += SECTOR_BYTES
    return False


class FileScan:
    """Iterate the payloads of ``data`` (the whole file of kind ``kind``: "wal" or "ckpt").
    After iteration ``valid_end`` is the offset just past the last good record, ``torn``
    says whether a tail was torn and ``version`` is the file's format.

    ``tail_may_tear`` is True only for the newest segment: elsewhere a bad record is
    corruption, because later data was written (and synced) after it. ``limit`` overrides
    the kind's record limit (only ``wal repair`` does, to rewrite records of earlier
    versions that exceeded it). ``clean_end``: where the last clean stop recorded this
    file's records ending (:class:`~shardq.wal.log.LogEnd`; 0: nothing recorded). Every
    byte before it was synced then, so bytes there that do not read, or a file that ends
    before it, are :class:`CorruptLog`, never a torn tail.
    """

    def __init__(self, path: str, data: bytes, kind: str, *, tail_may_tear: bool, limit: int | None = None,
                 first_write: int = 0, clean_end: int = 0):
        self.path = path
        self.data = data
        self.kind = kind
        self.tail_may_tear = tail_may_tear
        self.clean_end = clean_end
        self.limit = RECORD_BYTES_MAX[kind] if limit is None else limit
        self.valid_end = 0
        self.records = 0
        self.version = 0
        self.torn: TornTail | None = None
        self.damage: Damage | None = None
        self.held: list[memoryview] = []
        #: format 3: the write that the first record of this file starts or continues
        #: (set by the caller from the previous file), and the last write read.
        self.first_write = first_write
        self.last_write = first_write - 1

    def _torn(self, offset: int, reason: str, damage: Damage | None = None) -> None:
        if not self.tail_may_tear:
            raise CorruptLog(self.path, offset, reason)
        if offset < self.clean_end:
            raise CorruptLog(self.path, offset, f"{reason}; {self._cleanly_stopped()}")
        self.torn = TornTail(self.path, offset, len(self.data) - offset, reason, damage)

    def _cleanly_stopped(self) -> str:
        return (f"the last clean stop recorded this file's records ending at offset {self.clean_end}: every byte "
                "before it was synced then, so this is a loss or damage since, not a torn write")

    def _check_clean_end(self) -> None:
        """After a clean end of the data: it must reach where the last clean stop left it."""
        if self.valid_end < self.clean_end:
            if self.version >= 3 and self.damage is None:
                self.damage = Damage(self.valid_end, self.valid_end, self.last_write + 1, (), None)
            raise CorruptLog(self.path, self.valid_end, f"the records end at offset {self.valid_end} (the file is "
                             f"{len(self.data)} bytes); {self._cleanly_stopped()}: "
                             f"{self.clean_end - self.valid_end} bytes are missing")

    def _magic(self, view: memoryview) -> bool:
        """Set ``version``; False if the file is a torn (never acknowledged) creation."""
        data, n = self.data, len(self.data)
        head = bytes(data[:MAGIC_BYTES])
        for (kind, version), magic in MAGICS.items():
            if kind == self.kind and head == magic:
                self.version = version
                return True
        mine = [m for (k, _), m in MAGICS.items() if k == self.kind]
        if n >= MAGIC_BYTES and head[:-1] == mine[0][:-1] and head[-1] > FORMAT:
            # Our magic with a later format number: a newer shardq wrote it. Refused before any
            # check of damage, so that wal repair never takes it for a damaged file.
            raise NewerFormat(self.path, 0, f"written by a newer shardq (log format {head[-1]}; this "
                                            f"version reads formats 1 to {FORMAT}): upgrade shardq or restore a "
                                            f"backup (docs/upgrades.md); do not repair it")
        if n < MAGIC_BYTES and any(m.startswith(head) for m in mine) or _zeros(view):
            # A crash while the file was being created: nothing was ever acknowledged in it.
            self._torn(0, "incomplete file header")
            return False
        if data.find(RECORD_MARK, MAGIC_BYTES) >= 0:
            # Format-3 records behind a damaged magic: a damaged file of ours, not another
            # file. Refused like any damage, and described so that wal repair salvages it.
            self.version = 3
            after = tuple(r for r in self.intact_after(0) if r.offset >= MAGIC_BYTES)
            self.damage = Damage(0, after[0].offset if after else n, self.first_write, after, None)
            raise CorruptLog(self.path, 0, f"bad magic: {self.damage.describe()}")
        raise CorruptLog(self.path, 0, f"bad magic: not a shardq {self.kind} file")

    def __iter__(self) -> Iterator[memoryview]:
        view = memoryview(self.data)
        if not self._magic(view):
            return
        if self.version >= 3:
            yield from self._records_v3(view)
        else:
            yield from self._records_v2(view)

    # ------------------------------------------------------------------ format 3
    def _record_at(self, off: int) -> Intact | None:
        """The record at ``off`` if it reads whole (header, its checksum, length within the
        limit and the data, payload checksum), else None."""
        data = self.data
        if len(data) - off < _HB3:
            return None
        mark, length, crc, write, synced, flags, hcrc = _H3.unpack_from(data, off)
        if mark != RECORD_MARK or crc32(data[off:off + _HB3 - 4]) != hcrc or length == 0 or length > self.limit:
            return None
        end = off + _HB3 + length
        if end > len(data) or crc32(memoryview(data)[off + _HB3:end]) != crc:
            return None
        return Intact(off, end, write, synced, flags)

    def intact_after(self, start: int) -> list[Intact]:
        """Every record from ``start`` on that reads whole, in file order: found by its
        mark, then followed record by record. Write numbers may go back (a misdirected copy
        of older records): the reader's proof and ``read_intact`` decide what they mean.
        The record at ``start`` itself counts: one that reads whole but is not the write
        the scan expected there (a copy of another write, or a file read with the wrong
        first write) is not damaged bytes, and ``wal repair`` must not drop it as such."""
        found: list[Intact] = []
        data, pos = self.data, start
        while True:
            pos = data.find(RECORD_MARK, pos)
            if pos < 0:
                return found
            rec = self._record_at(pos)
            if rec is None:
                pos += 1
                continue
            while rec is not None:
                found.append(rec)
                pos = rec.end
                rec = self._record_at(pos)

    def _records_v3(self, view: memoryview) -> Iterator[memoryview]:
        """Yield whole writes only: the records of a write are held until its last one reads,
        so a write cut short by a crash is never half applied, and the log never continues
        after a write that has no end."""
        n = len(self.data)
        off = self.valid_end = MAGIC_BYTES
        numbered = self.kind == SEGMENT  # a checkpoint's records all have write 0
        # The write a record must continue (one whose last record is still to come), else
        # the number the next write must have: the previous file's last write + 1 (Log
        # passes it; 0 when unknown, and then any number is accepted).
        open_write, next_write = None, self.first_write
        held: list[memoryview] = []
        while off < n:
            rec = self._record_at(off)
            if rec is not None and numbered:
                if open_write is not None:
                    fits = rec.write == open_write
                else:
                    fits = rec.write == next_write or (next_write == 0 and rec.write > 0)
                if not fits:
                    rec = None
            if rec is None:
                break
            off = rec.end
            if not rec.flags & SYNC_MARK:
                held.append(view[rec.offset + _HB3:rec.end])
            if rec.flags & LAST_IN_WRITE or not numbered:
                open_write, next_write = None, rec.write + 1
                self.last_write = rec.write
                self.records += len(held)
                yield from held
                held.clear()
                self.valid_end = off
            else:
                open_write = rec.write
        if off < n or open_write is not None:
            self.held = list(held)  # whole records of the unfinished write (wal repair salvages them)
            self._damaged_v3(off, open_write if open_write is not None else next_write)
        self._check_clean_end()

    def _damaged_v3(self, off: int, write: int) -> None:
        """Bytes at ``off`` do not continue the log: a zero tail, a torn write, or damage.
        ``valid_end`` is the end of the last whole write (the cut, if it is torn)."""
        data, n, cut = self.data, len(self.data), self.valid_end
        if cut == off and data.count(0, off) == n - off:
            if not self.tail_may_tear or off < self.clean_end:
                self.damage = Damage(off, n, write, (), None)
            self._torn(off, ZERO_TAIL)
            return
        after = tuple(self.intact_after(off)) if off < n else ()
        proof = next((r for r in after if r.synced >= write), None)
        damage = Damage(off, after[0].offset if after else n, write, after, proof)
        self.damage = damage
        if proof is not None or not self.tail_may_tear:
            raise CorruptLog(self.path, off, damage.describe())
        if cut < self.clean_end:
            raise CorruptLog(self.path, off, f"{damage.describe()}; {self._cleanly_stopped()}")
        self._torn(cut, "the writes in flight at a crash: no later record says they were synced", damage)

    # ------------------------------------------------------------------ formats 1 and 2
    def _records_v2(self, view: memoryview) -> Iterator[memoryview]:
        data, n = self.data, len(self.data)
        header = HEADERS[self.version]
        hb = header.size
        checked = self.version >= 2
        off = self.valid_end = MAGIC_BYTES
        limit = self.limit
        while off < n:
            left = n - off
            if left < hb:
                self._torn(off, f"partial record header ({left} bytes)")
                return
            fields = header.unpack_from(data, off)
            length, crc = fields[0], fields[1]
            if length == 0 and crc == 0 and (not checked or fields[2] == 0):
                if _zeros(view[off:]):
                    self._torn(off, ZERO_TAIL)
                elif lost_sector(data, off, off + hb):
                    self._torn(off, "zero-filled header followed by data from the same lost write")
                else:
                    raise CorruptLog(self.path, off, "zero-length record")
                return
            if checked and header_crc(length, crc) != fields[2]:
                # Torn if the last write explains it: cut inside the header (zeros after
                # it), a lost sector in it, or a damaged final record whose length still
                # ends the data: zeros after it, and the length proven by the header
                # checksum over the payload as it reads (only the CRC field was hit).
                # Otherwise the length itself may be damaged, and the records after it
                # must not be dropped on its word: a flipped length that points into the
                # preallocated zeros also has only zeros after its "end".
                end = off + hb + length
                if (_zeros(view[off + hb:]) or lost_sector(data, off, off + hb)
                        or (end <= n and _zeros(view[end:])
                            and header_crc(length, crc32(view[off + hb:end])) == fields[2])):
                    self._torn(off, "damaged header of a record the last write did not finish")
                    return
                raise CorruptLog(self.path, off, "record header checksum mismatch (a damaged length)")
            end = off + hb + length
            if length > limit:
                if end <= n and crc32(view[off + hb:end]) == crc:
                    raise CorruptLog(self.path, off, f"record length {length} exceeds the limit {limit}; "
                                     "its checksum is valid, so an earlier shardq wrote it whole: "
                                     "`shardq wal repair <shard dir> --force` rewrites it in records "
                                     "within the limit, losing nothing")
                if checked:  # the header checksum passed: the writer broke its own limit
                    raise CorruptLog(self.path, off, f"record length {length} exceeds the limit {limit}")
                self._torn(off, f"record length {length} exceeds the limit {limit}")
                return
            if end > n:
                self._torn(off, f"partial record: {length} bytes declared, {left - hb} present")
                return
            payload = view[off + hb:end]
            if crc32(payload) != crc:
                if end == n or _zeros(view[end:]) or lost_sector(data, off, end):
                    self._torn(off, "CRC mismatch in a record the last write did not finish")
                else:
                    raise CorruptLog(self.path, off, "CRC mismatch")
                return
            self.records += 1
            yield payload
            off = end
            self.valid_end = off
        self.valid_end = off
        self._check_clean_end()


def read_intact(path: str, data: bytes, kind: str,
                first_write: int = 0) -> tuple[list[memoryview], list[tuple[int, int]], int]:
    """Every record of a file that reads whole, for ``wal repair``: the payloads (sync marks
    left out), the byte ranges that do not read, and the last write number seen. Format 3
    finds the records after damaged bytes by their mark; formats 1 and 2 cannot, and stop at
    the first bad record."""
    scan = FileScan(path, data, kind, tail_may_tear=False, first_write=first_write)
    payloads: list[memoryview] = []
    try:
        payloads.extend(scan)
        return payloads, [], scan.last_write
    except CorruptLog:
        if scan.version < 3 or scan.damage is None:
            if scan.version < 3:
                return payloads, [(scan.valid_end, len(data))], scan.last_write
            raise
    payloads.extend(scan.held)
    view, n, dmg = memoryview(data), len(data), scan.damage
    # The log's order is its write order. Records of writes before the damaged one are
    # copies (a page written at the wrong offset) of what was already read; a record seen
    # twice (the same write, length and checksum) is a copy too.
    keep: dict[tuple[int, int, int], Intact] = {}
    for rec in dmg.after:
        if kind == SEGMENT and rec.write < dmg.write:
            continue
        crc = _H3.unpack_from(data, rec.offset)[2]
        keep.setdefault((rec.write, rec.end - rec.offset, crc), rec)
    chosen = sorted(keep.values(), key=lambda r: (r.write, r.offset))
    bad: list[tuple[int, int]] = []
    pos, last = dmg.start, scan.last_write
    for rec in sorted(chosen, key=lambda r: r.offset):
        if rec.offset > pos:
            bad.append((pos, rec.offset))
        pos = max(pos, rec.end)
    if pos < n and data.count(0, pos) != n - pos:
        bad.append((pos, n))
    for rec in chosen:
        if not rec.flags & SYNC_MARK:
            payloads.append(view[rec.offset + _HB3:rec.end])
        last = max(last, rec.write)
    return payloads, bad, last
