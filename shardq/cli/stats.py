"""``shardq stats``: per-queue counts and per-shard figures."""
from __future__ import annotations

import argparse

import json
from typing import Any

from . import common, exits

COLUMNS = ["ready", "delayed", "waiting", "in_flight", "dead", "keys"]


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("stats", parents=[parent],
                       help=f"per-queue and per-shard figures (exit {exits.FAILURE} if a shard is down)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    with common.connect(args) as q:
        st = q.stats()
    down = [sh for sh in st["shards"] if not sh.get("available")]
    if args.json:
        print(json.dumps(st, indent=2, default=str))
    else:
        _table(st)
    return exits.FAILURE if down else exits.OK


def _table(st: dict[str, Any]) -> None:
    """The table, each queue name and down shard's reason :func:`common.shown` (escaped: a
    queue name with a newline or an escape sequence must not fake a row or drive the terminal)."""
    print(f"{'queue':<20}" + "".join(f"{c:>11}" for c in COLUMNS))
    for name, c in sorted(st["queues"].items()):
        lim = c.get("limits") or {}
        print(f"{common.shown(name):<20}" + "".join(f"{c.get(k, '-'):>11}" for k in COLUMNS)
              + ("  paused" if c.get("paused") else "")
              + (f"  owner shard {lim['owner']} down: figures not known" if lim.get("owner_down") else ""))
    if st.get("approximate"):  # a backend whose counts are estimates (SQS)
        print(f"({common.shown(st.get('backend', 'backend'))}: approximate counts; '-' = not known there)")
    if not st["shards"]:  # a backend with no shards of shardq's (SQS): no table of them
        return
    print()
    print(f"{'shard':<6}{'pid':>8}{'jobs':>11}{'wal_bytes':>13}{'segments':>10}{'clients':>9}")
    for sh in st["shards"]:
        if not sh.get("available"):
            print(f"{sh['shard']:<6}{'DOWN':>8}  {common.shown(why_down(sh), backslash=False)}")
            continue
        print(f"{sh['shard']:<6}{sh['pid']:>8}{sh['jobs']:>11}{sh['wal_bytes']:>13}{sh['segments']:>10}"
              f"{sh['clients']:>9}")


def why_down(sh: dict[str, Any]) -> str:
    """A down shard in words: the supervisor's status and reason when it published them
    (``restarting in 4 s: disk full: ...``, ``failed: corrupt log ... at offset N: ...``),
    else the error of the attempt to reach it."""
    status, reason = sh.get("status"), sh.get("reason")
    if status is None or (status in ("ready", "starting") and not reason):
        return str(sh.get("error", ""))
    if status == "restarting" and sh.get("restart_in_s") is not None:
        status = f"restarting in {sh['restart_in_s']:g} s"
    return f"{status}: {reason}" if reason else status
