"""Results, progress and workflow barriers in the pure state machine (shardq/shard/results.py;
docs/design.md, "Workflows and results"): every operation, every refusal changing nothing,
limits at their maximum, replay and checkpoints rebuilding the same state, expiry, and the
barrier found complete without its FIRED at start."""
from __future__ import annotations

import math

import msgpack
import pytest

from shardq import limits
from shardq.errors import InvalidJob, JobGone, LeaseLost, NotFound, QueueFull, UnknownQueue
from shardq.shard import ops
from shardq.shard.durable import DurableShard, Engine
from shardq.clock import FakeClock
from shardq.shard.state import ShardState

from conftest import config_from, state_digest

T0 = 1_000_000.0
MiB = 1024 * 1024
DAY = 24 * 3600.0
CALLBACK = [b"callback-body", None, "default", 0, 0]


# ---------------------------------------------------------------------------- harness
def roundtrip(op_list: list) -> list:
    """As replay reads them: msgpack, bin as bytes, str as str."""
    return msgpack.unpackb(msgpack.packb(op_list), raw=False)


class Shard:
    """A ShardState driven at ``self.now``, with the log it wrote (each call one record,
    msgpack round-tripped) and the atomic ranges of each record."""

    def __init__(self, config=None, index: int = 0, shards: int = 1):
        self.config = config or config_from()
        self.index = index
        self.shards = shards
        self.state = self.fresh()
        self.now = T0
        self.log: list[list] = []
        self.atomic: list[list[tuple[int, int]]] = []

    def fresh(self) -> ShardState:
        state = ShardState(self.index, self.config)
        state.shard_count = self.shards
        return state

    def run(self, name: str, *args):
        """``state.name(*args, now)``, then log what it emitted."""
        try:
            return getattr(self.state, name)(*args, self.now)
        finally:
            produced, atomic = self.state.take_batch()
            if produced:
                self.log.append(roundtrip(produced))
                self.atomic.append(atomic)

    def nack(self, job_id, token, error):
        try:
            return self.state.nack(job_id, token, self.now, 0, error)
        finally:
            self.log.append(roundtrip(self.state.take_ops()))

    def enqueue(self, body=b"job", key=None, queue="default", delay=0, priority=0):
        ids = self.run("enqueue_many", [(body, key, queue, delay, priority, None)])
        return ids[0]

    def lease(self, queue="default"):
        (lease,) = self.run_dequeue(queue)
        return lease

    def run_dequeue(self, queue="default", max_jobs=1):
        try:
            return self.state.dequeue(queue, self.now, None, max_jobs)
        finally:
            produced = self.state.take_ops()
            if produced:
                self.log.append(roundtrip(produced))

    def leased_job(self, body=b"job", key=None):
        jid = self.enqueue(body, key)
        lease = self.lease()
        assert lease.job_id == jid
        return jid, lease.token

    def replayed(self) -> ShardState:
        again = self.fresh()
        again.replay(self.log)
        return again

    def from_checkpoint(self, chunk_bytes: int = limits.CHECKPOINT_CHUNK_BYTES) -> ShardState:
        self.state.advance(self.now)
        chunks = list(self.state.snapshot(chunk_bytes))
        assert all(len(c) <= limits.CHECKPOINT_RECORD_BYTES_MAX for c in chunks)
        again = self.fresh()
        again.replay([msgpack.unpackb(c, raw=False) for c in chunks])
        return again


def view(state: ShardState, now: float) -> dict:
    """What the results, progress and barriers of ``state`` show at ``now`` (expired
    entries read as absent whether or not memory was freed yet), and its jobs."""
    barriers = {}
    kinds = {"open": 0, "fired": 0, "cancelled": 0}
    for bid, b in state.barriers.items():
        if b.fired_job is None and not b.cancelled or b.expires_at > now:
            barriers[bid] = (b.total, dict(b.values), b.size, b.fired_job, b.cancelled, b.expires_at,
                             None if b.callback is None else list(b.callback))
            kinds["fired" if b.fired_job is not None else "cancelled" if b.cancelled else "open"] += 1
    return {
        "results": {j: v for j, v in state.results.items() if v[1] > now},
        "progress": {j: p for j, p in state.progress.items() if j in state.jobs},
        "barriers": barriers,
        "kinds": kinds,
    }


def everything(state: ShardState, now: float) -> dict:
    state.advance(now)
    return {"view": view(state, now), "jobs": state_digest(state)}


def assert_same(a: ShardState, b: ShardState, now: float) -> None:
    assert everything(a, now) == everything(b, now)
    assert view(a, now)["kinds"] == a.workflow_stats()["barriers"]


def refused(shard: Shard, exc: type[Exception], name: str, *args, match: str | None = None) -> None:
    """``state.name(*args, now)`` raises ``exc`` and changes nothing: no operation, the same state."""
    before = everything(shard.state, shard.now)
    logged = len(shard.log)
    with pytest.raises(exc, match=match):
        shard.run(name, *args)
    assert len(shard.log) == logged, f"{name} logged {shard.log[-1]!r:.200} before refusing"
    assert everything(shard.state, shard.now) == before


# ---------------------------------------------------------------------------- results
def test_a_result_is_kept_through_the_ack_until_its_ttl_and_read_by_result():
    s = Shard()
    jid, token = s.leased_job()
    value = b"v" * limits.RESULT_BYTES_MAX  # at the limit
    assert s.run("put_result", jid, token, value, 60.0) is None
    assert s.log[-1] == [[ops.RESULT, jid, value, T0 + 60.0]]
    (row,) = s.run("results_of", [jid])
    assert row == ("succeeded", value, None, None, None, None, T0 + 60.0, False)  # before the ack too
    s.run("ack", jid, token)
    assert s.run("results_of", [jid])[0].state == "succeeded"
    assert s.state.workflow_stats()["results"] == 1
    s.now = T0 + 59.999
    assert s.run("results_of", [jid])[0].value == value
    s.now = T0 + 60.0
    assert s.run("results_of", [jid])[0] == ("gone", None, None, None, None, None, None, False)
    s.state.advance(s.now)
    assert s.state.results == {} and s.state.workflow_stats()["results"] == 0  # memory freed
    assert view(s.replayed(), s.now)["results"] == {}


def test_put_result_again_replaces_the_first_and_the_longest_ttl_is_accepted():
    s = Shard()
    jid, token = s.leased_job()
    s.run("put_result", jid, token, b"first", 10.0)
    s.run("put_result", jid, token, b"second", limits.KEEP_RESULT_S_MAX)
    s.run("ack", jid, token)
    s.now = T0 + 11
    s.state.advance(s.now)  # the first result's expiry passes: the second stays
    assert s.run("results_of", [jid])[0][:2] == ("succeeded", b"second")
    s.now = T0 + limits.KEEP_RESULT_S_MAX - 1
    assert s.run("results_of", [jid])[0].expires_at == T0 + limits.KEEP_RESULT_S_MAX
    assert_same(s.state, s.replayed(), s.now)


@pytest.mark.parametrize("value, ttl, error", [
    (b"v" * (limits.RESULT_BYTES_MAX + 1), 60.0, "over the limit"),
    ("text", 60.0, "must be bytes"),
    (bytearray(b"v"), 60.0, "must be bytes"),
    (b"v", 0, "ttl_s"),
    (b"v", -1.0, "ttl_s"),
    (b"v", limits.KEEP_RESULT_S_MAX + 1, "ttl_s"),
    (b"v", math.nan, "ttl_s"),
    (b"v", math.inf, "ttl_s"),
    (b"v", True, "ttl_s"),
    (b"v", "60", "ttl_s"),
])
def test_put_result_refuses_a_bad_value_or_ttl_and_changes_nothing(value, ttl, error):
    s = Shard()
    jid, token = s.leased_job()
    refused(s, InvalidJob, "put_result", jid, token, value, ttl, match=error)


def test_put_result_and_progress_check_the_lease_as_an_ack_does():
    s = Shard(config_from(visibility_timeout=30))
    jid, token = s.leased_job()
    for name, args in (("put_result", (b"v", 60.0)), ("set_progress", (0.5, "half"))):
        refused(s, LeaseLost, name, jid, token + 1, *args)                     # another token
        refused(s, NotFound, name, (7 << 10) | 1, token, *args)                # another shard's job
        refused(s, InvalidJob, name, "1024", token, *args)                     # not an id
        refused(s, InvalidJob, name, jid, -1, *args)
    gone = s.enqueue()
    (other,) = s.run_dequeue()
    s.run("ack", gone, other.token)
    refused(s, JobGone, "put_result", gone, other.token, b"v", 60.0)           # acked
    refused(s, JobGone, "set_progress", gone, other.token, 0.1, None)
    s.now = T0 + 30.0
    refused(s, LeaseLost, "put_result", jid, token, b"v", 60.0)                # expired
    refused(s, LeaseLost, "set_progress", jid, token, 0.1, None)


def test_result_answers_the_live_state_with_error_attempts_and_progress_then_gone():
    s = Shard(config_from(max_deliveries=2))
    waiting_head = s.enqueue(b"a", key="k")
    waiting = s.enqueue(b"b", key="k")
    delayed = s.enqueue(b"c", delay=100)
    (lease,) = s.run_dequeue()
    assert lease.job_id == waiting_head
    s.run("set_progress", waiting_head, lease.token, 0.25, "a quarter")
    rows = s.run("results_of", [waiting_head, waiting, delayed, (99 << 10)])
    assert rows == [("leased", None, None, 1, 0.25, "a quarter", None, False),
                    ("waiting", None, None, 0, None, None, None, False),
                    ("delayed", None, None, 0, None, None, None, False),
                    ("gone", None, None, None, None, None, None, False)]
    s.nack(waiting_head, lease.token, "boom")
    # progress stays while the job is live: ready again, then dead
    assert s.run("results_of", [waiting_head])[0] == ("ready", None, "boom", 1, 0.25, "a quarter", None, False)
    (lease,) = s.run_dequeue()
    s.nack(waiting_head, lease.token, "boom again")
    assert s.run("results_of", [waiting_head])[0] == ("dead", None, "boom again", 2, 0.25, "a quarter", None, False)
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)
    s.run("purge_dead", "default")
    assert s.run("results_of", [waiting_head])[0].state == "gone"
    assert s.state.progress == {}


def test_result_takes_a_full_batch_and_refuses_ids_that_are_not_this_shards():
    s = Shard(index=3, shards=4)
    ids = [(n << 10) | 3 for n in range(limits.BATCH_JOBS_MAX)]
    rows = s.run("results_of", ids)
    assert len(rows) == limits.BATCH_JOBS_MAX and {r.state for r in rows} == {"gone"}
    assert s.run("results_of", []) == []
    refused(s, InvalidJob, "results_of", ids + [(1 << 20) | 3], match="at most")
    refused(s, InvalidJob, "results_of", [(5 << 10) | 2], match="shard 3")
    refused(s, InvalidJob, "results_of", ["1027"])
    refused(s, InvalidJob, "results_of", [True])
    refused(s, InvalidJob, "results_of", [-1])
    refused(s, InvalidJob, "results_of", 1027)


def test_result_values_past_the_reply_limit_are_withheld_and_each_comes_alone():
    s = Shard()
    n = limits.REPLY_BYTES_MAX // limits.RESULT_BYTES_MAX + 2   # 65 values of 1 MiB: 65 MiB
    ids = []
    for i in range(n):
        jid, token = s.leased_job()
        s.run("put_result", jid, token, bytes([i]) * limits.RESULT_BYTES_MAX, 600.0)
        s.run("ack", jid, token)
        ids.append(jid)
    rows = s.run("results_of", ids)
    sent = [r for r in rows if not r.withheld]
    held = [r for r in rows if r.withheld]
    assert held and sent and all(r.value is None and r.state == "succeeded" for r in held)
    assert sum(len(r.value) for r in sent) <= limits.REPLY_BYTES_MAX
    assert len(msgpack.packb([[1, 0, rows]])) <= limits.FRAME_BYTES_MAX
    for i, (jid, row) in enumerate(zip(ids, rows)):
        if row.withheld:
            (alone,) = s.run("results_of", [jid])
            assert alone.value == bytes([i]) * limits.RESULT_BYTES_MAX and not alone.withheld
        else:
            assert row.value == bytes([i]) * limits.RESULT_BYTES_MAX


def test_result_sizes_answer_every_values_length_in_one_reply_with_none_withheld():
    """result_sizes (what a look at a workflow reads): the same rows with each value's
    length, the 65 MiB of values that result withholds answered in one small reply."""
    s = Shard()
    n = limits.REPLY_BYTES_MAX // limits.RESULT_BYTES_MAX + 2
    ids = []
    for i in range(n):
        jid, token = s.leased_job()
        s.run("put_result", jid, token, bytes([i]) * (limits.RESULT_BYTES_MAX - i), 600.0)
        s.run("ack", jid, token)
        ids.append(jid)
    live, _ = s.leased_job()
    rows = s.state.results_of(ids + [live], s.now, sizes=True)  # reads only: nothing to log
    assert [r.value for r in rows[:n]] == [limits.RESULT_BYTES_MAX - i for i in range(n)]
    assert not any(r.withheld for r in rows) and {r.state for r in rows[:n]} == {"succeeded"}
    assert rows[n].state == "leased" and rows[n].value is None
    plain = s.state.results_of(ids + [live], s.now)
    assert [r._replace(value=None, withheld=False) for r in rows] == \
        [r._replace(value=None, withheld=False) for r in plain]  # the same rows but for the values
    assert len(msgpack.packb([[1, 0, rows]])) < 64 * 1024


# ---------------------------------------------------------------------------- progress
def test_progress_is_checked_kept_while_live_and_dropped_when_the_job_leaves():
    s = Shard()
    jid, token = s.leased_job()
    note = "\U0001f600" * (limits.PROGRESS_NOTE_BYTES_MAX // 4)   # 512 UTF-8 bytes: at the limit
    s.run("set_progress", jid, token, 1, note)
    assert s.state.progress[jid] == (1.0, note)
    s.run("set_progress", jid, token, 0, None)
    s.run("set_progress", jid, token, None, "just a note")
    assert s.state.progress[jid] == (None, "just a note")
    for fraction in (-0.01, 1.01, math.nan, math.inf, True, "0.5", [0.5]):
        refused(s, InvalidJob, "set_progress", jid, token, fraction, None, match="fraction")
    for bad in ("x" * (limits.PROGRESS_NOTE_BYTES_MAX + 1), "\U0001f600" * 128 + "x", "\ud800" * 200, b"bytes", 5):
        refused(s, InvalidJob, "set_progress", jid, token, 0.5, bad, match="note")
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)
    s.run("ack", jid, token)
    assert s.state.progress == {}
    assert s.replayed().progress == {}


def test_progress_of_a_cancelled_lease_goes_with_the_job():
    s = Shard()
    jid, token = s.leased_job()
    s.run("set_progress", jid, token, 0.5, None)
    assert s.run("cancel", jid) == "cancelling"
    assert jid in s.state.progress                    # still running: its progress stays
    s.now = T0 + 31                                    # the lease runs out: the job goes
    s.state.advance(s.now)
    s.log.append(roundtrip(s.state.take_ops()))
    assert jid not in s.state.jobs and s.state.progress == {}
    assert s.replayed().progress == {}


def test_progress_of_a_job_the_log_lost_is_ignored_on_replay():
    """A salvaged log may keep the progress of a job whose enqueue was in the damaged bytes."""
    state = ShardState(0, config_from())
    state.replay([[[ops.PROGRESS, 5 << 10, 0.5, "orphan"], [ops.RESULT, 6 << 10, b"v", T0 + 1]]])
    assert state.progress == {} and state.results == {6 << 10: (b"v", T0 + 1)}


# ---------------------------------------------------------------------------- barriers
def test_a_barrier_counts_each_index_once_and_its_last_arrival_enqueues_the_callback_in_one_record():
    s = Shard()
    assert s.run("arrive", "wf1.b", 1, 3, b"one", 60.0, CALLBACK) == "counted"
    assert s.run("arrive", "wf1.b", 1, 3, b"one again", 60.0, CALLBACK) == "repeated"
    assert s.run("arrive", "wf1.b", 0, 3, b"zero", 60.0, CALLBACK) == "counted"
    assert s.run("barrier_info", ["wf1.b", "other"]) == [
        {"total": 3, "arrived": 2, "fired_job": None, "cancelled": False, "missing": [2]}, None]
    refused(s, InvalidJob, "barrier_values", "wf1.b", match="2 of 3 members arrived")
    jobs_before = set(s.state.jobs)
    assert s.run("arrive", "wf1.b", 2, 3, b"two", 60.0, CALLBACK) == "fired"
    (callback_job,) = set(s.state.jobs) - jobs_before
    record = s.log[-1]
    assert [op[0] for op in record] == [ops.ENQUEUE, ops.ARRIVE, ops.FIRED]
    assert s.atomic[-1] == [(0, 3)]  # one record whatever else the iteration logs
    assert record[0][7] == "wf:wf1.b"  # the callback's dedup id
    assert record[2] == [ops.FIRED, "wf1.b", callback_job, T0 + limits.BARRIER_TOMBSTONE_S]
    info = s.run("barrier_info", ["wf1.b"])[0]
    assert info == {"total": 3, "arrived": 3, "fired_job": callback_job, "cancelled": False, "missing": []}
    assert s.run("barrier_values", "wf1.b") == [b"zero", b"one", b"two"]
    lease = s.lease()
    assert (lease.job_id, lease.body) == (callback_job, b"callback-body")
    # a member delivered again late changes nothing
    assert s.run("arrive", "wf1.b", 2, 3, b"two", 60.0, CALLBACK) == "repeated"
    assert s.run("arrive", "wf1.b", 0, 3, b"zero", 60.0, CALLBACK) == "repeated"
    assert len(s.state.jobs) == 1
    assert s.state.workflow_stats()["barriers"] == {"open": 0, "fired": 1, "cancelled": 0}
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)


def test_a_barrier_of_the_most_members_fires_once_with_its_values_in_order():
    s = Shard()
    total = limits.BARRIER_MEMBERS_MAX
    order = list(range(total - 1, -1, -2)) + list(range(total - 2, -1, -2))  # odd ones first, backwards
    for n, i in enumerate(order[:-1]):
        assert s.state.arrive("big", i, total, i.to_bytes(4, "big"), 60.0, CALLBACK, s.now) == "counted"
        if n == total // 2:
            assert s.state.barrier_info(["big"], s.now)[0]["missing"] == list(range(0, 40, 2))
    assert s.state.barrier_info(["big"], s.now)[0]["missing"] == [0]
    s.log.append(roundtrip(s.state.take_ops()))
    assert s.run("arrive", "big", order[-1], total, (0).to_bytes(4, "big"), 60.0, CALLBACK) == "fired"
    assert s.run("barrier_values", "big") == [i.to_bytes(4, "big") for i in range(total)]
    refused(s, InvalidJob, "arrive", "other", 0, total + 1, b"", 60.0, CALLBACK, match="total")
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)


def test_a_barrier_at_the_byte_limit_fires_and_one_byte_more_is_refused():
    s = Shard()
    members = limits.BARRIER_BYTES_MAX // limits.RESULT_BYTES_MAX   # 32 values of 1 MiB
    for i in range(members):
        assert s.run("arrive", "heavy", i, members + 1, bytes([i]) * limits.RESULT_BYTES_MAX, 60.0,
                     CALLBACK) == "counted"
    refused(s, InvalidJob, "arrive", "heavy", members, members + 1, b"x", 60.0, CALLBACK, match="BARRIER_BYTES_MAX")
    assert s.run("arrive", "heavy", members, members + 1, b"", 60.0, CALLBACK) == "fired"
    values = s.run("barrier_values", "heavy")
    assert sum(map(len, values)) == limits.BARRIER_BYTES_MAX and values[-1] == b""
    assert len(msgpack.packb([[1, 0, values]])) <= limits.FRAME_BYTES_MAX
    assert_same(s.state, s.from_checkpoint(), s.now)


@pytest.mark.parametrize("args, error", [
    (("", 0, 1, b"v", 60.0, CALLBACK), "barrier_id"),
    (("x" * (limits.BARRIER_ID_BYTES_MAX + 1), 0, 1, b"v", 60.0, CALLBACK), "barrier_id"),
    (("\u00e9" * (limits.BARRIER_ID_BYTES_MAX // 2 + 1), 0, 1, b"v", 60.0, CALLBACK), "barrier_id"),
    (("\ud800" * 40, 0, 1, b"v", 60.0, CALLBACK), "barrier_id"),
    ((b"bytes-id", 0, 1, b"v", 60.0, CALLBACK), "barrier_id"),
    (("b", 1, 1, b"v", 60.0, CALLBACK), "index"),
    (("b", -1, 2, b"v", 60.0, CALLBACK), "index"),
    (("b", True, 2, b"v", 60.0, CALLBACK), "index"),
    (("b", 0, 0, b"v", 60.0, CALLBACK), "total"),
    (("b", 0, limits.BARRIER_MEMBERS_MAX + 1, b"v", 60.0, CALLBACK), "total"),
    (("b", 0, 2.0, b"v", 60.0, CALLBACK), "total"),
    (("b", 0, 1, b"v" * (limits.RESULT_BYTES_MAX + 1), 60.0, CALLBACK), "value"),
    (("b", 0, 1, "text", 60.0, CALLBACK), "value"),
    (("b", 0, 1, b"v", 0, CALLBACK), "ttl_s"),
    (("b", 0, 1, b"v", limits.KEEP_RESULT_S_MAX + 1, CALLBACK), "ttl_s"),
])
def test_an_arrival_with_a_bad_field_is_refused_whole(args, error):
    s = Shard()
    s.run("arrive", "other", 0, 2, b"first", 60.0, CALLBACK)
    refused(s, InvalidJob, "arrive", *args, match=error)


def _placed_config_and_a_shard_not_its_owner():
    from shardq.config import owner_shard
    cfg = config_from(declare_queues=True, queues={"default": {}, "placed": {"concurrency": 1}})
    return cfg, (owner_shard("placed", 4) + 1) % 4


BAD_CALLBACKS = [
    (CALLBACK[:4], InvalidJob, "callback"),
    (None, InvalidJob, "callback"),
    ([b"", None, "default", 0, 0], InvalidJob, "body"),
    ([b"x" * (limits.BODY_BYTES_MAX_DEFAULT + 1), None, "default", 0, 0], InvalidJob, "body"),
    (["text", None, "default", 0, 0], InvalidJob, "body"),
    ([b"x", "", "default", 0, 0], InvalidJob, "key"),
    ([b"x", "k" * (limits.KEY_BYTES_MAX + 1), "default", 0, 0], InvalidJob, "key"),
    ([b"x", None, "default", -1, 0], InvalidJob, "delay"),
    ([b"x", None, "default", limits.DELAY_S_MAX + 1, 0], InvalidJob, "delay"),
    ([b"x", None, "default", 0, 2**31], InvalidJob, "priority"),
    ([b"x", None, "no queue!", 0, 0], InvalidJob, "queue"),
    ([b"x", None, 7, 0, 0], InvalidJob, "queue"),
    ([b"x", None, "undeclared", 0, 0], UnknownQueue, "not declared"),
    ([b"x", None, "placed", 0, 0], InvalidJob, "all its jobs live on shard"),
]


@pytest.mark.parametrize("callback, exc, error", BAD_CALLBACKS)
def test_a_bad_callback_is_refused_at_any_arrival_not_only_the_last(callback, exc, error):
    cfg, index = _placed_config_and_a_shard_not_its_owner()
    s = Shard(cfg, index=index, shards=4)
    refused(s, exc, "arrive", "b", 0, 3, b"v", 60.0, callback, match=error)          # the first
    assert s.run("arrive", "b", 0, 3, b"v", 60.0, CALLBACK) == "counted"
    refused(s, exc, "arrive", "b", 1, 3, b"v", 60.0, callback, match=error)          # a middle one
    assert s.run("arrive", "b", 1, 3, b"v", 60.0, CALLBACK) == "counted"
    refused(s, exc, "arrive", "b", 2, 3, b"v", 60.0, callback, match=error)          # the last
    assert s.state.jobs == {}
    assert s.run("arrive", "b", 2, 3, b"v", 60.0, CALLBACK) == "fired"


def test_a_fired_cancelled_or_repeated_arrival_is_answered_without_checking_its_callback():
    """Nothing is logged for them: a member delivered again after the callback's queue left
    the config still hears that it was counted."""
    cfg, index = _placed_config_and_a_shard_not_its_owner()
    s = Shard(cfg, index=index, shards=4)
    s.run("arrive", "open", 0, 2, b"v", 60.0, CALLBACK)
    s.run("arrive", "fired", 0, 1, b"v", 60.0, CALLBACK)
    s.run("cancel_barrier", "cancelled", 0)
    logged = len(s.log)
    bad = [b"x", None, "undeclared", 0, 0]
    assert s.run("arrive", "open", 0, 2, b"v", 60.0, bad) == "repeated"
    assert s.run("arrive", "fired", 0, 1, b"v", 60.0, bad) == "repeated"
    assert s.run("arrive", "cancelled", 0, 1, b"v", 60.0, bad) == "cancelled"
    assert len(s.log) == logged


def test_an_arrival_with_another_total_is_refused_naming_both():
    s = Shard()
    s.run("arrive", "b", 0, 3, b"v", 60.0, CALLBACK)
    refused(s, InvalidJob, "arrive", "b", 1, 4, b"v", 60.0, CALLBACK, match="has 3 members; this arrival says 4")


def test_a_last_arrival_whose_callback_the_enqueue_refuses_logs_nothing_and_can_come_again():
    s = Shard(config_from(max_pending_jobs=1))
    s.run("arrive", "b", 0, 2, b"zero", 60.0, CALLBACK)
    blocker = s.enqueue()  # the shard is full
    refused(s, QueueFull, "arrive", "b", 1, 2, b"one", 60.0, CALLBACK)
    assert s.run("barrier_info", ["b"])[0]["missing"] == [1]
    s.run("cancel", blocker)
    assert s.run("arrive", "b", 1, 2, b"one", 60.0, CALLBACK) == "fired"
    assert_same(s.state, s.replayed(), s.now)


def test_a_callback_job_deduplicates_on_the_barrier_id():
    """Belt and braces: a callback of the same barrier id within the dedup window is the same job."""
    s = Shard()
    s.run("arrive", "b", 0, 1, b"v", 60.0, CALLBACK)
    (first,) = s.state.jobs
    s.run("cancel_barrier", "c", 0)  # nothing to do with it
    again = s.run("enqueue_many", [(b"other", None, "default", 0, 0, "wf:b")])
    assert again == [first]


def test_a_fired_barrier_is_kept_its_ttl_and_at_least_the_tombstone_then_a_late_arrival_starts_anew():
    s = Shard()
    s.run("arrive", "short", 0, 1, b"v", 60.0, CALLBACK)
    s.run("arrive", "long", 0, 1, b"v", limits.KEEP_RESULT_S_MAX, CALLBACK)
    s.now = T0 + limits.BARRIER_TOMBSTONE_S - 1
    assert s.run("arrive", "short", 0, 1, b"v", 60.0, CALLBACK) == "repeated"
    assert s.run("barrier_values", "short") == [b"v"]
    s.now = T0 + limits.BARRIER_TOMBSTONE_S
    replayed = s.replayed()  # memory not freed yet: expired all the same
    assert replayed.barrier_info(["short", "long"], s.now)[0] is None
    assert s.run("barrier_info", ["short"]) == [None]
    refused(s, NotFound, "barrier_values", "short")
    assert s.run("arrive", "long", 0, 1, b"v", 60.0, CALLBACK) == "repeated"
    jobs = len(s.state.jobs)
    assert s.run("arrive", "short", 0, 1, b"late", 60.0, CALLBACK) == "fired"  # a new barrier
    assert len(s.state.jobs) == jobs + 1 and s.run("barrier_values", "short") == [b"late"]
    assert_same(s.state, s.replayed(), s.now)
    s.now = T0 + limits.KEEP_RESULT_S_MAX
    assert s.run("barrier_info", ["long"]) == [None]
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)


def test_cancel_barrier_stops_an_open_one_says_fired_when_too_late_and_creates_an_unknown_one():
    s = Shard()
    s.run("arrive", "open", 0, 2, b"v", 60.0, CALLBACK)
    s.run("arrive", "done", 0, 1, b"v", 60.0, CALLBACK)
    assert s.run("cancel_barrier", "open", 0) == "cancelled"
    assert s.log[-1] == [[ops.BARRIER_CANCEL, "open", T0 + limits.BARRIER_TOMBSTONE_S]]
    logged = len(s.log)
    assert s.run("cancel_barrier", "open", 0) == "cancelled"        # already: nothing logged
    assert s.run("cancel_barrier", "done", 0) == "fired"            # too late: nothing logged
    assert len(s.log) == logged
    assert s.run("arrive", "open", 1, 2, b"v", 60.0, CALLBACK) == "cancelled"
    assert s.run("cancel_barrier", "unknown", limits.KEEP_RESULT_S_MAX) == "cancelled"
    assert s.run("arrive", "unknown", 0, 5, b"v", 60.0, CALLBACK) == "cancelled"
    assert s.run("barrier_info", ["open", "unknown"]) == [
        {"total": 2, "arrived": 1, "fired_job": None, "cancelled": True, "missing": [1]},
        {"total": 0, "arrived": 0, "fired_job": None, "cancelled": True, "missing": []}]
    refused(s, InvalidJob, "barrier_values", "unknown", match="cancelled")
    refused(s, InvalidJob, "barrier_values", "open", match="1 of 2")
    assert len(s.state.jobs) == 1   # only "done"'s callback
    assert s.state.workflow_stats()["barriers"] == {"open": 0, "fired": 1, "cancelled": 2}
    for bad in (-1, limits.KEEP_RESULT_S_MAX + 1, math.nan, None):
        refused(s, InvalidJob, "cancel_barrier", "x", bad, match="ttl_s")
    refused(s, InvalidJob, "cancel_barrier", "", 0, match="barrier_id")
    assert_same(s.state, s.replayed(), s.now)
    assert_same(s.state, s.from_checkpoint(), s.now)
    s.now = T0 + limits.BARRIER_TOMBSTONE_S
    assert s.run("arrive", "open", 1, 2, b"v", 60.0, CALLBACK) == "counted"   # a new barrier
    assert s.run("barrier_info", ["open"])[0]["cancelled"] is False
    assert s.run("cancel_barrier", "done", 0) == "cancelled"   # expired: a new, cancelled one
    assert_same(s.state, s.replayed(), s.now)


def test_barrier_and_barrier_values_check_their_ids():
    s = Shard()
    refused(s, InvalidJob, "barrier_info", ["ok"] * (limits.BATCH_JOBS_MAX + 1))
    assert s.run("barrier_info", ["b"] * limits.BATCH_JOBS_MAX) == [None] * limits.BATCH_JOBS_MAX
    refused(s, InvalidJob, "barrier_info", [5])
    refused(s, InvalidJob, "barrier_info", "b")
    refused(s, NotFound, "barrier_values", "unknown")
    refused(s, InvalidJob, "barrier_values", 5)


# ---------------------------------------------------------------------------- replay and checkpoints
def workload(s: Shard) -> None:
    """Every operation of results.py, and the jobs around them."""
    done, token = s.leased_job(b"done")
    s.run("put_result", done, token, b"result", 3600.0)
    s.run("set_progress", done, token, 1.0, "finished")
    s.run("ack", done, token)
    live, token = s.leased_job(b"live")
    s.run("set_progress", live, token, 0.5, "half")
    s.run("put_result", live, token, b"stored before the ack", 3600.0)
    s.run("arrive", "chord", 2, 3, b"c", 60.0, CALLBACK)
    s.run("arrive", "chord", 0, 3, b"a", 60.0, CALLBACK)
    s.run("arrive", "step", 0, 1, b"s", 60.0, [b"next", "key", "default", 5, 7])
    s.run("arrive", "cancelled", 0, 2, b"x", 60.0, CALLBACK)
    s.run("cancel_barrier", "cancelled", 60.0)
    s.run("cancel_barrier", "never", 60.0)


def test_replay_and_a_checkpoint_rebuild_the_same_state():
    s = Shard()
    workload(s)
    assert_same(s.state, s.replayed(), s.now)
    for chunk in (limits.CHECKPOINT_CHUNK_BYTES, 1):
        assert_same(s.state, s.from_checkpoint(chunk), s.now)
    seen = {op[0] for record in s.log for op in record}
    assert {ops.RESULT, ops.PROGRESS, ops.ARRIVE, ops.FIRED, ops.BARRIER_CANCEL} <= seen
    ckpt = [op for c in s.state.snapshot() for op in msgpack.unpackb(c, raw=False)]
    assert {op[0] for op in ckpt} >= {ops.RESULT, ops.PROGRESS, ops.BARRIER}
    assert sum(op[0] == ops.PROGRESS for op in ckpt) == 1   # the acked job's progress is gone
    # and a checkpoint of the checkpoint is the same again
    again = s.from_checkpoint()
    s2 = Shard()
    s2.state = again
    assert_same(s.state, s2.from_checkpoint(), s.now)


def test_a_checkpoint_cuts_a_barrier_of_32_mib_and_its_largest_callback_into_records_within_the_limit():
    """A barrier complete in the log without its FIRED keeps its callback (a body at the
    ceiling) and 32 MiB of values: each checkpoint record stays within its limit, and the
    barrier comes back whole, and fires at start."""
    cfg = config_from(max_body_bytes=limits.BODY_BYTES_MAX_CEILING)
    s = Shard(cfg)
    members = limits.BARRIER_BYTES_MAX // limits.RESULT_BYTES_MAX
    body = b"B" * limits.BODY_BYTES_MAX_CEILING
    callback = [body, "k" * limits.KEY_BYTES_MAX, "default", 0, 0]
    for i in range(members):
        last = i == members - 1
        s.state.apply([ops.ARRIVE, "h" * limits.BARRIER_ID_BYTES_MAX, i, members, bytes([i]) * limits.RESULT_BYTES_MAX,
                       T0 + limits.BARRIER_TOMBSTONE_S if last else None, callback if last else None])
    s.state.apply([ops.RESULT, 1 << 10, b"r" * limits.RESULT_BYTES_MAX, T0 + 60])
    chunks = list(s.state.snapshot())
    assert max(map(len, chunks)) <= limits.CHECKPOINT_RECORD_BYTES_MAX
    assert sum(map(len, chunks)) > limits.BARRIER_BYTES_MAX + limits.BODY_BYTES_MAX_CEILING
    again = s.fresh()
    again.replay([msgpack.unpackb(c, raw=False) for c in chunks])
    assert_same(s.state, again, s.now)
    fired = again.fire_complete(s.now)
    assert len(fired) == 1 and "fired now" in fired[0]
    (job,) = again.jobs.values()
    assert job.body == body and job.key == "k" * limits.KEY_BYTES_MAX
    assert again.barrier_values("h" * limits.BARRIER_ID_BYTES_MAX, s.now)[5] == bytes([5]) * limits.RESULT_BYTES_MAX


def test_open_barriers_are_kept_for_ever_and_what_expired_is_not_checkpointed(tmp_path):
    clock = FakeClock(T0)
    with Engine(str(tmp_path), config_from(), clock=clock) as engine:
        st = engine.state
        jid = engine.enqueue(b"job")
        (lease,) = engine.dequeue()
        st.put_result(jid, lease.token, b"r", 60.0, clock.now())
        engine.ack(jid, lease.token)
        st.arrive("open", 0, 2, b"v", 60.0, CALLBACK, clock.now())
        st.arrive("fired", 0, 1, b"v", 60.0, CALLBACK, clock.now())
        st.cancel_barrier("cancelled", 0.0, clock.now())
        engine.shard.commit()
        clock._t += limits.BARRIER_TOMBSTONE_S + 1000 * DAY
        engine.stats()  # advances
        assert st.results == {} and set(st.barriers) == {"open"}
        engine.compact()
        ckpt = [op for c in st.snapshot() for op in msgpack.unpackb(c, raw=False)]
        assert [op[1] for op in ckpt if op[0] == ops.BARRIER] == ["open"]
        assert not [op for op in ckpt if op[0] == ops.RESULT]
    with Engine(str(tmp_path), config_from(), clock=clock) as engine:
        assert set(engine.state.barriers) == {"open"} and engine.state.results == {}
        assert engine.state.arrive("open", 1, 2, b"w", 60.0, CALLBACK, clock.now()) == "fired"
        engine.shard.commit()
    with Engine(str(tmp_path), config_from(), clock=clock) as engine:
        assert engine.state.barrier_values("open", clock.now()) == [b"v", b"w"]


def test_a_32_mib_barrier_and_a_1_mib_result_survive_compaction_and_reopen(tmp_path):
    clock = FakeClock(T0)
    members = limits.BARRIER_BYTES_MAX // limits.RESULT_BYTES_MAX
    with Engine(str(tmp_path), config_from(), clock=clock) as engine:
        jid = engine.enqueue(b"job")
        (lease,) = engine.dequeue()
        engine.state.put_result(jid, lease.token, b"R" * limits.RESULT_BYTES_MAX, 600.0, clock.now())
        for i in range(members):
            engine.state.arrive("heavy", i, members, bytes([i]) * limits.RESULT_BYTES_MAX, 600.0, CALLBACK,
                                clock.now())
            engine.shard.commit()
        engine.compact()
    with Engine(str(tmp_path), config_from(), clock=clock) as engine:
        assert engine.state.results_of([jid], clock.now())[0].value == b"R" * limits.RESULT_BYTES_MAX
        values = engine.state.barrier_values("heavy", clock.now())
        assert values == [bytes([i]) * limits.RESULT_BYTES_MAX for i in range(members)]
        info = engine.state.barrier_info(["heavy"], clock.now())[0]
        assert info["fired_job"] in engine.state.jobs and len(engine.state.jobs) == 2


# ---------------------------------------------------------------------------- the start-up fire
def _hand_built(tmp_path, records: list[list]) -> None:
    """A shard directory whose log holds ``records`` (lists of operations), written as a
    shard writes them."""
    shard = DurableShard(str(tmp_path), 0, config_from())
    shard.open(T0)
    for record in records:
        shard.log.commit([msgpack.packb(record)])
    shard.close()


def test_a_barrier_complete_without_its_fired_is_fired_at_start_before_serving(tmp_path):
    expires = T0 + limits.BARRIER_TOMBSTONE_S
    _hand_built(tmp_path, [
        [[ops.ARRIVE, "torn", 0, 2, b"a", None]],
        # the completing arrival's record, its ENQUEUE and FIRED lost
        [[ops.ARRIVE, "torn", 1, 2, b"b", expires, [b"cb", "key", "default", 0, 3]]],
        [[ops.ARRIVE, "waiting", 0, 2, b"a", None]],
    ])
    shard = DurableShard(str(tmp_path), 0, config_from())
    shard.open(T0 + 10)
    st = shard.state
    (job,) = st.jobs.values()
    assert (job.body, job.key, job.priority) == (b"cb", "key", 3)
    assert st.barrier_info(["torn"], T0 + 10)[0]["fired_job"] == job.id
    assert st.barriers["torn"].expires_at == T0 + 10 + limits.BARRIER_TOMBSTONE_S
    assert st.barrier_info(["waiting"], T0 + 10)[0]["fired_job"] is None
    shard.close()
    again = DurableShard(str(tmp_path), 0, config_from())  # the fire was durable: not fired twice
    again.open(T0 + 20)
    assert list(again.state.jobs) == [job.id]
    assert again.state.barrier_info(["torn"], T0 + 20)[0]["fired_job"] == job.id
    again.close()


def test_a_start_up_fire_whose_enqueue_landed_uses_that_job(tmp_path):
    expires = T0 + limits.BARRIER_TOMBSTONE_S
    cb_job = (1 << 10)
    _hand_built(tmp_path, [
        [[ops.ENQUEUE, cb_job, "default", None, b"cb", 0, 0, "wf:half", T0, T0 + 300],
         [ops.ARRIVE, "half", 0, 1, b"a", expires, [b"cb", None, "default", 0, 0]]],
    ])
    shard = DurableShard(str(tmp_path), 0, config_from())
    shard.open(T0 + 10)
    assert list(shard.state.jobs) == [cb_job]  # the dedup id answered: no second job
    assert shard.state.barriers["half"].fired_job == cb_job
    shard.close()


def test_a_start_up_fire_the_enqueue_refuses_leaves_the_barrier_open_and_tries_at_the_next_start(tmp_path):
    expires = T0 + limits.BARRIER_TOMBSTONE_S
    _hand_built(tmp_path, [[[ops.ARRIVE, "later", 0, 1, b"a", expires, [b"cb", None, "gone-queue", 0, 0]]]])
    strict = config_from(declare_queues=True, queues={"default": {}})
    shard = DurableShard(str(tmp_path), 0, strict)
    shard.open(T0)
    assert shard.state.jobs == {} and shard.state.barriers["later"].fired_job is None
    assert shard.state.fire_complete(T0) and shard.state.take_ops() == []  # still refused, nothing logged
    shard.close()
    shard = DurableShard(str(tmp_path), 0, config_from())  # the queue is back in the config
    shard.open(T0)
    assert shard.state.barriers["later"].fired_job in shard.state.jobs
    shard.close()


# ---------------------------------------------------------------------------- salvage
def test_salvage_keeps_results_progress_and_barriers_around_a_damaged_record(tmp_path):
    """``shardq wal repair`` (shard/salvage.py) needs nothing new for these operations: a
    result and a barrier do not depend on a job's state, and a progress whose job was lost
    is ignored. Here the damaged record is a lease: its job's later ack is still applied (the
    shard logged it only once it matched the lease: the job was done and its worker told so),
    so the job does not come back, and the result its worker stored stays."""
    from shardq.errors import CorruptLog
    from shardq.shard.salvage import salvage
    from shardq.wal.format import HEADER, HEADER_BYTES, MAGIC_BYTES
    clock = FakeClock(T0)
    d = str(tmp_path / "shard-0")
    cfg = config_from()
    e = Engine(d, cfg, clock=clock)
    jid = e.enqueue(b"member")
    (lease,) = e.dequeue()
    lease_write = e.shard.log.writer.written
    e.state.put_result(jid, lease.token, b"the result", 3600.0, clock.now())
    e.state.set_progress(jid, lease.token, 0.5, "half", clock.now())
    e.shard.commit()
    e.ack(jid, lease.token)
    e.state.arrive("b", 0, 2, b"zero", 3600.0, CALLBACK, clock.now())
    e.shard.commit()
    e.state.arrive("b", 1, 2, b"one", 3600.0, CALLBACK, clock.now())
    e.shard.commit()
    path = e.shard.log.writer.path
    e.close()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    off = MAGIC_BYTES
    while HEADER.unpack_from(data, off)[3] != lease_write:  # to the lease's record (its write number)
        off += HEADER_BYTES + HEADER.unpack_from(data, off)[1]
    length = HEADER.unpack_from(data, off)[1]
    data[off + HEADER_BYTES:off + HEADER_BYTES + length] = bytes(length)   # its payload zeroed
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptLog):
        Engine(d, cfg, clock=clock)
    salvage(d, config=cfg)
    with Engine(d, cfg, clock=clock) as again:
        st = again.state
        callback_job = st.barrier_info(["b"], clock.now())[0]["fired_job"]
        assert set(st.jobs) == {callback_job}                            # its ack applied: jid is gone
        row = st.results_of([jid], clock.now())[0]
        assert (row.state, row.value) == ("succeeded", b"the result")
        assert st.progress == {}                                         # (its job's, gone with it)
        assert st.barrier_values("b", clock.now()) == [b"zero", b"one"]
