"""The workflows figure (``bench/workflows.py``): one side, one shape, one run.

A side is a framework's worker command on its broker: ``shardq worker`` (8 threads) on
``shardq serve``, or ``celery worker --pool threads -c 8`` on Redis, Redis being its result
backend too (a chord needs one). A shape is ``plain`` (N no-op jobs) or ``chord`` (a chord
of N no-op members and one callback). Per side, shape and run:

1. Start the broker fresh (brokers.py).
2. Send the jobs from a sender process with no worker running, timed (``send_s``):
   ``noop.send_many`` (shardq: one batch call per 10,000) or ``noop.apply_async(...,
   ignore_result=True)`` per job (Celery's one-job call, no result stored); for a chord,
   ``chord(group(noop.s(id) ...), done.s(cb)).send()`` / ``.apply_async()``. The sender of
   a chord then waits for its result (``Workflow.result`` / ``AsyncResult.get`` with
   ``follow_parents=False``), while the worker drains it (``wait="during"``, as a user
   would) or once the harness saw the callback run (``"after"``: the drain alone), and
   writes the value and when it came.
3. Start the worker command and read the record file (record.py) until every member ran
   (and the callback, for a chord), ``settle_s`` longer, then stop the worker by PID.
   ``drain_s``: the first run to the last member's (plain) or to the callback's (chord),
   so the worker's start-up is not counted; ``result_s``: the first run to the sender
   holding the chord's result (``"during"`` only).
4. Check the runs: every member once, the callback once, and the callback's value (the
   number of member values it got).

The sender: ``python -m bench.workers.chords SIDE SHAPE COUNT TAG OUT WAIT TIMEOUT_S``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..jobs import check
from ..peers import servers
from . import brokers
from .enqueue import job_ids
from .figure import POLL_S, _env, _tail, _wait_drained
from .record import RecordReader
from .runners import APPS, CONCURRENCY

SHAPES = ("plain", "chord")
WAITS = ("during", "after")  # the sender waits for the chord's result while it drains, or after
SHARDQ_WORKER = "shardq worker bench.workers.apps.shardq_app --concurrency 8 --mode thread"
CELERY_WORKER = "celery -A bench.workers.apps.celery_app:chords worker --pool threads -c 8"


@dataclass(frozen=True)
class Side:
    name: str
    command: str                        # the worker command, as a user types it (the report)
    modules: tuple[str, ...]            # Python modules it needs (else it is skipped)
    argv: Callable[[dict], list[str]]   # the worker's argv, given the broker's settings


def _shardq_argv(b: dict) -> list[str]:
    return [sys.executable, "-m", "shardq.cli", "worker", f"{APPS}.shardq_app",
            "--data-dir", b["data_dir"], "--concurrency", str(CONCURRENCY),
            "--mode", "thread", "--log-level", "WARNING"]


def _celery_argv(b: dict) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", f"{APPS}.celery_app:chords", "worker",
            "--pool", "threads", "--concurrency", str(CONCURRENCY), "--loglevel", "WARNING"]


SIDES = {"shardq": Side("shardq", SHARDQ_WORKER, ("shardq",), _shardq_argv),
         "celery": Side("celery", CELERY_WORKER, ("celery", "redis"), _celery_argv)}


def missing_modules(side: Side) -> list[str]:
    return [m for m in side.modules if importlib.util.find_spec(m) is None]


def callback_id(tag: str) -> str:
    return f"{tag}:callback"


# ----------------------------------------------------------------------------- the run
def run(side: Side, broker_kind: str, shape: str, members: int, tag: str, tmp_root: str,
        shards: int, wait: str, stall_s: float, deadline_s: float,
        settle_s: float) -> dict[str, Any]:
    """One run of ``shape`` on ``side``, the chord's result waited for ``wait`` (WAITS) the
    drain; raises SkipPeer (bench.peers.base) if its broker cannot run here."""
    tmpdir = tempfile.mkdtemp(prefix=f"Wf-{side.name}-{shape}-", dir=tmp_root)
    try:
        broker = brokers.start(broker_kind, tmpdir, shards)
        try:
            return _play(side, broker, shape, members, tag, tmpdir, wait, stall_s,
                         deadline_s, settle_s)
        finally:
            broker.stop()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _play(side: Side, broker: brokers.Broker, shape: str, members: int, tag: str,
          tmpdir: str, wait: str, stall_s: float, deadline_s: float,
          settle_s: float) -> dict[str, Any]:
    record_path = os.path.join(tmpdir, "runs.log")
    env = _env(broker, record_path)
    out = os.path.join(tmpdir, "sender")
    sender_log = os.path.join(tmpdir, "sender.log")
    sender = servers.spawn([sys.executable, "-m", "bench.workers.chords", side.name, shape,
                            str(members), tag, out, wait, str(deadline_s)],
                           sender_log, env=env, cwd=brokers.REPO)
    try:
        sent = _wait_for_file(f"{out}.sent", sender, deadline_s, sender_log)
        want = job_ids(tag, members) + ([callback_id(tag)] if shape == "chord" else [])
        worker_log = os.path.join(tmpdir, "worker.log")
        worker = servers.spawn(side.argv(broker.settings), worker_log, env=env,
                               cwd=brokers.REPO)
        reader = RecordReader(record_path)
        try:
            stopped = _wait_drained(reader, worker, set(want), stall_s, deadline_s, settle_s,
                                    worker_log)
        finally:
            servers.stop_tree(worker)
        _write(f"{out}.go", {})
        got = (_wait_for_file(f"{out}.result", sender, deadline_s, sender_log)
               if shape == "chord" and stopped is None else {})
    finally:
        servers.stop_tree(sender)
    reader.poll()
    return _figures(shape, members, want, reader, _ran_at(record_path), sent, got, stopped,
                    wait, broker.durability)


def _figures(shape: str, members: int, want: list[str], reader: RecordReader,
             ran_at: dict[str, int], sent: dict, got: dict, stopped: str | None,
             wait: str, durability: str) -> dict[str, Any]:
    delivery = check(want, reader.ids)
    first = reader.first_ns or 0
    # A plain drain ends at its last run; a chord's at its callback's (a late duplicate of
    # a member, if any, is counted in the delivery, not the time).
    end = None if stopped else reader.last_ns if shape == "plain" else ran_at.get(want[-1])
    drain_s = (end - first) / 1e9 if end is not None else None
    out: dict[str, Any] = {
        "shape": shape, "members": members, "durability": durability,
        "send_s": round(sent["seconds"], 4), "send_per_s": round(members / sent["seconds"]),
        "drain_s": _round(drain_s), "jobs_per_s": round(members / drain_s) if drain_s else None,
        "stopped": stopped, "delivery": delivery.to_dict()}
    if shape == "chord":
        returned = got.get("returned_ns") if wait == "during" else None
        out.update(result_wait=wait, callback_runs=reader.ids.count(want[-1]), callback_value=got.get("value"),
                   result_s=_round((returned - first) / 1e9 if returned else None))
    return out


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _ran_at(path: str) -> dict[str, int]:
    """id -> when it (first) ran, from the record file."""
    out: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                job_id, ns = line.rstrip(b"\n").rsplit(b" ", 1)
                out.setdefault(job_id.decode(), int(ns))
    except FileNotFoundError:
        pass
    return out


def _wait_for_file(path: str, proc, deadline_s: float, log_path: str) -> dict:
    """The JSON the sender wrote to ``path``; raises if it exits first or takes too long."""
    deadline = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if proc.poll() is not None and not os.path.exists(path):
            raise RuntimeError(f"the sender exited with {proc.returncode}: {_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sender wrote no {os.path.basename(path)} within "
                               f"{deadline_s:.0f} s: {_tail(log_path)}")
        time.sleep(POLL_S)
    with open(path) as f:
        result: dict = json.load(f)
    return result


# -------------------------------------------------------------------------- the sender
def _write(path: str, value: dict) -> None:
    """Write ``value`` to ``path`` whole: the harness polls for the name."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _wait_for_go(out: str, wait: str, timeout_s: float) -> None:
    """With ``wait == "after"``, return once the harness saw the callback run."""
    deadline = time.monotonic() + timeout_s
    while wait == "after" and not os.path.exists(out + ".go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {out}.go within {timeout_s} s")
        time.sleep(POLL_S)


def _send_shardq(shape: str, ids: list[str], cb: str, out: str, wait: str,
                 timeout_s: float) -> None:
    import shardq
    from .apps import shardq_app as a
    start = time.monotonic()
    if shape == "plain":
        a.wf_noop.send_many([((i,), {}) for i in ids])
        _write(out + ".sent", {"seconds": time.monotonic() - start})
        return
    wf = shardq.chord(shardq.group(a.wf_noop.s(i) for i in ids), a.wf_done.s(cb)).send()
    _write(out + ".sent", {"seconds": time.monotonic() - start})
    _wait_for_go(out, wait, timeout_s)
    value = wf.result(timeout=timeout_s)
    _write(out + ".result", {"value": value, "returned_ns": time.monotonic_ns()})


def _send_celery(shape: str, ids: list[str], cb: str, out: str, wait: str,
                 timeout_s: float) -> None:
    from celery import chord, group

    from .apps import celery_app as a
    start = time.monotonic()
    if shape == "plain":
        for i in ids:
            a.wf_noop.apply_async((i,), ignore_result=True)
        _write(out + ".sent", {"seconds": time.monotonic() - start})
        return
    res = chord(group(a.wf_noop.s(i) for i in ids), a.wf_done.s(cb)).apply_async()
    _write(out + ".sent", {"seconds": time.monotonic() - start})
    _wait_for_go(out, wait, timeout_s)
    # follow_parents=False: by default get() also checks every member's result for an
    # error, a Redis GET each, every 0.5 s; with 10,000 members that took the 2-CPU VM
    # minutes, beside the worker it slowed down.
    value = res.get(timeout=timeout_s, follow_parents=False)
    _write(out + ".result", {"value": value, "returned_ns": time.monotonic_ns()})


def main(argv: list[str]) -> int:
    side, shape, count, tag, out, wait, timeout_s = argv
    if shape not in SHAPES or wait not in WAITS:
        raise SystemExit(f"shape must be one of {SHAPES} and wait one of {WAITS}: {argv}")
    send = {"shardq": _send_shardq, "celery": _send_celery}[side]
    send(shape, job_ids(tag, int(count)), callback_id(tag), out, wait, float(timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

