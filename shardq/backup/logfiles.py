"""Reading the log files of a backup as replay would, and writing files privately.

A copy holds each shard's newest checkpoint and the segments after it, the newest cut at
the end of a whole write. So every file of a copy must read clean to its last byte: no torn
tail, no preallocated zeros, no damage anywhere (:class:`~shardq.wal.reader.FileScan` with
``tail_may_tear=False``); a checkpoint must end with its trailer, count its records right
and name the first write after it; the write numbers must follow on from file to file as
:class:`~shardq.wal.log.Log` requires. Anything else is :class:`~shardq.errors.CorruptLog`
naming the file and the offset.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import msgpack

from ..errors import CorruptLog
from ..wal.format import CHECKPOINT, FORMAT, SEGMENT
from ..wal.log import _CHECKPOINT_END
from ..wal.reader import FileScan


class WriteChain:
    """The number the next segment's first write must have, carried from file to file as
    :meth:`~shardq.wal.log.Log.replay` carries it (1; a checkpoint's trailer; one past each
    format-3 segment's last write; 1 again after a segment of an earlier format)."""

    def __init__(self) -> None:
        self.next_write = 1


class LogFile:
    """One log file of a copy, its bytes in ``data``. Iterate :meth:`records` once for the
    decoded operations of each record, checked; then ``version`` and ``records_read`` are
    set and ``chain`` has moved past the file."""

    def __init__(self, path: str, data: bytes, kind: str, chain: WriteChain):
        self.path = path
        self.data = data
        self.kind = kind
        self.chain = chain
        self.version = 0
        self.records_read = 0

    def records(self) -> Iterator[list[Any]]:
        scan = FileScan(self.path, self.data, self.kind, tail_may_tear=False,
                        first_write=self.chain.next_write if self.kind == SEGMENT else 0)
        if self.kind == CHECKPOINT:
            payloads = list(scan)  # every checksum and the trailer checked before any record is used
            self.version = scan.version
            trailer = _decode(self.path, payloads[-1], scan.valid_end) if payloads else None
            if not (isinstance(trailer, list) and len(trailer) in (2, 3) and trailer[0] == _CHECKPOINT_END
                    and trailer[1] == len(payloads) - 1):
                raise CorruptLog(self.path, scan.valid_end, "checkpoint without its trailer, or a trailer that "
                                 f"miscounts its {max(len(payloads) - 1, 0)} records")
            if len(trailer) == 3:
                self.chain.next_write = trailer[2]
            for payload in payloads[:-1]:
                self.records_read += 1
                yield _decode(self.path, payload, scan.valid_end)
            return
        for payload in scan:
            self.records_read += 1
            yield _decode(self.path, payload, scan.valid_end)
        self.version = scan.version
        if 0 < scan.version < FORMAT:
            self.chain.next_write = 1
        elif scan.last_write >= self.chain.next_write:
            self.chain.next_write = scan.last_write + 1

    def check(self) -> None:
        """Read every record (for a copy that is not replayed)."""
        for _ in self.records():
            pass


def _decode(path: str, payload: memoryview, offset: int) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, use_list=True)
    except Exception as e:  # noqa: BLE001 - a CRC-valid record that does not decode: a bug or tampering
        raise CorruptLog(path, offset, f"undecodable record: {e}") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_listed(path: str, size: int) -> bytes:
    """The ``size`` bytes a manifest lists for ``path``. CorruptLog naming the file if it is
    missing, shorter or longer."""
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        raise CorruptLog(path, 0, f"missing: the backup's manifest lists it ({size} bytes)") from None
    if len(data) != size:
        raise CorruptLog(path, min(len(data), size), f"holds {'more' if len(data) > size else len(data)} bytes, "
                         f"the manifest says {size}")
    return data


def write_private(path: str, data: bytes) -> None:
    """A new file readable by its owner only (a copy holds job bodies and the key), fsynced.
    An OSError names ``path`` (a failed ``write`` or ``fsync`` names no file by itself)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as e:
        raise naming(e, path) from e
    finally:
        os.close(fd)


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        raise naming(e, path) from e
    finally:
        os.close(fd)


def naming(e: OSError, path: str) -> OSError:
    """``e``, or, when it names no file, the same error (class and errno) naming ``path``."""
    return e if e.filename is not None else OSError(e.errno, e.strerror, path)
