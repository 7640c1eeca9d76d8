"""Byte layout of the log. Written down in ``docs/design.md`` ("Log format").

A *segment* file ``<seq:016d>.wal`` and a *checkpoint* file ``<seq:016d>.ckpt`` have the
same shape: an 8-byte magic, then records. A record (format 3) is::

    struct "<4sIIQQII"
        mark      b"SQr\\x03": where a record may start (a reader looking for the intact
                  records after damaged bytes searches for it)
        length    payload bytes
        crc       CRC-32 (zlib) of the payload
        write     the write (one append by the committer) this record belongs to: 1, 2, ...
                  across segments; a checkpoint's records have 0
        synced    the highest write whose fdatasync had returned when this one was issued
        flags     bit 0: the last record of its write; bit 1: a sync mark (no operations:
                  written when the log goes idle, to vouch for the writes before it)
        hcrc      CRC-32 of the 32 header bytes before it
    payload       msgpack: a list of operations

All integers are little-endian. ``write`` and ``synced`` let the reader prove that damaged
bytes were synced: an intact record after them whose ``synced`` reaches the damaged write
was issued after that write's fdatasync returned (docs/design.md, "Damage and torn writes").

Format 2 (magic ending in ``\\x02``) had the header ``"<III"`` (length, crc, CRC-32 of those
8 bytes); format 1 ``"<II"``. Both are still read (data dirs written by earlier versions)
and never written: a newest segment of either is sealed and a format-3 one started.

Each kind of record has one size limit (:data:`RECORD_BYTES_MAX`), which the writer checks
before it writes (it never produces what the reader would refuse) and the reader enforces.
"""
from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from .. import limits
from ..errors import check

SEGMENT, CHECKPOINT = "wal", "ckpt"
MAGIC_BYTES = 8
#: (kind, format) -> magic
MAGICS = {
    (SEGMENT, 1): b"SHQWAL\x00\x01", (SEGMENT, 2): b"SHQWAL\x00\x02", (SEGMENT, 3): b"SHQWAL\x00\x03",
    (CHECKPOINT, 1): b"SHQCKP\x00\x01", (CHECKPOINT, 2): b"SHQCKP\x00\x02", (CHECKPOINT, 3): b"SHQCKP\x00\x03",
}
#: The format every new file is written in.
FORMAT = 3
SEGMENT_MAGIC = MAGICS[(SEGMENT, FORMAT)]
CHECKPOINT_MAGIC = MAGICS[(CHECKPOINT, FORMAT)]
#: The record header of each format.
HEADERS = {1: struct.Struct("<II"), 2: struct.Struct("<III"), 3: struct.Struct("<4sIIQQII")}
HEADER = HEADERS[FORMAT]
HEADER_BYTES = HEADER.size
RECORD_MARK = b"SQr\x03"
#: flags: the last record of its write; a sync mark (no operations).
LAST_IN_WRITE, SYNC_MARK = 1, 2
#: The payload of a sync mark: an empty list of operations.
MARK_PAYLOAD = b"\x90"
_HEAD3 = struct.Struct("<4sIIQQI")
#: The limit of one record's payload, per kind of file.
RECORD_BYTES_MAX = {SEGMENT: limits.SEGMENT_RECORD_BYTES_MAX, CHECKPOINT: limits.CHECKPOINT_RECORD_BYTES_MAX}
#: The unit a torn write loses or zeroes: a disk sector (etcd's minSectorSize).
SECTOR_BYTES = 512

crc32 = zlib.crc32
_LEN_CRC = struct.Struct("<II")

_NAME = re.compile(r"^(\d{16})\.(wal|ckpt)$")


def header_crc(length: int, payload_crc: int) -> int:
    return crc32(_LEN_CRC.pack(length, payload_crc))


def frame(payload: bytes | memoryview, kind: str = SEGMENT, write: int = 0, synced: int = 0,
          flags: int = LAST_IN_WRITE) -> bytes:
    """One format-3 record: header + payload. A payload over the kind's limit is a bug
    upstream (requests are cut to fit): refused here, before anything is written."""
    n = len(payload)
    if n > RECORD_BYTES_MAX[kind] or n == 0:
        check(False, f"a {kind} record of {n} bytes is outside (0, {RECORD_BYTES_MAX[kind]}]")
    head = _HEAD3.pack(RECORD_MARK, n, crc32(payload), write, synced, flags)
    return head + crc32(head).to_bytes(4, "little") + payload


def frame_write(payloads: list[bytes], write: int, synced: int) -> bytes:
    """The records of one write: each tagged with the write's number and the highest synced
    write, the last one flagged as such (so a reader knows where the write ends)."""
    last = len(payloads) - 1
    return b"".join(frame(p, SEGMENT, write, synced, LAST_IN_WRITE if i == last else 0)
                    for i, p in enumerate(payloads))


def frame_v2(payload: bytes | memoryview, kind: str = SEGMENT) -> bytes:
    """A format-2 record (``wal repair`` of older files only: never appended)."""
    n = len(payload)
    if n > RECORD_BYTES_MAX[kind] or n == 0:
        check(False, f"a {kind} record of {n} bytes is outside (0, {RECORD_BYTES_MAX[kind]}]")
    c = crc32(payload)
    return HEADERS[2].pack(n, c, crc32(_LEN_CRC.pack(n, c))) + payload


def segment_name(seq: int) -> str:
    return f"{seq:016d}.wal"


def checkpoint_name(seq: int) -> str:
    return f"{seq:016d}.ckpt"


def parse_name(name: str) -> tuple[int, str] | None:
    """(seq, "wal"|"ckpt") for a log file name, None for anything else."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items (to join items encoded one by one)."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def pack_records(ops: list[Any], limit: int, atomic: Sequence[tuple[int, int]] = (),
                 pack: Callable[[Any], bytes] | None = None) -> list[bytes]:
    """Encode ``ops`` as record payloads (msgpack arrays of operations) of at most ``limit``
    bytes each, in order. ``atomic`` lists ``(start, end)`` index ranges that must stay in
    one record (the operations of one request: a batch is all-or-nothing across a crash).
    A range or operation larger than ``limit`` is a bug upstream (requests are refused
    before they are applied if they could not be logged) and raises InvariantViolation."""
    pack = pack or msgpack.Packer().pack
    glued_until = {}
    for start, end in atomic:
        glued_until[start] = end
    out: list[bytes] = []
    parts: list[bytes] = []
    count = size = 0
    i, n = 0, len(ops)
    while i < n:
        end = glued_until.get(i, i + 1)
        unit = [pack(op) for op in ops[i:end]]
        unit_bytes = sum(map(len, unit))
        check(unit_bytes + 5 <= limit, f"operations {i}..{end} need {unit_bytes} bytes, over the record limit {limit}")
        if count and size + unit_bytes + 5 > limit:
            out.append(array_header(count) + b"".join(parts))
            parts, count, size = [], 0, 0
        parts.extend(unit)
        count += len(unit)
        size += unit_bytes
        i = end
    if count:
        out.append(array_header(count) + b"".join(parts))
    return out
