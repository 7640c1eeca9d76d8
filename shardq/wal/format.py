"""Byte layout of the log. Written down in ``docs/design.md`` ("Log format").

A *segment* file ``<seq:016d>.wal`` and a *checkpoint* file ``<seq:016d>.ckpt`` have the
same shape: an 8-byte magic, then records. A record is::

    struct "<II"   payload length (bytes), CRC-32 (zlib) of the payload
    payload        msgpack: a list of operations

All integers are little-endian. A length of zero never occurs in a valid record, so zero
bytes after the last record are a preallocated or torn tail, never data.
"""
from __future__ import annotations

import re
import struct
import zlib

SEGMENT_MAGIC = b"SHQWAL\x00\x01"
CHECKPOINT_MAGIC = b"SHQCKP\x00\x01"
MAGIC_BYTES = 8
HEADER = struct.Struct("<II")
HEADER_BYTES = HEADER.size

crc32 = zlib.crc32

_NAME = re.compile(r"^(\d{16})\.(wal|ckpt)$")


def frame(payload: bytes) -> bytes:
    """One record: header + payload."""
    return HEADER.pack(len(payload), crc32(payload)) + payload


def segment_name(seq: int) -> str:
    return f"{seq:016d}.wal"


def checkpoint_name(seq: int) -> str:
    return f"{seq:016d}.ckpt"


def parse_name(name: str) -> tuple[int, str] | None:
    """(seq, "wal"|"ckpt") for a log file name, None for anything else."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None
