"""The handler that ``shardq verify --worker-kind runner`` gives the standard worker runner
(``shardq worker shardq.verify.runner:handle --idempotency <effects db>``).

The runner leases, prefetches, heartbeats, commits through its SQLite idempotency store and
acks, all its own code; this handler only does what the harness's own worker loop does in
between: log the lease, fail some jobs (``Retry``), extend some leases and work past the
first deadline, and write the effect row in the store's transaction. The run's settings
come in ``SHARDQ_VERIFY_RUNNER`` (JSON: history file, worker name, seed, probabilities).
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import Retry
from .history import CLOCK, body_digest, body_header

if TYPE_CHECKING:
    from ..consumer.handling import Context

ENV = "SHARDQ_VERIFY_RUNNER"
#: The runner's effect table: like the worker loop's, but a job id may appear twice, so
#: that an idempotency store letting a second execution commit shows up as a duplicated
#: effect instead of a constraint error.
SCHEMA = """CREATE TABLE IF NOT EXISTS effects (
    seqno INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    lease_key TEXT, body BLOB, worker TEXT, attempt INTEGER, token INTEGER, t REAL,
    body_digest TEXT)"""

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _settings() -> dict[str, Any]:
    with _lock:
        if not _state:
            cfg = json.loads(os.environ[ENV])
            _state.update(cfg, rng=random.Random(f"{cfg['seed']}/runner/{cfg['name']}"),
                          file=open(cfg["history"], "a", encoding="utf-8"))  # noqa: SIM115 - for the process's life
        return _state


def _write(s: dict[str, Any], **rec: Any) -> None:
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    with _lock:
        s["file"].write(line)
        s["file"].flush()


def _draw(s: dict[str, Any], p: float) -> bool:
    with _lock:
        return p > 0 and s["rng"].random() < p


def handle(ctx: Context) -> None:
    """One job, as the chaos run checks it: every lease logged when the handler starts (its
    earliest possible grant is before that) and when it ends (the lease ends no earlier)."""
    s = _settings()
    lease = ctx.lease
    start = CLOCK.now()
    _write(s, l=[ctx.job_id, ctx.key, ctx.attempt, lease.token, lease.deadline], t0=start, t1=start)
    if _draw(s, s["nack_prob"]):  # a failure: no effect, the runner nacks with this delay
        with _lock:
            delay = s["rng"].choice((0.0, round(s["rng"].uniform(0.05, 0.5), 3)))
        _write(s, ack=ctx.job_id, j=ctx.job_id, tok=lease.token, t=CLOCK.now(), nack=delay)
        raise Retry(delay, "verify: the handler failed")
    try:
        if _draw(s, s["extend_prob"]):
            deadline = ctx.extend(s["extend_s"])
            _write(s, e=ctx.job_id, j=ctx.job_id, tok=lease.token, t=CLOCK.now(), deadline=deadline)
            busy = min(lease.deadline + 0.1, deadline - 0.2) - CLOCK.now()
            if busy > 0:
                time.sleep(busy)  # the handler's work past its first deadline, not synchronisation
        ctx.db.execute("INSERT INTO effects (job_id, lease_key, body, worker, attempt, token, t, body_digest) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (ctx.job_id, ctx.key, body_header(ctx.body), s["name"], ctx.attempt, lease.token,
                        CLOCK.now(), body_digest(ctx.body)))
    finally:
        _write(s, ack=ctx.job_id, j=ctx.job_id, tok=lease.token, t=CLOCK.now())
