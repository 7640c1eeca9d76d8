"""What can still be read out of damaged log bytes: for the reports of a cut torn tail and
of ``shardq wal check|repair``, which name the jobs concerned.

Nothing here is trusted as data: operations read from bytes whose checksum failed are
used only to *name* job ids (an enqueue that may be lost), never replayed.
"""
from __future__ import annotations

from typing import Any

import msgpack

from .format import HEADERS, MAGIC_BYTES, RECORD_MARK

_ENQUEUE, _JOB = 1, 21  # shard/ops.py: [1, job_id, ...] and a checkpoint's [21, job_id, ...]
_H3 = HEADERS[3]


#: How an enqueue or a checkpoint's job starts in msgpack: a fixarray of its length, then
#: its code (shard/ops.py: ENQUEUE has 9 or 10 fields, JOB 12).
_OP_STARTS = (b"\x9a\x01", b"\x99\x01", b"\x9c\x15")


def readable_ops(payload: bytes | memoryview) -> list[Any]:
    """The operations at the start of a record payload that still decode, up to the first
    that does not (a payload is one msgpack array of operations)."""
    data = bytes(payload)
    unpacker = msgpack.Unpacker(raw=False, use_list=True, max_buffer_size=max(len(data), 1024))
    unpacker.feed(data)
    out: list[Any] = []
    try:
        n = unpacker.read_array_header()
        for _ in range(n):
            op = unpacker.unpack()
            if isinstance(op, list) and op and isinstance(op[0], int):
                out.append(op)
    except Exception:  # noqa: BLE001 - damaged bytes: whatever decodes before them is all there is
        pass
    return out


def scanned_job_ids(data: bytes | memoryview) -> set[int]:
    """Job ids of the enqueues and checkpoint jobs that start anywhere in damaged bytes,
    found by their first bytes (a fixarray of the op's length, then its code), so that one
    damaged job hides only itself. Only for damaged bytes: a job body can hold the same
    bytes, so an id found this way is a name to report, never a fact to replay."""
    raw = bytes(data)
    out: set[int] = set()
    for start in _OP_STARTS:
        pos = raw.find(start)
        while pos >= 0:
            jid = _uint_at(raw, pos + 2)  # only the id is wanted: the body may be damaged or huge
            if jid is not None:
                out.add(jid)
            pos = raw.find(start, pos + 1)
    return out


_UINTS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _uint_at(data: bytes, pos: int) -> int | None:
    """The msgpack unsigned integer at ``pos``, or None."""
    if pos >= len(data):
        return None
    first = data[pos]
    if first < 0x80:
        return first
    size = _UINTS.get(first)
    if size is None or pos + 1 + size > len(data):
        return None
    return int.from_bytes(data[pos + 1:pos + 1 + size], "big")


def job_ids_of(ops: list[Any]) -> list[int]:
    """Job ids enqueued (or, in a checkpoint, held) by ``ops``."""
    return [op[1] for op in ops if op[0] in (_ENQUEUE, _JOB) and len(op) > 1 and isinstance(op[1], int)]


def readable_job_ids(data: bytes, offset: int) -> list[int]:
    """Job ids of the enqueues that can be read in ``data[offset:]`` of a format-3 file:
    from every record header found there (by its mark), the operations of its payload that
    decode, whether or not its checksum holds."""
    ids: set[int] = set()
    pos = max(offset, MAGIC_BYTES)
    n = len(data)
    while True:
        pos = data.find(RECORD_MARK, pos)
        if pos < 0 or n - pos < _H3.size:
            break
        length = _H3.unpack_from(data, pos)[1]
        start = pos + _H3.size
        ids.update(job_ids_of(readable_ops(memoryview(data)[start:min(start + length, n)])))
        pos += 1
    return sorted(ids | scanned_job_ids(memoryview(data)[max(offset, MAGIC_BYTES):]))


def format_ids(ids: list[int], most: int = 20) -> str:
    """``ids`` for a log line: the count, then up to ``most`` of them."""
    if not ids:
        return "none"
    shown = ", ".join(map(str, ids[:most]))
    return f"{len(ids)} ({shown}{', ...' if len(ids) > most else ''})"
