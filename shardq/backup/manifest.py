"""The manifest of a backup: what ``shardq backup`` copied, and what ``restore`` checks.

``<DEST>/manifest.json`` is written last (temp file, fsync, rename, fsync of DEST), so a
backup without one is incomplete and ``restore`` refuses it. It holds::

    {"manifest": {
        "format": 1, "kind": "shardq-backup", "shardq_version": "0.1.0",
        "service_id": "...", "source": "/abs/data/dir", "shards": N,
        "started": <unix s>, "finished": <unix s>,
        "files": [{"path": "shardq.json", "bytes": n, "sha256": "..."}, {"path": "authkey", ...},
                  ..., {"path": "sqs-api/catalog.json", ...}],
        "cuts": [{"shard": 0, "time": <unix s>, "segment": "0000000000000002.wal", "offset": n,
                  "write": w, "job_seq": s,
                  "files": [{"path": "shard-0/0000000000000002.ckpt", "bytes": n, "sha256": "...",
                             "log_format": 3, "records": r}, ...]}, ...]},
     "sha256": "<of the manifest object, as json.dumps(sort_keys=True) writes it>"}

Its own checksum catches a damaged manifest before anything is compared with it. Every path
is checked when read (a log file name under ``shard-<i>/``, or one of :data:`TOP_FILES`), so
a manifest cannot make ``restore`` read or write outside the backup and the new data dir.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CorruptLog, UsageError
from ..wal.format import SEGMENT, parse_name
from . import sqs_catalog

MANIFEST = "manifest.json"
FORMAT = 1
KIND = "shardq-backup"
#: The data dir's own files a backup holds: its metadata, the HMAC key (so that clients and
#: ``serve`` of the restored data dir use the same key), the scheduler's last ticks, the SQS
#: API's catalog (its queues and the key of its receipt handles). The last two only where
#: the data dir has them: a backup without them (one taken before the SQS API was backed
#: up, too) restores as it always did.
META, KEY, SCHEDULES, SQS_CATALOG = "shardq.json", "authkey", "schedules.json", sqs_catalog.PATH
TOP_FILES = (META, KEY, SCHEDULES, SQS_CATALOG)


@dataclass(frozen=True)
class FileEntry:
    """One copied file: its path in the backup ("/"-separated), size and SHA-256; for a
    log file, its format and how many records it holds."""

    path: str
    bytes: int
    sha256: str
    log_format: int = 0
    records: int = 0

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ShardCut:
    """Where one shard's copy ends: the shard's clock when it took the cut, its newest
    segment and the offset its copy stops at, the last write in it, and the highest job
    number in it (every job numbered up to ``job_seq`` that was live at the cut is in the
    copy; none numbered after it)."""

    shard: int
    time: float
    segment: str
    offset: int
    write: int
    job_seq: int
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass(frozen=True)
class Manifest:
    shardq_version: str
    service_id: str | None
    source: str
    shards: int
    started: float
    finished: float
    files: tuple[FileEntry, ...]
    cuts: tuple[ShardCut, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files) + sum(c.total_bytes for c in self.cuts)

    def encode(self) -> bytes:
        body: dict[str, Any] = {"format": FORMAT, "kind": KIND, **asdict(self)}
        return json.dumps({"manifest": body, "sha256": _digest(body)}, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def read(cls, dest: str) -> Manifest:
        """The manifest of the backup in ``dest``. UsageError if there is none (not a
        backup, or one that did not finish); CorruptLog naming the manifest if it is damaged
        or malformed."""
        path = os.path.join(dest, MANIFEST)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise UsageError(f"{dest} is not a shardq backup: no {MANIFEST} (a backup that did not finish "
                             "has none)") from None
        return _parse(path, raw)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class _Reader:
    """Typed fields of the manifest; any wrong one is CorruptLog naming the manifest."""

    def __init__(self, path: str):
        self.path = path

    def bad(self, what: str) -> CorruptLog:
        return CorruptLog(self.path, 0, f"malformed backup manifest: {what}")

    def field(self, obj: Any, name: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise self.bad(f"no field {name!r}")
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
                raise self.bad(f"field {name!r} is {value!r:.60}")
        return value

    def entry(self, obj: Any, *, under: str | None) -> FileEntry:
        path = self.field(obj, "path", str)
        if under is None:
            if path not in TOP_FILES:
                raise self.bad(f"unknown file {path!r:.80}")
        elif not (path.startswith(under + "/") and parse_name(path[len(under) + 1:])):
            raise self.bad(f"file {path!r:.80} is not a log file of {under}")
        size = self.field(obj, "bytes", int)
        digest = self.field(obj, "sha256", str)
        if size < 0 or len(digest) != 64:
            raise self.bad(f"file {path!r}: bytes {size}, sha256 {digest!r:.70}")
        return FileEntry(path, size, digest, obj.get("log_format", 0), obj.get("records", 0))

    def cut(self, obj: Any, shards: int) -> ShardCut:
        shard = self.field(obj, "shard", int)
        if not 0 <= shard < shards:
            raise self.bad(f"cut of shard {shard} in a backup of {shards} shards")
        under = f"shard-{shard}"
        files = tuple(self.entry(e, under=under) for e in self.field(obj, "files", list))
        segment = self.field(obj, "segment", str)
        seg = parse_name(segment)
        if seg is None or seg[1] != SEGMENT or not files or files[-1].name != segment:
            raise self.bad(f"shard {shard}: its cut is in {segment!r:.60}, which is not its last file")
        return ShardCut(shard, float(self.field(obj, "time", float)), segment, self.field(obj, "offset", int),
                        self.field(obj, "write", int), self.field(obj, "job_seq", int), files)


def _parse(path: str, raw: bytes) -> Manifest:
    r = _Reader(path)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise r.bad(f"not JSON ({e})") from None
    body = r.field(doc, "manifest", dict)
    if r.field(doc, "sha256", str) != _digest(body):
        raise CorruptLog(path, 0, "the manifest's own sha256 does not match its content: it was damaged "
                         "or edited after the backup")
    if r.field(body, "kind", str) != KIND or r.field(body, "format", int) != FORMAT:
        raise r.bad(f"kind {body.get('kind')!r}, format {body.get('format')!r}: this shardq reads "
                    f"{KIND!r} format {FORMAT}")
    shards = r.field(body, "shards", int)
    cuts = tuple(r.cut(c, shards) for c in r.field(body, "cuts", list))
    if sorted(c.shard for c in cuts) != list(range(shards)):
        raise r.bad(f"cuts of shards {sorted(c.shard for c in cuts)} in a backup of {shards} shards")
    files = tuple(r.entry(e, under=None) for e in r.field(body, "files", list))
    if not {META, KEY} <= {f.path for f in files}:
        raise r.bad(f"it must list {META} and {KEY}")
    service_id = body.get("service_id")
    return Manifest(r.field(body, "shardq_version", str), service_id if isinstance(service_id, str) else None,
                    r.field(body, "source", str), shards, float(r.field(body, "started", float)),
                    float(r.field(body, "finished", float)), files, tuple(sorted(cuts, key=lambda c: c.shard)))
