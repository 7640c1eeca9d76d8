"""Figure Wk inside ``python -m bench.run``: the table of runner@broker rows, one run of all
of them, and installing what the chosen runners miss.

``results["wk"]`` holds, per row, its runner, broker, command, status (``ok`` or
``skipped`` with the reason), the fsync rate just before each run, and each run's result
(figure.py) or ``{"error": ...}``; run.py adds the summary.
"""
from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from typing import Any

from .. import physical
from ..peers import servers
from ..peers.base import SkipPeer
from . import figure
from .runners import RUNNERS, variant_name, variants

PROBE_S = 0.3


def new_table(names: list[str]) -> dict[str, Any]:
    return {variant_name(r, b): {"runner": r.name, "broker": b, "command": r.command,
                                 "status": "ok", "fsync_probe_per_s": [], "runs": []}
            for r, b in variants(names)}


def missing_modules(names: list[str]) -> list[str]:
    needed = {m for r, _b in variants(names) for m in r.modules}
    return sorted(m for m in needed if importlib.util.find_spec(m) is None)


def install_missing(names: list[str], progress: Callable[[str], None]) -> None:
    """pip-install the missing frameworks at the versions pinned in the bench extra;
    redis-server through setup_peers.sh if a Redis-based runner is chosen."""
    if any(b.startswith("redis-") for _r, b in variants(names)) \
            and shutil.which("redis-server") is None:
        progress("installing redis-server (bench/setup_peers.sh)")
        servers.install_peers(["redis"])
    missing = [m for m in missing_modules(names) if m != "shardq"]
    if missing:
        progress(f"installing missing frameworks: {', '.join(missing)} (pinned in pyproject)")
        servers.pip_install_pinned(missing)


def play_run(table: dict[str, Any], jobs: int, run: int, tmp_root: str, shards: int,
             stall_s: float, deadline_s: float, settle_s: float,
             progress: Callable[[str], None]) -> None:
    """One run of every row of ``table`` still ``ok``; results appended to its ``runs``."""
    for i, (name, row) in enumerate(table.items()):
        if row["status"] != "ok":
            continue
        runner = RUNNERS[row["runner"]]
        missing = [m for m in runner.modules if importlib.util.find_spec(m) is None]
        if missing:
            row.update(status="skipped", reason=f"not installed: {', '.join(missing)} "
                                                 "(pip install -e '.[bench]')")
            progress(f"  Wk {name}: skipped: {row['reason']}")
            continue
        probe = physical.fsync_rate(tmp_root, PROBE_S)
        row["fsync_probe_per_s"].append(probe)
        try:
            result = figure.run(runner, row["broker"], jobs, f"r{run}w{i}", tmp_root, shards,
                                stall_s, deadline_s, settle_s)
        except SkipPeer as e:
            row.update(status="skipped", reason=str(e))
            progress(f"  Wk {name}: skipped: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a failed peer is recorded and the others still run
            result = {"error": f"{type(e).__name__}: {e}"}
        if result.get("durability"):
            row["durability"] = result["durability"]
        row["runs"].append(result)
        progress(f"  [run {run + 1}] Wk {name}: {describe(result)} (fsync/s before: "
                 f"{probe:,.0f})")


def describe(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    d = result["delivery"]
    check = ("every job ran once" if d["exactly_once"] else
             f"NOT once: lost {d['missing']}, duplicate runs {d['duplicates']}, "
             f"unexpected {d['unexpected']}")
    stopped = f", drain stopped: {result['stopped']}" if result["stopped"] else ""
    return (f"enqueue {result['enqueue_per_s']:,.0f}/s, drain {result['jobs_per_s']:,.0f}/s, "
            f"{check}{stopped}")


