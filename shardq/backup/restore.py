"""``shardq restore``: check a backup, then hand over a data dir that ``shardq serve`` starts on.

Everything is checked before the data dir appears under its name. The copy is written
into a temporary directory beside it (``.<name>.restoring-<pid>``, 0700) and renamed onto
it at the end (rename replaces an empty directory atomically), so the target is either
untouched or complete. Checks, each a :class:`~shardq.errors.CorruptLog` naming the file
(and the offset, for a record):

* the manifest's own checksum and shape (:mod:`.manifest`);
* each listed file: present, of the listed size, every record reading whole with its
  checksums, write numbers following on, a checkpoint's trailer (:mod:`.logfiles`), then
  its SHA-256 against the manifest;
* each shard replayed in memory into a :class:`~shardq.shard.state.ShardState`, as
  ``serve`` will at start: its operations apply, and its last write and highest job
  number are the ones the shard reported at its cut;
* the key file: a regular file of this user that nobody else may read (as ``serve``
  requires; AuthError otherwise) whose SHA-256 matches; the metadata: its SHA-256 and
  shard count; the SQS API's catalog, where the backup has one: its SHA-256, and that it
  is a catalog with its receipt handle key (:mod:`.sqs_catalog`).

The catalog is restored as it was, handle key included, so receipt handles given out
before the backup still work on the messages the copy holds in flight.

The restored data dir gets a **new service id** (``restored_from`` in ``shardq.json``
names the old one): job numbers after the cut will be given again, to other jobs, so an
idempotency store that recorded the original's later jobs must not be taken for this
service's (it refuses the new id: docs/backup.md, "Idempotency stores").
"""
from __future__ import annotations

import gc
import json
import os
import secrets
import shlex
import shutil
from dataclasses import dataclass

from ..config import Config
from ..datadir import FORMAT as DATA_DIR_FORMAT
from ..datadir import _read_private
from ..errors import CorruptLog, InvariantViolation, UsageError
from ..shard.state import ShardState
from ..wal.format import parse_name
from . import sqs_catalog
from .logfiles import LogFile, WriteChain, read_listed, sha256, sync_dir, write_private
from .manifest import KEY, META, SCHEDULES, SQS_CATALOG, FileEntry, Manifest, ShardCut


@dataclass(frozen=True)
class RestoredShard:
    cut: ShardCut
    records: int
    jobs: int  # live jobs at the cut (ready, delayed, waiting, leased, dead)


@dataclass(frozen=True)
class Restored:
    path: str
    service_id: str
    manifest: Manifest
    shards: tuple[RestoredShard, ...]

    def serve_command(self, config: str | None = None) -> str:
        """The ``shardq serve`` that starts on the restored data dir *beside* the service
        still running on the original, to check the copy before switching: its own data
        dir and sockets, and its HTTP listener on any free port (printed at start), so
        the port of the running service is not in the way."""
        argv = ["shardq", "serve", "--data-dir", self.path, "--shards", str(self.manifest.shards),
                "--http-listen", "127.0.0.1:0"]
        return shlex.join(argv + (["--config", config] if config else []))


def restore(backup_dir: str, data_dir: str) -> Restored:
    """Check the backup in ``backup_dir`` and write it as the data dir ``data_dir`` (which
    must not exist, or be an empty directory). Guarantee: ``data_dir`` is left untouched
    unless every check passed, and then holds exactly the backup's files, fsynced."""
    backup_dir, target = os.path.abspath(backup_dir), os.path.abspath(data_dir)
    manifest = Manifest.read(backup_dir)
    _check_target(target)
    parent = os.path.dirname(target)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.restoring-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier restore of this pid
    os.mkdir(tmp, 0o700)
    try:
        service_id = _restore_top(backup_dir, tmp, manifest)
        os.mkdir(os.path.join(tmp, "run"), 0o700)  # the socket dir, as serve makes it (clients check it)
        shards = tuple(_restore_shard(backup_dir, tmp, cut) for cut in manifest.cuts)
        sync_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError as e:
            raise UsageError(f"cannot put the restored data dir at {target} ({e.strerror}): restore into a new "
                             "directory (a mount point cannot be replaced)") from None
        sync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Restored(target, service_id, manifest, shards)


def _check_target(target: str) -> None:
    if os.path.lexists(target):
        if os.path.islink(target) or not os.path.isdir(target):
            raise UsageError(f"{target} exists and is not a directory")
        if os.listdir(target):
            raise UsageError(f"{target} is not empty: restore writes only into a new or empty directory")
    elif not os.path.isdir(os.path.dirname(target)):
        raise UsageError(f"{os.path.dirname(target)}: no such directory")


def _restore_top(backup_dir: str, out: str, manifest: Manifest) -> str:
    """The key file, the metadata (with a new service id) and the scheduler's ticks."""
    listed = {f.path: f for f in manifest.files}
    key_path = os.path.join(backup_dir, KEY)
    key = _read_private(key_path, "key file", missing="the backup's manifest lists it",
                        symlink="replace it with the file itself (mode 0600)")
    _check_hash(key_path, key, listed[KEY])
    meta_path = os.path.join(backup_dir, META)
    raw = read_listed(meta_path, listed[META].bytes)
    _check_hash(meta_path, raw, listed[META])
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CorruptLog(meta_path, 0, f"not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != DATA_DIR_FORMAT or meta.get("shards") != manifest.shards:
        raise CorruptLog(meta_path, 0, f"expected format {DATA_DIR_FORMAT} and {manifest.shards} shards, "
                         f"found {meta!r:.120}")
    old_id = meta.get("id")
    meta["id"] = secrets.token_hex(8)
    meta["restored_from"] = {"id": old_id, "source": manifest.source, "backup_started": manifest.started}
    write_private(os.path.join(out, KEY), key)
    write_private(os.path.join(out, META), json.dumps(meta).encode())
    if SCHEDULES in listed:
        path = os.path.join(backup_dir, SCHEDULES)
        ticks = read_listed(path, listed[SCHEDULES].bytes)
        _check_hash(path, ticks, listed[SCHEDULES])
        write_private(os.path.join(out, SCHEDULES), ticks)
    if SQS_CATALOG in listed:
        path = os.path.join(backup_dir, SQS_CATALOG)
        catalog = read_listed(path, listed[SQS_CATALOG].bytes)
        _check_hash(path, catalog, listed[SQS_CATALOG])
        sqs_catalog.check(path, catalog)
        catalog_dir = os.path.join(out, os.path.dirname(SQS_CATALOG))
        os.mkdir(catalog_dir, 0o700)
        write_private(os.path.join(out, SQS_CATALOG), catalog)
        sync_dir(catalog_dir)
    return str(meta["id"])


def _restore_shard(backup_dir: str, out_root: str, cut: ShardCut) -> RestoredShard:
    out = os.path.join(out_root, f"shard-{cut.shard}")
    os.mkdir(out, 0o700)
    state = ShardState(cut.shard, Config())  # replay never depends on the config (docs/design.md)
    chain, records = WriteChain(), 0
    last = os.path.join(backup_dir, cut.files[-1].path)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as at a shard's start: replay builds many objects and frees none
    try:
        for entry in cut.files:
            path = os.path.join(backup_dir, entry.path)
            data = read_listed(path, entry.bytes)
            lf = LogFile(path, data, parse_name(entry.name)[1], chain)  # type: ignore[index]  # checked in manifest
            try:
                state.replay(lf.records())
            except InvariantViolation as e:
                raise CorruptLog(path, 0, f"its records read whole but do not replay: {e}") from None
            _check_hash(path, data, entry)
            records += lf.records_read
            write_private(os.path.join(out, entry.name), data)
    finally:
        if gc_was_enabled:
            gc.enable()
    if chain.next_write - 1 != cut.write or cut.files[-1].bytes != cut.offset:
        raise CorruptLog(last, cut.offset, f"the copy ends at write {chain.next_write - 1} and byte "
                         f"{cut.files[-1].bytes}; the shard's cut was write {cut.write} at byte {cut.offset}")
    if state.next_seq - 1 != cut.job_seq:
        raise CorruptLog(last, cut.offset, f"the copy's highest job number is {state.next_seq - 1}; the shard's "
                         f"cut said {cut.job_seq}")
    sync_dir(out)
    return RestoredShard(cut, records, len(state.jobs))


def _check_hash(path: str, data: bytes, entry: FileEntry) -> None:
    got = sha256(data)
    if got != entry.sha256:
        raise CorruptLog(path, 0, f"its sha256 is {got}, the manifest's {entry.sha256}: the file changed "
                         "after the backup")

