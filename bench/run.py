"""Entry point: ``python -m bench.run [--quick] [--jobs N] [--runs R] [--only a,b]
[--figures A,M,Wk] [--runners shardq,celery] [--json PATH]``.

For each run, measures the machine's limits, then for each peer plays every chosen figure
group (see plan.py) on a freshly set-up peer, then figure Wk (each worker runner, see
workers/); after the runs, figure S (shardq scaling) if asked. Progress
goes to stderr, the final table to stdout, everything to the JSON file.

Exit status: 0 when every figure ran, every drain delivered each job exactly once and
every Wk runner ran each job exactly once; 1 when a figure failed, a delivery check did
not hold, or shardq itself (its peer or one of its Wk rows) was skipped: a peer may be
missing here, shardq may not; 2 when every peer and runner was skipped (nothing was
measured). No timing is ever checked.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import physical, plan, report, scaling
from .peers import PEERS, SkipPeer
from .peers.shardq_peer import ShardqAdapter, default_shard_count
from .workers import play as wk
from .workers.runners import RUNNERS, known_names

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
DEFAULT_JSON = os.path.join(RESULTS_DIR, "latest.json")
QUICK_JSON = os.path.join(RESULTS_DIR, "quick.json")  # so a quick check keeps latest.json
PROBE_S = 0.3  # fsync rate read just before each peer's figures: the disk's speed drifts


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Throughput of shardq and its peers (beanstalkd, Redis, persist-queue), "
                    "each at its durable setting; see bench/README.md.")
    p.add_argument("--quick", action="store_true",
                   help="1 run of 500 jobs, fewer samples, no scaling figure")
    p.add_argument("--jobs", type=int, help="jobs per figure (default 10000; quick 500)")
    p.add_argument("--runs", type=int, help="runs per figure, median shown (default 3)")
    p.add_argument("--only", default=",".join(PEERS),
                   help=f"comma-separated peers (default: {','.join(PEERS)})")
    p.add_argument("--figures", default=",".join(plan.figure_names()),
                   help="comma-separated figures to run (default: all of "
                        f"{','.join(plan.figure_names())}); figures that share a queue "
                        "(A and C, B and C2) run together")
    p.add_argument("--runners", default=",".join(RUNNERS),
                   help=f"figure Wk's worker runners (default: {','.join(RUNNERS)}); "
                        "runner@broker picks one row, e.g. celery@redis-always")
    p.add_argument("--wk-jobs", type=int,
                   help="figure Wk: no-op jobs per runner (default 20000; quick 200)")
    p.add_argument("--json", default=None,
                   help="where to write the results (default bench/results/latest.json; "
                        "with --quick, bench/results/quick.json)")
    p.add_argument("--shards", type=int, default=0,
                   help="shardq shards (default 0: what the default config gives this machine, "
                        "one per two CPUs)")
    p.add_argument("--lease-sync", choices=("batched", "strict"), default="batched",
                   help="shardq's lease_sync for the benchmark queue (default batched, the "
                        "queue default; strict: every lease fsynced before it is handed out)")
    p.add_argument("--busy-poll-us", type=int, default=None,
                   help="shardq's busy_poll_us for every router and shard of the run (default: "
                        "theirs; 0: callers sleep until their reply comes, shards until a request does)")
    p.add_argument("--restarted", action="store_true",
                   help="shardq on a data dir that was used, stopped and reopened (its newest "
                        "segment reopened, not freshly created)")
    p.add_argument("--scaling", action=argparse.BooleanOptionalAction, default=None,
                   help="figure S, shardq shards x threads (default: on, off with --quick)")
    p.add_argument("--no-install", action="store_true",
                   help="do not run bench/setup_peers.sh for missing peers")
    p.add_argument("--tmpdir", default=None, help="where data dirs go (default: system tmp)")
    args = p.parse_args(argv)
    args.json = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    args.only.sort(key=lambda n: n != "shardq")  # shardq's column first, the rest as given
    unknown = [n for n in args.only if n not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    args.figures = {n.strip() for n in args.figures.split(",") if n.strip()}
    unknown = sorted(args.figures - set(plan.figure_names()))
    if unknown:
        p.error(f"unknown figure(s) {unknown}; choose from {plan.figure_names()}")
    args.runners = [n.strip() for n in args.runners.split(",") if n.strip()]
    unknown = [n for n in args.runners if n not in known_names()]
    if unknown:
        p.error(f"unknown runner(s) {unknown}; choose from {known_names()}")
    if args.shards < 0:
        p.error(f"--shards {args.shards}: expected 0 (the default config's count) or more")
    args.shards = args.shards or default_shard_count()
    return args


def settings_from(args: argparse.Namespace) -> plan.Settings:
    s = plan.Settings.quick() if args.quick else plan.Settings.full()
    changes: dict[str, Any] = {}
    if args.jobs is not None:
        changes["jobs"] = args.jobs
    if args.runs is not None:
        changes["runs"] = args.runs
    if args.scaling is not None:
        changes["scaling"] = args.scaling
    if args.wk_jobs is not None:
        changes["wk_jobs"] = args.wk_jobs
    return dataclasses.replace(s, **changes)


def make_adapter(name: str, args: argparse.Namespace):
    if name == "shardq":
        return ShardqAdapter(shards=args.shards, lease_sync=args.lease_sync, restarted=args.restarted,
                             busy_poll_us=args.busy_poll_us)
    return PEERS[name]()


def play_group(name: str, group: plan.Group, args, settings: plan.Settings, run: int,
               tmp_root: str, peer: dict) -> None:
    """Set up a fresh peer, play ``group`` on it, tear it down; results go into ``peer``."""
    done: list[str] = []

    def record(figure: str, result: dict) -> None:
        done.append(figure)
        peer["figures"][figure]["runs"].append(result)
        progress(f"  [run {run + 1}] {name} {figure}: {plan.describe(figure, result)}")

    adapter = make_adapter(name, args)
    reason = group.not_applicable(adapter)  # from class attributes: no setup needed
    if reason:
        for figure in group.figures:
            peer["figures"][figure]["na"] = reason
        return
    tmpdir = tempfile.mkdtemp(prefix=f"{name}-{group.figures[0]}-", dir=tmp_root)
    try:
        adapter.setup(tmpdir)
        peer.setdefault("durability", adapter.durability)
        peer.setdefault("batch_mode", adapter.batch_mode)
        group.play(adapter, settings, f"r{run}", record)
    except SkipPeer as e:
        if not peer["figures_started"]:
            raise  # the peer cannot run at all: skipped
        _record_errors(group, done, f"setup failed: {e}", record)
    except Exception as e:  # noqa: BLE001 - a failed figure is recorded and the run goes on
        _record_errors(group, done, f"{type(e).__name__}: {e}", record)
    finally:
        peer["figures_started"] = True
        try:
            adapter.teardown()
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _record_errors(group: plan.Group, done: list[str], message: str, record) -> None:
    for figure in group.figures:
        if figure not in done:
            record(figure, {"error": message})


def install_missing(names: list[str]) -> None:
    def missing(name: str) -> bool:
        binaries = {"beanstalkd": ["beanstalkd"], "redis": ["redis-server"]}.get(name, [])
        modules = {"redis": "redis", "persistq": "persistqueue"}.get(name)
        gone = any(shutil.which(b) is None for b in binaries)
        if modules:
            probe = subprocess.run([sys.executable, "-c", f"import {modules}"],
                                   capture_output=True)
            gone = gone or probe.returncode != 0
        return gone

    todo = [n for n in names if n != "shardq" and missing(n)]
    if todo:
        progress(f"installing missing peers: {', '.join(todo)} (bench/setup_peers.sh)")
        from .peers.servers import install_peers
        install_peers(todo)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for label, argv in (("beanstalkd", ["beanstalkd", "-v"]),
                        ("redis-server", ["redis-server", "--version"])):
        if shutil.which(argv[0]):
            out = subprocess.run(argv, capture_output=True, text=True)
            found[label] = (out.stdout or out.stderr).strip()
    for dist in ("shardq", "redis", "persist-queue", "celery", "kombu", "dramatiq", "rq", "huey"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _stop_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through every adapter's teardown: its servers stop by PID


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    args = parse_args(argv)
    settings = settings_from(args)
    groups = plan.selected_groups(args.figures)
    peer_names = args.only if groups else []
    play_wk = "Wk" in args.figures
    if not args.no_install:
        install_missing(peer_names)
        if play_wk:
            wk.install_missing(args.runners, progress)
    tmp_root = tempfile.mkdtemp(prefix="shardq-bench-", dir=args.tmpdir)
    results: dict[str, Any] = {
        "meta": {"argv": sys.argv[1:], "settings": dataclasses.asdict(settings),
                 "shardq_shards": args.shards, "shardq_lease_sync": args.lease_sync,
                 "shardq_busy_poll_us": args.busy_poll_us,
                 "shardq_restarted": args.restarted, "cpus": os.cpu_count(),
                 "platform": platform.platform(), "tmp_root": tmp_root,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions()},
        "peers": {}, "physical": {}, "physical_runs": [], "scaling": None,
        "wk": wk.new_table(args.runners) if play_wk else {},
    }
    try:
        peers = results["peers"]
        for name in peer_names:
            peers[name] = {"status": "ok", "figures_started": False, "fsync_probe_per_s": [],
                           "figures": {f: {"runs": []} for g in groups for f in g.figures}}
        for run in range(settings.runs):
            progress(f"run {run + 1}/{settings.runs}: physical limits "
                     f"({settings.physical_s} s each) in {tmp_root}")
            limits = physical.measure(tmp_root, settings.physical_s)
            results["physical_runs"].append(limits)
            progress("  " + ", ".join(f"{k} {v:,.0f}" for k, v in limits.items()))
            for name in peer_names:
                if peers[name]["status"] != "ok":
                    continue
                probe = physical.fsync_rate(tmp_root, PROBE_S)
                peers[name]["fsync_probe_per_s"].append(probe)
                progress(f"run {run + 1}/{settings.runs}: {name} (fsync/s just before: "
                         f"{probe:,.0f})")
                for group in groups:
                    try:
                        play_group(name, group, args, settings, run, tmp_root, peers[name])
                    except SkipPeer as e:
                        peers[name].update(status="skipped", reason=str(e))
                        progress(f"  {name}: skipped: {e}")
                        break
            if play_wk:
                progress(f"run {run + 1}/{settings.runs}: figure Wk, {settings.wk_jobs:,} "
                         "no-op jobs per worker runner")
                wk.play_run(results["wk"], settings.wk_jobs, run, tmp_root, args.shards,
                            settings.stall_s, settings.wk_deadline_s, settings.wk_settle_s,
                            progress)
        if settings.scaling and "S" in args.figures and "shardq" in args.only \
                and peers.get("shardq", {}).get("status", "ok") == "ok":
            progress("figure S: shardq scaling")
            try:
                results["scaling"] = scaling.run(tmp_root, settings.jobs)
            except SkipPeer as e:
                results["scaling"] = {"skipped": str(e)}
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    runs = results["physical_runs"]
    results["physical"] = ({k: statistics.median(r[k] for r in runs) for k in runs[0]}
                           if runs else {})
    for peer in results["peers"].values():
        peer.pop("figures_started", None)
        for figure, fig in peer["figures"].items():
            fig["summary"] = report.summarize(figure, fig["runs"])
    for row in results["wk"].values():
        row["summary"] = report.summarize("Wk", row["runs"])
    status = exit_status(results)
    results["ok"] = status == 0
    write_json(results, args.json)
    print(report.text(results))
    progress(f"results: {args.json}; exit status {status}")
    return status


def exit_status(results: dict) -> int:
    measured = [p for p in results["peers"].values() if p["status"] == "ok"]
    rows = [r for r in results["wk"].values() if r["status"] == "ok"]
    scaled = isinstance(results.get("scaling"), dict) and "skipped" not in results["scaling"]
    if not measured and not rows and not scaled:
        return 2
    ours = [p for name, p in [*results["peers"].items(), *results["wk"].items()]
            if name.startswith("shardq")]
    if any(p["status"] != "ok" for p in ours):
        return 1
    summaries = [fig["summary"] for p in measured for fig in p["figures"].values()]
    for s in summaries + [r["summary"] for r in rows]:
        if s["errors"] or s.get("exactly_once") is False:
            return 1
    for mode in (results.get("scaling") or {}).values():
        if isinstance(mode, dict) and any(isinstance(c, dict) for row in mode.values()
                                          for c in row.values()):
            return 1
    return 0


def write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
