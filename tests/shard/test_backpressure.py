"""Backpressure and input limits against a real service: a full shard refuses with a typed
QueueFull, all-or-nothing per shard, while dequeue and ack keep working so it drains; bad
input is refused with a typed error at the Python API and the CLI, and nothing is enqueued."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from support.service import REPO, Service

import shardq
from shardq import limits
from shardq.client.router import shard_for_key

PENDING_MAX = 1000
BODY_MAX = 1024
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def svc():
    cfg = {"limits": {"max_pending_jobs": PENDING_MAX}, "queue_defaults": {"max_body_bytes": BODY_MAX}}
    with Service(shards=2, config=cfg) as s:
        yield s


@pytest.fixture
def q(svc):
    with svc.connect(retry_s=5, request_timeout_s=10) as r:
        r.held = []
        yield r
        # leave the service empty for the next test
        r.ack_many(r.held)
        while True:
            leases = r.dequeue_many("default", max_jobs=10_000, visibility=60) + \
                     r.dequeue_many("other", max_jobs=10_000, visibility=60)
            if not leases:
                break
            r.ack_many(leases)


def keys_of(shard: int, n: int) -> list[str]:
    return [k for k in (f"key-{i}" for i in range(10_000)) if shard_for_key(k, 2) == shard][:n]


def jobs(q) -> list[int]:
    return [s["jobs"] for s in q.stats()["shards"]]


def cli(*args: str, stdin: bytes | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardq.cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)


def test_a_full_shard_refuses_whole_batches_and_drains(q, svc):
    k0, k1 = keys_of(0, 10), keys_of(1, 1)
    q.enqueue_many([{"body": f"a{i}".encode(), "key": k0[i % 10]} for i in range(PENDING_MAX - 10)])
    assert jobs(q) == [PENDING_MAX - 10, 0]

    with pytest.raises(shardq.QueueFull):
        q.enqueue_many([{"body": f"b{i}".encode(), "key": k0[0]} for i in range(20)])
    assert jobs(q) == [PENDING_MAX - 10, 0], "a refused batch was partly enqueued"

    q.enqueue_many([{"body": f"c{i}".encode(), "key": k0[1]} for i in range(10)])   # exactly to the limit
    with pytest.raises(shardq.QueueFull) as exc:
        q.enqueue(b"one more", key=k0[2])
    assert not isinstance(exc.value, shardq.InvalidJob)  # capacity, not bad input
    assert q.enqueue(b"other shard", key=k1[0], queue="other") > 0  # the other shard is not full

    # A batch across shards: the full shard refuses its part whole; the other's part may be in.
    with pytest.raises(shardq.QueueFull):
        q.enqueue_many([{"body": b"x", "key": k0[3]}] * 5 + [{"body": b"y", "key": k1[0], "queue": "other"}] * 5)
    n0, n1 = jobs(q)
    assert n0 == PENDING_MAX and n1 in (1, 6)

    p = cli("enqueue", "via cli", "--key", k0[4], "--data-dir", svc.data_dir)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and b"error: QueueFull" in err, err

    # Dequeue and ack keep working while full, and free room.
    freed = 0
    while freed < 100:
        leases = q.dequeue_many(max_jobs=100 - freed, visibility=60)
        assert leases
        assert q.ack_many(leases) == [None] * len(leases)
        freed += len(leases)
    assert jobs(q)[0] == PENDING_MAX - 100
    q.enqueue_many([{"body": f"d{i}".encode(), "key": k0[5]} for i in range(100)])
    with pytest.raises(shardq.QueueFull):
        q.enqueue(b"full again", key=k0[5])


def _lease(q):
    q.enqueue(b"held", key="held", queue="other")
    lease = q.dequeue("other", visibility=60, wait=5)
    assert lease is not None
    q.held.append(lease)
    return lease


BAD_CALLS = {
    "body over the queue limit": lambda q: q.enqueue(b"x" * (BODY_MAX + 1)),
    "body over the ceiling": lambda q: q.enqueue(b"x" * (limits.BODY_BYTES_MAX_CEILING + 1)),
    "body str": lambda q: q.enqueue("text"),
    "body empty": lambda q: q.enqueue(b""),
    "key too long": lambda q: q.enqueue(b"x", key="k" * (limits.KEY_BYTES_MAX + 1)),
    "key multibyte too long": lambda q: q.enqueue(b"x", key="\u00e9" * (limits.KEY_BYTES_MAX // 2 + 1)),
    "key empty": lambda q: q.enqueue(b"x", key=""),
    "key int": lambda q: q.enqueue(b"x", key=5),
    "delay negative": lambda q: q.enqueue(b"x", delay=-1),
    "delay nan": lambda q: q.enqueue(b"x", delay=math.nan),
    "delay inf": lambda q: q.enqueue(b"x", delay=math.inf),
    "delay too long": lambda q: q.enqueue(b"x", delay=limits.DELAY_S_MAX + 1),
    "delay str": lambda q: q.enqueue(b"x", delay="5"),
    "delay bool": lambda q: q.enqueue(b"x", delay=True),
    "delay None": lambda q: q.enqueue(b"x", delay=None),
    "priority too high": lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MAX + 1),
    "priority too low": lambda q: q.enqueue(b"x", priority=limits.PRIORITY_MIN - 1),
    "priority float": lambda q: q.enqueue(b"x", priority=1.5),
    "priority None": lambda q: q.enqueue(b"x", priority=None),
    "queue empty": lambda q: q.enqueue(b"x", queue=""),
    "queue too long": lambda q: q.enqueue(b"x", queue="q" * (limits.QUEUE_NAME_BYTES_MAX + 1)),
    "dedup id too long": lambda q: q.enqueue(b"x", dedup_id="d" * (limits.DEDUP_ID_BYTES_MAX + 1)),
    "batch unknown field": lambda q: q.enqueue_many([{"body": b"x", "colour": "red"}]),
    "batch one bad item (router)": lambda q: q.enqueue_many([{"body": b"ok", "key": "a"},
                                                             {"body": b"ok", "key": "a", "delay": -1}]),
    "batch one bad item (shard)": lambda q: q.enqueue_many([{"body": b"ok", "key": "a"},
                                                            {"body": b"x" * (BODY_MAX + 1), "key": "a"}]),
    "visibility zero": lambda q: q.dequeue(visibility=0),
    "visibility negative": lambda q: q.dequeue(visibility=-1),
    "visibility nan": lambda q: q.dequeue(visibility=math.nan),
    "visibility too long": lambda q: q.dequeue(visibility=limits.VISIBILITY_TIMEOUT_S_MAX + 1),
    "max_jobs zero": lambda q: q.dequeue_many(max_jobs=0),
    "max_jobs too many": lambda q: q.dequeue_many(max_jobs=limits.BATCH_JOBS_MAX + 1),
    "wait negative": lambda q: q.dequeue(wait=-1),
    "wait too long": lambda q: q.dequeue(wait=limits.WAIT_S_MAX + 1),
    "nack delay negative": lambda q: q.nack(_lease(q), delay=-1),
    "extend zero": lambda q: q.extend(_lease(q), 0),
    "extend nan": lambda q: q.extend(_lease(q), math.nan),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_a_typed_error_and_enqueues_nothing(q, name):
    before = q.stats()["queues"].get("default", {})
    with pytest.raises(shardq.InvalidJob):
        BAD_CALLS[name](q)
    after = q.stats()["queues"].get("default", {})
    assert {k: v for k, v in after.items() if k != "keys"} == {k: v for k, v in before.items() if k != "keys"}
    assert sum(jobs(q)) == (1 if name.startswith(("nack", "extend")) else 0)  # only the held lease
    if name.startswith(("nack", "extend")):  # the refused call left the lease as it was
        held = q.stats()["queues"]["other"]
        assert held["in_flight"] == 1


def test_bad_input_at_the_cli_is_a_typed_error_and_enqueues_nothing(q, svc):
    d = ["--data-dir", svc.data_dir]
    held = _lease(q)
    cases = {
        "priority": cli("enqueue", "x", "--priority", str(limits.PRIORITY_MAX + 1), *d),
        "delay negative": cli("enqueue", "x", "--delay=-1", *d),
        "delay nan": cli("enqueue", "x", "--delay", "nan", *d),
        "key": cli("enqueue", "x", "--key", "k" * 600, *d),
        "body": cli("enqueue", "-", *d),
        "visibility": cli("dequeue", "--visibility", "0", *d),
        "max": cli("dequeue", "--max", "0", *d),
        "wait": cli("dequeue", "--wait=-1", *d),
        "nack delay": cli("nack", str(held.job_id), str(held.token), "--delay=-5", *d),
    }
    results = {}
    for name, p in cases.items():
        _, err = p.communicate(b"x" * (BODY_MAX + 1) if name == "body" else None, timeout=60)
        results[name] = (p.returncode, err.decode())
    wrong = {n: r for n, r in results.items() if r[0] != 2 or "error: InvalidJob" not in r[1]}
    assert not wrong, wrong
    # argparse refuses what is not even a number, with its own usage error (also exit 2)
    p = cli("enqueue", "x", "--priority", "1.5", *d)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and b"invalid int value" in err
    assert sum(jobs(q)) == 1 and q.stats()["queues"]["other"]["in_flight"] == 1  # only the held lease
