"""One behaviour suite for both client drivers (the threaded router and the asyncio client,
called synchronously here): every scenario runs against each, so none can exist for one
only. Both drive the same sans-I/O core (shardq/client/core.py); these tests check that
what reaches the shards, and what the caller gets, is the same.

Scripted fake shards (the real handshake and framing, replies chosen per request) make the
failures exact: an error from a later shard of a lease round, a shard down, a priority plan.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time

import pytest

import shardq
from shardq import limits
from shardq.protocol import validate, wire

from support.fake_shard import FakeShards, Refuse
from support.service import Service, _to_toml, restarted, wait_until

Q = "jobs"


# ---------------------------------------------------------------------- the drivers
class SyncAsyncQueue:
    """The asyncio client, called like the router: its event loop runs in a thread of its
    own, and each coroutine method is run there and waited for."""

    def __init__(self, data_dir: str, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.q = self._run(shardq.aio.connect(data_dir, **kw))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def __getattr__(self, name):
        attr = getattr(self.q, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *a, **kw: self._run(attr(*a, **kw))

    def close(self) -> None:
        self._run(self.q.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(params=["threaded", "asyncio"])
def connect(request):
    """``connect(data_dir, **kw)``: a client of the driver under test (closed afterwards)."""
    made = []

    def make(data_dir: str, **kw):
        kw.setdefault("retry_s", 2)
        kw.setdefault("request_timeout_s", 10)
        q = shardq.connect(data_dir, **kw) if request.param == "threaded" else SyncAsyncQueue(data_dir, **kw)
        made.append(q)
        return q

    make.threaded = request.param == "threaded"  # type: ignore[attr-defined]
    yield make
    for q in made:
        q.close()


# ---------------------------------------------------------------------- fake shards


def job_id(seq: int, shard: int) -> int:
    return (seq << limits.JOB_ID_SHARD_BITS) | shard


def row(seq: int, shard: int, priority: int = 0, uses_priorities: bool = False) -> list:
    """A lease on the wire: [job_id, key, body, attempt, token, deadline, priority, uses_priorities]."""
    return [job_id(seq, shard), None, b"body-%d-%d" % (shard, seq), 1, 100 + seq, 9e9, priority, uses_priorities]


def releases(f: FakeShards) -> list[tuple[int, int, int]]:
    """(shard, job id, token) of every unstarted release (a nack that is not a delivery)."""
    return [(s, a[0], a[1]) for s, _, a in f.sent("nack") if a[2:] == [0, None, False]]


def serve_leases(by_shard: dict[int, object], peeks: dict[int, list] | None = None):
    """An ``answer``: each shard's first dequeue gets ``by_shard[shard]`` (rows, or a
    Refuse), later ones nothing; peeks get ``peeks[shard]``; nacks, acks and notes succeed."""
    asked: set[int] = set()

    def answer(shard, op, args):
        if op == "dequeue":
            if shard in asked:
                return []
            asked.add(shard)
            return by_shard.get(shard, [])
        if op == "peek":
            return (peeks or {}).get(shard, [])
        if op == "ack":
            return [None] * len(args[0])
        if op == "extend":
            return 12345.0
        if op in ("nack", "bury", "note_priorities"):
            return None
        raise AssertionError(f"unexpected {op}")
    return answer


# ---------------------------------------------------------------------- lease rounds
def test_a_lease_round_asks_shard_after_shard_for_what_is_still_missing(fake, connect):
    f = fake(3, serve_leases({0: [row(1, 0)], 1: [row(2, 1), row(3, 1)]}))
    q = connect(f.dd.path)
    leases = q.dequeue_many(Q, max_jobs=3)
    assert [l.job_id for l in leases] == [job_id(1, 0), job_id(2, 1), job_id(3, 1)]
    assert [(s, a[2]) for s, _, a in f.sent("dequeue")] == [(0, 3), (1, 2)]  # shard 2 not asked: full
    assert releases(f) == []


@pytest.mark.parametrize("error", ["ProtocolError", "InvalidJob", "Closed"])
def test_an_error_from_a_later_shard_releases_the_leases_the_round_took(fake, connect, error):
    """Shard 0 leases a job, shard 1 answers the same round with an error: the caller gets
    the error, and the lease taken at shard 0 is handed back at once, unstarted, instead of
    blocking its key until the visibility timeout (the asyncio client used to keep it)."""
    f = fake(2, serve_leases({0: [row(1, 0)], 1: Refuse(error)}))
    q = connect(f.dd.path)
    with pytest.raises(getattr(shardq.errors, error)):
        q.dequeue_many(Q, max_jobs=2)
    wait_until(lambda: releases(f), 10, what="the lease of shard 0 released")
    assert releases(f) == [(0, job_id(1, 0), 101)]


def test_a_round_holding_leases_waits_for_a_hung_shard_a_moment_then_returns_them_and_releases_its_late_ones(
        fake, connect):
    """Found by a walkthrough (one shard SIGSTOPped, jobs on the other): a round that had
    leased at the healthy shard waited for the hung one's reply for the whole request
    timeout, then returned leases whose deadline had passed (another consumer had them
    meanwhile). It waits ``HELD_STEP_S`` at most; the hung shard's later reply's leases are
    released unstarted."""
    hung = threading.Event()
    healthy = serve_leases({0: [row(1, 0), row(2, 0)]})

    def answer(shard, op, args):
        if shard == 1 and op == "dequeue":
            hung.wait(60)  # a shard that does not answer until the test lets it
            return [row(9, 1)]
        return healthy(shard, op, args)
    f = fake(2, answer)
    q = connect(f.dd.path, request_timeout_s=30)
    try:
        started = time.monotonic()
        leases = q.dequeue_many(Q, max_jobs=10)
        waited = time.monotonic() - started
        assert [l.job_id for l in leases] == [job_id(1, 0), job_id(2, 0)]
        assert waited < 10, waited  # HELD_STEP_S (1 s), not the request timeout (30 s)
    finally:
        hung.set()
    wait_until(lambda: releases(f), 10, what="the hung shard's late lease released")
    assert releases(f) == [(1, job_id(9, 1), 109)]


@pytest.mark.parametrize("error", ["ShardUnavailable", "OutcomeUnknown"])
def test_a_later_shard_down_or_unknown_leaves_the_leases_in_hand_to_the_caller(fake, connect, error):
    """A shard that is down (or whose dequeue's outcome is unknown) does not fail the
    round: the leases already taken are returned, never stranded, and nothing is released."""
    f = fake(2, serve_leases({0: [row(1, 0)], 1: Refuse(error)}))
    q = connect(f.dd.path)
    assert [l.job_id for l in q.dequeue_many(Q, max_jobs=2)] == [job_id(1, 0)]
    assert releases(f) == []


def test_a_shard_found_down_is_left_out_of_the_next_lease_rounds_for_a_while(fake, connect):
    """Shard 1 is down; shard 0 has jobs. Every round that began at shard 1 paid a connect
    attempt's back-off there (~160 ms) before it went on: with one shard of two down a
    consumer acked ~12 jobs/s where it acked 1,000 (found by a walkthrough). A round leaves
    out a shard a recent round found down (DOWN_RECHECK_S), unless every shard is."""
    rows = iter(range(1, 10**6))

    def answer(shard, op, args):
        if op == "dequeue":
            return Refuse("ShardUnavailable") if shard == 1 else [row(next(rows), 0)]
        return [None] * len(args[0]) if op == "ack" else None

    f = fake(2, answer)
    q = connect(f.dd.path)
    for _ in range(20):
        lease = q.dequeue(Q)
        assert lease is not None and lease.job_id & 1 == 0  # shard 0's
        q.ack(lease)
    assert [s for s, _, _ in f.sent("dequeue")].count(1) == 1  # asked once, then left out


def test_a_round_asks_every_shard_when_every_one_was_found_down(fake, connect):
    """Left out only while another shard may answer: with both down, each round asks both."""
    f = fake(2, lambda shard, op, args: Refuse("ShardUnavailable"))
    q = connect(f.dd.path, retry_s=0.1)
    for _ in range(3):
        with pytest.raises(shardq.ShardUnavailable):
            q.dequeue(Q)
    assert len(f.sent("dequeue")) >= 6 and {s for s, _, _ in f.sent("dequeue")} == {0, 1}


def test_an_error_in_the_priority_step_releases_the_leases_kept(fake, connect):
    """Shard 0's lease says the queue uses priorities; shard 1 has a higher one. The plan
    keeps shard 0's lease and takes one at shard 1, whose dequeue fails: the kept lease is
    released, not stranded."""
    f = fake(2, serve_leases({0: [row(1, 0, priority=1, uses_priorities=True)], 1: Refuse("ProtocolError")},
                             peeks={1: [[5, 1]]}))
    q = connect(f.dd.path)
    with pytest.raises(shardq.ProtocolError):
        q.dequeue_many(Q, max_jobs=2)
    wait_until(lambda: releases(f), 10, what="the kept lease released")
    assert releases(f) == [(0, job_id(1, 0), 101)]
    assert [op for _, op, _ in f.requests if op != "nack"] == ["dequeue", "peek", "dequeue"]


def test_priorities_keep_the_highest_over_the_shards_and_release_the_lower(fake, connect):
    f = fake(2, serve_leases({0: [row(1, 0, priority=1, uses_priorities=True)], 1: [row(2, 1, priority=7)]},
                             peeks={1: [[7, 1]]}))
    q = connect(f.dd.path)
    [lease] = q.dequeue_many(Q, max_jobs=1)
    assert lease.job_id == job_id(2, 1)
    wait_until(lambda: releases(f), 10, what="the lower lease released")
    assert releases(f) == [(0, job_id(1, 0), 101)]  # handed back unstarted: not a delivery
    assert [(s, op) for s, op, _ in f.requests if op != "nack"] == [(0, "dequeue"), (1, "peek"), (1, "dequeue")]


def test_a_prioritized_queue_whose_first_shard_is_down_is_served_by_the_others(fake, connect):
    """A queue known to use priorities leases at the first shard while peeking at the
    others; that shard being down is no error (the threaded router raised TypeError)."""
    f = fake(2, serve_leases({0: Refuse("ShardUnavailable"), 1: [row(2, 1, priority=3)]}, peeks={1: [[3, 1]]}))
    answer = f.answer
    f.answer = lambda s, op, args: [job_id(9, s)] if op == "enqueue" else answer(s, op, args)
    q = connect(f.dd.path)
    q.enqueue(b"x", key="k", queue=Q, priority=3)  # tells every shard; this client compares them from now on
    assert len(f.sent("note_priorities")) == 2
    [lease] = q.dequeue_many(Q, max_jobs=1)
    assert lease.job_id == job_id(2, 1)
    asked = [(s, op) for s, op, _ in f.sent("dequeue", "peek")]
    assert sorted(asked[:2]) == [(0, "dequeue"), (1, "peek")] and asked[2:] == [(1, "dequeue")]  # the first two at once


# ---------------------------------------------------------------------- settling
def test_settle_calls_go_to_the_shard_each_job_id_names(fake, connect):
    f = fake(3, serve_leases({}))
    q = connect(f.dd.path)
    leases = [shardq.Lease(job_id(5, s), None, b"", Q, 1, 50 + s, 9e9) for s in (2, 0, 2, 1)]
    q.ack(leases[0])
    assert q.ack_many(leases) == [None] * 4
    q.nack(leases[1], delay=3, error="boom")
    q.bury(leases[3], "given up")
    assert q.extend(leases[2], 60).deadline == 12345.0
    by_shard: dict[int, list] = {}
    for shard, op, args in f.requests:  # the order between shards is the threads' to choose
        by_shard.setdefault(shard, []).append((op, args))
    assert by_shard == {
        0: [("ack", [[[job_id(5, 0), 50]]]), ("nack", [job_id(5, 0), 50, 3, "boom", True])],
        1: [("ack", [[[job_id(5, 1), 51]]]), ("bury", [job_id(5, 1), 51, "given up"])],
        2: [("ack", [[[job_id(5, 2), 52]]]), ("ack", [[[job_id(5, 2), 52], [job_id(5, 2), 52]]]),
            ("extend", [job_id(5, 2), 52, 60])],
    }


def test_ack_many_reports_each_lease_and_a_resent_acks_job_gone_is_success(fake, connect):
    f = fake(1, lambda s, op, args: [None, ["LeaseLost", "expired"], ["JobGone", "gone"]])
    q = connect(f.dd.path)
    leases = [shardq.Lease(job_id(i, 0), None, b"", Q, 1, i, 9e9) for i in (1, 2, 3)]
    out = q.ack_many(leases)
    assert out[0] is None and type(out[1]) is shardq.LeaseLost and type(out[2]) is shardq.JobGone


def test_ack_many_and_purge_by_id_past_a_requests_limit_go_in_several_requests(fake, connect):
    """A shard takes at most BATCH_JOBS_MAX pairs (or ids) a request: 25,000 leases over two
    shards raised InvalidJob from the shard that got too many, after the other had acked its
    part (half applied); a purge by id past it did the same. Both cut each shard's part."""
    n = limits.BATCH_JOBS_MAX

    def answer(shard, op, args):
        if op == "ack":
            assert len(args[0]) <= n
            return [None] * len(args[0])
        assert op == "purge_ids" and len(args[1]) <= n
        return len(args[1])
    f = fake(2, answer)
    q = connect(f.dd.path)
    leases = [shardq.Lease(job_id(i, 0), None, b"", Q, 1, i, 9e9) for i in range(1, 2 * n + 2)]
    leases.append(shardq.Lease(job_id(1, 1), None, b"", Q, 1, 7, 9e9))
    assert q.ack_many(leases) == [None] * (2 * n + 2)
    assert sorted((s, len(a[0])) for s, _, a in f.sent("ack")) == [(0, 1), (0, n), (0, n), (1, 1)]
    acked = [pair[0] for s, _, a in f.sent("ack") if s == 0 for pair in a[0]]
    assert acked == [lease.job_id for lease in leases[:-1]]  # each lease once, in order
    ids = [job_id(i, 0) for i in range(1, n + 2)] + [job_id(1, 1)]
    assert q.purge_dead_letters(Q, ids) == n + 2
    assert sorted((s, len(a[1])) for s, _, a in f.sent("purge_ids")) == [(0, 1), (0, n), (1, 1)]


# ---------------------------------------------------------------------- batches at the frame limit
def test_a_batch_of_requests_at_the_request_limit_leaves_in_frames_within_the_frame_limit(fake, connect):
    """Eight jobs that fill two requests to exactly REQUEST_BYTES_MAX, sent in one call:
    every frame that reaches the shard is within FRAME_BYTES_MAX, and the ids come back in
    input order."""
    per_request = 4
    fixed = validate.job_bytes(b"", "k", Q) + 16
    body_len = (limits.REQUEST_BYTES_MAX - 64 - per_request * fixed) // per_request
    assert body_len <= limits.BODY_BYTES_MAX_CEILING
    jobs = [{"body": bytes([65 + i]) * body_len, "key": "k"} for i in range(2 * per_request)]
    counter = iter(range(1, 1000))
    f = fake(1, lambda s, op, args: [job_id(next(counter), s) for _ in args[0]])
    q = connect(f.dd.path)
    ids = q.enqueue_many(jobs, queue=Q)
    assert ids == [job_id(i, 0) for i in range(1, 9)]
    assert [len(a[0]) for _, _, a in f.sent("enqueue")] == [per_request, per_request]
    assert [a[0][0][0][:1] for _, _, a in f.sent("enqueue")] == [b"A", b"E"]  # in order
    assert len(f.frames) == 2 and max(f.frames) <= limits.FRAME_BYTES_MAX


def test_a_request_that_cannot_be_encoded_fails_alone_and_the_connection_keeps_working(fake, connect):
    """Both connections cut frames with the core's cutter: a request msgpack cannot hold
    (an integer over 64 bits) is refused with InvalidJob before anything is written, and
    the calls after it go out as usual (the asyncio connection used to leave it, and every
    request of its turn, unanswered until the request timeout)."""
    f = fake(1, serve_leases({}))
    q = connect(f.dd.path, request_timeout_s=30)
    too_big = shardq.Lease(1 << 64, None, b"", Q, 1, 7, 9e9)  # its shard bits say shard 0
    with pytest.raises(shardq.InvalidJob, match="cannot be encoded"):
        q.extend(too_big, 60)
    ok = shardq.Lease(job_id(3, 0), None, b"", Q, 1, 7, 9e9)
    assert q.extend(ok, 60).deadline == 12345.0
    assert [op for _, op, _ in f.requests] == ["extend"]


def test_a_shard_that_misses_the_priority_note_is_told_with_the_next_prioritized_enqueue(fake, connect):
    refused: list[int] = []

    def answer(shard, op, args):
        if op == "note_priorities" and shard == 1 and not refused:
            refused.append(shard)
            return Refuse("ShardUnavailable")
        return [job_id(1, shard)] if op == "enqueue" else None

    f = fake(2, answer)
    q = connect(f.dd.path)
    q.enqueue(b"a", key="k", queue=Q, priority=3)  # goes ahead
    q.enqueue(b"b", key="k", queue=Q, priority=3)  # tells both shards again
    q.enqueue(b"c", key="k", queue=Q, priority=3)  # told for good: no note
    assert refused == [1] and len(f.sent("note_priorities")) == 4 and len(f.sent("enqueue")) == 3
    with pytest.raises(shardq.UnknownQueue):  # a typed refusal is raised, and nothing is enqueued
        f.answer = lambda s, op, args: Refuse("UnknownQueue") if op == "note_priorities" else [job_id(2, s)]
        q.enqueue(b"d", key="k", queue="other", priority=1)
    assert len(f.sent("enqueue")) == 3


# ---------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("call", [
    lambda q: q.ack(shardq.Lease(job_id(1, 1000), None, b"", Q, 1, 7, 9e9)),      # a shard it has not
    lambda q: q.nack(shardq.Lease(job_id(1, 0), None, b"", Q, 1, 7, 9e9), delay=[]),  # falsy, no number
    lambda q: q.extend("not a lease", 10),
    lambda q: q.ack_many(None),
    lambda q: q.dequeue_many(["not", "a", "name"]),
    lambda q: q.enqueue_many(None),  # the threaded client raised TypeError
], ids=["lease-of-no-shard", "nack-delay-list", "extend-not-a-lease", "ack-many-none", "queue-a-list",
        "enqueue-many-none"])
def test_a_bad_argument_is_invalid_job_and_nothing_is_sent(fake, connect, call):
    """Both drivers check what they are given in the one core before anything is sent
    (tests/client/test_aio_hostile.py drives the asyncio client with Hypothesis)."""
    f = fake(2, lambda shard, op, args: None)
    q = connect(f.dd.path)
    with pytest.raises(shardq.InvalidJob):
        call(q)
    assert f.requests == []


# ---------------------------------------------------------------------- one table of calls
def test_both_clients_offer_every_call_of_the_one_table_with_the_same_signature():
    """The calls come from one table (shardq/client/engine.py): neither client can lack a
    call the other has (the asyncio client lacked pause, resume, cancel, job,
    dead_letters_page, set_limits, shard_metrics and backup_cuts)."""
    from shardq.client.aio import AsyncQueue
    from shardq.client.engine import Calls, operation
    from shardq.client.router import Router

    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert public(Router) <= public(AsyncQueue)
    assert public(AsyncQueue) - public(Router) == {"consume", "spawn"}  # an async iterator and its task helper
    table = {n for n, v in vars(Calls).items() if isinstance(v, operation)}
    assert {"pause", "resume", "cancel", "job", "dead_letters_page", "set_limits", "shard_metrics",
            "backup_cuts", "results", "settle_many", "nack", "extend"} <= table
    for name in public(Router):
        sync, aio = inspect.signature(getattr(Router, name)), inspect.signature(getattr(AsyncQueue, name))
        assert list(sync.parameters) == list(aio.parameters), name
        assert [p.default for p in sync.parameters.values()] == [p.default for p in aio.parameters.values()], name
        assert inspect.iscoroutinefunction(getattr(AsyncQueue, name)) or name in ("consume", "spawn") \
            or isinstance(getattr(Calls, name, None), operation), name


def test_pause_and_resume_are_told_to_every_shard_and_count_the_shards_that_changed(fake, connect):
    f = fake(3, lambda shard, op, args: shard != 2)
    q = connect(f.dd.path)
    assert q.pause(Q) == 2
    assert q.resume(Q) == 2
    assert sorted(f.requests) == sorted([(s, op, [Q]) for s in range(3) for op in ("pause", "resume")])
    with pytest.raises(shardq.InvalidJob):
        q.pause(["not", "a", "name"])
    assert len(f.requests) == 6  # nothing sent


def test_purge_is_told_to_every_shard_and_sums_what_each_deleted(fake, connect):
    f = fake(3, lambda shard, op, args: 10 * shard + 1)
    q = connect(f.dd.path)
    assert q.purge(Q) == 1 + 11 + 21
    assert sorted(f.requests) == [(s, "purge_queue", [Q]) for s in range(3)]
    with pytest.raises(shardq.InvalidJob):
        q.purge(["not", "a", "name"])
    assert len(f.requests) == 3  # nothing sent
    assert wire.RETRY["purge_queue"] == wire.UNKNOWN  # re-sent, it would delete jobs enqueued since


def test_cancel_and_job_go_to_the_shard_the_id_names(fake, connect):
    f = fake(3, lambda shard, op, args: "cancelled" if op == "cancel" else {"state": "ready", "queue": Q})
    q = connect(f.dd.path)
    assert q.cancel(job_id(5, 2)) == "cancelled"
    assert q.job(job_id(6, 1)) == {"state": "ready", "queue": Q, "shard": 1}
    assert f.requests == [(2, "cancel", [job_id(5, 2)]), (1, "job", [job_id(6, 1)])]
    with pytest.raises(shardq.NotFound):
        q.cancel(job_id(1, 7))  # a shard this service has not: it cannot be one of its jobs
    with pytest.raises(shardq.InvalidJob):
        q.job("not an id")
    assert len(f.requests) == 2


def dead_row(seq: int, shard: int) -> list:
    return [job_id(seq, shard), None, b"dead", 3, "boom"]


def test_dead_letters_page_walks_shard_by_shard_and_can_skip_a_shard_that_is_down(fake, connect):
    def answer(shard, op, args):
        _, after, want = args
        if shard == 1:
            return Refuse("ShardUnavailable")
        rows = [dead_row(i, shard) for i in (1, 2, 3)]
        return [r for r in rows if after is None or r[0] > after][:want]

    f = fake(3, answer)
    q = connect(f.dd.path)
    page = q.dead_letters_page(Q, limit=2)
    assert [d.job_id for d in page.items] == [job_id(1, 0), job_id(2, 0)] and page.cursor == f"0:{job_id(2, 0)}"
    with pytest.raises(shardq.ShardUnavailable):
        q.dead_letters_page(Q, limit=2, cursor=page.cursor)  # shard 0's last, then shard 1 is down
    page = q.dead_letters_page(Q, limit=2, cursor=page.cursor, skip_unavailable=True)
    assert [d.job_id for d in page.items] == [job_id(3, 0), job_id(1, 2)]
    assert page.skipped_shards == [1] and page.cursor == f"2:{job_id(1, 2)}"
    assert all(d.error == "boom" and d.queue == Q for d in page.items)
    with pytest.raises(shardq.InvalidJob):
        q.dead_letters_page(Q, cursor="7:")  # not a cursor of a 3-shard service


def test_a_dead_letter_page_a_shard_cut_to_its_reply_frame_is_walked_on_not_skipped(fake, connect):
    """A shard answers fewer dead letters than asked when the rest would not fit one reply
    (big bodies): the page then asks that shard again after its last row, and moves to the
    next shard only when one answers none. Taken as 'no more here', such a shard's other
    letters were skipped."""
    def answer(shard, op, args):
        _, after, want = args
        rows = [r for r in (dead_row(i, shard) for i in (1, 2, 3, 4)) if after is None or r[0] > after]
        return rows[:min(want, 1 if shard == 0 else want)]  # shard 0 fits one a reply

    f = fake(2, answer)
    q = connect(f.dd.path)
    seen, cursor = [], None
    while True:
        page = q.dead_letters_page(Q, limit=3, cursor=cursor)
        seen += [d.job_id for d in page.items]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert seen == [job_id(i, 0) for i in (1, 2, 3, 4)] + [job_id(i, 1) for i in (1, 2, 3, 4)]


def test_set_limits_is_told_to_every_shard_and_answers_the_owners_figures(fake, connect):
    def answer(shard, op, args):
        if op == "queue_config":
            return {"shard": 1}
        return {"concurrency": 4, "shard": shard}

    f = fake(2, answer)
    f.answers_placement = True
    q = connect(f.dd.path)
    assert q.set_limits(Q, {"concurrency": 4}) == {"concurrency": 4, "shard": 1}
    assert sorted(f.sent("set_limits")) == [(0, "set_limits", [Q, {"concurrency": 4}]),
                                            (1, "set_limits", [Q, {"concurrency": 4}])]


def test_shard_metrics_reports_a_failed_or_slow_shard_as_unavailable_and_never_raises(fake, connect):
    slow = threading.Event()

    def answer(shard, op, args):
        if shard == 1:
            return Refuse("ShardUnavailable")
        if shard == 2:
            slow.wait(10)  # answers only after the scrape gave up on it
        return {"shard": shard, "queues": {}}

    f = fake(3, answer)
    q = connect(f.dd.path)
    try:
        got = q.shard_metrics(timeout_s=0.3)
    finally:
        slow.set()
    assert got[0] == {"shard": 0, "queues": {}, "available": True}
    assert [(m["shard"], m["available"]) for m in got[1:]] == [(1, False), (2, False)]
    assert "error" in got[1] and "error" in got[2]


def test_backup_cuts_ask_every_shard_at_once(fake, connect):
    f = fake(2, lambda shard, op, args: {"shard": shard, "stage": args[0]})
    q = connect(f.dd.path)
    assert q.backup_cuts("s1") == [{"shard": 0, "stage": "s1"}, {"shard": 1, "stage": "s1"}]
    assert sorted(f.requests) == [(0, "backup_cut", ["s1"]), (1, "backup_cut", ["s1"])]


# ---------------------------------------------------------------------- the waiting dequeue
def test_a_waiting_dequeue_keeps_max_jobs_and_releases_what_the_other_shards_leased(fake, connect):
    """Nothing is ready at the first round; both shards' waiting dequeues then answer with
    a lease. The caller gets one; the other is handed back unstarted, on either driver
    (the engine's _wait_lease, executed by each)."""
    def answer(shard, op, args):
        if op == "dequeue":
            return []
        if op == "dequeue_wait":
            return [row(1, shard)]
        if op == "cancel_wait":
            return False  # already answered
        return None

    f = fake(2, answer)
    q = connect(f.dd.path)
    [lease] = q.dequeue_many(Q, max_jobs=1, wait=5)
    other = 1 - lease.job_id % 2
    wait_until(lambda: releases(f), 10, what="the other shard's lease released")
    assert releases(f) == [(other, job_id(1, other), 101)]
    assert {s for s, _, a in f.sent("dequeue_wait")} == {0, 1}
    assert all(a[:3] == [Q, None, 1] and 0 < a[3] <= 5 for _, _, a in f.sent("dequeue_wait"))


def test_a_waiting_dequeue_that_gets_nothing_returns_empty_after_its_wait(fake, connect):
    f = fake(2, lambda shard, op, args: [] if op in ("dequeue", "dequeue_wait") else None)
    q = connect(f.dd.path)
    assert q.dequeue(Q, wait=0.3) is None
    assert len(f.sent("dequeue_wait")) >= 2 and releases(f) == []


def test_a_waiting_dequeue_goes_straight_to_the_shards_wait_when_the_queue_was_found_empty(fake, connect):
    """A shard answers ``dequeue_wait`` at once when a job is ready (shard/process.py), so
    after an empty answer the plain ``dequeue`` before it is a round trip for nothing (issue
    47): a waiting dequeue that follows the queue's empty answer sends only ``dequeue_wait``;
    one that follows a lease starts with a round (on a busy queue the plain dequeue, on the
    lone-call path, is the faster call: figure C)."""
    ready: list[list] = []

    def answer(shard, op, args):
        if op in ("dequeue", "dequeue_wait"):
            if not ready and op == "dequeue_wait":
                time.sleep(min(args[3], 0.2))  # the shard's long poll, cut short
            return [ready.pop()] if ready else []
        return None

    one = fake(1, answer)
    q = connect(one.dd.path)
    assert q.dequeue(Q, wait=0.2) is None  # a round, then the wait
    ready.append(row(1, 0))
    assert q.dequeue(Q, wait=5).job_id == job_id(1, 0)  # it followed an empty answer: the wait alone
    assert q.dequeue(Q) is None  # no wait: a plain dequeue
    assert [op for _, op, _ in one.requests] == ["dequeue", "dequeue_wait", "dequeue_wait", "dequeue"]

    two = fake(2, answer)
    q = connect(two.dd.path)
    assert q.dequeue(Q, wait=0.2) is None  # a round, then the wait at both shards
    rounds = len(two.sent("dequeue"))
    assert rounds >= 1 and len(two.sent("dequeue_wait")) == 2
    ready.append(row(2, 1))
    assert q.dequeue(Q, wait=5).job_id == job_id(2, 1)
    assert len(two.sent("dequeue")) == rounds  # it followed an empty answer: no round first
    assert q.dequeue(Q, wait=0.2) is None
    assert len(two.sent("dequeue")) > rounds  # it followed a lease: a round first
    assert releases(one) == releases(two) == []


def test_a_prioritized_queue_waits_with_a_watch_and_leases_where_work_is(fake, connect):
    watched = threading.Event()

    def answer(shard, op, args):
        if op == "enqueue":
            return [job_id(9, shard)]
        if op == "watch":
            if shard == 1:
                watched.set()
                return True
            return False
        if op == "dequeue":
            return [row(2, 1, priority=5, uses_priorities=True)] if shard == 1 and watched.is_set() else []
        if op == "peek":
            return [[5, 1]] if shard == 1 and watched.is_set() else []
        return None

    f = fake(2, answer)
    q = connect(f.dd.path)
    q.enqueue(b"x", key="k", queue=Q, priority=5)  # this client compares the shards from now on
    lease = q.dequeue(Q, wait=5)
    assert lease.job_id == job_id(2, 1)
    assert f.sent("watch") and not f.sent("dequeue_wait") and releases(f) == []


def test_every_enqueue_request_carries_a_session_of_its_shard(fake, connect):
    """One batch over two shards, then a single enqueue: each request carries ``[client
    id, seq, lowest unanswered seq]`` from the client's sessions at that shard (the core's
    Sessions, on both clients), so a re-sent request is answered from the first."""
    counter = iter(range(1, 1000))
    f = fake(2, lambda s, op, args: [job_id(next(counter), s) for _ in args[0]])
    q = connect(f.dd.path)
    keys = {shardq.client.routing.shard_for_key(f"k{i}", 2): f"k{i}" for i in range(10)}
    ids = q.enqueue_many([{"body": b"a", "key": keys[0]}, {"body": b"b", "key": keys[1]}], queue=Q)
    q.enqueue(b"c", key=keys[1], queue=Q)
    assert [i % 2 for i in ids] == [0, 1]
    sessions = [(s, a[1]) for s, _, a in f.sent("enqueue")]
    assert len({session[0] for _, session in sessions}) == 1  # one client id
    by_shard: dict[int, list] = {}
    for shard, (_, seq, low) in sessions:
        by_shard.setdefault(shard, []).append((seq, low))
    assert by_shard[0] == [(1, 1)] and by_shard[1] == [(1, 1), (2, 2)]  # each answered before the next


def test_a_keyless_job_with_a_dedup_id_goes_where_the_id_hashes_every_time(fake, connect):
    """A shard keeps the dedup window of its own jobs, so every repeat of a keyless job's
    dedup id must reach the shard the first one did, alone or in a batch (both clients):
    placed round-robin, the second went to the other shard and was added again. Keyless
    jobs without a dedup id still take turns."""
    counter = iter(range(1, 1000))
    f = fake(2, lambda s, op, args: [job_id(next(counter), s) for _ in args[0]])
    q = connect(f.dd.path)
    ids = {shardq.client.routing.shard_for_dedup_id(f"order-{i}", 2): f"order-{i}" for i in range(10)}
    for did in (ids[0], ids[1], b"bytes-id"):
        want = shardq.client.routing.shard_for_dedup_id(did, 2)
        got = [q.enqueue(b"x", queue=Q, dedup_id=did) % 2 for _ in range(3)]
        got += [i % 2 for i in q.enqueue_many([{"body": b"y", "dedup_id": did}, {"body": b"z", "dedup_id": did}],
                                              queue=Q)]
        assert got == [want] * 5
    assert {q.enqueue(b"x", queue=Q) % 2 for _ in range(2)} == {0, 1}


@pytest.mark.parametrize("bad", [{"job_id": 1 << 70}, {"job_id": 1 << 63}, {"token": 1 << 64}],
                         ids=["id-past-64-bits", "id-at-2**63", "token-past-64-bits"])
def test_ack_many_with_an_id_out_of_range_is_refused_before_any_shard_acks(fake, connect, bad):
    """A lease of shard 1 and one whose id (on shard 0) is out of range: the encoder (or
    the shard) refused only shard 0's request, after shard 1 had acked its lease: half
    applied (found by test_aio_hostile.py's Hypothesis run; both clients did it). Now
    nothing is sent."""
    f = fake(2, serve_leases({}))
    q = connect(f.dd.path)
    good = shardq.Lease(job_id(1, 1), "h", b"", Q, 1, 7, 9e9)
    with pytest.raises(shardq.InvalidJob, match="out of range"):
        q.ack_many([good, good._replace(**bad)])
    with pytest.raises(shardq.InvalidJob, match="out of range"):
        q.settle_many([good, good._replace(**bad)], [])
    assert f.requests == []


def test_stats_totals_the_shards_that_answered_and_lists_the_others_as_unavailable(fake, connect):
    def answer(shard, op, args):
        if shard == 1:
            return Refuse("ShardUnavailable")
        return {"shard": shard, "queues": {Q: {"ready": 2 + shard, "leased": 1}}}

    f = fake(3, answer)
    q = connect(f.dd.path)
    got = q.stats()
    assert [(sh["shard"], sh["available"]) for sh in got["shards"]] == [(0, True), (1, False), (2, True)]
    assert "error" in got["shards"][1] and got["shards"][1]["queues"] == {}
    assert got["queues"][Q]["ready"] == 2 + 4 and got["queues"][Q]["leased"] == 2


def test_stats_lists_a_shard_that_does_not_answer_as_unavailable_within_its_wait(fake, connect, monkeypatch):
    """A shard that takes requests and does not answer (SIGSTOPped, hung) held ``stats``
    (``shardq stats``, the totals an operator reads during the incident) for the whole
    request timeout; it is listed as unavailable after ``STATS_WAIT_S``."""
    monkeypatch.setattr("shardq.client.engine.STATS_WAIT_S", 0.5, raising=False)
    hung = threading.Event()

    def answer(shard, op, args):
        if shard == 1:
            hung.wait(60)  # a shard that does not answer until the test lets it
        return {"shard": shard, "queues": {Q: {"ready": 2}}}

    f = fake(2, answer)
    q = connect(f.dd.path, request_timeout_s=30)
    try:
        started = time.monotonic()
        got = q.stats()
        waited = time.monotonic() - started
    finally:
        hung.set()
    assert [(sh["shard"], sh["available"]) for sh in got["shards"]] == [(0, True), (1, False)]
    assert got["queues"][Q]["ready"] == 2 and waited < 10, waited  # not the request timeout (30 s)


# ---------------------------------------------------------------------- a broken connection
@pytest.fixture
def scripted():
    """``scripted(*script)``: a one-shard fake that plays one
    action per connection; closed after the clients (requested before ``connect``)."""
    made = []

    def make(*script):
        f = FakeShards(script=script)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def left_pending(q) -> int:
    """Requests a client still keeps for a reply (none once every call has returned)."""
    # the asyncio client's connections; the router's lanes and its I/O thread's
    chans = [c.chan for c in q.q.conns] if isinstance(q, SyncAsyncQueue) else \
        [lane.chan for lanes in q.lanes for lane in lanes.all] + [c.chan for c in (q._io.conns if q._io else [])]
    return sum(len(c.pending) + len(c.outbox) + len(c.enq_parts) + len(c.ack_parts) for c in chans)


LEASE = shardq.Lease(1 << 10, None, b"", "default", 1, 5, 9e9)


@pytest.mark.parametrize("op, call, outcome", [
    ("enqueue", lambda q: q.enqueue(b"job", key="k"), 42),
    ("ack", lambda q: q.ack(LEASE), None),  # JobGone answering a re-sent ack: the first landed
    ("extend", lambda q: q.extend(LEASE, 10).deadline, 123.0),
    ("ping", lambda q: q.ping(), [7]),
    ("dequeue", lambda q: q.dequeue("default"), shardq.OutcomeUnknown),
    ("dequeue", lambda q: q.dequeue_many(max_jobs=10), shardq.OutcomeUnknown),
    ("nack", lambda q: q.nack(LEASE), shardq.OutcomeUnknown),
    ("bury", lambda q: q.bury(LEASE), shardq.OutcomeUnknown),
    ("redrive", lambda q: q.redrive("default"), shardq.OutcomeUnknown),
    ("redrive", lambda q: q.redrive("default", [1 << 10]), shardq.OutcomeUnknown),
    ("purge_dead", lambda q: q.purge_dead_letters("default"), shardq.OutcomeUnknown),
], ids=["enqueue", "ack", "extend", "ping", "dequeue", "dequeue_many", "nack", "bury", "redrive-all",
        "redrive-ids", "purge"])
def test_after_a_break_only_ops_that_may_be_resent_are_sent_again(scripted, connect, op, call, outcome):
    """The shard reads the request, then drops the connection without answering. An op
    that may be re-sent (wire.RETRY) is sent again on a new connection and succeeds (an
    enqueue with the same session, so the shard answers from the first); any other raises
    OutcomeUnknown and is sent once. The same on both clients (each had its own copy of
    this test, and its own copy of the retry loop)."""
    answers = {"enqueue": [42], "ack": [["JobGone", "gone"]], "extend": 123.0, "ping": 7}
    f = scripted("drop", lambda o, args: answers[o] if o in answers else pytest.fail(f"{o} re-sent"))
    q = connect(f.dd.path, retry_s=5)
    if isinstance(outcome, type):
        with pytest.raises(outcome) as raised:
            call(q)
        # the same decision (engine.deliver), so the same words on both clients
        assert str(raised.value) == (f"shard 0: {op} was sent but the connection broke before its reply; "
                                     "it may or may not have been applied")
        assert f.ops() == [op]  # sent once, never again
        assert [len(c) for c in f.by_conn] == [1]
        assert isinstance(shardq.OutcomeUnknown("x"), shardq.ShardUnavailable)  # old handlers still catch it
    else:
        assert call(q) == outcome
        assert f.ops() == [op, op]
        assert [len(c) for c in f.by_conn] == [1, 1]  # once on each connection: re-sent once, not more
        if op == "enqueue":
            assert f.requests[0][2] == f.requests[1][2]  # the same items and session: the shard dedups
    assert left_pending(q) == 0


def test_a_break_mid_call_resends_a_shards_requests_in_order_with_their_sessions(scripted, connect):
    """A batch one shard gets as two requests (one over the job limit) whose connection
    breaks after the shard read what was written: on the new connection both go again, in
    the batch's order, each with the session (and items) it had, so the shard would answer
    the ids of a first execution. Both clients re-send through the engine's one loop
    (engine.deliver); the asyncio client used to re-queue in its connection."""
    serve = ("serve", lambda op, args: list(range(len(args[0]))))
    # (the router asks the queue's placement alone: on its lane, a connection of its own)
    f = scripted(*[serve] * connect.threaded, "drop", serve)
    q = connect(f.dd.path, retry_s=5)
    n = limits.BATCH_JOBS_MAX + 1
    ids = q.enqueue_many([{"body": b"%d" % i, "key": "k"} for i in range(n)])
    assert len(ids) == n
    dropped, served = f.by_conn[connect.threaded:]
    assert [len(args[0]) for _, _, args in served] == [limits.BATCH_JOBS_MAX, 1]  # in the batch's order
    assert dropped and [args for _, _, args in dropped] == [args for _, _, args in served][:len(dropped)]
    sessions = [args[1] for _, _, args in served]
    assert sessions[0] != sessions[1] and all(s is not None for s in sessions)
    assert left_pending(q) == 0


def test_both_clients_implement_the_declared_contracts():
    """mypy checks the signatures (the TYPE_CHECKING blocks of router.py and aio.py); this
    checks at run time that each member exists, as a coroutine on the asyncio client."""
    from shardq.client import contracts
    from shardq.client.aio import AsyncQueue
    from shardq.client.router import Router

    def members(proto) -> set[str]:
        return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}

    from shardq.client.engine import operation

    def made(cls, name) -> bool:  # a method of its own, or an entry of the one table
        attr = getattr(cls, name, None)
        return isinstance(attr, operation) or inspect.isfunction(attr)

    for proto in (shardq.Queue, contracts.Control, contracts.Results):
        for name in members(proto):
            assert made(Router, name), (proto.__name__, name)
    for proto in (contracts.AsyncQueue, contracts.AsyncResults):
        for name in members(proto) - {"consume"}:
            assert made(AsyncQueue, name), (proto.__name__, name)
            assert isinstance(getattr(AsyncQueue, name), operation) or \
                inspect.iscoroutinefunction(getattr(AsyncQueue, name)), name
    assert members(contracts.AsyncResults) == members(contracts.Results)
    assert members(contracts.AsyncQueue) - {"consume"} == members(shardq.Queue)


def test_a_call_that_times_out_leaves_nothing_pending(scripted, connect):
    """A shard that reads the request and never answers: ShardUnavailable after the
    request timeout, and the client keeps nothing for the reply (a future whose caller gave
    up used to stay in the threaded client's pending table)."""
    f = scripted("hang")
    q = connect(f.dd.path, request_timeout_s=0.3, retry_s=1)
    with pytest.raises(shardq.ShardUnavailable, match="did not answer"):
        q.ping()
    assert left_pending(q) == 0


def test_a_waiting_dequeue_whose_round_lost_its_connection_goes_on_waiting(scripted, connect):
    """A lease round's dequeue written, then its connection broken (a shard restarted while
    a worker waited on it): a dequeue that waits went on to raise OutcomeUnknown, ending the
    worker's wait (seen as a flaky test_a_waiting_consumer_outlives_a_sigkilled_shard). It
    now waits on, as after a lost waiting dequeue: whatever the lost request leased expires
    unheld. A plain dequeue still raises OutcomeUnknown."""
    def serve(op, args):
        return {"dequeue": [], "dequeue_wait": [], "cancel_wait": False}[op]

    f = scripted("drop", ("serve", serve))
    q = connect(f.dd.path, request_timeout_s=5, retry_s=2)
    assert q.dequeue(Q, wait=1.0) is None         # (before: OutcomeUnknown)
    assert f.dropped.is_set() and [op for op in f.ops() if op == "dequeue"][:2] == ["dequeue", "dequeue"]
    g = scripted("drop")
    p = connect(g.dd.path, request_timeout_s=5, retry_s=1)
    with pytest.raises(shardq.OutcomeUnknown):
        p.dequeue(Q)


def test_an_enqueue_sent_and_never_answered_is_outcome_unknown(scripted, connect):
    """A shard that reads the enqueue and never answers (hung, or its container paused):
    the enqueue may yet be applied, so its caller gets OutcomeUnknown, not the plain
    ShardUnavailable after which a caller tries again and enqueues twice (found by a
    walkthrough: every frozen request's job was processed after the thaw). A dequeue's late
    reply is released, so its timeout stays ShardUnavailable."""
    f = scripted("hang", "hang")
    q = connect(f.dd.path, request_timeout_s=0.3, retry_s=1)
    with pytest.raises(shardq.OutcomeUnknown, match="did not answer enqueue"):
        q.enqueue(b"x", key="k")
    with pytest.raises(shardq.ShardUnavailable, match="did not answer dequeue") as e:
        q.dequeue_many(max_jobs=1)
    assert not isinstance(e.value, shardq.OutcomeUnknown)


def test_an_enqueue_sent_before_its_shard_went_away_for_good_is_outcome_unknown(scripted, connect):
    """The shard reads the enqueue, the connection breaks, and no connection comes back
    before ``retry_s``: the first sending may have been applied, so OutcomeUnknown (it was
    a plain ShardUnavailable: 'not reachable')."""
    f = scripted("drop")
    q = connect(f.dd.path, request_timeout_s=5, retry_s=1)
    with pytest.raises(shardq.OutcomeUnknown, match="may or may not have been applied"):
        q.enqueue(b"x", key="k")
    assert f.dropped.is_set()


@pytest.mark.parametrize("call", [lambda q: q.ping(), lambda q: q.job(1 << 10)], ids=["ping", "job"])
@pytest.mark.parametrize("script", [("drop",), ("hang", "hang")], ids=["gone-for-good", "never-answered"])
def test_a_read_given_up_on_is_shard_unavailable_not_outcome_unknown(scripted, connect, call, script):
    """A read (``wire.READS``) applies nothing, so a caller that gave up on one is told the
    shard could not be reached (ShardUnavailable), not that it 'may or may not have been
    applied' (OutcomeUnknown, as ``app.result`` said while a shard restarted)."""
    f = scripted(*script)
    q = connect(f.dd.path, request_timeout_s=0.3, retry_s=1)
    with pytest.raises(shardq.ShardUnavailable) as e:
        call(q)
    assert not isinstance(e.value, shardq.OutcomeUnknown), e.value
    assert "applied" not in str(e.value)


# ---------------------------------------------------------------------- a real service
@pytest.fixture(scope="module")
def service():
    small = {f"small-{driver}": {"max_body_bytes": 100} for driver in ("threaded", "asyncio")}
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 3}, "queues": small}) as s:
        yield s


def _keys_on_each_shard(shards: int) -> list[str]:
    by_shard = {shardq.client.routing.shard_for_key(f"k{i}", shards): f"k{i}" for i in range(20)}
    return [by_shard[s] for s in range(shards)]


def test_a_queue_no_longer_declared_is_served_where_its_jobs_are_and_unknown_names_stay_refused(connect):
    """With ``declare_queues``, a queue taken out of the config whose jobs sit on one shard
    only: the other shard answers UnknownQueue. Dequeues, dead letters and purges raised it
    (a purge after the holding shard had deleted its jobs: 'nothing happened', and the
    jobs were gone). A shard that holds no such queue now counts as empty while another
    holds it; a name no shard holds is still UnknownQueue."""
    cfg = {"service": {"declare_queues": True}, "queues": {"default": {}, "emails": {}}}
    with Service(shards=2, config=cfg) as svc:
        data_dir = svc.data_dir
        keys = [k for k in (f"k{i}" for i in range(40)) if shardq.client.routing.shard_for_key(k, 2) == 1][:4]
        with shardq.connect(data_dir) as q:
            ids = [q.enqueue(b"mail %d" % i, key=k, queue="emails") for i, k in enumerate(keys)]
        svc.stop()
        svc.config["queues"].pop("emails")
        svc.start()
        q = connect(data_dir)
        lease = q.dequeue("emails")
        assert lease is not None and lease.job_id in ids
        q.ack(lease)
        held = q.dequeue_many("emails", max_jobs=1, wait=0.2)
        held += q.dequeue_many("emails", max_jobs=10, wait=0.3)
        assert sorted(lease.job_id for lease in held) == sorted(set(ids) - {lease.job_id})
        assert q.dead_letters("emails") == [] and q.dead_letters_page("emails").items == []
        assert q.purge_dead_letters("emails") == 0 and q.redrive("emails") == 0
        assert q.purge("emails") == 3  # the leases held too
        assert q.dequeue_many("emails", max_jobs=10, wait=0.3) == []  # empty now, and no error
        for call in (lambda: q.dequeue("emials"), lambda: q.dequeue_many("emials", wait=0.2),
                     lambda: q.purge("emials"), lambda: q.dead_letters("emials"),
                     lambda: q.dead_letters_page("emials")):
            with pytest.raises(shardq.UnknownQueue):
                call()


def test_a_batch_with_a_body_over_its_queues_limit_is_refused_before_any_shard_takes_it(service, connect,
                                                                                        request):
    """A batch over both shards whose second shard's part holds a body over the queue's
    ``max_body_bytes``: that shard refused its request after the first had taken its jobs
    (the batch half in, and the caller told only InvalidJob). Now the client checks each
    queue's limit before it sends any part, and nothing is in."""
    small = "small-" + request.node.callspec.id
    q = connect(service.data_dir)
    k0, k1 = _keys_on_each_shard(2)
    limit = q.queue_config(small)["max_body_bytes"]
    assert limit == 100
    with pytest.raises(shardq.InvalidJob, match=f"{limit + 1} bytes, over the queue's limit of {limit}"):
        q.enqueue_many([{"body": b"a", "key": k0}, {"body": b"b" * (limit + 1), "key": k1}], queue=small)
    assert q.dequeue_many(small, max_jobs=10) == []
    ids = q.enqueue_many([{"body": b"a", "key": k0}, {"body": b"b" * limit, "key": k1}], queue=small)  # at the limit
    assert sorted(lease.job_id for lease in q.dequeue_many(small, max_jobs=10)) == sorted(ids)


def test_a_reload_that_raises_a_queues_body_limit_reaches_a_client_already_connected(connect, tmp_path):
    """``queue_config`` was asked once per client and kept: after a reload (SIGHUP) raised
    ``max_body_bytes``, a long-lived client (the SQS listener's, a worker's) kept the old
    settings until it was restarted. Now what it holds is at most QUEUE_CONFIG_MAX_AGE_S old,
    and a batch over the old limit goes in."""
    import signal
    with Service(shards=2, config={"queues": {"small": {"max_body_bytes": 100}}}) as svc:
        q = connect(svc.data_dir)
        k0, k1 = _keys_on_each_shard(2)
        assert q.queue_config("small")["max_body_bytes"] == 100
        svc.config = {**svc.config, "queues": {"small": {"max_body_bytes": 1000}}}
        with open(svc.data_dir.rstrip("/") + ".toml", "w") as f:
            f.write(_to_toml(svc.config))
        os.kill(svc.proc.pid, signal.SIGHUP)
        wait_until(lambda: q.queue_config("small")["max_body_bytes"] == 1000, 15, 0.05, "the reload seen")
        ids = q.enqueue_many([{"body": b"a", "key": k0}, {"body": b"b" * 500, "key": k1}], queue="small")
        assert len(ids) == 2


def test_a_new_client_learns_a_queues_settings_from_another_shard_while_shard_0_is_down(service, connect, request):
    """Found by an operator's walkthrough: a queue's settings were asked of shard 0 alone,
    so with shard 0 down a new client could not enqueue a batch whose jobs all go to
    shard 1, nor a ``shardq worker`` start (ShardUnavailable after retry_s), nor a queue
    command begin before waiting a second retry_s. Every shard holds the whole config:
    one that is down is passed over at once."""
    import signal
    queue = "settings-" + request.node.callspec.id
    on_1 = [k for k in (f"k{i}" for i in range(40)) if shardq.client.routing.shard_for_key(k, 2) == 1][:2]
    pid0 = service.shard_pids()[0]
    os.kill(pid0, signal.SIGSTOP)  # (a new client's handshake with it never completes)
    try:
        q = connect(service.data_dir, retry_s=30)
        assert q.queue_config(queue)["max_deliveries"] == 3
        ids = q.enqueue_many([{"body": b"a", "key": on_1[0]}, {"body": b"b", "key": on_1[1]}], queue=queue)
        assert sorted(lease.job_id for lease in q.dequeue_many(queue, max_jobs=10)) == sorted(ids)
    finally:
        os.kill(pid0, signal.SIGCONT)


def test_the_whole_api_against_a_real_service(service, connect, request):
    """Every call of the Queue protocol and the control calls, against ``shardq serve``,
    on each client (the asyncio client had this test alone, and lacked the control calls).
    Each driver uses queues of its own."""
    par = "par-" + request.node.callspec.id
    q = connect(service.data_dir)
    jid = q.enqueue(b"a", key="k1", queue=par)
    ids = q.enqueue_many([{"body": b"b", "key": "k1"}, {"body": b"c", "delay": 3600}], queue=par)
    assert q.enqueue(b"a2", key="k1", queue=par, dedup_id="d") == q.enqueue(b"a2", key="k1", queue=par, dedup_id="d")
    assert q.job(ids[1])["state"] == "delayed" and q.job(jid)["state"] == "ready"
    assert q.pause(par) == 2
    assert q.dequeue(par) is None  # paused on every shard
    assert q.resume(par) == 2
    [lease] = q.dequeue_many(par, max_jobs=10)
    assert (lease.job_id, lease.body, lease.key, lease.attempt) == (jid, b"a", "k1", 1)
    longer = q.extend(lease, 100)
    assert longer.deadline > lease.deadline
    q.ack(longer)
    with pytest.raises(shardq.JobGone):
        q.ack(longer)
    nxt = q.dequeue(par)
    assert nxt.job_id == ids[0]
    q.nack(nxt, error="boom")
    again = q.dequeue(par)
    assert again.job_id == ids[0] and again.attempt == 2
    q.bury(again, "given up")
    [dl] = q.dead_letters(par)
    assert (dl.job_id, dl.error) == (ids[0], "given up")
    page = q.dead_letters_page(par, limit=10)
    assert [d.job_id for d in page.items] == [ids[0]] and page.cursor is None
    assert q.redrive(par) == 1
    st = q.stats()
    assert st["queues"][par]["delayed"] == 1 and len(st["shards"]) == 2
    assert q.queue_config(par)["max_deliveries"] == 3
    assert len(q.ping()) == 2
    assert [m["available"] for m in q.shard_metrics()] == [True, True]
    with pytest.raises(shardq.InvalidJob):
        q.enqueue("not bytes")
    with pytest.raises(shardq.LeaseLost):
        q.extend(again, 5)
    assert q.purge_dead_letters(par) == 0
    assert q.cancel(ids[1]) == "cancelled" and q.cancel(ids[1]) == "gone"
    doomed = q.enqueue(b"doomed", key="k9", queue=par)
    while (lease := q.dequeue(par, wait=5)).job_id != doomed:
        q.ack(lease)  # the job redriven above comes first
    q.bury(lease, "chosen")
    assert q.purge_dead_letters(par, [doomed, doomed]) == 1
    assert q.purge_dead_letters(par, [doomed]) == 0  # again: nothing, no error
    assert q.dead_letters(par) == []
    with pytest.raises(shardq.InvalidJob):
        q.purge_dead_letters(par, "not a list")
    # each client reads what the other wrote
    with service.connect() as r:
        rid = r.enqueue(b"from the router", key="mixed", queue=par + "2")
    assert q.dequeue(par + "2").job_id == rid


def test_each_client_rides_out_shard_restarts(connect):
    """Both shards SIGKILLed twice under one client: the very next calls ride out the
    restarts (re-sent within retry_s where that is safe), nothing is lost (the router
    had this test alone)."""
    import os
    import signal
    with Service(config={"queue_defaults": {"visibility_timeout": 30}}) as svc:
        q = connect(svc.data_dir, retry_s=15)
        before = q.ping()
        q.enqueue(b"before", key="a")
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        q.enqueue(b"after", key="a")  # no waiting: it rides out the restart
        after = q.ping()
        assert set(after).isdisjoint(before)
        got = []
        while (lease := q.dequeue()) is not None:  # one key: one lease at a time, in order
            got.append(lease.body)
            q.ack(lease)
        assert got == [b"before", b"after"]
        for pid in after:  # again, once the client has reconnected: still the same client
            os.kill(pid, signal.SIGKILL)
        assert set(q.ping()).isdisjoint(after)  # ping may be re-sent; a dequeue may not
        assert q.dequeue(wait=0) is None

        def restarts() -> int:
            with open(svc.log_path, "rb") as f:
                return f.read().decode(errors="replace").count("event=shard-restart")
        wait_until(lambda: restarts() >= 4, 10, what="four restarts logged")
        assert restarts() == 4


def test_a_wait_that_could_not_ask_a_shard_leaves_the_queue_not_known_empty(fake, connect):
    """Shard 1, where the jobs are, is down; shard 0 has none. A dequeue that waited found
    nothing, so the queue was noted empty and each later dequeue only waited, at the
    shards connected: shard 1's connection was never tried again, and once it was back
    the consumer got nothing for ever (found with a queue placed on a shard that
    restarted: docs/limits.md). Now a wait that could not ask every shard leaves the queue
    not known empty, and the next dequeue's lease round reaches (and connects to) shard 1."""
    rows = iter(range(1, 10**6))

    def answer(shard, op, args):
        if op in ("dequeue", "dequeue_wait"):
            if shard == 1:
                return [row(next(rows), 1)]
            if op == "dequeue_wait":
                time.sleep(args[3])  # a shard's wait for work that never comes
            return []
        return [None] * len(args[0]) if op == "ack" else None

    f = fake(2, answer)
    f.down(1)
    q = connect(f.dd.path, retry_s=2)
    for _ in range(2):
        assert q.dequeue_many(Q, max_jobs=1, wait=0.2) == []
    f.up(1)
    assert wait_until(lambda: q.dequeue_many(Q, max_jobs=1, wait=0.2), 10, 0, "a lease from shard 1")


def test_a_consumer_of_a_placed_queue_gets_leases_again_after_its_owner_shard_restarts(connect):
    """A queue with a limit lives on one shard (docs/limits.md): a consumer that dequeued
    while its owner restarted got nothing for ever after, with jobs ready (a walkthrough,
    13 of 13 runs, both clients, where the restart outlasted a dequeue's wait; the fake
    shards' test above makes that order certain). End to end, with a real SIGKILL."""
    import os
    import signal
    with Service(shards=2, config={"queues": {"kq": {"concurrency": 3}}}) as svc:
        q = connect(svc.data_dir, retry_s=15)
        q.enqueue_many([{"body": b"x", "key": f"k{i}"} for i in range(11)], queue="kq")
        (lease,) = q.dequeue_many("kq", max_jobs=1, wait=0.5)
        q.ack(lease)
        owner = shardq.client.routing.shard_of_job(lease.job_id)
        pid = q.ping()[owner]
        os.kill(pid, signal.SIGKILL)
        for _ in range(3):  # while it is down: short waits, each over before it is back
            for got in q.dequeue_many("kq", max_jobs=1, wait=0.05):
                q.ack(got)  # (it came back quickly; the cap is 3)
        restarted(svc, owner, pid)
        assert wait_until(lambda: q.dequeue_many("kq", max_jobs=1, wait=0.5), 10, 0,
                          "a lease from the restarted owner")


def test_jobs_another_shard_held_when_a_restart_placed_their_queue_are_still_leased(connect):
    """docs/limits.md: "A queue that held jobs on several shards when a restart placed it
    keeps them there: each shard serves the jobs it holds". A walkthrough added a limit to a
    queue holding 10 keyed jobs on both shards and restarted: a client that knew the queue
    was placed asked its owner only, and the other shard's jobs were never handed out
    (`shardq worker --burst` said drained, 6 left ready for good)."""
    with Service(shards=2, config={"queues": {"later": {}}}) as svc:
        before = connect(svc.data_dir)
        ids = set(before.enqueue_many([{"body": b"%d" % i, "key": f"k{i}"} for i in range(10)], queue="later"))
        assert {shardq.client.routing.shard_of_job(i) for i in ids} == {0, 1}
        svc.stop()
        svc.config = {**svc.config, "queues": {"later": {"concurrency": 20}}}
        svc.start()
        q = connect(svc.data_dir)
        ids.add(q.enqueue(b"placed", key="k0", queue="later"))  # (the client learns the placement)
        leased: set[int] = set()
        deadline = time.monotonic() + 30
        while leased != ids and time.monotonic() < deadline:
            got = q.dequeue_many("later", max_jobs=5, wait=0.2)
            leased.update(lease.job_id for lease in got)
            q.ack_many(got)
        assert leased == ids, sorted(ids - leased)


def test_a_purge_deletes_every_live_job_and_survives_a_kill(connect):
    """``purge`` deletes ready, delayed, waiting and leased jobs on every shard (dead letters
    stay); it is logged and fsynced before the answer, so a SIGKILL of the whole service
    right after brings none of them back."""
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 3}}) as svc:
        q = connect(svc.data_dir)
        q.enqueue_many([{"body": b"k%d" % i, "key": "k"} for i in range(3)], queue="p")   # 1 ready, 2 waiting
        q.enqueue_many([{"body": b"r%d" % i} for i in range(20)], queue="p")            # on both shards
        q.enqueue_many([{"body": b"d%d" % i, "delay": 3600} for i in range(4)], queue="p")
        q.enqueue(b"other", queue="kept")
        held = q.dequeue_many("p", max_jobs=5, visibility=600)
        dead = q.dequeue("p", visibility=600)
        q.bury(dead, "stays")
        assert q.purge("p") == 3 + 20 + 4 - 1
        assert q.purge("p") == 0
        with pytest.raises(shardq.JobGone):
            q.ack(held[0])
        assert q.enqueue(b"after", key="k", queue="p")                                 # the key is free
        svc.kill_all()
        svc.start()
        again = connect(svc.data_dir)
        counts = again.stats()["queues"]
        assert (counts["p"]["ready"], counts["p"]["delayed"], counts["p"]["in_flight"], counts["p"]["dead"]) \
            == (1, 0, 0, 1)
        assert counts["kept"]["ready"] == 1
        assert again.dequeue("p").body == b"after"


def test_a_dequeue_answered_after_its_request_timeout_has_its_leases_released(fake, connect):
    """The shard answers a dequeue after the caller gave up on it (request timeout): nobody
    will take that lease, so it is released unstarted at once, not left to expire with its
    delivery counted. The threaded client's lone-call path dropped such a reply."""
    def answer(shard, op, args):
        if op == "dequeue":
            time.sleep(0.6)  # the shard is slow: past the caller's 0.3 s request timeout
            return [row(1, 0)]
        return None  # the release
    f = fake(1, answer)
    q = connect(f.dd.path, request_timeout_s=0.3)
    with pytest.raises(shardq.ShardUnavailable, match="did not answer dequeue"):
        q.dequeue("default")
    wait_until(lambda: releases(f), 10, what="the late lease released")
    assert releases(f) == [(0, job_id(1, 0), 101)]
