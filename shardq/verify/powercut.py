"""``shardq verify --power-cuts``: make a killed service's disk look as after a power cut.

A SIGKILL leaves the page cache intact: everything a shard wrote survives, synced or not.
A power cut does not. With the service killed (every process gone), this drops or zeroes
random 4 KiB pages of each shard's newest segment that hold bytes written after that
segment's last fsync/fdatasync; the newest segment is the only file a shard appends to
without syncing at once. The synced size comes from the side file of the WAL's test hook
(``SHARDQ_FAULT_SYNC_LOG``, :class:`shardq.wal.fileio.SyncLoggingFiles`), which the run
sets for the service: ``<path> <inode> <synced bytes>`` per sync, the last line of an inode
being its durable size.

The machine restarts too: :func:`reboot` makes each shard's boot record name an earlier
boot, so the restarted shards treat what their last run handed out before its fsync as a
power cut may have lost it (placed queues are fenced: docs/limits.md, "Across restarts").

The segment is preallocated, so a dropped page's old content is zeros: dropping and
zeroing both write zeros over the unsynced bytes of the page (the synced bytes before them
in the same page stay). Nothing acknowledged may be lost by this, because no reply leaves a
shard before the fdatasync that covers it.
"""
from __future__ import annotations

import dataclasses
import os
import random
from collections import Counter

from ..datadir import DataDir
from ..shard import boot_fence
from ..wal.format import parse_name

PAGE_BYTES = 4096
FATES = ("keep", "drop", "zero")


def synced_sizes(side_file: str) -> dict[int, int]:
    """inode -> its last synced size, from the hook's side file."""
    sizes: dict[int, int] = {}
    try:
        with open(side_file, "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                    sizes[int(parts[1])] = int(parts[2])
    except FileNotFoundError:
        pass
    return sizes


def newest_segment(shard_dir: str) -> str | None:
    segments = [(p[0], n) for n in os.listdir(shard_dir) if (p := parse_name(n)) and p[1] == "wal"]
    return os.path.join(shard_dir, max(segments)[1]) if segments else None


def reboot(data_dir: str) -> int:
    """Make each shard's boot record name a boot before this one, as a machine's restart
    after a power cut does (shard/boot_fence.py). Call only while no shard process runs.
    Returns how many records it changed."""
    dd = DataDir(data_dir)
    changed = 0
    for i in range(dd.shards()):
        rec, _ = boot_fence.read(dd.shard_dir(i))
        if rec is not None:
            boot_fence.write(dd.shard_dir(i), dataclasses.replace(rec, boot_id=f"before-the-power-cut-{rec.boot_id}"))
            changed += 1
    return changed


def lose_unsynced_pages(data_dir: str, side_file: str, rng: random.Random) -> Counter[str]:
    """Keep, drop or zero (``rng``) each page of each shard's newest segment holding bytes
    written after its last sync. Call only while no shard process runs. Returns counts:
    ``segments`` looked at, ``unknown`` (no sync recorded: left alone), ``pages_kept``,
    ``pages_lost``, ``bytes_lost``."""
    sizes = synced_sizes(side_file)
    dd = DataDir(data_dir)
    out: Counter[str] = Counter()
    for i in range(dd.shards()):
        path = newest_segment(dd.shard_dir(i))
        if path is None:
            continue
        out["segments"] += 1
        synced = sizes.get(os.stat(path).st_ino)
        if synced is None:
            out["unknown"] += 1
            continue
        with open(path, "r+b") as f:
            data = f.read()
            for page in range(synced - synced % PAGE_BYTES, len(data), PAGE_BYTES):
                lo, hi = max(page, synced), min(page + PAGE_BYTES, len(data))
                if data.count(0, lo, hi) == hi - lo:
                    continue  # nothing was written there since the sync
                if rng.choice(FATES) == "keep":
                    out["pages_kept"] += 1
                    continue
                f.seek(lo)
                f.write(bytes(hi - lo))
                out["pages_lost"] += 1
                out["bytes_lost"] += hi - lo - data.count(0, lo, hi)
            f.flush()
            os.fsync(f.fileno())
    return out
