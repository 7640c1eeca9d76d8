"""The supervisor's view of its shards, as clients in other processes read it (the writer is
:class:`shardq.service.status.StatusBoard`).

``<data>/run/supervisor.json`` holds, while ``shardq serve`` runs, each shard's status
(``starting``, ``ready``, ``restarting``, ``failed``), why it is not ready (``reason``, and
``reason_kind``: ``disk_full``, ``corrupt_log``, ``hung``, ``log_failed``, ``io_error``,
``exit``), its last exit, its restarts, and when a restart is due. ``shardq stats`` (any
:class:`~shardq.client.router.Router`) adds it to what the shards say, so a shard that is
down says why.

The file is created, with its space reserved, once at start; every update overwrites it in
place with one ``pwrite``. So publishing needs no free space: the status still goes out
when the disk is full, which is when it matters most. A reader that catches a write half
done reads again. A file whose supervisor is gone (SIGKILL) is ignored.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..clock import SystemClock

FILE = "supervisor.json"
BYTES_PER_SHARD = 1024
REASON_CHARS_MAX = 600  # a reason is cut to this, so every shard fits in BYTES_PER_SHARD


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILE)


def read(run_dir: str) -> dict[str, Any] | None:
    """What a running supervisor last published, or None (none running, or none published)."""
    for _ in range(5):
        try:
            with open(path(run_dir), "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            status = json.loads(data)
        except ValueError:
            continue  # read while it was being overwritten
        if type(status) is not dict or not pid_alive(status.get("pid")):
            return None
        return status
    return None


def add_to(shards: list[dict[str, Any]], run_dir: str) -> None:
    """Add to each of ``stats()``'s shard dicts what the running supervisor published about
    it (``restart_at`` becomes ``restart_in_s``); nothing if no supervisor runs."""
    published = read(run_dir)
    if published is None:
        return
    rows = {row.get("shard"): row for row in published.get("shards", [])}
    now = SystemClock().now()
    for sh in shards:
        row = dict(rows.get(sh["shard"], {}))
        at = row.pop("restart_at", None)
        if at is not None:
            row["restart_in_s"] = round(max(at - now, 0.0), 1)
        row.pop("shard", None)
        sh.update(row)


def pid_alive(pid: object) -> bool:
    """Whether ``pid`` (anything: a value read from a file) names a live process."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
