"""Results and workflow barriers against a real shard process, over the raw wire
(docs/design.md, "Workflows and results"; shardq/protocol/wire.py): a worker's result and
progress fenced by its lease, a barrier whose last arrival enqueues the callback that a
waiting consumer then leases, errors as typed error replies, and everything still there
after the shard is SIGKILLed and after the service restarts."""
from __future__ import annotations

import os
import signal
import time

import pytest

from shardq import limits
from shardq.datadir import DataDir
from support.raw_shard import Raw, key_per_shard
from support.service import Service, restarted, wait_until

SHARDS = 2
KEYS = key_per_shard(SHARDS)  # shard -> a key that lands there


@pytest.fixture
def svc():
    with Service(shards=SHARDS, config={"queue_defaults": {"visibility_timeout": 60}}) as s:
        yield s


def lease(raw: Raw, queue: str = "default") -> list:
    (row,) = raw.call("dequeue", queue, None, 1)
    return row


def test_results_progress_and_a_barrier_over_the_wire_survive_a_kill_and_a_restart(svc):
    key = KEYS[0]
    raw = Raw(svc, 0)
    waiter = Raw(svc, 0)
    try:
        with svc.connect() as q:
            member = q.enqueue(b"member", key=key)
        job_id, _key, body, attempt, token = lease(raw)[:5]
        assert (job_id, body, attempt) == (member, b"member", 1)
        big = b"R" * limits.RESULT_BYTES_MAX
        assert raw.call("put_result", job_id, token, big, 3600.0) is None
        assert raw.call("progress", job_id, token, 0.5, "half way") is None
        other = (12345 << 10) | 0
        assert raw.call("result", [job_id, other]) == [
            ["succeeded", big, None, None, None, None, pytest.approx(time.time() + 3600.0, abs=120), False],
            ["gone", None, None, None, None, None, None, False]]
        assert raw.call("result_sizes", [job_id, other]) == [
            ["succeeded", limits.RESULT_BYTES_MAX, None, None, None, None,
             pytest.approx(time.time() + 3600.0, abs=120), False],
            ["gone", None, None, None, None, None, None, False]]
        assert raw.error("result_sizes", [(5 << 10) | 1])[0] == "InvalidJob"
        assert raw.error("put_result", job_id, token + 1, b"v", 60.0)[0] == "LeaseLost"
        assert raw.error("put_result", job_id, token, b"v" * (limits.RESULT_BYTES_MAX + 1), 60.0)[0] == "InvalidJob"
        assert raw.error("result", [(5 << 10) | 1])[0] == "InvalidJob"   # shard 1's job
        assert raw.call("ack", [[job_id, token]]) == [None]
        assert raw.call("result", [job_id])[0][:2] == ["succeeded", big]   # outlives the ack

        # A barrier of two: a consumer waits at the shard for the callback's queue.
        callback = [b"callback", key, "cbq", 0, 0]
        rid = waiter.send("dequeue_wait", ["cbq", None, 1, 30.0])
        wait_until(lambda: raw.call("stats")["waiting_dequeues"] == 1, what="the wait parked")
        assert raw.call("arrive", "wf1.b", 1, 2, b"one", 600.0, callback) == "counted"
        assert raw.call("arrive", "wf1.b", 1, 2, b"one", 600.0, callback) == "repeated"
        assert raw.error("arrive", "wf1.b", 0, 3, b"zero", 600.0, callback)[1].endswith(
            "has 2 members; this arrival says 3")
        assert raw.call("barrier", ["wf1.b"]) == [
            {"total": 2, "arrived": 1, "fired_job": None, "cancelled": False, "missing": [0]}]
        assert raw.error("barrier_values", "wf1.b") == ["InvalidJob", "barrier 'wf1.b': 1 of 2 members arrived"]
        assert raw.call("arrive", "wf1.b", 0, 2, b"zero", 600.0, callback) == "fired"
        status, rows = waiter.reply(rid)
        assert status == 0 and len(rows) == 1
        cb_id, cb_key, cb_body = rows[0][:3]
        assert (cb_key, cb_body) == (key, b"callback")
        info = raw.call("barrier", ["wf1.b", "nope"])
        assert info == [{"total": 2, "arrived": 2, "fired_job": cb_id, "cancelled": False, "missing": []}, None]
        assert raw.call("barrier_values", "wf1.b") == [b"zero", b"one"]
        assert raw.call("cancel_barrier", "wf1.b", 0) == "fired"
        assert raw.call("cancel_barrier", "wf1.c", 0) == "cancelled"
        assert raw.call("arrive", "wf1.c", 0, 1, b"late", 600.0, callback) == "cancelled"
        assert raw.error("barrier_values", "unknown")[0] == "NotFound"
        stats = raw.call("stats")
        assert (stats["results"], stats["barriers"]) == (1, {"open": 0, "fired": 1, "cancelled": 1})
        assert raw.call("arrive", "wf1.open", 0, 2, b"half", 600.0, callback) == "counted"
    finally:
        raw.close()
        waiter.close()

    def check(after: str, results: int = 1) -> None:
        again = Raw(svc, 0)
        try:
            assert again.call("result", [job_id])[0][:2] == ["succeeded", big], after
            assert again.call("barrier", ["wf1.b"])[0]["fired_job"] == cb_id, after
            assert again.call("barrier_values", "wf1.b") == [b"zero", b"one"], after
            assert again.call("arrive", "wf1.b", 0, 2, b"zero", 600.0, callback) == "repeated", after
            assert again.call("arrive", "wf1.c", 0, 1, b"late", 600.0, callback) == "cancelled", after
            stats = again.call("stats")
            assert (stats["results"], stats["barriers"]) == (results, {"open": 1, "fired": 1, "cancelled": 1}), after
        finally:
            again.close()

    pid = svc.shard_pids()[0]
    os.kill(pid, signal.SIGKILL)
    restarted(svc, 0, pid)
    check("after SIGKILL: replayed from the log")
    # A second result of a mebibyte, so that the stop writes a checkpoint (a mebibyte logged
    # since the start) and the restart replays it.
    more = Raw(svc, 0)
    try:
        with svc.connect() as q:
            second = q.enqueue(b"second", key=key)
        row = lease(more)
        assert row[0] == second
        more.call("put_result", second, row[4], big, 3600.0)
    finally:
        more.close()
    svc.stop()
    svc.start()
    check("after a restart", results=2)
    shard_dir = DataDir(svc.data_dir).shard_dir(0)
    assert any(n.endswith(".ckpt") for n in os.listdir(shard_dir))
    last = Raw(svc, 0)
    try:
        # the open barrier kept its member: its last arrival fires now
        assert last.call("arrive", "wf1.open", 1, 2, b"rest", 600.0, callback) == "fired"
        assert last.call("barrier_values", "wf1.open") == [b"half", b"rest"]
    finally:
        last.close()

