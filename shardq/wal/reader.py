"""Scan one log file into record payloads.

Three outcomes, each typed (as in etcd's decoder):

* clean end: every byte after the magic is a valid record;
* torn tail (:class:`TornTail`): the *last* file ends in a partial record, a record whose
  CRC fails and after which only zero bytes follow, or a zero-filled run. That is what a
  crash during an append leaves; :class:`~shardq.wal.log.Log` truncates it away and logs it.
* :class:`~shardq.errors.CorruptLog` with file and offset: anything else. Never dropped.

Lengths are checked against the limit and against the bytes left before anything is
allocated for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .. import limits
from ..errors import CorruptLog
from .format import HEADER, HEADER_BYTES, MAGIC_BYTES, crc32


@dataclass(frozen=True)
class TornTail:
    """Where a torn tail starts, how many bytes it has, and why it is torn."""

    path: str
    offset: int
    dropped_bytes: int
    reason: str


#: Why a tail of zeros ends the newest segment: its preallocated space, or a write whose
#: data never reached the disk. Either way nothing acknowledged is in it.
ZERO_TAIL = "zero-filled tail"


def _zeros(view: memoryview) -> bool:
    return view.tobytes().count(0) == len(view)


class FileScan:
    """Iterate the payloads of ``data`` (the whole file). After iteration ``valid_end`` is
    the offset just past the last good record and ``torn`` says whether a tail was torn.

    ``tail_may_tear`` is True only for the newest segment: elsewhere a bad record is
    corruption, because later data was written after it.
    """

    def __init__(self, path: str, data: bytes, magic: bytes, *, tail_may_tear: bool):
        self.path = path
        self.data = data
        self.magic = magic
        self.tail_may_tear = tail_may_tear
        self.valid_end = 0
        self.records = 0
        self.torn: TornTail | None = None

    def _bad(self, offset: int, reason: str) -> None:
        """A bad spot: torn tail if allowed, else CorruptLog."""
        if not self.tail_may_tear:
            raise CorruptLog(self.path, offset, reason)
        self.torn = TornTail(self.path, offset, len(self.data) - offset, reason)

    def __iter__(self) -> Iterator[memoryview]:
        data, n = self.data, len(self.data)
        view = memoryview(data)
        if n < MAGIC_BYTES or data[:MAGIC_BYTES] != self.magic:
            if n < MAGIC_BYTES and self.magic.startswith(data[:n]) or _zeros(view):
                # A crash while the file was being created: nothing was ever acknowledged in it.
                self._bad(0, "incomplete file header")
                return
            raise CorruptLog(self.path, 0, "bad magic: not a shardq log file")
        off = self.valid_end = MAGIC_BYTES
        record_max = limits.RECORD_BYTES_MAX
        while off < n:
            left = n - off
            if left < HEADER_BYTES:
                self._bad(off, f"partial record header ({left} bytes)")
                return
            length, crc = HEADER.unpack_from(data, off)
            if length == 0:
                if _zeros(view[off:]):
                    self._bad(off, ZERO_TAIL)
                else:
                    raise CorruptLog(self.path, off, "zero-length record")
                return
            end = off + HEADER_BYTES + length
            if length > record_max:
                self._bad(off, f"record length {length} exceeds the limit {record_max}")
                return
            if end > n:
                self._bad(off, f"partial record: {length} bytes declared, {left - HEADER_BYTES} present")
                return
            payload = view[off + HEADER_BYTES:end]
            if crc32(payload) != crc:
                if end == n or _zeros(view[end:]):
                    self._bad(off, "CRC mismatch in the final record")
                else:
                    raise CorruptLog(self.path, off, "CRC mismatch")
                return
            self.records += 1
            yield payload
            off = end
            self.valid_end = off
        self.valid_end = off
