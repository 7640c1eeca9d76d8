"""Figure S, shardq only: enqueue throughput for 1, 2, 4 shards x 1, 4, 16 producer threads
sharing one router, one call per job ("unbatched") and batches of 100 ("batched").

Unbatched cells enqueue N jobs, batched cells 5 N (a batched cell of N jobs is over in tens
of milliseconds). One run per cell (no median): 18 cells are long enough already. Each
shard count gets a fresh data dir; its cells run in turn on the same router, so the queue
grows through them.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from typing import Any

from .jobs import make_items
from .peers.shardq_peer import ShardqAdapter
from .workloads import enqueue_threads

SHARDS = (1, 2, 4)
THREADS = (1, 4, 16)
MODES = {"unbatched": False, "batched": True}
BATCHED_JOBS_FACTOR = 5


def run(tmp_root: str, jobs: int) -> dict[str, Any]:
    """``{"unbatched": {"<shards>": {"<threads>": jobs_per_s}}, "batched": {...}}``;
    a cell that failed holds ``{"error": ...}``."""
    table: dict[str, Any] = {mode: {} for mode in MODES}
    for shards in SHARDS:
        tmpdir = tempfile.mkdtemp(prefix=f"S-{shards}-", dir=tmp_root)
        adapter = ShardqAdapter(shards=shards)
        adapter.setup(tmpdir)  # SkipPeer propagates: the caller reports S as skipped
        try:
            for mode, batch in MODES.items():
                count = jobs * BATCHED_JOBS_FACTOR if batch else jobs
                row = table[mode].setdefault(str(shards), {})
                for threads in THREADS:
                    items = make_items(f"S{shards}{mode[0]}{threads}", count)
                    try:
                        res = enqueue_threads(adapter, items, threads=threads, batch=batch)
                        row[str(threads)] = res["jobs_per_s"]
                    except Exception as e:  # noqa: BLE001 - a failed cell is recorded in the table
                        row[str(threads)] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  S {mode:9} shards={shards} threads={threads:2}: "
                          f"{_show(row[str(threads)])}", file=sys.stderr, flush=True)
        finally:
            adapter.teardown()
            shutil.rmtree(tmpdir, ignore_errors=True)
    return table


def _show(cell: Any) -> str:
    return f"{cell:,.0f} jobs/s" if isinstance(cell, float) else str(cell)
