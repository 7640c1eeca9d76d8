"""Pause/resume, cancel, look-up and dead-letter paging through the router and the CLI,
against a real ``shardq serve``; pause survives a SIGKILL of the shard."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import shardq
from shardq.client.router import shard_for_key
from shardq.errors import Cancelled, InvalidJob, LeaseLost, NotFound

from support.service import REPO, Service, reset_queues, restarted

CONFIG = {"queues": {"default": {}, "once": {"max_deliveries": 1}}}


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config=CONFIG) as s:
        yield s


@pytest.fixture
def q(svc):
    with svc.connect(retry_s=20) as router:
        yield router
        reset_queues(router, ("default", "once"))


def cli(svc, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args, "--data-dir", svc.data_dir],
                          capture_output=True, text=True, timeout=60, env=env, cwd=os.path.dirname(svc.data_dir))


def keys_on(shard: int, n: int, shards: int = 2) -> list[str]:
    return [k for k in (f"key-{i}" for i in range(1000)) if shard_for_key(k, shards) == shard][:n]


def kill_dead(q, queue: str, n: int) -> list[int]:
    ids = [q.enqueue(f"dead {i}".encode(), key=f"d{i}", queue=queue) for i in range(n)]
    got = 0
    while got < n:
        for lease in q.dequeue_many(queue, max_jobs=n, wait=1):
            q.nack(lease, error=f"handler failed on {lease.job_id}")
            got += 1
    return ids


def test_a_paused_queue_leases_nothing_until_resumed_and_the_pause_survives_sigkill(svc, q):
    ids = [q.enqueue(f"p{i}".encode(), key=k) for i, k in enumerate(keys_on(0, 2) + keys_on(1, 2))]
    held = q.dequeue(wait=1)
    assert q.pause("default") == 2 and q.pause("default") == 0
    assert q.stats()["queues"]["default"]["paused"] is True
    t0 = time.monotonic()
    assert q.dequeue(wait=0.5) is None                      # the wait is spent waiting, not spinning
    assert time.monotonic() - t0 >= 0.45
    new = q.enqueue(b"while paused")                        # enqueue, extend, nack, ack keep working
    held = q.extend(held, 60)
    q.nack(held)
    assert q.dequeue() is None
    # The pause is logged: a shard SIGKILLed and restarted is still paused.
    pid = q.ping()[0]
    os.kill(pid, signal.SIGKILL)
    restarted(svc, 0, pid)
    assert q.dequeue(wait=0.2) is None
    assert q.stats()["queues"]["default"]["paused"] is True
    # A consumer waiting on the paused queue is woken by the resume.
    woke: list = []
    waiter = threading.Thread(target=lambda: woke.append(q.dequeue(wait=20)))
    waiter.start()
    time.sleep(0.3)  # not synchronisation: the asserts hold either way; this makes the waiter
    #                  most likely blocked in its watch when the resume comes (the case under test)
    resumed_at = time.monotonic()
    assert q.resume("default") == 2
    waiter.join(20)
    assert woke and woke[0] is not None
    assert time.monotonic() - resumed_at < 10, "the resume did not wake the waiting consumer"
    q.ack(woke[0])
    rest = q.dequeue_many(max_jobs=10, wait=1)
    assert {l.job_id for l in rest} | {woke[0].job_id} <= set(ids) | {new}
    for lease in rest:
        q.ack(lease)
    assert "paused" not in q.stats()["queues"]["default"]


def test_cancel_a_leased_job_reaches_its_holder_and_the_key_moves_on(q):
    first = q.enqueue(b"long job", key="acct-7")
    second = q.enqueue(b"next", key="acct-7")
    lease = q.dequeue(wait=1)
    assert lease.job_id == first
    assert q.cancel(first) == "cancelling"
    assert q.job(first)["cancelled"] is True
    with pytest.raises(Cancelled):
        q.extend(lease, 30)
    assert q.dequeue(wait=0.2) is None                      # the key is still held by the cancelled job
    with pytest.raises(Cancelled) as e:
        q.ack(lease)
    assert isinstance(e.value, LeaseLost)
    assert q.cancel(first) == "gone"
    nxt = q.dequeue(wait=1)
    assert nxt.job_id == second
    q.ack(nxt)


def test_job_lookup_and_cancel_of_waiting_and_dead_jobs(q):
    a, b, c = (q.enqueue(x, key="k") for x in (b"a", b"b", b"c"))
    info = q.job(c)
    assert (info["state"], info["position"], info["queue"], info["key"]) == ("waiting", 2, "default", "k")
    assert info["shard"] == shardq.client.router.shard_of_job(c) and info["body"] == b"c"
    assert abs(info["enqueued_at"] - time.time()) < 5
    assert q.cancel(b) == "cancelled"
    assert q.job(c)["position"] == 1
    with pytest.raises(NotFound):
        q.job(b)
    with pytest.raises(InvalidJob):
        q.cancel("not an id")
    dead = kill_dead(q, "once", 1)[0]
    assert q.job(dead)["state"] == "dead" and q.job(dead)["error"].startswith("handler failed")
    assert q.cancel(dead) == "purged"
    assert q.dead_letters("once") == []


def test_dead_letters_page_across_shards_and_redrive_or_purge_chosen_ones(q):
    ids = kill_dead(q, "once", 23)
    seen, cursor = [], None
    while True:
        page = q.dead_letters_page("once", limit=5, cursor=cursor)
        assert len(page.items) <= 5 and page.skipped_shards == []
        seen += [d.job_id for d in page.items]
        assert all(d.error.startswith("handler failed") for d in page.items)
        cursor = page.cursor
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    assert q.redrive("once", ids[:3]) == 3
    assert q.purge_dead_letters("once", ids[3:6] + ids[3:6]) == 3
    assert q.purge_dead_letters("once", ids[3:6]) == 0      # again: nothing, no error
    left = {d.job_id for d in q.dead_letters_page("once", limit=1000).items}
    assert left == set(ids[6:])
    with pytest.raises(InvalidJob):
        q.dead_letters_page("once", cursor="nonsense")
    for call in (q.redrive, q.purge_dead_letters):  # ids are checked alike before any is sent
        with pytest.raises(InvalidJob):
            call("once", "not a list")
        with pytest.raises(InvalidJob):
            call("once", [ids[6], "x"])
    assert {d.job_id for d in q.dead_letters_page("once", limit=1000).items} == set(ids[6:])


def test_cli_queue_job_and_dead_letter_commands(svc, q):
    r = cli(svc, "queue", "pause", "default")
    assert r.returncode == 0 and r.stdout.strip() == "paused: default", r.stderr
    assert cli(svc, "queue", "pause", "default").stdout.strip() == "paused: default (it was paused already)"
    assert q.stats()["queues"]["default"]["paused"] is True
    r = cli(svc, "stats")
    assert any(l.split()[:1] == ["default"] and l.split()[-1] == "paused" for l in r.stdout.splitlines())
    assert cli(svc, "queue", "resume", "default").stdout.strip() == "resumed: default"
    jid = q.enqueue(b"look at me", key="cli")
    r = cli(svc, "job", "show", str(jid))
    shown = json.loads(r.stdout)
    assert (shown["job_id"], shown["state"], shown["body"], shown["body_bytes"]) == (jid, "ready", "look at me", 10)
    assert cli(svc, "job", "cancel", str(jid)).stdout.strip() == "cancelled"
    for args in (("job", "cancel", str(jid)), ("job", "show", str(jid))):  # gone: the one "no such job"
        r = cli(svc, *args)
        assert r.returncode == 2 and f"NotFound: no such job: {jid}" in r.stderr, args
    ids = kill_dead(q, "once", 4)
    r = cli(svc, "dead-letters", "list", "--queue", "once", "--limit", "3")
    assert len(r.stdout.splitlines()) == 3
    cursor = r.stderr.strip().rpartition("--cursor ")[2]
    r = cli(svc, "dead-letters", "list", "--queue", "once", "--limit", "3", "--cursor", cursor)
    assert len(r.stdout.splitlines()) == 1
    r = cli(svc, "dead-letters", "redrive", "--queue", "once", "--id", str(ids[0]), "--id", str(ids[1]))
    assert r.stdout.strip() == "redriven: 2", r.stderr
    r = cli(svc, "dead-letters", "purge", "--queue", "once", "--id", str(ids[2]))
    assert r.stdout.strip() == "purged: 1", r.stderr
    r = cli(svc, "dead-letters", "purge", "--queue", "once", "--id", "not-a-job-id")  # an SQS-style id
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(
        "error: UsageError: argument --id: not a job id: 'not-a-job-id'"), r.stderr
    assert "Traceback" not in r.stderr
    assert [d.job_id for d in q.dead_letters("once")] == [ids[3]]
