"""Workflows: a chord against plain jobs (docs/performance.md), measured:
``python -m bench.workflows [--members 10000] [--celery/--no-celery] [--runs 1]
[--result-wait during|after] [--redis always|default]``.

Issue 34's target: a chord of N no-op members and one callback drains in at most 1.5x the
time of N plain no-op jobs, on the same worker. Per side (``bench/workers/chords.py`` has
the method), in one run:

* shardq: ``shardq serve`` (2 shards) and ``shardq worker MODULE --concurrency 8``; plain
  jobs sent with ``send_many``, the chord with ``chord(group(...), done.s()).send()``.
* Celery: ``celery worker --pool threads -c 8`` on Redis (``appendfsync always`` by
  default: the setting equal to shardq's fsync before each reply), Redis also its result
  backend; plain jobs with ``apply_async(ignore_result=True)``, the chord with
  ``chord(group(...), done.s()).apply_async()``. Skipped, with the reason, where Celery, the
  redis client or redis-server is not installed (``pip install -e '.[bench]'``, ``bash
  bench/setup_peers.sh redis``).

Each shape gets a fresh broker and worker. With ``--runs`` above 1 the order of the shapes
alternates between runs, and the summary is the median. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from typing import Any

from . import physical
from .peers.base import SkipPeer
from .workers import chords

TARGET_RATIO = 1.5
PROBE_S = 0.3
STALL_S, DEADLINE_S, SETTLE_S = 60.0, 900.0, 0.5


def _side_runs(side: chords.Side, broker: str, members: int, runs: int, tmp_root: str,
               shards: int, wait: str, settle_s: float) -> dict[str, Any]:
    """Every run of both shapes on ``side``: ``{status, worker, runs: {shape: [...]}}``."""
    out: dict[str, Any] = {"status": "ok", "worker": side.command, "broker": broker,
                           "runs": {shape: [] for shape in chords.SHAPES}}
    missing = chords.missing_modules(side)
    if missing:
        return dict(out, status="skipped", reason=f"not installed: {', '.join(missing)} "
                                                  "(pip install -e '.[bench]')")
    for r in range(runs):
        order = chords.SHAPES if r % 2 == 0 else chords.SHAPES[::-1]
        for shape in order:
            tag = f"r{r}{side.name}{shape}"
            try:
                got = chords.run(side, broker, shape, members, tag, tmp_root, shards, wait,
                                 STALL_S, DEADLINE_S, settle_s)
            except SkipPeer as e:
                return dict(out, status="skipped", reason=str(e))
            out["runs"][shape].append(got)
    return out


def _median(rows: list[dict], field: str) -> float | None:
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def summary(side: dict[str, Any]) -> dict[str, Any]:
    """The medians of each shape, the chord's time over the plain jobs', and whether every
    member ran once and every callback once."""
    if side["status"] != "ok":
        return {}
    plain, chord = side["runs"]["plain"], side["runs"]["chord"]
    out: dict[str, Any] = {}
    for shape, rows in (("plain", plain), ("chord", chord)):
        out[shape] = {f: _median(rows, f) for f in ("send_s", "send_per_s", "drain_s",
                                                   "jobs_per_s")}
    out["chord"]["result_s"] = _median(chord, "result_s")
    p, c = out["plain"]["drain_s"], out["chord"]["drain_s"]
    out["chord_over_plain"] = round(c / p, 3) if p and c else None
    out["every_member_once"] = all(r["delivery"]["exactly_once"] for r in plain + chord)
    out["callback_once"] = all(r["callback_runs"] == 1 and r["callback_value"] == r["members"]
                               for r in chord)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workflows")
    p.add_argument("--members", type=int, default=10_000)
    p.add_argument("--celery", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--redis", choices=("always", "default"), default="always",
                   help="Redis persistence for Celery (runners.py): AOF fsync always, or defaults")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--result-wait", choices=chords.WAITS, default="during",
                   help="the sender waits for the chord's result while the worker drains it "
                        "(as a user would), or only after its callback ran")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds to wait after the last run for late duplicates")
    a = p.parse_args(argv)
    tmp_root = tempfile.mkdtemp(prefix="bench-wf-", dir="/tmp")  # short: unix socket paths
    try:
        probe = physical.fsync_rate(tmp_root, PROBE_S)
        wanted = [("shardq", "shardq")] + ([("celery", f"redis-{a.redis}")] if a.celery else [])
        sides = {name: _side_runs(chords.SIDES[name], broker, a.members, a.runs, tmp_root,
                                  a.shards, a.result_wait, a.settle)
                 for name, broker in wanted}
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    for side in sides.values():
        side["summary"] = summary(side)
    ratio = sides["shardq"]["summary"].get("chord_over_plain")
    print(json.dumps({
        "members": a.members, "shards": a.shards, "concurrency": 8, "runs": a.runs,
        "result_wait": a.result_wait,
        "cpus": os.cpu_count(), "fsync_probe_per_s": round(probe),
        "target": f"shardq chord drain <= {TARGET_RATIO}x plain",
        "target_met": ratio is not None and ratio <= TARGET_RATIO,
        "sides": sides}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
