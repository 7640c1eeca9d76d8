"""Many arrivals in one request (``arrive_many``) and a worker's round of reports and acks
(``Router.settle_many``), against real shard processes: each arrival answered as ``arrive``
answers it, a refused one leaving the others counted, the count limit refused with a clear
error, and the client cutting a round into requests a shard accepts, at the count limit
and at the byte limit (shardq/protocol/wire.py, shardq/client/results.py)."""
from __future__ import annotations

import msgpack
import pytest

from shardq import limits
from shardq.client import results as res
from support.raw_shard import Raw, key_per_shard
from support.service import Service

SHARDS = 2
KEYS = key_per_shard(SHARDS)  # shard -> a key that lands there


@pytest.fixture
def svc():
    with Service(shards=SHARDS, config={"queue_defaults": {"visibility_timeout": 60}}) as s:
        yield s


def test_each_arrival_is_answered_as_arrive_answers_it_and_a_refused_one_leaves_the_others(svc):
    callback = [b"callback", KEYS[0], "cbq", 0, 0]
    raw = Raw(svc, 0)
    try:
        got = raw.call("arrive_many", [
            ["am.b", 0, 3, b"zero", 600.0, callback],
            ["am.b", 1, 3, b"one", 600.0, callback],
            ["am.b", 2, 4, b"two", 600.0, callback],     # the wrong total: refused alone
            ["am.b", 0, 3, b"zero", 600.0, callback],    # counted already
            "not an arrival",
            ["am.b", 2, 3, b"two", 600.0, callback],     # the last: fires
        ])
        assert got[:2] == ["counted", "counted"] and got[3] == "repeated" and got[5] == "fired"
        assert got[2] == ["InvalidJob", "barrier 'am.b' has 3 members; this arrival says 4"]
        assert got[4][0] == "InvalidJob" and "each arrival is [barrier_id" in got[4][1]
        (row,) = raw.call("dequeue", "cbq", None, 10)
        assert row[2] == b"callback"  # the callback, once
        assert raw.call("barrier_values", "am.b") == [b"zero", b"one", b"two"]
        again = raw.call("arrive_many", [["am.b", i, 3, b"x", 600.0, callback] for i in range(3)])
        assert again == ["repeated"] * 3  # a re-sent request changes nothing
        assert raw.call("dequeue", "cbq", None, 10) == []
        too_many = [["am.c", 0, 1, b"", 600.0, callback]] * (limits.BATCH_JOBS_MAX + 1)
        assert raw.error("arrive_many", too_many) == [
            "InvalidJob", f"arrive_many: expected at most {limits.BATCH_JOBS_MAX} arrivals"]
        assert raw.call("barrier", ["am.c"]) == [None]  # nothing of it applied
    finally:
        raw.close()


def test_a_round_over_the_count_limit_is_cut_and_every_report_and_ack_lands(svc):
    """BATCH_JOBS_MAX + 1 arrivals at one barrier, a kept result and an ack, in one call:
    two ``arrive_many`` requests (the count limit) and every answer None."""
    total = limits.BATCH_JOBS_MAX + 1
    callback = [b"done", KEYS[1], "cbq", 0, 0]
    with svc.connect() as q:
        kept_id = q.enqueue(b"kept", key=KEYS[0])
        acked_id = q.enqueue(b"acked", key=KEYS[1])
        leases = {lz.job_id: lz for lz in q.dequeue_many("default", max_jobs=2, wait=5)}
        kept, acked = leases[kept_id], leases[acked_id]
        shard = 1
        reports = [(kept, ("arrive", (shard, "big.b", i, total, b"%d" % i, 600.0, callback)))
                   for i in range(total)]
        reports.append((kept, ("put_result", (b"\x07", 600.0))))
        calls, where, _ = res.report_calls(reports, SHARDS)
        assert [(c.shard, c.op, len(w)) for c, w in zip(calls, where)] == [
            (0, "put_result", 1), (1, "arrive_many", limits.BATCH_JOBS_MAX), (1, "arrive_many", 1)]
        acks, answers = q.settle_many([acked], reports)
        assert acks == [None] and answers == [None] * len(reports)
        assert q.barriers([(shard, "big.b")])[0]["fired_job"] is not None
        assert q.barrier_values(shard, "big.b") == [b"%d" % i for i in range(total)]
        assert q.results([kept_id])[0].value == b"\x07"
        assert q.results([acked_id])[0].state == "gone"  # acked, no result kept
        # The same round again: every arrival "repeated" (landed), the ack's JobGone
        # answered as what it is: that job is gone.
        acks, answers = q.settle_many([], reports[:-1])
        assert answers == [None] * (len(reports) - 1)


def test_a_round_over_the_byte_limit_is_cut_into_requests_a_shard_accepts(svc):
    """Arrivals of RESULT_BYTES_MAX values whose sum is over REQUEST_BYTES_MAX: cut into
    requests that each encode within it, and all of them counted."""
    per_barrier = limits.BARRIER_BYTES_MAX // (limits.RESULT_BYTES_MAX + 1024)  # values within the barrier limit
    barriers = limits.REQUEST_BYTES_MAX // (per_barrier * limits.RESULT_BYTES_MAX) + 1
    callback = [b"done", KEYS[0], "cbq", 0, 0]
    value = b"v" * limits.RESULT_BYTES_MAX
    with svc.connect() as q:
        job_id = q.enqueue(b"member", key=KEYS[0])
        (lz,) = q.dequeue_many("default", max_jobs=1, wait=5)
        assert lz.job_id == job_id
        reports = [(lz, ("arrive", (0, f"bytes.{b}", i, per_barrier, value, 600.0, callback)))
                   for b in range(barriers) for i in range(per_barrier)]
        assert len(reports) * limits.RESULT_BYTES_MAX > limits.REQUEST_BYTES_MAX
        calls, _, _ = res.report_calls(reports, SHARDS)
        assert len(calls) >= 2
        for call in calls:
            assert len(msgpack.packb([[1, call.op, call.args]])) <= limits.REQUEST_BYTES_MAX
        assert q.report_many(reports) == [None] * len(reports)
        states = q.barriers([(0, f"bytes.{b}") for b in range(barriers)])
        assert all(s["arrived"] == per_barrier and s["fired_job"] is not None for s in states)


def test_a_report_the_client_refuses_is_answered_alone_and_the_others_land(svc):
    callback = [b"done", KEYS[0], "cbq", 0, 0]
    with svc.connect() as q:
        q.enqueue(b"m", key=KEYS[0])
        (lz,) = q.dequeue_many("default", max_jobs=1, wait=5)
        answers = q.report_many([
            (lz, ("arrive", (0, "", 0, 1, b"v", 600.0, callback))),          # no barrier id
            (lz, ("arrive", (SHARDS, "ok.b", 0, 1, b"v", 600.0, callback))),  # no such shard
            (lz, ("put_result", (b"v" * (limits.RESULT_BYTES_MAX + 1), 60.0))),
            (lz, ("put_result", (b"v",))),                                    # an arg missing
            (lz, ("arrive", (0, "ok.b", 0, 1, b"v", 600.0, callback))),
        ])
        assert [type(a).__name__ for a in answers] == ["InvalidJob"] * 4 + ["NoneType"]
        assert "barrier id" in str(answers[0]) and "not one of this service's 2" in str(answers[1])
        assert q.barriers([(0, "ok.b")])[0]["fired_job"] is not None
