"""Scan one log file into record payloads.

Three outcomes, each typed (as in etcd's decoder):

* clean end: every byte after the magic is a valid record;
* torn tail (:class:`TornTail`): the *newest* segment ends in what a crash during its last,
  never-acknowledged write leaves: a run of zeros (preallocated space, or pages the disk
  never wrote), a partial header or record, or a bad record that a lost write explains
  (an all-zero disk sector inside it: etcd's ``isTornEntry``). :class:`~shardq.wal.log.Log`
  cuts it off and says so;
* :class:`~shardq.errors.CorruptLog` with file and offset: anything else, including a
  record header whose checksum fails (a damaged length) and a length over the kind's limit.
  Never dropped.

Why an all-zero sector means "torn": a write that was not fsynced may lose any of its
pages (they read back as zeros in a preallocated file, or revert to their old contents);
a later fsync would have made them durable. So a record with a lost sector, and anything
after it, was never acknowledged. The residual risk is etcd's: a damaged record whose own
data holds a whole sector of zeros at that place is read as torn.

Lengths are checked against the limit and against the bytes left before anything is
allocated for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import CorruptLog
from .format import HEADERS, MAGIC_BYTES, MAGICS, RECORD_BYTES_MAX, SECTOR_BYTES, crc32, header_crc


@dataclass(frozen=True)
class TornTail:
    """Where a torn tail starts, how many bytes it has, and why it is torn."""

    path: str
    offset: int
    dropped_bytes: int
    reason: str

    @property
    def zeros_only(self) -> bool:
        return self.reason == ZERO_TAIL


#: Why a tail of zeros ends the newest segment: its preallocated space, or a write whose
#: data never reached the disk. Either way nothing acknowledged is in it.
ZERO_TAIL = "zero-filled tail"


def _zeros(view: memoryview) -> bool:
    return view.tobytes().count(0) == len(view)


def lost_sector(data, start: int, end: int) -> bool:
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
    versions that exceeded it).
    """

    def __init__(self, path: str, data: bytes, kind: str, *, tail_may_tear: bool, limit: int | None = None):
        self.path = path
        self.data = data
        self.kind = kind
        self.tail_may_tear = tail_may_tear
        self.limit = RECORD_BYTES_MAX[kind] if limit is None else limit
        self.valid_end = 0
        self.records = 0
        self.version = 0
        self.torn: TornTail | None = None

    def _torn(self, offset: int, reason: str) -> None:
        if not self.tail_may_tear:
            raise CorruptLog(self.path, offset, reason)
        self.torn = TornTail(self.path, offset, len(self.data) - offset, reason)

    def _magic(self, view: memoryview) -> bool:
        """Set ``version``; False if the file is a torn (never acknowledged) creation."""
        data, n = self.data, len(self.data)
        head = bytes(data[:MAGIC_BYTES])
        for (kind, version), magic in MAGICS.items():
            if kind == self.kind and head == magic:
                self.version = version
                return True
        mine = [m for (k, _), m in MAGICS.items() if k == self.kind]
        if n < MAGIC_BYTES and any(m.startswith(head) for m in mine) or _zeros(view):
            # A crash while the file was being created: nothing was ever acknowledged in it.
            self._torn(0, "incomplete file header")
            return False
        raise CorruptLog(self.path, 0, f"bad magic: not a shardq {self.kind} file")

    def __iter__(self) -> Iterator[memoryview]:
        data, n = self.data, len(self.data)
        view = memoryview(data)
        if not self._magic(view):
            return
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
