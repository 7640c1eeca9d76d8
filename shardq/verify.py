"""``shardq verify``: a seeded chaos run against a real service, then a history checker.

The run (Jepsen's ``total-queue`` workload, with kills and pauses):

* a real ``shardq serve`` on a fresh data dir: 1 s visibility timeout, a short health
  timeout, small WAL segments so compaction runs during the test;
* producer processes enqueue jobs under known keys; a job's body is ``"<producer> <key>
  <seq>"`` with a per-key sequence number (each key belongs to one producer, so its seqs are
  in enqueue order). Every enqueue's invocation and outcome (ok + ids / error) is appended
  and flushed to the producer's history file before and after the call;
* idempotent worker processes: for each lease, one SQLite transaction (WAL, synchronous=FULL,
  ``BEGIN IMMEDIATE``) inserts the effect row unless its job id is already there; commit;
  then ack. Workers log every lease (job id, key, attempt, token, deadline, times of lease,
  commit and ack) to their own history files;
* a seeded fault schedule (the seed is printed: the same seed gives the same schedule):
  SIGKILL one shard, SIGKILL the whole supervisor and its shards (then restart the service
  on the same data dir), SIGKILL a worker (restarted), SIGSTOP a shard or a worker for longer
  than the visibility timeout (sometimes longer than the health timeout, so the supervisor
  kills the shard as hung). Each round of five faults holds each kind once, in seeded order;
* then faults stop, producers stop, workers drain the queue, and :func:`check` reads the
  histories and the effect table.

Pass = no lost job, no duplicated effect, no per-key order violation, no unexpected job, no
id mismatch, no double in-flight lease of a key, no reused lease token. Exit 0 on pass, 1 on
fail, 2 when the run itself could not be carried out.

Per-key order. A key's next job becomes leasable only when its head is acked (or
dead-lettered); a worker acks only once the head's effect is committed (by itself or by an
earlier delivery); so effect(n) commits before ack(n) < lease(n+1) < effect(n+1). A worker
paused past its lease deadline may still commit late, but then nobody has acked job n yet (the
redelivery would have found and reused its row), so its late commit still precedes n+1.
Order can break only when the key is unblocked without the effect: a job dead-lettered
after ``max_deliveries`` (the run sets it out of reach and counts dead letters as lost), a
redrive, or a handler whose side effect is not inside the transaction that records the job
id. The checker counts late commits (after the lease deadline) so a run shows how often the
paused-worker case actually happened.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from .clock import SystemClock

CLOCK = SystemClock()
KINDS = ("kill_shard", "kill_service", "kill_worker", "pause_shard", "pause_worker")
#: Counts that must be zero for a pass.
FAILING = ("lost", "duplicated_effects", "order_violations", "unexpected", "id_mismatch",
           "double_in_flight", "token_reused")
EXAMPLES_MAX = 5
START_MARGIN_S = 0.05      # a worker never starts a lease with less than this left
STALL_POINTS = ("before_txn", "in_txn", "before_ack")
PROGRESS_EVERY_S = 5.0
SCHEMA = """CREATE TABLE IF NOT EXISTS effects (
    seqno INTEGER PRIMARY KEY AUTOINCREMENT,  -- commit order (writers are serialised)
    job_id INTEGER NOT NULL UNIQUE,
    lease_key TEXT, body BLOB, worker TEXT, attempt INTEGER, token INTEGER, t REAL)"""


# ====================================================================== histories
@dataclass
class Enqueue:
    """One enqueue call: ``items`` are (key, seq); outcome ``ok`` (``ids`` in item order),
    ``fail`` (certainly not enqueued) or ``info`` (unknown: error, timeout, or no outcome)."""

    producer: int
    op: int
    items: list
    outcome: str = "info"
    ids: list | None = None
    error: str | None = None
    t0: float = 0.0
    t1: float | None = None


@dataclass
class LeaseRec:
    """One lease as a worker saw it. ``t0``/``t1``: dequeue call and return; ``end_t0``: when
    the ack was sent (None: never sent, e.g. killed before, or expired before start);
    ``result``: ack outcome (None: unknown, the worker died) or ``expired`` (not started)."""

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


@dataclass
class Effect:
    order: int
    job_id: int
    lease_key: str | None
    body: bytes
    worker: str = ""
    attempt: int = 0
    t: float = 0.0


def body_for(producer: int, key: str, seq: int) -> bytes:
    return f"{producer} {key} {seq}".encode()


def parse_body(body: bytes) -> tuple[int, str, int] | None:
    try:
        p, key, seq = body.decode().split(" ")
        return int(p), key, int(seq)
    except (ValueError, UnicodeDecodeError):
        return None


def _json_lines(path: str):
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
            ops[r["i"]] = Enqueue(producer, r["i"], [tuple(x) for x in r["items"]], t0=r["t"])
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
        rec = recs.get((r.get("j"), r.get("tok")))
        if rec is None:
            continue
        if "s" in r:
            rec.stalled = r["s"]
        elif "x" in r:
            rec.result = "expired"
        elif "c" in r:
            rec.commit_t, rec.inserted = r["t"], r["c"]
        elif "ack" in r:
            rec.end_t0 = r["t"]
        elif "a" in r:
            rec.end_t0, rec.end_t1, rec.result = r["t0"], r["t1"], r["a"]
    return list(recs.values())


def read_effects(db_path: str, after: int = 0) -> list[Effect]:
    db = sqlite3.connect(db_path, timeout=60)
    try:
        rows = db.execute("SELECT seqno, job_id, lease_key, body, worker, attempt, t FROM effects "
                          "WHERE seqno > ? ORDER BY seqno", (after,)).fetchall()
    finally:
        db.close()
    return [Effect(*r) for r in rows]


# ====================================================================== the checker
@dataclass
class Report:
    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.counts.get(k, 0) == 0 for k in FAILING)

    def bad(self, what: str, example) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        ex = self.examples.setdefault(what, [])
        if len(ex) < EXAMPLES_MAX:
            ex.append(example)


def check(enqueues: list[Enqueue], leases: list[LeaseRec], effects: list[Effect],
          dead_letters: int = 0) -> Report:
    """Judge a run's histories. Pure: no I/O. See the module docstring for the rules."""
    rep = Report(counts=dict.fromkeys(FAILING, 0))
    invoked: dict[tuple, tuple[Enqueue, int | None]] = {}   # (key, seq) -> (op, id if ok)
    for op in enqueues:
        for i, item in enumerate(op.items):
            invoked[tuple(item)] = (op, op.ids[i] if op.outcome == "ok" else None)

    # Effects by (key, seq), in commit order.
    applied: dict[tuple, list[Effect]] = defaultdict(list)
    for e in sorted(effects, key=lambda e: e.order):
        parsed = parse_body(e.body)
        if parsed is None or (e.lease_key is not None and parsed[1] != e.lease_key):
            rep.bad("unexpected", {"job_id": e.job_id, "body": e.body.decode("utf-8", "replace")[:80],
                                   "why": "body not a verify job or not its lease's key"})
            continue
        applied[(parsed[1], parsed[2])].append(e)

    for kseq, effs in applied.items():
        if len(effs) > 1:
            rep.bad("duplicated_effects", {"key": kseq[0], "seq": kseq[1], "job_ids": [e.job_id for e in effs]})
        hit = invoked.get(kseq)
        if hit is None or hit[0].outcome == "fail":
            rep.bad("unexpected", {"key": kseq[0], "seq": kseq[1], "job_id": effs[0].job_id,
                                   "why": "never enqueued" if hit is None else "enqueue failed definitely"})
        elif hit[1] is not None and effs[0].job_id != hit[1]:
            rep.bad("id_mismatch", {"key": kseq[0], "seq": kseq[1], "enqueue_id": hit[1],
                                    "effect_job_id": effs[0].job_id})

    ok_jobs = ambiguous = recovered = 0
    for kseq, (op, jid) in invoked.items():
        if op.outcome == "ok":
            ok_jobs += 1
            if kseq not in applied:
                rep.bad("lost", {"key": kseq[0], "seq": kseq[1], "job_id": jid, "producer": op.producer})
        elif op.outcome == "info":
            ambiguous += 1
            recovered += kseq in applied

    def order_check(included, count_as: str | None) -> int:
        last: dict[str, tuple[int, Effect]] = {}
        bad = 0
        for e in sorted((effs[0] for effs in applied.values()), key=lambda e: e.order):
            _, key, seq = parse_body(e.body)
            if not included((key, seq)):
                continue
            prev = last.get(key)
            if prev is not None and seq < prev[0]:
                bad += 1
                if count_as:
                    rep.bad(count_as, {"key": key, "seq": seq, "committed_after_seq": prev[0],
                                       "job_id": e.job_id, "after_job_id": prev[1].job_id})
            else:
                last[key] = (seq, e)
        return bad

    order_check(lambda ks: ks in invoked and invoked[ks][0].outcome == "ok", "order_violations")
    rep.info["order_violations_incl_recovered"] = order_check(
        lambda ks: ks in invoked and invoked[ks][0].outcome != "fail", None)

    _check_leases(rep, leases)
    deliveries = Counter(l.job_id for l in leases)
    rep.info.update(
        enqueue_ops=len(enqueues),
        enqueue_ops_ok=sum(op.outcome == "ok" for op in enqueues),
        jobs_ok=ok_jobs, jobs_ambiguous=ambiguous, ambiguous_delivered=recovered,
        ambiguous_not_delivered=ambiguous - recovered,
        jobs_failed=sum(len(op.items) for op in enqueues if op.outcome == "fail"),
        effects=len(effects), deliveries=len(leases),
        duplicate_deliveries=sum(n - 1 for n in deliveries.values()),
        redelivered_jobs=sum(n > 1 for n in deliveries.values()),
        max_attempt=max((l.attempt for l in leases), default=0),
        worker_stalls=dict(Counter(l.stalled for l in leases if l.stalled)),
        leases_expired_before_start=sum(l.result == "expired" for l in leases),
        acks_lease_lost=sum(l.result in ("LeaseLost", "JobGone") for l in leases),
        late_commits=sum(l.commit_t is not None and l.commit_t > l.deadline for l in leases),
        late_commits_new_effect=sum(bool(l.inserted) and l.commit_t is not None and l.commit_t > l.deadline
                                    for l in leases),
        dead_letters=dead_letters)
    return rep


def _check_leases(rep: Report, leases: list[LeaseRec]) -> None:
    """Two leases of one key live at once, judged conservatively from the worker's clock
    readings: a lease was granted at some time in [t0, t1] and ended no earlier than
    min(ack sent, deadline); a pair overlaps for certain when each was granted before the
    other's earliest end."""
    seen: dict[tuple[int, int], str] = {}
    for l in leases:
        other = seen.setdefault((l.job_id, l.token), l.worker)
        if other != l.worker:
            rep.bad("token_reused", {"job_id": l.job_id, "token": l.token, "workers": [other, l.worker]})
    by_key: dict = defaultdict(list)
    for l in leases:
        if l.key is not None:
            by_key[l.key].append(l)

    def end_lo(l: LeaseRec) -> float:
        return min(l.deadline, l.end_t0 if l.end_t0 is not None else float("inf"))

    for key, ls in by_key.items():
        ls.sort(key=lambda l: l.t1)
        active: list[LeaseRec] = []
        for l in ls:
            active = [a for a in active if end_lo(a) > l.t1]
            for a in active:
                if a.t1 < end_lo(l) and (a.job_id, a.token) != (l.job_id, l.token):
                    rep.bad("double_in_flight", {
                        "key": key, "first": [a.job_id, a.token, a.worker], "second": [l.job_id, l.token, l.worker],
                        "first_deadline": a.deadline, "second_granted_by": l.t1})
            active.append(l)


# ====================================================================== child roles
def _hist(path: str):
    f = open(path, "a")

    def write(**rec) -> None:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
    return write


def producer_main(a) -> int:
    import shardq
    from .errors import ShardqError
    rng = random.Random(f"{a.seed}/producer/{a.index}")
    keys = a.keys.split(",")
    seqs = dict.fromkeys(keys, 0)
    write = _hist(a.history)
    q = shardq.connect(a.data_dir, retry_s=a.retry_s, request_timeout_s=a.retry_s)
    pace = CLOCK.monotonic()
    op = 0
    while not os.path.exists(a.stop):
        items = []
        for _ in range(rng.randint(1, a.batch)):
            key = rng.choice(keys)
            seqs[key] += 1
            items.append((key, seqs[key]))
        op += 1
        write(i=op, t=CLOCK.now(), items=items)
        try:
            ids = q.enqueue_many([{"body": body_for(a.index, k, s), "key": k} for k, s in items])
            write(o=op, t=CLOCK.now(), ids=ids)
        except ShardqError as e:
            write(o=op, t=CLOCK.now(), outcome="info", err=f"{type(e).__name__}: {e}"[:200])
        pace += len(items) / a.rate
        ahead = pace - CLOCK.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # pacing to the target rate, not synchronisation
        else:
            pace = CLOCK.monotonic()
    q.close()
    return 0


def worker_main(a) -> int:
    import shardq
    from .errors import JobGone, LeaseLost, ShardqError
    rng = random.Random(f"{a.seed}/worker/{a.name}")
    write = _hist(a.history)
    db = sqlite3.connect(a.db, isolation_level=None, timeout=300)
    db.execute("PRAGMA synchronous=FULL")
    q = shardq.connect(a.data_dir, retry_s=a.retry_s, request_timeout_s=a.retry_s)

    def stall(where: str, stall_at: str | None, l) -> None:
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
            stall_at = rng.choice(STALL_POINTS) if rng.random() < a.stall_prob else None
            stall("before_txn", stall_at, l)
            db.execute("BEGIN IMMEDIATE")
            try:
                cur = db.execute("INSERT OR IGNORE INTO effects (job_id, lease_key, body, worker, attempt, "
                                 "token, t) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (l.job_id, l.key, l.body, a.name, l.attempt, l.token, CLOCK.now()))
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


# ====================================================================== the run
def _short_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="sqv", dir="/tmp")  # unix socket paths must stay short


def _alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _toml(cfg: dict) -> str:
    out = []
    for section, body in cfg.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"


class Run:
    """One chaos run: owns every process it starts and ends them by PID."""

    def __init__(self, a):
        self.a = a
        self.rng = random.Random(f"{a.seed}/schedule")
        self.data_dir = a.data_dir or os.path.join(_short_tmpdir(), "data")
        self.work = self.data_dir.rstrip("/") + "-verify"
        os.makedirs(self.work, exist_ok=True)
        self.db = os.path.join(self.work, "effects.db")
        self.stop_producers = os.path.join(self.work, "stop-producers")
        self.stop_workers = os.path.join(self.work, "stop-workers")
        self.log_path = os.path.join(self.work, "service.log")
        self.service: subprocess.Popen | None = None
        self.producers: list[subprocess.Popen] = []
        self.workers: dict[int, subprocess.Popen] = {}
        self.worker_files: list[tuple[str, str]] = []
        self.incarnation: Counter = Counter()
        self.faults: Counter = Counter()
        self.unexpected_exits: Counter = Counter()
        self.started = CLOCK.monotonic()
        self.next_progress = self.started + PROGRESS_EVERY_S
        self._effects_seen = 0
        self._delivered: set = set()
        self.env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, self.env.get("PYTHONPATH")]))

    # ------------------------------------------------------------------ processes
    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        out = open(os.path.join(self.work, log_name), "ab")
        try:
            return subprocess.Popen([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env)
        finally:
            out.close()

    def start_service(self) -> None:
        cfg = os.path.join(self.work, "shardq.toml")
        with open(cfg, "w") as f:
            f.write(_toml({
                "service": {"health_timeout": self.a.health_timeout, "restart_limit": 1000,
                            "restart_window": 1.0},
                "limits": {"segment_bytes": 32 * 1024, "compact_min_bytes": 64 * 1024},
                "queue_defaults": {"visibility_timeout": self.a.visibility, "max_deliveries": self.a.max_deliveries},
            }))
        self.service = self._spawn(["-m", "shardq.cli", "serve", "--config", cfg, "--data-dir", self.data_dir,
                                    "--shards", str(self.a.shards)], "service.log")
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import shardq
        deadline = CLOCK.monotonic() + timeout
        while True:
            if self.service.poll() is not None:
                raise RuntimeError(f"shardq serve exited with {self.service.returncode}; see {self.log_path}")
            try:
                with shardq.connect(self.data_dir, retry_s=0.5, request_timeout_s=2) as q:
                    q.ping()
                return
            except Exception:
                if CLOCK.monotonic() > deadline:
                    raise RuntimeError(f"service not ready after {timeout:.0f} s; see {self.log_path}") from None
                time.sleep(0.05)  # poll with a deadline

    def service_pids(self) -> list[int]:
        import psutil
        try:
            return [self.service.pid] + [c.pid for c in psutil.Process(self.service.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return [self.service.pid]

    def shard_pids(self) -> dict[int, int]:
        import psutil
        out = {}
        try:
            for c in psutil.Process(self.service.pid).children():
                cmd = c.cmdline()
                if "shardq.shard.process" in cmd and "--index" in cmd:
                    out[int(cmd[cmd.index("--index") + 1])] = c.pid
        except psutil.Error:
            pass
        return out

    def kill_service(self) -> None:
        pids = self.service_pids()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self.service.wait()
        self._wait_gone(pids)

    @staticmethod
    def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
        deadline = CLOCK.monotonic() + timeout
        while any(_alive(p) for p in pids) and CLOCK.monotonic() < deadline:
            time.sleep(0.01)  # poll with a deadline

    def start_producers(self) -> None:
        keys = [f"k{i:03d}" for i in range(self.a.keys)]
        for p in range(self.a.producers):
            mine = keys[p::self.a.producers]
            self.producers.append(self._spawn(
                ["-m", "shardq.verify", "_producer", "--data-dir", self.data_dir, "--index", str(p),
                 "--keys", ",".join(mine), "--history", os.path.join(self.work, f"producer-{p}.jsonl"),
                 "--stop", self.stop_producers, "--seed", str(self.a.seed), "--rate", str(self.a.rate),
                 # Even producers retry long enough to ride out every fault; odd ones give
                 # up after 1 s, so pauses and restarts leave enqueues of unknown outcome.
                 "--batch", "5", "--retry-s", "8" if p % 2 == 0 else "1"], f"producer-{p}.log"))

    def start_worker(self, w: int) -> None:
        self.incarnation[w] += 1
        name = f"w{w}.{self.incarnation[w]}"
        hist = os.path.join(self.work, f"worker-{name}.jsonl")
        self.worker_files.append((name, hist))
        self.workers[w] = self._spawn(
            ["-m", "shardq.verify", "_worker", "--data-dir", self.data_dir, "--name", name, "--db", self.db,
             "--history", hist, "--stop", self.stop_workers, "--batch", "4", "--retry-s", "5",
             "--seed", str(self.a.seed), "--stall-prob", str(self.a.stall_prob),
             "--stall-s", str(self.a.visibility / 2)],
            f"worker-{w}.log")

    def init_db(self) -> None:
        db = sqlite3.connect(self.db, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(SCHEMA)
        db.close()

    # ------------------------------------------------------------------ faults
    def tick(self) -> None:
        """Keep the cast alive (restart what died on its own) and print progress."""
        if self.service is not None and self.service.poll() is not None:
            self.unexpected_exits["service"] += 1
            self._log(f"service exited on its own with {self.service.returncode}; restarting")
            self.start_service()
        for w, proc in list(self.workers.items()):
            if proc.poll() is not None and not os.path.exists(self.stop_workers):
                self.unexpected_exits["worker"] += 1
                self._log(f"worker {w} exited on its own with {proc.returncode}; restarting")
                self.start_worker(w)
        if CLOCK.monotonic() >= self.next_progress:
            self.next_progress += PROGRESS_EVERY_S
            self.progress()

    def sleep(self, seconds: float) -> None:
        """Sleep inside the fault schedule (spacing faults, holding a pause), ticking."""
        end = CLOCK.monotonic() + seconds
        while (left := end - CLOCK.monotonic()) > 0:
            time.sleep(min(left, 0.1))
            self.tick()

    def inject(self, kind: str) -> str:
        a, rng = self.a, self.rng
        if kind == "kill_shard":
            pids = self.shard_pids()
            if not pids:
                return "no shard running"
            i = rng.choice(sorted(pids))
            _signal(pids[i], signal.SIGKILL)
            detail = f"shard {i} pid {pids[i]}"
        elif kind == "kill_service":
            t0 = CLOCK.monotonic()
            self.kill_service()
            self.start_service()
            detail = f"restarted in {CLOCK.monotonic() - t0:.1f} s"
        elif kind == "kill_worker":
            w = rng.randrange(a.workers)
            _signal(self.workers[w].pid, signal.SIGKILL)
            self.workers[w].wait()
            self.start_worker(w)
            detail = f"worker {w}"
        elif kind == "pause_shard":
            pids = self.shard_pids()
            if not pids:
                return "no shard running"
            i = rng.choice(sorted(pids))
            hung = rng.random() < 0.25
            d = a.health_timeout * 1.5 if hung else rng.uniform(1.5 * a.visibility, 0.8 * a.health_timeout)
            _signal(pids[i], signal.SIGSTOP)
            self.sleep(d)
            _signal(pids[i], signal.SIGCONT)
            if hung:
                self.faults["pause_shard_past_health_timeout"] += 1
            detail = f"shard {i} for {d:.1f} s"
        elif kind == "pause_worker":
            w = rng.randrange(a.workers)
            d = rng.uniform(1.5 * a.visibility, 3 * a.visibility)
            pid = self.workers[w].pid
            _signal(pid, signal.SIGSTOP)
            self.sleep(d)
            _signal(pid, signal.SIGCONT)
            detail = f"worker {w} for {d:.1f} s"
        else:
            raise ValueError(kind)
        self.faults[kind] += 1
        return detail

    def schedule(self) -> None:
        a, rng = self.a, self.rng
        end = self.started + a.duration
        deck: list[str] = []
        self.sleep(rng.uniform(0.5, 1.0) * a.fault_interval)
        while CLOCK.monotonic() < end:
            if not deck:
                deck = list(KINDS)
                rng.shuffle(deck)
            kind = deck.pop()
            detail = self.inject(kind)
            self._log(f"fault {kind}: {detail}")
            self.sleep(min(rng.uniform(0.5, 1.5) * a.fault_interval, max(end - CLOCK.monotonic(), 0)))

    # ------------------------------------------------------------------ progress
    def _log(self, msg: str) -> None:
        print(f"[{CLOCK.monotonic() - self.started:7.1f}s] {msg}", flush=True)

    def _enqueues(self) -> list[Enqueue]:
        return [op for p in range(self.a.producers)
                for op in read_producer_history(os.path.join(self.work, f"producer-{p}.jsonl"), p)]

    def _applied(self) -> set:
        for e in read_effects(self.db, self._effects_seen):
            self._effects_seen = max(self._effects_seen, e.order)
            parsed = parse_body(e.body)
            if parsed:
                self._delivered.add(parsed[1:])
        return self._delivered

    def progress(self) -> None:
        ops = self._enqueues()
        ok = sum(len(o.items) for o in ops if o.outcome == "ok")
        amb = sum(len(o.items) for o in ops if o.outcome != "ok" and o.t1 is not None)
        faults = sum(self.faults[k] for k in KINDS)
        self._log(f"enqueued ok={ok} ambiguous={amb} | delivered={len(self._applied())} | faults={faults} "
                  + " ".join(f"{k}={self.faults[k]}" for k in KINDS if self.faults[k]))

    # ------------------------------------------------------------------ drain and check
    def drain(self) -> dict:
        import shardq
        open(self.stop_producers, "w").close()
        deadline = CLOCK.monotonic() + 60
        for p in self.producers:
            while p.poll() is None and CLOCK.monotonic() < deadline:
                self.sleep(0.1)
            if p.poll() is None:
                p.kill()
                p.wait()
        ok_items = {tuple(it) for op in self._enqueues() if op.outcome == "ok" for it in op.items}
        self._log(f"producers stopped; draining {len(ok_items) - len(ok_items & self._applied())} "
                  "acknowledged jobs not yet applied")
        deadline = CLOCK.monotonic() + self.a.drain_timeout
        backlog, empty_polls = None, 0
        q = shardq.connect(self.data_dir, retry_s=5, request_timeout_s=5)
        try:
            while CLOCK.monotonic() < deadline:
                self.tick()
                try:
                    st = q.stats()["queues"].get("default", {})
                    backlog = sum(st.get(k, 0) for k in ("ready", "delayed", "waiting", "in_flight"))
                except Exception:
                    backlog = None
                empty_polls = empty_polls + 1 if backlog == 0 else 0
                # Done when every acknowledged job is applied, or when nothing is left to
                # deliver (only dead letters, if any) for a second.
                if backlog == 0 and (ok_items <= self._applied() or empty_polls >= 5):
                    break
                time.sleep(0.2)  # poll with a deadline
            try:
                dead = len(q.dead_letters("default", limit=10_000))
            except Exception:
                dead = -1
        finally:
            q.close()
        open(self.stop_workers, "w").close()
        for proc in self.workers.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {"drained": backlog == 0, "backlog_left": backlog,
                "dead_letters": dead}

    def stop_service(self) -> None:
        if self.service is None or self.service.poll() is not None:
            return
        pids = self.service_pids()
        self.service.send_signal(signal.SIGTERM)
        try:
            self.service.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self._wait_gone(pids)

    def cleanup(self) -> None:
        """End every process this run started, by PID."""
        for proc in [*self.producers, *self.workers.values()]:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
        if self.service is not None:
            pids = self.service_pids() if self.service.poll() is None else []
            for pid in pids:
                _signal(pid, signal.SIGCONT)
                _signal(pid, signal.SIGKILL)
            if pids:
                self.service.wait()
                self._wait_gone(pids)

    def wal_check(self) -> dict:
        from .datadir import DataDir
        from .wal import repair
        dd = DataDir(self.data_dir)
        statuses = Counter(r.status for i in range(dd.shards()) for r in repair.check(dd.shard_dir(i)))
        return dict(statuses)

    def service_events(self) -> dict:
        events = Counter()
        try:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if "event=shard-exit" in line:
                        events["shard_exits_sigkill" if "signal=SIGKILL" in line else "shard_exits_other"] += 1
                    for ev in ("shard-hung", "shard-failed", "shard-restart"):
                        if f"event={ev} " in line:
                            events[ev.replace("-", "_")] += 1
                    if "torn tail truncated" in line:
                        events["torn_tails_repaired"] += 1
                    if " compacted: " in line:
                        events["compactions"] += 1
        except OSError:
            pass
        return dict(events)


def run(a) -> int:
    if a.data_dir and os.path.exists(a.data_dir) and os.listdir(a.data_dir):
        print(f"error: --data-dir {a.data_dir} is not empty; verify needs a fresh directory", file=sys.stderr)
        return 2
    r = Run(a)
    print(f"shardq verify seed={a.seed} duration={a.duration}s shards={a.shards} producers={a.producers} "
          f"workers={a.workers} keys={a.keys} visibility={a.visibility}s data_dir={r.data_dir}", flush=True)
    print(f"replay: shardq verify --seed {a.seed} --duration {a.duration} --shards {a.shards} "
          f"--producers {a.producers} --workers {a.workers} --keys {a.keys} --fault-interval {a.fault_interval}",
          flush=True)
    try:
        r.init_db()
        r.start_service()
        r.start_producers()
        for w in range(a.workers):
            r.start_worker(w)
        r.schedule()
        r._log("fault schedule over; stopping producers")
        drain = r.drain()
        r.stop_service()
        wal = r.wal_check()
    except RuntimeError as e:
        print(f"error: the run could not be carried out: {e}; files kept in {r.work}", file=sys.stderr)
        return 2
    finally:
        r.cleanup()
    enqueues = r._enqueues()
    leases = [l for name, path in r.worker_files for l in read_worker_history(path, name)]
    effects = read_effects(r.db)
    rep = check(enqueues, leases, effects, dead_letters=max(drain["dead_letters"], 0))
    rep.info.update(drain)
    rep.info["wal_check"] = wal
    rep.info["service"] = r.service_events()
    rep.info["unexpected_exits"] = dict(r.unexpected_exits)
    if wal.get("corrupt"):
        rep.counts["wal_corrupt"] = wal["corrupt"]
    faults = {k: r.faults[k] for k in KINDS}
    faults["pause_shard_past_health_timeout"] = r.faults["pause_shard_past_health_timeout"]
    passed = rep.ok and not rep.counts.get("wal_corrupt")
    _print_summary(a, rep, faults, passed, CLOCK.monotonic() - r.started)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"passed": passed, "seed": a.seed, "args": {k: v for k, v in vars(a).items() if k != "fn"},
                       "faults": faults, "elapsed_s": round(CLOCK.monotonic() - r.started, 1),
                       **asdict(rep)}, f, indent=2, default=str)
    if passed and not a.data_dir and not a.keep:
        shutil.rmtree(os.path.dirname(r.data_dir), ignore_errors=True)
    else:
        print(f"data dir and histories kept in {r.data_dir} and {r.work}")
    return 0 if passed else 1


def _print_summary(a, rep: Report, faults: dict, passed: bool, elapsed: float) -> None:
    i = rep.info
    print()
    print(f"shardq verify summary  (seed {a.seed}, {elapsed:.0f} s)")
    print("faults injected: " + ", ".join(f"{k}={v}" for k, v in faults.items())
          + f"  (total {sum(faults[k] for k in KINDS)})")
    print(f"enqueue calls {i['enqueue_ops']} ({i['enqueue_ops_ok']} ok); jobs ok {i['jobs_ok']}, "
          f"ambiguous {i['jobs_ambiguous']} (delivered {i['ambiguous_delivered']}, "
          f"not {i['ambiguous_not_delivered']}), failed {i['jobs_failed']}")
    print(f"deliveries {i['deliveries']} (duplicate {i['duplicate_deliveries']}, max attempt {i['max_attempt']}, "
          f"expired before start {i['leases_expired_before_start']}, ack LeaseLost {i['acks_lease_lost']}); "
          f"worker stalls {i['worker_stalls']}; "
          f"effects {i['effects']}; late commits {i['late_commits']} "
          f"(new effect {i['late_commits_new_effect']}); dead letters {i['dead_letters']}")
    print(f"service: {i.get('service')}; wal check after stop: {i.get('wal_check')}; "
          f"drained: {i.get('drained')}")
    print(f"{'check':<28}{'count':>8}  result")
    for k in (*FAILING, *(["wal_corrupt"] if "wal_corrupt" in rep.counts else [])):
        n = rep.counts.get(k, 0)
        print(f"{k:<28}{n:>8}  {'ok' if n == 0 else 'FAIL'}")
        for ex in rep.examples.get(k, []):
            print(f"    e.g. {json.dumps(ex, default=str)}")
    print(f"VERDICT: {'PASS' if passed else 'FAIL'}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardq verify", description="chaos run + history checker")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faults (default 60)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--keys", type=int, default=20)
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--data-dir", help="fresh service data dir (default: a temp dir, removed on pass)")
    p.add_argument("--json", help="write the full report to this file")
    p.add_argument("--fault-interval", type=float, default=3.0, help="mean seconds between faults")
    p.add_argument("--visibility", type=float, default=1.0, help="visibility timeout, seconds")
    p.add_argument("--health-timeout", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=100.0, help="jobs/s per producer")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--max-deliveries", type=int, default=1_000_000,
                   help="queue max_deliveries (default: out of reach; small values show what "
                        "dead-lettering does to per-key order)")
    p.add_argument("--stall-prob", type=float, default=0.002,
                   help="chance that a worker stalls past a lease's deadline (before its transaction, "
                        "inside it, or before the ack)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on pass")
    return p


def _child_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"shardq verify {role}")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--retry-s", type=float, default=5.0)
    if role == "_producer":
        p.add_argument("--index", type=int, required=True)
        p.add_argument("--keys", required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--rate", type=float, required=True)
    else:
        p.add_argument("--name", required=True)
        p.add_argument("--db", required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--stall-prob", type=float, default=0.0)
        p.add_argument("--stall-s", type=float, default=0.5)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("_producer", "_worker"):
        role = argv[0]
        a = _child_parser(role).parse_args(argv[1:])
        return producer_main(a) if role == "_producer" else worker_main(a)
    a = build_parser().parse_args(argv)
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 2**31)
    if a.keys < a.producers or min(a.shards, a.producers, a.workers, a.keys) < 1:
        print("error: need at least one shard, producer, worker and key, and keys >= producers", file=sys.stderr)
        return 2
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
