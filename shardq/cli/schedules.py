"""``shardq schedules``: the periodic jobs the supervisor fires, with their next fire times.

Reads the config (``[schedules.*]`` and ``service.schedule_modules``) and, when the data dir
has one, the scheduler's record of the last tick fired. It needs no running service. A value
that is not there (a schedule's key; ``last`` of a schedule never fired) prints as ``-`` in
the table and as null in ``--json``.
"""
from __future__ import annotations

import argparse

from . import common, exits


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("schedules", parents=[parent],
                       help="list the periodic jobs with their next fire times")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..clock import SystemClock
    from ..service.scheduler import collect_schedules, load_state, state_path
    from ..schedules import iso, local_iso
    cfg = common.load_config(args.config)
    # the supervisor of `shardq serve` fires them and keeps their record: none on a backend's URL
    data_dir = common.local_only(args.data_dir or cfg.service.data_dir, "schedules")
    schedules = collect_schedules(cfg)
    state = load_state(state_path(data_dir))
    now = SystemClock().now()
    rows = []
    for s in sorted(schedules, key=lambda s: s.name):
        nxt = s.next_after(max(now, state.last.get(s.name, now)))
        fired = state.fired.get(s.name)  # (state.last is no fire: a start, a skipped tick)
        rows.append({"name": s.name, "when": s.describe(), "queue": s.queue, "key": s.key,
                     "runs": f"task {s.task}" if s.task else f"body {s.body[:40]!r}",
                     "next": local_iso(nxt, s.timezone), "next_utc": iso(nxt),
                     "last": iso(fired) if fired is not None else None,
                     "catch_up": s.catch_up})
    if args.json:
        common.print_json(rows)
        return exits.OK
    if not rows:
        print("no schedules (add [schedules.<name>] to the config, or list modules with "
              "@app.periodic tasks in service.schedule_modules)")
        return exits.OK
    cols = ["name", "when", "queue", "runs", "next", "last"]
    # escaped (names, queues, task names); "runs" shows a body as repr already: backslashes kept
    cells = [{c: common.shown(r[c] or "-", backslash=False) for c in cols} for r in rows]
    widths = {c: max(len(c), *(len(r[c]) for r in cells)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in cells:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return exits.OK
