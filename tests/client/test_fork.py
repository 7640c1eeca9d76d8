"""A router used before a fork (gunicorn's ``--preload``, a multiprocessing pool on ``fork``).

The child got the parent's sockets, I/O thread and enqueue sessions: the two processes
wrote frames on the same connections and read each other's replies, so calls in both timed
out (ShardUnavailable) although the shard had applied them, and a caller that tried again
enqueued twice. The child now starts its own connections, under its own client id.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import shardq
from shardq.errors import UsageError

from support.service import Service, short_tmpdir

CHILDREN, SINGLES, BATCH = 3, 100, 50


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2) as s:
        yield s


def _reap(pids: list[int], timeout: float) -> list[int | str]:
    """Each child's exit code, "hung" for one still running at the deadline (then killed)."""
    deadline, codes = time.monotonic() + timeout, []
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes.append("hung")
                break
            time.sleep(0.02)
    return codes


def _child(work) -> None:
    """Run ``work()`` in a forked child and leave with its verdict, never returning into pytest."""
    code = 1
    try:
        code = 0 if work() else 3
    except BaseException as e:  # noqa: BLE001 - told by the exit code
        print(f"child {os.getpid()}: {type(e).__name__}: {e}", flush=True)
    finally:
        os._exit(code)


def test_parent_and_forked_children_each_get_their_own_replies(svc):
    queue = "forked"
    q = shardq.connect(svc.data_dir, retry_s=5, request_timeout_s=10)
    try:
        q.enqueue(b"before", key="a", queue=queue)  # a lane is open
        q.enqueue_many([{"body": b"x", "key": f"b{i}"} for i in range(4)], queue=queue)
        assert q.dequeue("nothing-here", wait=0.05) is None  # a wait on both shards: the I/O thread
        assert q._io is not None

        def work(c: int) -> bool:
            ids = [q.enqueue(b"c%d-%d" % (c, i), key=f"k{i % 7}", queue=queue) for i in range(SINGLES)]
            ids += q.enqueue_many([{"body": b"m", "key": f"m{i}"} for i in range(BATCH)], queue=queue)
            q.close()
            return len(set(ids)) == SINGLES + BATCH

        pids = []
        for c in range(CHILDREN):
            pid = os.fork()
            if pid == 0:
                _child(lambda c=c: work(c))
            pids.append(pid)
        ids = [q.enqueue(b"p%d" % i, key=f"p{i % 5}", queue=queue) for i in range(SINGLES)]
        assert _reap(pids, 60) == [0] * CHILDREN
        assert len(set(ids)) == SINGLES
        totals = q.stats()["queues"][queue]
        assert totals["ready"] + totals["waiting"] == 1 + 4 + SINGLES + CHILDREN * (SINGLES + BATCH)
    finally:
        q.close()


def test_a_forked_child_closing_an_embedded_service_leaves_it_running():
    """``shardq.open``'s router stops the service it embeds when closed; a child's copy of it
    must not stop the parent's (before the fix the child's supervisor found its copies of
    the shard processes not its own and did nothing worse than wake the parent's monitor
    and log "stopped"; now the child leaves the service to the parent altogether)."""
    data = os.path.join(short_tmpdir(), "data")
    with shardq.open(data, shards=1) as e:
        e.enqueue(b"before")
        shard_pids = e.ping()
        pid = os.fork()
        if pid == 0:
            _child(lambda: (e.enqueue(b"from-child") > 0, e.close())[0])
        assert _reap([pid], 60) == [0]
        assert e.ping() == shard_pids  # not stopped, nor restarted (replay would hide it in the counts)
        assert e.stats()["queues"]["default"]["ready"] == 2



def test_an_asyncio_client_copied_by_a_fork_refuses_calls_in_the_child_and_the_parents_jobs_stay(svc):
    """The child's enqueue on the copied client took the parent's session numbers: the shard
    answered the parent's next enqueue with the child's job id and the parent's job was
    lost (3 of 3). The child's calls now raise UsageError before touching a socket."""
    queue = "aio-forked"
    loop = asyncio.new_event_loop()
    try:
        q = loop.run_until_complete(shardq.aio.connect(svc.data_dir))
        first = loop.run_until_complete(q.enqueue(b"before fork", queue=queue))

        def work() -> bool:
            for call in (lambda: q.enqueue(b"from child", queue=queue), lambda: q.stats(), lambda: q.close()):
                try:
                    loop.run_until_complete(call())
                except UsageError as e:
                    if "fork" not in str(e):
                        return False
                else:
                    return False
            return True

        pid = os.fork()
        if pid == 0:
            _child(work)
        assert _reap([pid], 60) == [0]
        second = loop.run_until_complete(q.enqueue(b"from parent", queue=queue))
        assert second != first
        leases = loop.run_until_complete(q.dequeue_many(queue, max_jobs=10, wait=0.5))
        assert sorted(lease.body for lease in leases) == [b"before fork", b"from parent"]
        loop.run_until_complete(q.ack_many(leases))
        loop.run_until_complete(q.close())
    finally:
        loop.close()
