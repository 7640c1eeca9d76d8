"""The producer and worker child processes of a chaos run
(``python -m shardq.verify _producer|_worker``)."""
from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..types import JobId, Lease
from .history import CLOCK, STALL_POINTS, START_MARGIN_S, body_digest, body_for, body_header, dedup_id_for


CLIENTS = ("threads", "aio")
T = TypeVar("T")
#: writes one record to a role's history file (``_hist``)
Write = Callable[..., None]


class _AioClient:
    """The asyncio client (``shardq.aio``) behind the router's calls that the roles make, each
    run to completion on a loop of its own, so the same producer and worker code drives
    either client. Its reconnects, re-sends and sessions are the asyncio client's own."""

    def __init__(self, data_dir: str, retry_s: float, request_timeout_s: float) -> None:
        import asyncio

        from ..client import aio
        self._loop = asyncio.new_event_loop()
        try:
            self._q = self._run(aio.connect(data_dir, retry_s=retry_s, request_timeout_s=request_timeout_s))
        except BaseException:
            self._loop.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def enqueue_many(self, jobs: list[dict[str, Any]]) -> list[JobId]:
        return self._run(self._q.enqueue_many(jobs))

    def dequeue_many(self, max_jobs: int, wait: float) -> list[Lease]:
        return self._run(self._q.dequeue_many(max_jobs=max_jobs, wait=wait))

    def ack(self, lease: Lease) -> None:
        self._run(self._q.ack(lease))

    def nack(self, lease: Lease, delay: float = 0.0, error: str | None = None) -> None:
        self._run(self._q.nack(lease, delay, error))

    def extend(self, lease: Lease, seconds: float) -> Lease:
        return self._run(self._q.extend(lease, seconds))

    def close(self) -> None:
        self._run(self._q.close())
        self._loop.close()


CONNECT_S = 30.0  # a role's first connect rides out a restart of the service this long (_connect)


def _connect(a: argparse.Namespace) -> Any:
    """The client ``--client`` names, with the role's retry budget as its request timeout
    (said in the role's log). A role started while the run restarts the service (a
    ``kill_service`` fault) finds no service for a moment: it connects again for up to
    :data:`CONNECT_S` rather than exit (a role's exit stops the run). Not its retry budget:
    a producer that gives up after 1 s, started late on a loaded machine, met a restart of
    3 s and ended the run."""
    from ..errors import ServiceNotRunning
    client = getattr(a, "client", "threads")
    print(f"client: {client}", flush=True)
    deadline = CLOCK.monotonic() + max(a.retry_s, CONNECT_S)
    while True:
        try:
            if client == "aio":
                return _AioClient(a.data_dir, a.retry_s, a.retry_s)
            import shardq
            return shardq.connect(a.data_dir, retry_s=a.retry_s, request_timeout_s=a.retry_s)
        except ServiceNotRunning:
            if CLOCK.monotonic() >= deadline:
                raise
            print("no service yet (a restart): connecting again", flush=True)
            time.sleep(0.1)  # a polled deadline: the run's supervisor is restarting it


def _hist(path: str) -> Write:
    f = open(path, "a")  # noqa: SIM115 - open for the life of the process, flushed per record

    def write(**rec: Any) -> None:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
    return write


def _taken_up(history: str, keys: list[str]) -> tuple[dict[str, Any], int, tuple[Any, ...] | None]:
    """What a killed producer left (``--resume``): each key's last sequence number, the last
    call number, and that call's ``(op, items, delays)`` if it has no answer. A line torn by
    the kill is ended, so the next record starts a line of its own."""
    from .history import _json_lines
    seqs = dict.fromkeys(keys, 0)
    calls: dict[int, dict[str, Any]] = {}
    answered = set()
    for r in _json_lines(history):
        if "i" in r:
            calls[r["i"]] = r
            for key, seq in r["items"]:
                seqs[key] = max(seqs.get(key, 0), seq)
        elif "o" in r:
            answered.add(r["o"])
    with open(history, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
    last = max(calls, default=0)
    open_call = None
    if last and last not in answered:
        r = calls[last]
        open_call = (last, [tuple(x) for x in r["items"]], r.get("delays", []))
    return seqs, last, open_call


def _send(q: Any, write: Write, a: argparse.Namespace, op: int, jobs: list[Any]) -> None:
    """One enqueue call and its outcome. With ``--dedup``, what an application does with a
    dedup id: a call of unknown outcome is sent again, before any later job of its keys,
    until it is answered (or the producers are stopped)."""
    from ..errors import ShardqError
    while True:
        try:
            ids = q.enqueue_many(jobs)
            write(o=op, t=CLOCK.now(), ids=ids)
            return
        except ShardqError as e:
            err = f"{type(e).__name__}: {e}"[:200]
            if not a.dedup or os.path.exists(a.stop):
                write(o=op, t=CLOCK.now(), outcome="info", err=err)
                return
            write(r=op, t=CLOCK.now(), err=err)


def _jobs(a: argparse.Namespace, items: list[Any], delays: list[Any]) -> list[Any]:
    jobs = [{"body": body_for(a.index, k, s, a.body_bytes), "key": k} for k, s in items]
    for job, (k, s), d in zip(jobs, items, delays or [0] * len(items)):
        if a.dedup:
            job["dedup_id"] = dedup_id_for(a.index, k, s)
        if d:
            job["delay"] = d
    return jobs


def producer_main(a: argparse.Namespace) -> int:
    keys = a.keys.split(",")
    rng = random.Random(f"{a.seed}/producer/{a.index}" + ("/resumed" if a.resume else ""))
    seqs, op, open_call = _taken_up(a.history, keys) if a.resume else (dict.fromkeys(keys, 0), 0, None)
    write = _hist(a.history)
    q = _connect(a)
    if open_call is not None and a.dedup:  # the killed producer's last call, maybe applied
        write(r=open_call[0], t=CLOCK.now(), err="the producer was killed during the call", taken_up=1)
        _send(q, write, a, open_call[0], _jobs(a, open_call[1], open_call[2]))
    pace = CLOCK.monotonic()
    while not os.path.exists(a.stop):
        items = []
        for _ in range(rng.randint(1, a.batch)):
            key = rng.choice(keys)
            seqs[key] += 1
            items.append((key, seqs[key]))
        op += 1
        delays = [round(rng.uniform(0.05, 0.5), 3) if rng.random() < a.delay_prob else 0 for _ in items] \
            if a.delay_prob else []
        write(i=op, t=CLOCK.now(), items=items, **({"delays": delays} if any(delays) else {}))
        _send(q, write, a, op, _jobs(a, items, delays))
        pace += len(items) / a.rate
        ahead = pace - CLOCK.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # pacing to the target rate, not synchronisation
        else:
            pace = CLOCK.monotonic()
    q.close()
    return 0


def worker_main(a: argparse.Namespace) -> int:
    from ..errors import JobGone, LeaseLost, ShardqError
    rng = random.Random(f"{a.seed}/worker/{a.name}")
    write = _hist(a.history)
    db = sqlite3.connect(a.db, isolation_level=None, timeout=300)
    db.execute("PRAGMA synchronous=FULL")
    q = _connect(a)

    def stall(where: str, stall_at: str | None, l: Lease) -> None:
        if where == stall_at:  # a fault: a GC pause or slow handler outliving the lease
            write(s=where, j=l.job_id, tok=l.token, t=CLOCK.now())
            time.sleep(max(l.deadline - CLOCK.now(), 0) + a.stall_s)

    while not os.path.exists(a.stop):
        t0 = CLOCK.now()
        try:
            leases = q.dequeue_many(max_jobs=a.batch, wait=0.5)
        except ShardqError as e:
            write(err=f"dequeue: {type(e).__name__}", t=CLOCK.now())
            continue
        t1 = CLOCK.now()
        for l in leases:
            write(l=[l.job_id, l.key, l.attempt, l.token, l.deadline], t0=t0, t1=t1)
        for l in leases:
            if CLOCK.now() >= l.deadline - START_MARGIN_S:
                write(x=1, j=l.job_id, tok=l.token, t=CLOCK.now())  # never start an expired lease
                continue
            if a.nack_prob and rng.random() < a.nack_prob:
                _fail(q, write, l, rng.choice((0.0, round(rng.uniform(0.05, 0.5), 3))))
                continue
            if a.extend_prob and rng.random() < a.extend_prob:
                l = _extend(q, write, l, a.extend_s)
                if l is None:
                    continue
            stall_at = rng.choice(STALL_POINTS) if rng.random() < a.stall_prob else None
            stall("before_txn", stall_at, l)
            db.execute("BEGIN IMMEDIATE")
            try:
                cur = db.execute("INSERT OR IGNORE INTO effects (job_id, lease_key, body, worker, attempt, "
                                 "token, t, body_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                 (l.job_id, l.key, body_header(l.body), a.name, l.attempt, l.token, CLOCK.now(),
                                  body_digest(l.body)))
                inserted = cur.rowcount == 1
                stall("in_txn", stall_at, l)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            write(c=inserted, j=l.job_id, tok=l.token, t=CLOCK.now())
            stall("before_ack", stall_at, l)
            ta = CLOCK.now()
            write(ack=l.job_id, j=l.job_id, tok=l.token, t=ta)  # if killed now, the ack may have landed
            try:
                q.ack(l)
                result = "ok"
            except (JobGone, LeaseLost) as e:
                result = type(e).__name__
            except ShardqError as e:
                result = type(e).__name__  # unknown: the lease expires and the job comes back
            write(a=result, j=l.job_id, tok=l.token, t0=ta, t1=CLOCK.now())
    q.close()
    return 0


def _fail(q: Any, write: Write, l: Lease, delay: float) -> None:
    """A handler that failed: no effect (its transaction never commits), and the job handed
    back with a ``nack`` of ``delay`` seconds (its retry backoff), during which it stays at
    the head of its key and blocks it."""
    from ..errors import ShardqError
    ta = CLOCK.now()
    write(ack=l.job_id, j=l.job_id, tok=l.token, t=ta, nack=delay)  # the lease may end here
    try:
        q.nack(l, delay, "verify: the handler failed")
        result = "ok"
    except ShardqError as e:  # LeaseLost or JobGone: it had ended; else unknown: it expires
        result = type(e).__name__
    write(a=result, j=l.job_id, tok=l.token, t0=ta, t1=CLOCK.now())


def _extend(q: Any, write: Write, l: Lease, seconds: float) -> Lease | None:
    """A long handler's heartbeat: extend the lease by ``seconds``, then work past its first
    deadline (inside the new one), where another worker getting the job would be two leases
    at once. Returns the extended lease, or None when it was lost (not started then)."""
    from ..errors import ShardqError
    t = CLOCK.now()
    try:
        longer: Lease = q.extend(l, seconds)
    except ShardqError as e:  # lost, or unknown: either way the job is not started
        write(e=l.job_id, j=l.job_id, tok=l.token, t=t, err=type(e).__name__)
        return None
    write(e=l.job_id, j=l.job_id, tok=l.token, t=t, deadline=longer.deadline)
    busy = min(l.deadline + 0.1, longer.deadline - 4 * START_MARGIN_S) - CLOCK.now()
    if busy > 0:
        time.sleep(busy)  # the handler's work, not synchronisation
    return longer


# ====================================================================== the run
