"""End-to-end tests of the multi-process service: real ``shardq serve`` processes, real
routers in this process and in child processes, no mocks.

Synchronisation is by polling with a deadline (``wait_until``), blocking calls with
timeouts, or lines a child process prints; never by sleeping. Every process started here is
cleaned up by PID.
"""
from __future__ import annotations

import json
import os
import queue as queue_mod
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import psutil
import pytest

import shardq
from support.service import REPO, Service, short_tmpdir, wait_until
from shardq.errors import LeaseLost
from shardq.client.router import shard_for_key
from shardq.types import Lease

CONFIG = {
    "queue_defaults": {"visibility_timeout": 30},
    "queues": {"default": {}, "dl": {"max_deliveries": 2}, "st": {"max_deliveries": 1}},
}


@pytest.fixture
def svc():
    with Service(config=CONFIG) as s:
        yield s


def keys_on_shard(shard: int, n: int, shards: int = 2, prefix: str = "k") -> list[str]:
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if shard_for_key(k, shards) == shard:
            out.append(k)
        i += 1
    return out


class Script:
    """A small python program as a child process; its stdout lines arrive on a queue."""

    def __init__(self, code: str, *args: str):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        self.lines: queue_mod.Queue = queue_mod.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, timeout: float = 20.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue_mod.Empty:
            raise AssertionError(f"no output from child within {timeout} s") from None
        if line is None:
            self.proc.wait(5)
            raise AssertionError(f"child exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
        return line

    def send(self, text: str) -> None:
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stderr):
            f.close()


def drain(q: shardq.Router, queue: str = "default") -> list[Lease]:
    """Lease and ack everything deliverable now; the leases in delivery order."""
    out: list[Lease] = []
    while True:
        leases = q.dequeue_many(queue, max_jobs=1000)
        if not leases:
            return out
        out.extend(leases)
        assert q.ack_many(leases) == [None] * len(leases)


def totals(q: shardq.Router, queue: str = "default") -> dict:
    return q.stats()["queues"].get(queue, {})


# ---------------------------------------------------------------------- basics
def test_happy_path_enqueue_dequeue_ack(svc):
    with svc.connect() as q:
        jid = q.enqueue(b"hello", key="user-1")
        lease = q.dequeue()
        assert ((lease.job_id, lease.body, lease.key, lease.attempt, lease.queue)
                == (jid, b"hello", "user-1", 1, "default"))
        assert lease.deadline > time.time() + 20  # the queue's 30 s visibility timeout
        q.ack(lease)
        assert q.dequeue(wait=0) is None
        with pytest.raises(LeaseLost):  # a second ack of the same lease: the job is gone
            q.ack(lease)
        assert all(v == 0 for v in totals(q).values())


def test_embedded_open_and_close_stops_its_processes():
    root = short_tmpdir()
    data = os.path.join(root, "data")
    try:
        q = shardq.open(data, shards=2, config={"queue_defaults": {"visibility_timeout": 5}})
        try:
            pids = q.ping()
            assert len(set(pids)) == 2 and os.getpid() not in pids
            jid = q.enqueue(b"kept", key="a")
            st = q.stats()
            assert [sh["status"] for sh in st["shards"]] == ["ready", "ready"]
            assert [sh["pid"] for sh in st["shards"]] == pids
            lease = q.dequeue()
            assert lease.job_id == jid and lease.deadline - time.time() < 6
            q.nack(lease)
        finally:
            q.close()
        wait_until(lambda: not any(_alive(p) for p in pids), 10, what="embedded shards to exit")
        # The data dir is released (lock, sockets) and the job survived.
        with shardq.open(data, shards=2) as q2:
            lease = q2.dequeue()
            assert (lease.job_id, lease.body, lease.attempt) == (jid, b"kept", 2)
            q2.ack(lease)
            pids2 = q2.ping()
        wait_until(lambda: not any(_alive(p) for p in pids2), 10, what="embedded shards to exit")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------------- at-least-once
LEASE_AND_HANG = r"""
import json, sys, shardq
q = shardq.connect(sys.argv[1])
l = q.dequeue(wait=10, visibility=float(sys.argv[2]))
print(json.dumps({"job_id": l.job_id, "attempt": l.attempt, "token": l.token, "deadline": l.deadline}), flush=True)
sys.stdin.read()  # hold the lease until SIGKILLed
"""


def test_job_comes_back_after_worker_process_is_killed_holding_its_lease(svc):
    with svc.connect() as q:
        jid = q.enqueue(b"work", key="acct-7")
        with Script(LEASE_AND_HANG, svc.data_dir, "1.0") as worker:
            first = json.loads(worker.line())
            assert (first["job_id"], first["attempt"]) == (jid, 1)
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(10)
        early = q.dequeue()
        assert early is None or time.time() >= first["deadline"], "redelivered while the lease was live"
        lease = early or q.dequeue(wait=10)
        assert lease is not None and time.time() >= first["deadline"] - 0.01
        assert (lease.job_id, lease.body, lease.attempt) == (jid, b"work", 2)
        assert lease.token != first["token"]
        stale = lease._replace(token=first["token"])
        with pytest.raises(LeaseLost):
            q.ack(stale)
        q.ack(lease)
        assert q.dequeue() is None


# ---------------------------------------------------------------------- no double delivery
CONSUMER = r"""
import json, sys, shardq
q = shardq.connect(sys.argv[1])
q.ping()
print("ready", flush=True)
sys.stdin.readline()
got = []
while True:
    leases = q.dequeue_many(max_jobs=5, wait=0.5, visibility=30)
    if not leases:
        break
    got += [[l.job_id, l.attempt, l.token] for l in leases]
    keyed = [l for l in leases if l.key is not None]  # keyless leases are held to the end
    assert q.ack_many(keyed) == [None] * len(keyed)
print(json.dumps(got), flush=True)
"""


def test_no_double_delivery_among_threads_and_processes(svc):
    keyed = [{"body": f"k{i}".encode(), "key": f"key-{i % 20}"} for i in range(200)]
    keyless = [{"body": f"n{i}".encode()} for i in range(100)]
    deliveries: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    with svc.connect() as q, Script(CONSUMER, svc.data_dir) as p1, Script(CONSUMER, svc.data_dir) as p2:
        assert p1.line() == "ready" and p2.line() == "ready"
        ids = q.enqueue_many(keyed + keyless)
        keyless_ids = set(ids[200:])

        def consume():
            while True:
                leases = q.dequeue_many(max_jobs=5, wait=0.5, visibility=30)
                if not leases:
                    return
                with lock:
                    deliveries.extend((l.job_id, l.attempt, l.token) for l in leases)
                mine = [l for l in leases if l.key is not None]
                assert q.ack_many(mine) == [None] * len(mine)

        threads = [threading.Thread(target=consume) for _ in range(3)]
        p1.send("go\n")
        p2.send("go\n")
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for p in (p1, p2):
            deliveries.extend(tuple(d) for d in json.loads(p.line(60)))
        # Whatever the consumers left (they stop after 0.5 s without work), drain here.
        for l in q.dequeue_many(max_jobs=1000):
            deliveries.append((l.job_id, l.attempt, l.token))
            if l.key is not None:
                q.ack(l)
        rest = drain(q)
        deliveries.extend((l.job_id, l.attempt, l.token) for l in rest)
        counts = Counter(d[0] for d in deliveries)
        assert [j for j, n in counts.items() if n > 1] == []
        assert set(counts) == set(ids)
        assert {d[1] for d in deliveries} == {1}
        # The held keyless leases are still in flight, and nobody else got them.
        assert totals(q)["in_flight"] == len(keyless_ids)
        assert q.dequeue() is None
        held = [Lease(j, None, b"", "default", a, tok, 0.0) for j, a, tok in deliveries if j in keyless_ids]
        assert q.ack_many(held) == [None] * len(held)
        assert totals(q)["in_flight"] == 0


# ---------------------------------------------------------------------- per-key FIFO
def test_per_key_fifo_and_one_lease_per_key_with_concurrent_consumers(svc):
    keys = [f"key-{i}" for i in range(50)]
    per_key = 20
    total = len(keys) * per_key
    with svc.connect() as q:
        q.enqueue_many([{"body": f"{k}|{i}".encode(), "key": k} for i in range(per_key) for k in keys])
    spans: dict[str, list[tuple[float, float, int, int]]] = defaultdict(list)  # key -> (got, ack, seq, attempt)
    lock = threading.Lock()
    done = [0]
    errors: list[BaseException] = []
    shared = svc.connect()

    def consume(own_router: bool):
        q = svc.connect() if own_router else shared
        deadline = time.monotonic() + 60
        try:
            while done[0] < total and time.monotonic() < deadline:
                leases = q.dequeue_many(max_jobs=3, wait=0.2, visibility=30)
                got = time.monotonic()
                if not leases:
                    continue
                t_ack = time.monotonic()  # before the ack is sent: the shard sees it later
                assert q.ack_many(leases) == [None] * len(leases)
                with lock:
                    for l in leases:
                        key, seq = l.body.decode().split("|")
                        assert key == l.key
                        spans[key].append((got, t_ack, int(seq), l.attempt))
                    done[0] += len(leases)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if own_router:
                q.close()

    threads = [threading.Thread(target=consume, args=(i % 2 == 0,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    shared.close()
    assert not errors, errors
    assert done[0] == total
    for key in keys:
        s = sorted(spans[key])
        assert [seq for _, _, seq, _ in s] == list(range(per_key)), f"{key}: delivered out of order"
        assert {a for *_, a in s} == {1}
        for (_got_a, ack_a, seq_a, _), (got_b, _, seq_b, _) in zip(s, s[1:]):
            assert ack_a < got_b, f"{key}: job {seq_b} leased while job {seq_a} was still leased"


# ---------------------------------------------------------------------- durability
def test_every_job_survives_sigkill_of_the_whole_service_exactly_once_in_key_order():
    keys = [f"acct-{i}" for i in range(20)] + [None]
    n = 2000
    jobs = [{"body": str(i).encode(), "key": keys[i % len(keys)]} for i in range(n)]
    s1 = Service(config=CONFIG)
    with s1:
        with s1.connect() as q:
            ids = [q.enqueue(j["body"], key=j["key"]) for j in jobs[:200]]
            for i in range(200, n, 450):
                ids += q.enqueue_many(jobs[i:i + 450])
            assert len(set(ids)) == n
            held = q.dequeue_many(max_jobs=5)  # leases must survive too (token and count)
            assert len(held) == 5
        s1.kill_all()
        s2 = Service(data_dir=s1.data_dir, config=CONFIG, log_path=s1.log_path).start()
        try:
            with s2.connect() as q:
                t = totals(q)
                assert t["in_flight"] == 5 and t["ready"] + t["waiting"] + t["in_flight"] == n
                assert q.ack_many(held) == [None] * 5  # old tokens are still the live leases
                delivered = [(l.job_id, l.key, int(l.body), l.attempt) for l in drain(q)]
                assert all(v == 0 for v in totals(q).values())
        finally:
            s2.stop()
            s2.log.close()
    got = [(l.job_id, l.key, int(l.body)) for l in held] + [d[:3] for d in delivered]
    assert sorted(b for _, _, b in got) == list(range(n))  # every job, exactly once
    assert sorted(j for j, _, _ in got) == sorted(ids)
    assert {d[3] for d in delivered} == {1}
    per_key = defaultdict(list)
    for _, key, body in got:
        per_key[key].append(body)
    for key, bodies in per_key.items():
        if key is not None:
            assert bodies == sorted(bodies), f"key {key}: order changed across the restart"


# ---------------------------------------------------------------------- stats, DLQ, delay, priority, dedup
def test_stats_counts_per_queue_and_per_shard(svc):
    k_lease, k_dead, k_two, k_later = keys_on_shard(0, 4)  # one shard: priority order is exact
    with svc.connect() as q:
        before = [sh["wal_bytes"] for sh in q.stats()["shards"]]
        q.enqueue(b"later", queue="st", key=k_later, delay=60)
        q.enqueue(b"lease me", queue="st", key=k_lease, priority=10)
        q.enqueue(b"kill me", queue="st", key=k_dead, priority=9)
        q.enqueue(b"head", queue="st", key=k_two)
        q.enqueue(b"behind", queue="st", key=k_two)
        leased = q.dequeue("st")
        assert leased.key == k_lease
        dying = q.dequeue("st")
        assert dying.key == k_dead
        q.nack(dying, error="boom")  # max_deliveries 1: dead
        q.enqueue(b"shard one", queue="other", key=keys_on_shard(1, 1)[0])
        st = q.stats()
        assert st["queues"]["st"] == {"ready": 1, "delayed": 1, "waiting": 1, "in_flight": 1, "dead": 1,
                                      "keys": 3}
        assert st["queues"]["other"]["ready"] == 1
        assert [sh["shard"] for sh in st["shards"]] == [0, 1]
        assert [sh["pid"] for sh in st["shards"]] == svc.shard_pids()
        assert [sh["jobs"] for sh in st["shards"]] == [5, 1]
        after = [sh["wal_bytes"] for sh in st["shards"]]
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        q.ack(leased)
        assert q.stats()["queues"]["st"]["in_flight"] == 0


def test_dead_letters_end_to_end(svc):
    with svc.connect() as q:
        jid = q.enqueue(b"poison", queue="dl", key="p")
        for attempt, err in ((1, "boom-1"), (2, "boom-2")):
            lease = q.dequeue("dl")
            assert (lease.job_id, lease.attempt) == (jid, attempt)
            q.nack(lease, error=err)
        assert q.dequeue("dl") is None
        dead = q.dead_letters("dl")
        assert [(d.job_id, d.key, d.body, d.attempts, d.error) for d in dead] == [(jid, "p", b"poison", 2, "boom-2")]
        assert totals(q, "dl")["dead"] == 1
        assert q.redrive("dl") == 1
        assert q.dead_letters("dl") == []
        lease = q.dequeue("dl")
        assert (lease.job_id, lease.attempt) == (jid, 1)
        q.ack(lease)
        assert all(v == 0 for v in totals(q, "dl").values())


def test_delayed_job_is_not_delivered_before_its_delay(svc):
    with svc.connect() as q:
        delay = 1.0
        t0 = time.time()
        jid = q.enqueue(b"later", delay=delay)
        early = q.dequeue()
        assert early is None or time.time() - t0 >= delay
        lease = early or q.dequeue(wait=5)  # the long poll wakes when the delay is due
        t1 = time.time()
        assert lease is not None and lease.job_id == jid
        assert t1 - t0 >= delay - 0.01
        assert t1 - t0 < delay + 1.5
        q.ack(lease)


def test_priorities_end_to_end(svc):
    prios = [0, 10, 5, 10, -3, 5, 0]
    keys = keys_on_shard(0, len(prios))  # priority orders the ready jobs of one shard
    with svc.connect() as q:
        ids = [q.enqueue(f"p{p}".encode(), key=k, priority=p) for k, p in zip(keys, prios)]
        got = [q.dequeue().job_id for _ in prios]
        expected = [ids[i] for i in sorted(range(len(prios)), key=lambda i: (-prios[i], i))]
        assert got == expected
        assert q.dequeue() is None


def test_dedup_id_end_to_end_and_across_a_restart(svc):
    with svc.connect() as q:
        a = q.enqueue(b"once", key="k", dedup_id="order-1")
        assert q.enqueue(b"twice", key="k", dedup_id="order-1") == a
        other_scope = q.enqueue(b"other key", key="k2", dedup_id="order-1")
        assert other_scope != a
        batch = q.enqueue_many([{"body": b"b1", "dedup_id": "d2", "key": "k"},
                                {"body": b"b2", "dedup_id": "d2", "key": "k"}])
        assert batch[0] == batch[1]
    svc.kill_all()
    svc.log.close()
    svc.start()
    with svc.connect() as q:
        assert q.enqueue(b"thrice", key="k", dedup_id="order-1") == a
        bodies = sorted(l.body for l in drain(q))
        assert bodies == [b"b1", b"once", b"other key"]


# ---------------------------------------------------------------------- long poll
LONG_POLL = r"""
import json, sys, time, shardq
q = shardq.connect(sys.argv[1])
q.ping()
for _ in range(2):
    print("waiting", flush=True)
    l = q.dequeue(wait=5)
    print(json.dumps({"t": time.time(), "body": l.body.decode() if l else None}), flush=True)
    if l:
        q.ack(l)
"""


def test_long_poll_wakes_on_enqueue_from_another_process_and_idles_cheaply(svc):
    with svc.connect() as q, Script(LONG_POLL, svc.data_dir) as consumer:
        child = psutil.Process(consumer.proc.pid)
        for shard in (0, 1):
            assert consumer.line() == "waiting"
            if shard == 0:
                # The blocked consumer, and the shards it long-polls, use little CPU:
                # cpu_percent(0.5) measures over 0.5 s (a measurement, not a sync point).
                shards = [psutil.Process(p) for p in svc.shard_pids()]
                for p in shards:
                    p.cpu_percent(None)
                wait_until(lambda: child.cpu_percent(0.5) < 20 and all(p.cpu_percent(None) < 20 for p in shards)
                           or None, 3, what="the blocked consumer and the shards to idle")
            t_enq = time.time()
            q.enqueue(f"to-{shard}".encode(), key=keys_on_shard(shard, 1)[0])
            got = json.loads(consumer.line(10))
            assert got["body"] == f"to-{shard}"
            assert got["t"] - t_enq < 1.0, f"long poll woke after {got['t'] - t_enq:.3f} s"
