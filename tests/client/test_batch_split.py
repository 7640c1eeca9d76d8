"""A batch measured, checked and split by C loops gives what the job-by-job loop gave.

``validate.jobs_bytes`` (the size bound of many jobs), ``routing.cut_requests`` (one shard's
items cut into requests) and ``routing.split_by_shard`` (a batch of job dicts checked and
grouped by shard) each have a path for the usual batch that takes no Python step per job.
Here each is held to the job-by-job definition it replaced, at the limits and around them.
"""
from __future__ import annotations

import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardq import limits
from shardq.client.routing import (_usual_batch, cut_requests, in_input_order, shard_for_dedup_id, shard_for_key,
                                   split_by_shard)
from shardq.config import parse as parse_config
from shardq.errors import InvalidJob, UnknownQueue
from shardq.protocol import validate
from shardq.shard.state import ShardState

MAX_REQUEST, MAX_JOBS = limits.REQUEST_BYTES_MAX, limits.BATCH_JOBS_MAX

keys = st.one_of(st.none(), st.just(""), st.text(max_size=40))
dedup_ids = st.one_of(st.none(), st.text(min_size=1, max_size=20), st.binary(min_size=1, max_size=20))
wire_items = st.lists(st.tuples(st.binary(min_size=1, max_size=64), keys, st.text(min_size=1, max_size=10),
                                st.just(0), st.just(0), dedup_ids).map(list), max_size=50)


def reference_cut(items: list) -> list[list]:
    """The job-by-job cut: a request ends before the job that would take it past
    BATCH_JOBS_MAX jobs or REQUEST_BYTES_MAX bytes (64 bytes of request, 16 per job id)."""
    out, cur, size = [], [], 64
    for it in items:
        n = validate.job_bytes(it[0], it[1], it[2], it[5]) + 16
        if cur and (len(cur) >= MAX_JOBS or size + n > MAX_REQUEST):
            out.append(cur)
            cur, size = [], 64
        cur.append(it)
        size += n
    return out + [cur] if cur else out


@given(wire_items)
def test_jobs_bytes_is_the_sum_of_job_bytes(items):
    assert validate.jobs_bytes(items) == sum(validate.job_bytes(i[0], i[1], i[2], i[5]) for i in items)


@given(wire_items)
def test_cut_requests_cuts_small_batches_as_the_job_by_job_loop(items):
    assert list(cut_requests(items)) == reference_cut(items)


def _batch_of_bytes(total: int, n: int) -> list:
    """``n`` items whose requests would take exactly ``total`` bytes (by job_bytes), all
    sharing one large body (so the test holds the memory of two bodies, not of ``n``)."""
    per_job = validate.job_bytes(b"", "k", "default") + 16
    room = total - 64 - n * per_job
    body_len, rest = divmod(room, n)
    shared = b"b" * body_len
    return [[shared, "k", "default", 0, 0, None] for _ in range(n - 1)] + [[b"b" * (body_len + rest), "k", "default",
                                                                           0, 0, None]]


@pytest.mark.parametrize("n", [1, 2, 7, MAX_JOBS])
def test_a_batch_of_exactly_the_request_limit_is_one_request_and_a_byte_more_is_two(n):
    exact = _batch_of_bytes(MAX_REQUEST, n)
    assert 64 + 16 * n + validate.jobs_bytes(exact) == MAX_REQUEST
    assert list(cut_requests(exact)) == [exact]
    over = exact[:-1] + [[exact[-1][0] + b"b"] + exact[-1][1:]]
    got = list(cut_requests(over))
    assert got == reference_cut(over)
    assert len(got) == (2 if n > 1 else 1)  # a lone job is sent as it is: the shard refuses it, typed


def test_a_batch_of_the_job_limit_is_one_request_and_one_job_more_is_two():
    items = [[b"x", f"k{i}", "default", 0, 0, None] for i in range(MAX_JOBS + 1)]
    assert list(cut_requests(items[:MAX_JOBS])) == [items[:MAX_JOBS]]
    assert list(cut_requests(items)) == [items[:MAX_JOBS], items[MAX_JOBS:]]


def _state(max_body: int) -> ShardState:
    return ShardState(0, parse_config({"queues": {"default": {"max_body_bytes": max_body}}}))


def test_the_shard_takes_a_batch_of_exactly_its_request_limit_and_refuses_a_byte_more():
    n = 4  # the fewest jobs of at most BODY_BYTES_MAX_CEILING that reach the limit
    exact = _batch_of_bytes(MAX_REQUEST, n)  # the router's bound is the shard's: 64 + 16 per job
    assert max(len(i[0]) for i in exact) <= limits.BODY_BYTES_MAX_CEILING
    state = _state(limits.BODY_BYTES_MAX_CEILING)
    assert len(state.enqueue_many(exact, time.time())) == n
    over = exact[:-1] + [[exact[-1][0] + b"b"] + exact[-1][1:]]
    fresh = _state(limits.BODY_BYTES_MAX_CEILING)
    with pytest.raises(InvalidJob, match="smaller batches"):
        fresh.enqueue_many(over, time.time())
    assert fresh.jobs == {} and fresh.take_ops() == []


usual_jobs = st.lists(st.fixed_dictionaries({"body": st.binary(min_size=1, max_size=64),
                                             "key": st.text(min_size=1, max_size=30)}), min_size=1, max_size=60)


def _rr():
    """A router as Router._shard_for (fresh per call): by key, a keyless job by its dedup id,
    any other keyless one round-robin."""
    state = iter(range(10**9))

    def route(shards):
        def shard_for(key, dedup_id=None):
            if key is not None:
                return shard_for_key(key, shards)
            return next(state) % shards if dedup_id is None else shard_for_dedup_id(dedup_id, shards)
        return shard_for
    return route


@settings(max_examples=200)
@given(usual_jobs, st.integers(min_value=1, max_value=6))
def test_the_usual_batch_is_split_as_the_job_by_job_loop_splits_it(jobs, shards):
    try:
        for j in jobs:
            j["key"].encode("utf-8")
    except UnicodeEncodeError:
        assert _usual_batch(jobs, "default", shards) is None  # the loop names the error
        with pytest.raises(InvalidJob, match="not valid text"):
            split_by_shard(jobs, "default", _rr()(shards), shards)
        return
    usual = _usual_batch(jobs, "default", shards)
    assert usual is not None
    # The same jobs with the queue spelled out take the job-by-job loop.
    loop = split_by_shard([dict(j, queue="default") for j in jobs], "default", _rr()(shards), shards)
    assert usual == loop
    assert usual[1] == [zlib.crc32(j["key"].encode()) % shards for j in jobs]
    assert split_by_shard(iter(jobs), "default", _rr()(shards), shards) == usual  # any iterable


@pytest.mark.parametrize("job, error", [
    ({"body": b"", "key": "k"}, "body must not be empty"),
    ({"body": b"x" * (limits.BODY_BYTES_MAX_CEILING + 1), "key": "k"}, "over the queue's limit"),
    ({"body": "text", "key": "k"}, "body must be bytes"),
    ({"body": b"x", "key": ""}, "key must not be empty"),
    ({"body": b"x", "key": 7}, "key must be a string"),
    ({"body": b"x", "key": "\ud800"}, "not valid text"),
    ({"body": b"x", "key": "k" * (limits.KEY_BYTES_MAX + 1)}, "key is over"),
    ({"body": b"x", "kee": "k"}, "each job is a dict"),
])
def test_an_unusual_job_in_a_usual_batch_gets_the_job_by_job_error(job, error):
    jobs = [{"body": b"x", "key": f"k{i}"} for i in range(5)] + [job]
    assert _usual_batch(jobs, "default", 2) is None
    with pytest.raises(InvalidJob, match=error):
        split_by_shard(jobs, "default", _rr()(2), 2)


def test_other_shapes_take_the_job_by_job_loop_and_are_routed_as_before():
    route = _rr()(3)
    jobs = [{"body": b"a"}, {"body": b"b", "key": "k"}, {"body": bytearray(b"c"), "key": "k"},
            {"body": b"d", "key": "kk" * 100}, {"body": b"e", "key": "k", "priority": 5, "queue": "hi"}]
    assert _usual_batch(jobs, "default", 3) is None
    per_shard, shard_ids, prioritized = split_by_shard(jobs, "default", route, 3)
    assert shard_ids == [0, shard_for_key("k", 3), shard_for_key("k", 3), shard_for_key("kk" * 100, 3),
                         shard_for_key("k", 3)]
    assert prioritized == {"hi"}
    assert sum(map(len, per_shard.values())) == 5
    assert per_shard[shard_for_key("k", 3)][1] == [b"c", "k", "default", 0, 0, None]  # bytearray: bytes
    assert _usual_batch([], "default", 3) is None and split_by_shard([], "default", route, 3) == ({}, [], set())
    assert _usual_batch([{"body": b"x", "key": "k"}], 7, 3) is None
    with pytest.raises(InvalidJob, match="queue must be a string"):
        split_by_shard([{"body": b"x", "key": "k"}], 7, route, 3)


@given(st.lists(st.integers(min_value=0, max_value=4), max_size=80))
def test_ids_come_back_in_input_order(shard_ids):
    ids_by_shard: dict[int, list] = {}
    for i, s in enumerate(shard_ids):
        ids_by_shard.setdefault(s, []).append(("id", i))
    assert in_input_order(ids_by_shard, shard_ids) == [("id", i) for i in range(len(shard_ids))]


# The shard measures a batch with jobs_bytes too; one bad job refuses the whole batch.
def _primed(cfg) -> ShardState:
    """A state whose queues have taken a job (and so exist)."""
    state = ShardState(0, cfg)
    state.enqueue_many([(b"first", None, q, 0, 0, None) for q in cfg.queues], 1.0)
    state.take_batch()
    return state


@pytest.mark.parametrize("bad, error", [
    ([b"", "k", "default", 0, 0, None], "body must not be empty"),
    ([b"x" * 101, "k", "default", 0, 0, None], "over the queue's limit of 100"),
    ([b"x", "", "default", 0, 0, None], "key must not be empty"),
    ([b"x", "k" * (limits.KEY_BYTES_MAX + 1), "default", 0, 0, None], "key is over"),
    ([b"x", 5, "default", 0, 0, None], "key must be a string"),
    ([b"x", "k", "nowhere", 0, 0, None], "nowhere"),
    ([b"x", "k", "default", -1, 0, None], "delay must be"),
    ([b"x", "k", "default", 0, True, None], "priority must be an integer"),
    (["x", "k", "default", 0, 0, None], "body must be bytes"),
    ([b"x", "k", "default", 0, 0], "each job is"),
])
def test_one_bad_job_in_a_usual_batch_gets_its_error_and_nothing_is_applied(bad, error):
    state = _primed(parse_config({"service": {"declare_queues": True},
                                  "queues": {"default": {"max_body_bytes": 100}}}))
    jobs_before = dict(state.jobs)
    batch = [[b"x", f"k{i}", "default", 0, 0, None] for i in range(4)] + [bad]
    with pytest.raises((InvalidJob, UnknownQueue), match=error):
        state.enqueue_many(batch, 1_000_000.0)
    assert state.jobs == jobs_before and state.take_ops() == []
    assert len(state.enqueue_many(batch[:4] + [[b"x" * 100, "k" * limits.KEY_BYTES_MAX, "default", 0, 0, None]],
                                  1_000_000.0)) == 5  # each at its limit
