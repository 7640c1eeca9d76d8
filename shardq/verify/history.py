"""The chaos run's records: enqueue and lease histories, effect rows, job bodies, and the
readers of the files the producers and workers append to."""
from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import limits
from ..clock import SystemClock
from ..types import JobId


CLOCK = SystemClock()
#: Counts that must be zero for a pass.
FAILING = ("lost", "duplicated_effects", "order_violations", "unexpected", "id_mismatch",
           "double_in_flight", "token_reused", "body_mismatch", "attempt_reused")
EXAMPLES_MAX = 5
START_MARGIN_S = 0.05      # a worker never starts a lease with less than this left
STALL_POINTS = ("before_txn", "in_txn", "before_ack")
PROGRESS_EVERY_S = 5.0
SCHEMA = """CREATE TABLE IF NOT EXISTS effects (
    seqno INTEGER PRIMARY KEY AUTOINCREMENT,  -- commit order (writers are serialised)
    job_id INTEGER NOT NULL UNIQUE,
    lease_key TEXT, body BLOB, worker TEXT, attempt INTEGER, token INTEGER, t REAL,
    body_digest TEXT)  -- body: the header line only; body_digest: of the whole body"""


# ====================================================================== histories
@dataclass
class Enqueue:
    """One enqueue call: ``items`` are (key, seq); outcome ``ok`` (``ids`` in item order),
    ``fail`` (certainly not enqueued) or ``info`` (unknown: error, timeout, or no outcome).
    ``tries``: how many times the call was sent; more than one only with ``--dedup``, whose
    producers send a call of unknown outcome again with the same dedup ids. ``delayed``: how
    many of its jobs were enqueued with a delay (``--delay-prob``)."""

    producer: int
    op: int
    items: list[tuple[str, int]]
    outcome: str = "info"
    ids: list[JobId] | None = None
    error: str | None = None
    t0: float = 0.0
    t1: float | None = None
    tries: int = 1
    delayed: int = 0
    taken_up: bool = False   # sent again by the producer that replaced a killed one


@dataclass
class LeaseRec:
    """One lease as a worker saw it. ``t0``/``t1``: dequeue call and return; ``end_t0``: when
    the ack was sent (None: never sent, e.g. killed before, or expired before start);
    ``result``: ack outcome (None: unknown, the worker died) or ``expired`` (not started).
    ``nack_delay``: set when the worker failed the job (``--nack-prob``) and sent a ``nack``
    with that delay instead of an ack; ``end_t0`` and ``result`` are then the nack's.
    ``extended``: ``ok`` when the worker extended the lease (``--extend-prob``; ``deadline``
    is then the extended one), else the error that stopped it (the job was not started)."""

    worker: str
    job_id: int
    key: str | None
    attempt: int
    token: int
    deadline: float
    t0: float
    t1: float
    end_t0: float | None = None
    end_t1: float | None = None
    result: str | None = None
    commit_t: float | None = None
    inserted: bool | None = None
    stalled: str | None = None
    nack_delay: float | None = None
    extended: str | None = None


@dataclass
class Effect:
    """One row of the effect table. ``body`` is the body's header line (all of a small
    body); ``body_digest`` is :func:`body_digest` of the whole body as delivered."""

    order: int
    job_id: int
    lease_key: str | None
    body: bytes
    worker: str = ""
    attempt: int = 0
    t: float = 0.0
    body_digest: str | None = None


def body_for(producer: int, key: str, seq: int, size: int = 0) -> bytes:
    """A job's body: the header ``"<producer> <key> <seq>"``, padded to ``size`` bytes
    (``--body-bytes``; when larger than the header) with a newline and bytes derived from
    the header alone, so the checker can rebuild any body and compare it byte for byte."""
    head = f"{producer} {key} {seq}".encode()
    if size <= len(head) + 1:
        return head
    return head + b"\n" + hashlib.shake_128(head).digest(size - len(head) - 1)


def dedup_id_for(producer: int, key: str, seq: int) -> str:
    """A job's dedup id under ``--dedup``: unique per job, and as long as a dedup id may be
    (``DEDUP_ID_BYTES_MAX``), so the longest ids go through the log, compaction and replay."""
    head = f"{producer}/{key}/{seq}/"
    digest = hashlib.shake_128(head.encode()).hexdigest(limits.DEDUP_ID_BYTES_MAX)
    return head + digest[:limits.DEDUP_ID_BYTES_MAX - len(head)]


def body_header(body: bytes) -> bytes:
    return bytes(body).split(b"\n", 1)[0]


def body_digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def parse_body(body: bytes) -> tuple[int, str, int] | None:
    """(producer, key, seq) from a body or its header line; None if it is not a verify job."""
    try:
        p, key, seq = body_header(body).decode().split(" ")
        return int(p), key, int(seq)
    except (ValueError, UnicodeDecodeError):
        return None


def _json_lines(path: str) -> Iterator[dict[str, Any]]:
    """Decoded lines of a history file; a torn last line (writer killed) is skipped."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return
    for line in lines:
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_producer_history(path: str, producer: int) -> list[Enqueue]:
    ops: dict[int, Enqueue] = {}
    for r in _json_lines(path):
        if "i" in r:
            ops[r["i"]] = Enqueue(producer, r["i"], [tuple(x) for x in r["items"]], t0=r["t"],
                                  delayed=sum(1 for d in r.get("delays", ()) if d))
        elif "r" in r and r["r"] in ops:  # a try of unknown outcome, sent again (--dedup)
            ops[r["r"]].tries += 1
            ops[r["r"]].error = r.get("err")
            ops[r["r"]].taken_up |= bool(r.get("taken_up"))
        elif "o" in r and r["o"] in ops:
            e = ops[r["o"]]
            e.t1 = r["t"]
            if "ids" in r:
                e.outcome, e.ids = "ok", r["ids"]
            else:
                e.outcome, e.error = r.get("outcome", "info"), r.get("err")
    return list(ops.values())


def read_worker_history(path: str, worker: str) -> list[LeaseRec]:
    recs: dict[tuple[int, int], LeaseRec] = {}
    for r in _json_lines(path):
        if "l" in r:
            jid, key, attempt, token, deadline = r["l"]
            recs[(jid, token)] = LeaseRec(worker, jid, key, attempt, token, deadline, r["t0"], r["t1"])
            continue
        logged: tuple[Any, Any] = (r.get("j"), r.get("tok"))  # (job id, token) as the writer logged them
        rec = recs.get(logged)
        if rec is None:
            continue
        if "s" in r:
            rec.stalled = r["s"]
        elif "x" in r:
            rec.result = "expired"
        elif "c" in r:
            rec.commit_t, rec.inserted = r["t"], r["c"]
        elif "e" in r:
            if "deadline" in r:
                rec.extended, rec.deadline = "ok", r["deadline"]
            else:
                rec.extended = r.get("err", "unknown")
        elif "ack" in r:
            rec.end_t0 = r["t"]
            rec.nack_delay = r.get("nack")
        elif "a" in r:
            rec.end_t0, rec.end_t1, rec.result = r["t0"], r["t1"], r["a"]
    return list(recs.values())


PROTOCOL_RETRY_S = 10.0  # how long a read retries SQLite's "locking protocol"


def read_effects(db_path: str, after: int = 0) -> list[Effect]:
    """The effect rows after ``after``, in commit order. A worker SIGKILLed or stopped while
    it held the WAL index can make a reader's lock attempts fail for a moment with SQLite's
    "locking protocol" error (SQLITE_PROTOCOL, whose remedy is to try again): the read is
    retried, for up to PROTOCOL_RETRY_S."""
    deadline = CLOCK.monotonic() + PROTOCOL_RETRY_S
    while True:
        db = sqlite3.connect(db_path, timeout=60)
        try:
            rows = db.execute("SELECT seqno, job_id, lease_key, body, worker, attempt, t, body_digest FROM effects "
                              "WHERE seqno > ? ORDER BY seqno", (after,)).fetchall()
            return [Effect(*r) for r in rows]
        except sqlite3.OperationalError as e:
            if "locking protocol" not in str(e) or CLOCK.monotonic() >= deadline:
                raise
        finally:
            db.close()
        time.sleep(0.01)  # backoff before the next try, as SQLite's docs advise


# ====================================================================== the checker
