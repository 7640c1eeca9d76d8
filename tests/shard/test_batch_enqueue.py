"""The batch path of an enqueue (figure B): a batch whose jobs have no dedup id and no delay
is checked in one test a job (``QueueOps._check_items``) and added by ``_add_usual``, which
writes out, per batch, what ``_apply_enqueue`` does per record. These tests hold the two to
one result: the same state as the general path (``_add_jobs``, one record applied at a time)
and as a replay of the log, the same records, and the same refusals, with nothing applied."""
from __future__ import annotations

from collections import deque

import msgpack
import pytest

from shardq import limits
from shardq.errors import InvalidJob, UnknownQueue
from shardq.shard import ops
from shardq.shard.core import KEY_LIST_MAX
from shardq.shard.state import ShardState

T0 = 1_000_000.0
QUEUES = {"default": {}, "g": {"group_separator": ":", "group_concurrency": 1}}


def fingerprint(state: ShardState) -> dict:
    """More than the contract suite's digest: the order of every ready line, the priorities,
    the key lines' kinds, counters, the sampled enqueue times."""
    queues = {}
    for name, q in state.queues.items():
        queues[name] = {
            "ready": {p: [j.id for j in dq] for p, dq in q.ready.items()},
            "prios": list(q.prios),
            "keys": {k: (type(kq).__name__, [j.id for j in kq]) for k, kq in q.keys.items()},
            "counts": list(q.counts),
            "prioritized": q.prioritized,
        }
    jobs = {jid: (j.q.name, j.key, j.body, j.priority, j.ready_at, j.attempts, j.state)
            for jid, j in state.jobs.items()}
    return {"jobs": jobs, "queues": queues, "next_seq": state.next_seq,
            "times": (list(state.enqueue_times.seqs), list(state.enqueue_times.times)),
            "sessions": {c: dict(e[1]) for c, e in state.sessions.items()}}


def batches() -> list[list[list]]:
    """Usual batches that exercise every branch: keyless, new keys, a key past
    KEY_LIST_MAX (a list that becomes a deque), priorities, several queues, a grouped one."""
    b = []
    b.append([[b"a%d" % i, None, "default", 0, 0, None] for i in range(10)])
    b.append([[b"k%d" % i, f"k{i % 2}", "default", 0, 0, None] for i in range(2 * KEY_LIST_MAX + 6)])
    b.append([[b"p%d" % i, f"p{i}", "default", 0, i % 3, None] for i in range(9)])
    b.append([[b"m%d" % i, f"m{i % 2}", ("default", "other", "g")[i % 3], 0, 0, None] for i in range(12)])
    b.append([[b"g%d" % i, f"grp{i % 2}:{i}", "g", 0, 0, None] for i in range(6)])
    b.append([[b"one", "k0", "default", 0, 0, None]])
    return b


def replay(config, records: list[bytes]) -> ShardState:
    fresh = ShardState(0, config)
    for record in records:
        for op in msgpack.unpackb(record, raw=False):
            fresh.apply(op)
    return fresh


def test_the_usual_path_builds_what_the_general_path_and_a_replay_build(make_config):
    config = make_config(queues=QUEUES)
    usual, general = ShardState(0, config), ShardState(0, config)
    log: list[bytes] = []
    for i, batch in enumerate(batches()):
        now = T0 + i * 0.25  # a second sampled enqueue time among them
        if len(batch) > 1:
            assert usual._check_items(batch, {})[1]
        ids = usual.enqueue_many(batch, now, [7, i + 1, i + 1])
        records, _ = usual.take_batch()
        log.append(msgpack.packb(records))

        general.advance(now)
        new_queues: dict = {}
        checked = [general._check_item(item, new_queues) for item in batch]
        general.queues.update(new_queues)
        for q in new_queues.values():
            general._note_limited(q)
        assert general._add_jobs(checked, now) == ids
        sop = ops.Session(7, i + 1, i + 1, ids, now)
        general._apply_session(*sop)
        general._ops.append(sop)
        assert general.take_batch()[0] == records  # the same records, encoded alike
    assert fingerprint(usual) == fingerprint(general)
    assert fingerprint(replay(config, log)) == fingerprint(usual)
    assert [q.totals for q in usual.queues.values()] == [q.totals for q in general.queues.values()]
    assert type(usual.queues["default"].keys["k0"]) is deque  # the list became a deque on the way
    now = T0 + 10
    for name in QUEUES:  # the order each hands its jobs out in (a grouped queue's lines included)
        assert [lease.job_id for lease in usual.dequeue(name, now, None, 1000)] == \
               [lease.job_id for lease in general.dequeue(name, now, None, 1000)]


def test_a_batch_with_a_dedup_id_or_a_delay_takes_the_general_path(make_config):
    state = ShardState(0, make_config())
    items = [[b"x%d" % i, f"k{i}", "default", 0, 0, None] for i in range(20)]
    items[10] = [b"d", "k10", "default", 0, 0, "dedup-1"]
    items[15] = [b"late", "k15", "default", 5, 0, None]
    assert not state._check_items(items, {})[1]
    first = state.enqueue_many(items, T0)
    assert state.enqueue_many([[b"again", "k10", "default", 0, 0, "dedup-1"]], T0 + 1) == [first[10]]
    got = state.dequeue("default", T0 + 1, None, 100)
    assert sorted(lease.job_id for lease in got) == sorted(first[:15] + first[16:])
    assert [lease.job_id for lease in state.dequeue("default", T0 + 5, None, 100)] == [first[15]]


BAD = [
    ("empty body", [b"", "k", "default", 0, 0, None], InvalidJob),
    ("body over the limit", [b"x" * (limits.BODY_BYTES_MAX_DEFAULT + 1), "k", "default", 0, 0, None], InvalidJob),
    ("body not bytes", ["text", "k", "default", 0, 0, None], InvalidJob),
    ("empty key", [b"x", "", "default", 0, 0, None], InvalidJob),
    ("key over the limit", [b"x", "k" * (limits.KEY_BYTES_MAX + 1), "default", 0, 0, None], InvalidJob),
    ("key not text", [b"x", 5, "default", 0, 0, None], InvalidJob),
    ("a bool delay", [b"x", "k", "default", True, 0, None], InvalidJob),
    ("a negative delay", [b"x", "k", "default", -1, 0, None], InvalidJob),
    ("a float priority", [b"x", "k", "default", 0, 0.5, None], InvalidJob),
    ("a queue not text", [b"x", "k", b"default", 0, 0, None], InvalidJob),
    ("an empty queue name", [b"x", "k", "", 0, 0, None], InvalidJob),
    ("an undeclared queue", [b"x", "k", "nope", 0, 0, None], UnknownQueue),
    ("five fields", [b"x", "k", "default", 0, 0], InvalidJob),
    ("not a list", "job", InvalidJob),
]


@pytest.mark.parametrize("name,bad,error", BAD, ids=[b[0] for b in BAD])
def test_a_bad_job_anywhere_in_a_batch_refuses_it_whole(make_config, digest, name, bad, error):
    state = ShardState(0, make_config(declare_queues=True, queues={"default": {}}))
    state.enqueue_many([[b"before", "k1", "default", 0, 0, None]], T0)
    state.take_batch()
    before = digest(state)
    for at in (0, 50, 99):
        items: list = [[b"x%d" % i, f"k{i}", "default", 0, 0, None] for i in range(100)]
        items[at] = bad
        with pytest.raises(error):
            state.enqueue_many(items, T0)
        assert digest(state) == before and state.take_batch() == ([], [])


def test_a_batch_at_the_limits_goes_whole(make_config):
    """BATCH_JOBS_MAX jobs, every other one under one key at its longest (past the one
    test's short keys: the general check measures it), in one batch: every one added, in
    order, as one record that a replay rebuilds."""
    config = make_config(max_pending_jobs=limits.BATCH_JOBS_MAX)
    state = ShardState(0, config)
    long_key = "k" * limits.KEY_BYTES_MAX
    items = [[b"%d" % i, long_key if i % 2 else None, "default", 0, 0, None] for i in range(limits.BATCH_JOBS_MAX)]
    ids = state.enqueue_many(items, T0)
    assert len(set(ids)) == limits.BATCH_JOBS_MAX and ids == sorted(ids)
    records, atomic = state.take_batch()
    assert atomic == [(0, limits.BATCH_JOBS_MAX)]
    assert fingerprint(replay(config, [msgpack.packb(records)])) == fingerprint(state)
    got = state.dequeue("default", T0, None, limits.BATCH_JOBS_MAX)
    assert got[0].body == b"0" and len(got) == limits.BATCH_JOBS_MAX // 2 + 1  # keyless, and the key's head


@pytest.mark.parametrize("record", [
    ops.Enqueue(1 << 8, "q", "k", b"b", 0, 0, None, T0, None),
    ops.Enqueue(1 << 8, "q", None, b"b", 3, T0 + 1, "d", T0, T0 + 60),
    ops.Ack(5),
])
def test_encode_all_writes_each_record_as_encode_does(record):
    assert ops.encode_all([record]) == [ops.encode(record)]
