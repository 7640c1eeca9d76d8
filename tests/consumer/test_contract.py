"""THE contract suite: the same tests against every backend of :class:`shardq.Queue`.

``local``: a real ``shardq serve`` (two shard processes). ``sqs``: the SQS FIFO backend
against a real ``moto_server`` over HTTP (tests/support/sqs_server.py). Where moto is known to
differ from AWS, the case is marked ``xfail(strict=True)`` for sqs with the reason, so a
fixed server is noticed; the backend's own logic does not rely on those server behaviours
(its fencing is local, its redrive is done by the client), and tests/test_sqs_*.py check it.
``sqs-api``: the same SQS backend against shardq's own SQS API (``shardq serve`` with
``[sqs_api] listen``, docs/sqs-api.md): code written for AWS, on shardq; none of moto's
differences apply there.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import shardq
from support.service import REPO, Service, short_tmpdir, wait_until
from support.sqs_server import fresh_target
from support.worker_effects import _effects, _setup

BODY_MAX = 1024 * 1024
CONFIG = {"queues": {
    "default": {"visibility_timeout": 30, "max_deliveries": 5, "max_body_bytes": BODY_MAX},
    "short": {"visibility_timeout": 1, "max_deliveries": 3, "max_body_bytes": BODY_MAX},
    "kill": {"visibility_timeout": 2, "max_deliveries": 1000, "max_body_bytes": BODY_MAX},
}}


class Backend:
    """One backend under test: ``target`` for ``shardq.connect`` (and ``--connect``)."""

    def __init__(self, name: str, target: str, request):
        self.name, self.target, self._request = name, target, request
        self._clients: list = []

    def connect(self, **kw):
        q = shardq.connect(self.target, **kw)
        self._clients.append(q)
        return q

    def server_differs(self, reason: str) -> None:
        """This case fails on the SQS test server (moto) for ``reason``, not on AWS."""
        if self.name == "sqs":
            self._request.applymarker(pytest.mark.xfail(strict=True, reason=f"moto: {reason}"))

    def close(self) -> None:
        for q in self._clients:
            q.close()


@pytest.fixture(scope="module")
def sqs_api_service():
    """One ``shardq serve`` answering the SQS API; each test takes a fresh queue prefix on it."""
    from support.sqs_listener import sqs_service, sqs_url
    with sqs_service() as svc:
        svc.url = sqs_url(svc).rstrip("/")
        yield svc


_prefixes = iter(range(10**6))


@pytest.fixture(params=["local", "sqs", "sqs-api"])
def backend(request):
    if request.param == "sqs-api":
        from support.sqs_server import init_queues
        target = f"sqs://us-east-1/c{next(_prefixes)}?endpoint={request.getfixturevalue('sqs_api_service').url}"
        init_queues(target, CONFIG)
        b = Backend("sqs-api", target, request)
        yield b
        b.close()
    elif request.param == "local":
        with Service(shards=2, config=CONFIG) as svc:
            b = Backend("local", svc.data_dir, request)
            yield b
            b.close()
    else:
        b = Backend("sqs", fresh_target(request.getfixturevalue("moto"), CONFIG), request)
        yield b
        b.close()


@pytest.fixture
def q(backend):
    return backend.connect()


def drain(q, queue="default", wait=0.5):
    """Lease and ack everything ready; returns the leases in the order they came."""
    out = []
    while True:
        leases = q.dequeue_many(queue, max_jobs=10, wait=wait)
        if not leases:
            return out
        out.extend(leases)
        assert q.ack_many(leases) == [None] * len(leases)


def redelivery(q, queue="short", timeout=15.0):
    """Poll until a job (whose lease ran out) is leased again; the new lease is extended at
    once, so a slow machine cannot lose it before the test is done with it."""
    lease = wait_until(lambda: q.dequeue(queue), timeout, 0.1, "a redelivery")
    return q.extend(lease, 30)


# ---------------------------------------------------------------------------- the basics
def test_happy_path(q):
    job_id = q.enqueue(b"payload", key="user-42")
    lease = q.dequeue("default", wait=2)
    assert (lease.job_id, lease.key, lease.body, lease.queue, lease.attempt) == \
        (job_id, "user-42", b"payload", "default", 1)
    assert lease.deadline > time.time() + 20
    extended = q.extend(lease, 60)
    assert extended.deadline > lease.deadline
    q.ack(extended)
    assert q.dequeue("default") is None
    counts = q.stats()["queues"]["default"]
    assert counts["ready"] == counts["in_flight"] == 0


def test_queue_config_names_the_limits(q):
    cfg = q.queue_config("short")
    assert (cfg["visibility_timeout"], cfg["max_deliveries"], cfg["max_body_bytes"]) == (1, 3, BODY_MAX)


def test_at_least_once_after_lease_expiry(q):
    job_id = q.enqueue(b"x", key="k", queue="short")
    first = q.dequeue("short", wait=2)
    assert first.attempt == 1
    again = redelivery(q)
    assert (again.job_id, again.attempt, again.body) == (job_id, 2, b"x")
    assert again.token != first.token
    q.ack(again)


def test_stale_ack_is_lease_lost_and_changes_nothing(q):
    q.enqueue(b"x", key="k", queue="short")
    first = q.dequeue("short", wait=2)
    again = redelivery(q)
    with pytest.raises(shardq.LeaseLost):
        q.ack(first)
    with pytest.raises(shardq.LeaseLost):
        q.extend(first, 10)
    with pytest.raises(shardq.LeaseLost):
        q.nack(first)
    q.ack(again)  # the stale calls changed nothing: the current lease still acks
    with pytest.raises(shardq.LeaseLost):
        q.ack(again)  # acked already (JobGone)


def test_stale_token_is_refused_even_while_its_deadline_looks_live(backend, q):
    """The fence at the server: an old delivery's token, presented by a client that knows
    nothing about it, with a deadline that has not passed. Only the server can refuse it."""
    backend.server_differs("accepts stale receipt handles: DeleteMessage with the handle of an "
                           "earlier delivery deletes the message (AWS: ReceiptHandleIsInvalid)")
    q.enqueue(b"x", key="k", queue="short")
    first = q.dequeue("short", wait=2)
    again = redelivery(q)
    other = backend.connect()
    with pytest.raises(shardq.LeaseLost):
        other.ack(first._replace(deadline=time.time() + 3600))
    q.ack(again)


# ---------------------------------------------------------------------------- per-key FIFO
def test_one_lease_per_key_even_from_one_batch(backend, q):
    q.enqueue_many([{"body": f"a{i}".encode(), "key": "a"} for i in range(5)]
                   + [{"body": b"free1"}, {"body": b"free2"}])
    got = q.dequeue_many("default", max_jobs=10, wait=2)
    bodies = sorted(l.body for l in got)
    assert bodies == [b"a0", b"free1", b"free2"]
    other = backend.connect()
    assert other.dequeue_many("default", max_jobs=10) == []  # "a" is leased; nothing else is ready
    seen = [b"a0"]
    head = next(l for l in got if l.key == "a")
    q.ack_many([l for l in got])
    while len(seen) < 5:
        nxt = wait_until(lambda: q.dequeue_many("default", max_jobs=10, wait=0.5), 10, 0.01, "next of key a")
        assert len(nxt) == 1 and nxt[0].key == "a" and nxt[0].attempt == 1
        assert other.dequeue_many("default", max_jobs=10) == []
        seen.append(nxt[0].body)
        q.ack(nxt[0])
    assert seen == [f"a{i}".encode() for i in range(5)]
    assert head.attempt == 1


def test_per_key_fifo_with_several_consumers(backend):
    producer = backend.connect()
    keys, per_key = 4, 8
    producer.enqueue_many([{"body": f"{k}:{s}".encode(), "key": f"k{k}"}
                           for s in range(per_key) for k in range(keys)])
    held: set[str] = set()
    order: dict[str, list[int]] = {}
    violations: list[str] = []
    lock = threading.Lock()
    consumers = [backend.connect() for _ in range(3)]
    deadline = time.monotonic() + 60

    def consume(c):
        while time.monotonic() < deadline:
            with lock:
                if sum(map(len, order.values())) >= keys * per_key:
                    return
            for lease in c.dequeue_many("default", max_jobs=5, wait=0.2):
                key, seq = lease.body.decode().split(":")
                with lock:
                    if key in held:
                        violations.append(f"{key} leased twice at once")
                    held.add(key)
                    order.setdefault(key, []).append(int(seq))
                time.sleep(random.uniform(0, 0.01))  # the work itself
                with lock:
                    held.discard(key)  # before the ack: the next lease can only follow it
                c.ack(lease)

    threads = [threading.Thread(target=consume, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == []
    assert order == {str(k): list(range(per_key)) for k in range(keys)}


def test_a_dead_consumer_holding_a_keys_batch_gives_the_key_back_in_order(backend, q):
    """A consumer process dies (SIGKILL) holding a batch with several jobs of one key."""
    backend.server_differs("mis-orders the redelivery of a timed-out batch of one message group "
                           "(it skips the group's earlier messages while later ones are still "
                           "marked pending, and returns the last first)")
    q.enqueue_many([{"body": f"{i}".encode(), "key": "k"} for i in range(3)], queue="short")
    code = textwrap.dedent(f"""
        import os, sys, shardq
        q = shardq.connect({backend.target!r})
        leases = q.dequeue_many("short", max_jobs=10, wait=2)
        print(len(leases), flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == b"1", out.stderr
    bodies = []
    while len(bodies) < 3:
        lease = redelivery(q)
        bodies.append(lease.body)
        q.ack(lease)
    assert bodies == [b"0", b"1", b"2"]


# ---------------------------------------------------------------------------- dedup
def test_dedup_id_adds_the_job_once_per_key(q):
    q.enqueue(b"first", key="k", dedup_id="order-1")
    q.enqueue(b"second", key="k", dedup_id="order-1")
    q.enqueue(b"other key", key="j", dedup_id="order-1")  # scope: (queue, key)
    assert sorted(l.body for l in drain(q)) == [b"first", b"other key"]


def test_dedup_id_of_a_keyless_job_holds_on_every_shard(q):
    """A keyless job's dedup id is scoped to (queue, no key) however many shards there are
    (the local backend has two): a repeat, alone or in a batch, meets the first one."""
    q.enqueue(b"first", dedup_id="order-k1")
    for _ in range(3):  # (placed round-robin, every other one went to the other shard)
        q.enqueue(b"again", dedup_id="order-k1")
    q.enqueue_many([{"body": b"batch"}, {"body": b"batch", "dedup_id": "order-k2"},
                    {"body": b"batch again", "dedup_id": "order-k2"}])
    q.enqueue_many([{"body": b"next batch", "dedup_id": "order-k2"}, {"body": b"again", "dedup_id": "order-k1"}])
    assert sorted(l.body for l in drain(q)) == [b"batch", b"batch", b"first"]


def test_dedup_retry_returns_the_first_id(backend, q):
    backend.server_differs("answers a deduplicated send with a fresh MessageId (AWS answers "
                           "with the first message's id)")
    first = q.enqueue(b"x", key="k", dedup_id="order-2")
    assert q.enqueue(b"x", key="k", dedup_id="order-2") == first


def test_dedup_window_outlives_the_ack(backend, q):
    backend.server_differs("forgets a deduplication id once its message is deleted (AWS keeps "
                           "it for the 5-minute window)")
    q.enqueue(b"x", key="k", dedup_id="order-3")
    assert [l.body for l in drain(q)] == [b"x"]
    q.enqueue(b"x", key="k", dedup_id="order-3")
    assert drain(q) == []


# ---------------------------------------------------------------------------- dead letters
def _dead_letter(q, body=b"poison", key="p"):
    job_id = q.enqueue(body, key=key, queue="short")
    for attempt in (1, 2, 3):
        lease = wait_until(lambda: q.dequeue("short", wait=1), 10, 0.01, f"delivery {attempt}")
        assert (lease.job_id, lease.attempt) == (job_id, attempt)
        q.nack(lease, error=f"boom {attempt}")
    return job_id


def test_dead_letter_after_max_deliveries(q):
    job_id = _dead_letter(q)
    assert q.dequeue("short", wait=1) is None
    dead = wait_until(lambda: q.dead_letters("short"), 10, 0.05, "the dead letter")
    assert [(d.job_id, d.key, d.body, d.queue, d.attempts) for d in dead] == \
        [(job_id, "p", b"poison", "short", 3)]


def test_redrive_all_and_by_id(q):
    a = _dead_letter(q, b"a", "ka")
    b = _dead_letter(q, b"b", "kb")
    assert q.dequeue("short", wait=1) is None
    wait_until(lambda: len(q.dead_letters("short")) == 2, 10, 0.05, "two dead letters")
    assert q.redrive("short", job_ids=[b]) == 1
    assert [d.job_id for d in q.dead_letters("short")] == [a]
    lease = q.dequeue("short", wait=2)
    assert (lease.job_id, lease.body, lease.attempt) == (b, b"b", 1)  # same id, fresh count
    q.ack(lease)
    assert q.redrive("short") == 1
    assert q.dead_letters("short") == []
    lease = q.dequeue("short", wait=2)
    assert (lease.job_id, lease.attempt) == (a, 1)
    q.ack(lease)
    assert q.purge_dead_letters("short") == 0


def test_bury_dead_letters_a_job_at_once_with_its_error(q):
    """What tasks use for Fail, exhausted retries and unknown task names."""
    job_id = q.enqueue(b"doomed", key="b")
    follower = q.enqueue(b"next", key="b")
    lease = q.dequeue(wait=2)
    assert lease.job_id == job_id and lease.attempt == 1
    q.bury(lease, error="Fail: bad input")
    with pytest.raises(shardq.LeaseLost):
        q.ack(lease)  # the lease ended with the bury
    nxt = q.dequeue(wait=2)
    assert nxt.job_id == follower  # the key moves on
    q.ack(nxt)
    dead = wait_until(lambda: q.dead_letters("default"), 10, 0.05, "the buried job")
    assert [(d.job_id, d.body, d.error) for d in dead] == [(job_id, b"doomed", "Fail: bad input")]


# ---------------------------------------------------------------------------- batches
def test_batch_calls_keep_order_and_report_per_lease_errors(q):
    jobs = [{"body": f"job-{i}".encode()} for i in range(25)]
    ids = q.enqueue_many(jobs)
    assert len(set(ids)) == 25
    leases = []
    while len(leases) < 25:
        leases += wait_until(lambda: q.dequeue_many("default", max_jobs=25, wait=1), 10, 0.01, "jobs")
    by_id = {l.job_id: l.body for l in leases}
    assert [by_id[i] for i in ids] == [j["body"] for j in jobs]  # ids come back in input order
    first, rest = leases[0], leases[1:]
    q.ack(first)
    results = q.ack_many(rest[:12] + [first] + rest[12:])
    assert results[:12] == [None] * 12 and results[13:] == [None] * 12
    assert isinstance(results[12], shardq.LeaseLost)
    assert q.dequeue("default") is None


# ---------------------------------------------------------------------------- bad input
def test_body_at_the_limit_round_trips_and_one_more_byte_is_refused(q):
    body = b"x" * BODY_MAX
    job_id = q.enqueue(body)
    lease = q.dequeue("default", wait=2)
    assert (lease.job_id, lease.body == body) == (job_id, True)
    q.ack(lease)
    with pytest.raises(shardq.InvalidJob):
        q.enqueue(b"x" * (BODY_MAX + 1))


@pytest.mark.parametrize("bad", [
    {"body": "text, not bytes"}, {"body": b""}, {"body": b"x", "key": "k" * 513},
    {"body": b"x", "key": 7}, {"body": b"x", "queue": 7}, {"body": b"x", "dedup_id": "d" * 129},
    {"body": b"x", "delay": -1}, {"body": b"x", "bogus": 1},
])
def test_bad_jobs_are_refused_and_nothing_is_half_applied(q, bad):
    good = [{"body": b"ok-1"}, {"body": b"ok-2"}]
    with pytest.raises(shardq.InvalidJob):
        q.enqueue_many(good[:1] + [bad] + good[1:])
    if "bogus" not in bad:
        with pytest.raises(shardq.InvalidJob):
            q.enqueue(**bad)
    assert q.dequeue("default", wait=0.5) is None


@pytest.mark.parametrize("call", [
    lambda q: q.dequeue_many("default", max_jobs=0), lambda q: q.dequeue_many("default", max_jobs=10_001),
    lambda q: q.dequeue("default", wait=-1), lambda q: q.dequeue("default", visibility=0),
])
def test_bad_dequeue_arguments(q, call):
    with pytest.raises(shardq.InvalidJob):
        call(q)


# ---------------------------------------------------------------------------- the worker
def test_worker_effects_exactly_once_with_sigkilled_worker_processes(backend):
    """Real ``shardq worker`` processes, SIGKILLed at random moments, restarted."""
    rng = random.Random(13)
    tmp = short_tmpdir()
    try:
        db = _setup(tmp)  # the handler of test_worker_processes: effect + job id in one transaction
        q = backend.connect()
        # Work arrives in a phase before each kill, so every kill finds jobs to cut into however
        # fast the workers drain (all of it up front, the workers could finish before the 4th).
        keys, per_phase, kills_wanted = 6, 4, 4
        ids: list = []

        def enqueue_phase(p: int) -> None:
            ids.extend(q.enqueue_many([{"body": f"k{k}:{s}".encode(), "key": f"k{k}", "queue": "kill"}
                                       for s in range(p * per_phase, (p + 1) * per_phase)
                                       for k in range(keys)]))

        enqueue_phase(0)
        env = dict(os.environ, PYTHONPATH=REPO)
        log = open(os.path.join(tmp, "workers.log"), "ab")

        def worker():
            return subprocess.Popen(
                [sys.executable, "-m", "shardq.cli", "worker", "handler_mod:handle", "--connect", backend.target,
                 "--queue", "kill", "--idempotency", db, "--concurrency", "3", "--grace", "5",
                 "--log-level", "WARNING"], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)

        workers = [worker(), worker()]
        kills = 0
        try:
            while kills < kills_wanted:
                done = len(_effects(db))
                wait_until(lambda: len(_effects(db)) >= min(len(ids), done + rng.randint(3, 8)), 60, 0.02,
                           "progress between kills")
                victim = rng.randrange(len(workers))
                workers[victim].send_signal(signal.SIGKILL)
                workers[victim].wait()
                kills += 1
                workers[victim] = worker()
                enqueue_phase(kills)
            wait_until(lambda: len(_effects(db)) >= len(ids), 120, 0.05, "every job's effect")
            wait_until(lambda: q.stats()["queues"]["kill"]["ready"] == 0
                       and q.stats()["queues"]["kill"]["in_flight"] == 0, 60, 0.1, "every job acked")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            log.close()
        rows = _effects(db)
        assert kills == 4
        assert sorted(r[1] for r in rows) == sorted(ids)  # every job, exactly once
        if backend.name != "sqs":
            # On moto a killed worker's buffered batch of one key can come back mis-ordered
            # (the server bug of the xfail case above), so key order is asserted off moto only.
            by_key: dict[str, list[int]] = {}
            for _, _, key, seq in rows:
                by_key.setdefault(key, []).append(seq)
            assert all(seqs == sorted(seqs) for seqs in by_key.values())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
