"""Figure Wk for one runner on one broker, one run: enqueue, drain, check.

1. Start the broker fresh (brokers.py).
2. Enqueue ``jobs`` no-op jobs from one child process, one framework call per job, with no
   worker running (enqueue.py): ``enqueue_per_s``.
3. Start the framework's worker command (runners.py) and read the record file (record.py)
   until every job has run, then ``settle_s`` longer for late duplicates; stop the worker
   by PID. ``jobs_per_s`` (the drain rate) = jobs / (last run - first run), so the
   worker's start-up is not counted.
4. Check the runs against the ids enqueued: missing (lost), duplicated, unexpected.

A drain that stalls (no run for ``stall_s``, or none within STARTUP_S of the worker's
start) or passes ``deadline_s`` stops there (``stopped`` says which); what did not run by
then counts as missing.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from ..jobs import check
from ..peers import servers
from . import brokers
from .enqueue import job_ids
from .record import RECORD_ENV, RecordReader
from .runners import Runner

STARTUP_S = 60.0    # a worker's first job may take this long (imports, connecting)
POLL_S = 0.02       # how often the record file is read
LOG_TAIL_BYTES = 2000


def run(runner: Runner, broker_kind: str, jobs: int, tag: str, tmp_root: str, shards: int,
        stall_s: float, deadline_s: float, settle_s: float) -> dict[str, Any]:
    tmpdir = tempfile.mkdtemp(prefix=f"Wk-{runner.name}-{broker_kind}-", dir=tmp_root)
    try:
        broker = brokers.start(broker_kind, tmpdir, shards)  # SkipPeer: the caller skips it
        try:
            return _play(runner, broker, jobs, tag, tmpdir, stall_s, deadline_s, settle_s)
        finally:
            broker.stop()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _env(broker: brokers.Broker, record_path: str) -> dict[str, str]:
    env = dict(os.environ, **broker.env)
    env[RECORD_ENV] = record_path
    env["PYTHONPATH"] = brokers.REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _play(runner: Runner, broker: brokers.Broker, jobs: int, tag: str, tmpdir: str,
          stall_s: float, deadline_s: float, settle_s: float) -> dict[str, Any]:
    record_path = os.path.join(tmpdir, "runs.log")
    env = _env(broker, record_path)
    enqueue_s = _enqueue(runner, jobs, tag, tmpdir, env, deadline_s)
    log_path = os.path.join(tmpdir, "worker.log")
    worker = servers.spawn(runner.argv(broker.settings), log_path, env=env, cwd=brokers.REPO)
    reader = RecordReader(record_path)
    try:
        stopped = _wait_drained(reader, worker, set(job_ids(tag, jobs)), stall_s,
                                 deadline_s, settle_s, log_path)
    finally:
        servers.stop_tree(worker)
    reader.poll()
    delivery = check(job_ids(tag, jobs), reader.ids)
    span_s = ((reader.last_ns - reader.first_ns) / 1e9
              if reader.first_ns is not None else 0.0)
    ran = delivery.expected - delivery.missing
    durability = f"{broker.durability} {runner.adds}".strip()
    return {"jobs": jobs, "durability": durability,
            "enqueue_s": enqueue_s, "enqueue_per_s": jobs / enqueue_s if enqueue_s > 0 else 0.0,
            "drain_s": span_s, "jobs_per_s": ran / span_s if span_s > 0 else 0.0,
            "stopped": stopped, "delivery": delivery.to_dict()}


def _enqueue(runner: Runner, jobs: int, tag: str, tmpdir: str, env: dict[str, str],
             deadline_s: float) -> float:
    out = os.path.join(tmpdir, "enqueue.json")
    log_path = os.path.join(tmpdir, "enqueue.log")
    argv = [sys.executable, "-m", "bench.workers.enqueue", runner.app, str(jobs), tag, out]
    proc = servers.spawn(argv, log_path, env=env, cwd=brokers.REPO)
    try:
        rc = proc.wait(deadline_s)
    except Exception:  # noqa: BLE001 - on a timeout or any failed wait the tree is stopped
        servers.stop_tree(proc)
        raise RuntimeError(f"enqueue did not finish within {deadline_s} s") from None
    if rc != 0:
        raise RuntimeError(f"enqueue exited with {rc}: {_tail(log_path)}")
    with open(out) as f:
        return json.load(f)["seconds"]


def _wait_drained(reader: RecordReader, worker, want: set[str], stall_s: float,
                  deadline_s: float, settle_s: float, log_path: str) -> str | None:
    """Read runs until every id in ``want`` ran (then ``settle_s`` more): None; or until
    the drain stalls or passes its deadline: which of the two, in words. Raises if the
    worker exits."""
    started = last_run = time.monotonic()
    seen: set[str] = set()
    while True:
        before = len(reader.ids)
        if reader.poll():
            last_run = time.monotonic()
            seen.update(reader.ids[before:])
            if want <= seen:
                time.sleep(settle_s)  # late duplicates, if any, land in the file meanwhile
                return None
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}: "
                               f"{_tail(log_path)}")
        now = time.monotonic()
        if now - started > deadline_s:
            return f"deadline ({deadline_s:.0f} s)"
        if reader.ids and now - last_run > stall_s:
            return f"stalled (no job ran for {stall_s:.0f} s)"
        if not reader.ids and now - last_run > STARTUP_S:
            return f"no job ran within {STARTUP_S:.0f} s of the worker's start"
        time.sleep(POLL_S)


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"
