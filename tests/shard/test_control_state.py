"""Pause/resume, cancel, look-up, dead-letter paging and the metrics figures of the pure
shard state (shardq/shard/control.py). Every test ends by checking that replaying the
log, and loading a checkpoint, rebuild the same state, paused queues and cancelled leases
included."""
from __future__ import annotations

import msgpack
import pytest

from shardq import limits
from shardq.protocol import validate
from shardq.errors import Cancelled, InvalidJob, JobGone, LeaseLost, NotFound
from shardq.shard import ops
from shardq.shard.control import DEAD_PAGE_MAX
from shardq.shard.enqueue_times import RESOLUTION_S, SAMPLES_MAX, EnqueueTimes
from shardq.shard.state import ShardState

from conftest import state_digest

T0 = 1_000_000.0


class Shard:
    """A ShardState whose emitted operations are kept as a msgpack log."""

    def __init__(self, config, clock, index=0):
        self.config, self.clock, self.index = config, clock, index
        self.state = ShardState(index, config)
        self.log: list[bytes] = []

    def __getattr__(self, name):
        fn = getattr(self.state, name)

        def call(*args, **kw):
            try:
                return fn(*args, **kw)
            finally:
                produced = self.state.take_ops()
                if produced:
                    self.log.append(msgpack.packb(produced))
        return call

    @property
    def now(self):
        return self.clock.now()

    def put(self, body=b"x", key=None, queue="default", delay=0):
        return self.enqueue(body, self.now, key, queue, delay)

    def take(self, queue="default", n=1, visibility=None):
        return self.dequeue(queue, self.now, visibility, n)

    def replayed(self) -> ShardState:
        fresh = ShardState(self.index, self.config)
        for record in self.log:
            for op in msgpack.unpackb(record, raw=False):
                fresh.apply(op)
        return fresh

    def from_checkpoint(self) -> ShardState:
        fresh = ShardState(self.index, self.config)
        for record in self.state.snapshot(chunk_bytes=300):
            for op in msgpack.unpackb(record, raw=False):
                fresh.apply(op)
        return fresh


def digest(state) -> dict:
    d = state_digest(state)
    d["cancelled"] = sorted(state.cancelled)
    d["paused"] = {n: q.paused for n, q in state.queues.items() if q.paused is not None}
    return d


@pytest.fixture
def shard(make_config, clock):
    clock.set(T0)
    s = Shard(make_config(max_deliveries=3, visibility_timeout=30), clock)
    yield s
    s.advance(clock.now())
    live = digest(s.state)
    for rebuilt in (s.replayed(), s.from_checkpoint()):
        rebuilt.advance(clock.now())
        assert digest(rebuilt) == live, "the log or a checkpoint does not rebuild the state"


# ---------------------------------------------------------------------------- pause / resume
def test_a_paused_queue_leases_nothing_but_everything_else_works(shard, clock):
    held = shard.take() or None
    assert held is None
    a, b = shard.put(b"a"), shard.put(b"b")
    lease = shard.take()[0]
    assert shard.pause("default", shard.now) is True
    assert shard.pause("default", shard.now) is False       # idempotent: nothing logged
    records = len(shard.log)
    assert shard.state.stats()["default"]["paused"] is True
    assert shard.take() == [] and not shard.state.has_ready("default")
    c = shard.put(b"c")                                      # enqueue works
    assert shard.extend(lease.job_id, lease.token, shard.now, 60) == shard.now + 60
    shard.nack(lease.job_id, lease.token, shard.now)         # nack works: ready again, not leased
    assert shard.take() == []
    clock.advance(61)                                        # leases run out as usual
    assert shard.take() == []
    assert shard.state.stats()["default"]["ready"] == 3
    assert len(shard.log) > records
    assert shard.resume("default", shard.now) is True
    assert shard.resume("default", shard.now) is False
    assert "paused" not in shard.state.stats()["default"]
    assert shard.state.has_ready("default")
    got = shard.take(n=10)
    assert sorted(l.job_id for l in got) == sorted([a, b, c])
    for l in got:
        shard.ack(l.job_id, l.token, shard.now)              # ack works


def test_pause_survives_replay_and_checkpoint_and_is_per_queue(shard):
    shard.put(b"a", queue="slow")
    shard.put(b"b", queue="fast")
    shard.pause("slow", shard.now)
    shard.pause("empty", shard.now)                          # a queue with no jobs can be paused
    for rebuilt in (shard.replayed(), shard.from_checkpoint()):
        rebuilt.advance(shard.now)
        assert rebuilt.dequeue("slow", shard.now) == []
        assert rebuilt.stats()["empty"]["paused"] is True
        assert [l.body for l in rebuilt.dequeue("fast", shard.now)] == [b"b"]
    assert [l.body for l in shard.take("fast")] == [b"b"]


def test_pause_validates_the_queue_name(shard, make_config):
    with pytest.raises(InvalidJob):
        shard.pause("", shard.now)
    strict = Shard(make_config(declare_queues=True), shard.clock)
    with pytest.raises(InvalidJob):
        strict.pause("undeclared", shard.now)
    assert strict.log == []


# ---------------------------------------------------------------------------- cancel
def test_cancel_a_ready_head_lets_the_next_job_of_its_key_move_up(shard):
    first, second, third = (shard.put(b, key="k") for b in (b"1", b"2", b"3"))
    assert shard.cancel(first, shard.now) == "cancelled"
    assert shard.state.stats()["default"]["ready"] == 1
    assert shard.state.stats()["default"]["waiting"] == 1
    lease = shard.take()[0]
    assert lease.job_id == second
    shard.ack(lease.job_id, lease.token, shard.now)
    assert shard.take()[0].job_id == third
    assert shard.cancel(first, shard.now) == "gone"          # idempotent


def test_cancel_a_waiting_job_keeps_the_order_of_the_rest(shard):
    ids = [shard.put(str(i).encode(), key="k") for i in range(5)]
    assert shard.cancel(ids[2], shard.now) == "cancelled"
    order = []
    while True:
        got = shard.take()
        if not got:
            break
        order.append(got[0].job_id)
        shard.ack(got[0].job_id, got[0].token, shard.now)
    assert order == [ids[0], ids[1], ids[3], ids[4]]


def test_cancel_delayed_keyless_and_dead_jobs(shard, clock):
    dead = shard.put(b"poison", key="p")
    for _ in range(3):
        lease = shard.take()[0]
        shard.nack(lease.job_id, lease.token, shard.now, error="boom")
    delayed = shard.put(b"later", delay=60)
    keyless = shard.put(b"free")
    assert [d.job_id for d in shard.state.dead_letters("default")] == [dead]
    assert shard.cancel(delayed, shard.now) == "cancelled"
    assert shard.cancel(keyless, shard.now) == "cancelled"
    assert shard.cancel(dead, shard.now) == "purged"
    clock.advance(120)
    assert shard.take(n=10) == []
    assert shard.state.stats()["default"] == {"ready": 0, "delayed": 0, "waiting": 0, "in_flight": 0,
                                              "dead": 0, "keys": 0}
    assert shard.state.jobs == {}
    for jid in (delayed, keyless, dead):
        assert shard.cancel(jid, shard.now) == "gone"
    with pytest.raises(NotFound):
        shard.cancel((5 << limits.JOB_ID_SHARD_BITS) | 7, shard.now)   # another shard's id
    with pytest.raises(InvalidJob):
        shard.cancel("12", shard.now)


def test_a_cancelled_lease_tells_its_holder_and_is_never_redelivered(shard):
    jid, nxt = shard.put(b"running", key="k"), shard.put(b"next", key="k")
    lease = shard.take()[0]
    assert shard.cancel(jid, shard.now) == "cancelling"
    assert shard.cancel(jid, shard.now) == "cancelling"     # idempotent: no second mark
    records = len(shard.log)
    with pytest.raises(Cancelled):
        shard.extend(jid, lease.token, shard.now, 60)
    assert len(shard.log) == records                         # extend changed nothing
    assert shard.state.stats()["default"]["in_flight"] == 1
    assert shard.take() == []                                # the key stays held meanwhile
    with pytest.raises(LeaseLost):                           # a stale token is just LeaseLost
        shard.ack(jid, lease.token + 99, shard.now)
    with pytest.raises(Cancelled) as e:
        shard.ack(jid, lease.token, shard.now)
    assert isinstance(e.value, LeaseLost)
    assert jid not in shard.state.jobs and jid not in shard.state.cancelled
    with pytest.raises(JobGone):
        shard.ack(jid, lease.token, shard.now)
    assert shard.take()[0].job_id == nxt


def test_a_cancelled_lease_nacked_is_deleted_not_requeued(shard):
    jid = shard.put(b"x", key="k")
    lease = shard.take()[0]
    shard.cancel(jid, shard.now)
    with pytest.raises(Cancelled):
        shard.nack(jid, lease.token, shard.now, delay=5, error="handler saw the cancel")
    assert shard.state.jobs == {}
    with pytest.raises(Cancelled):                           # undelivered release: the same
        jid2 = shard.put(b"y")
        lease2 = shard.take()[0]
        shard.cancel(jid2, shard.now)
        shard.nack(jid2, lease2.token, shard.now, delivered=False)
    assert shard.state.jobs == {}


def test_a_cancelled_lease_that_runs_out_is_deleted_at_its_deadline(shard, clock):
    jid, nxt = shard.put(b"slow", key="k"), shard.put(b"next", key="k")
    lease = shard.take(visibility=10)[0]
    shard.cancel(jid, shard.now)
    for rebuilt in (shard.replayed(), shard.from_checkpoint()):   # the mark is durable
        assert jid in rebuilt.cancelled
        with pytest.raises(Cancelled):
            rebuilt.extend(jid, lease.token, shard.now, 5)
    clock.advance(9)
    assert shard.take() == []
    clock.advance(2)
    got = shard.take()
    assert [l.job_id for l in got] == [nxt]                  # never redelivered; the key moved up
    assert jid not in shard.state.jobs and not shard.state.cancelled
    assert shard.state.queue_metrics(shard.now)["default"]["lease_expiries"] == 1


# ---------------------------------------------------------------------------- purge a queue
EMPTY = {"ready": 0, "delayed": 0, "waiting": 0, "in_flight": 0, "dead": 0, "keys": 0}


def test_purge_queue_deletes_every_live_job_and_keeps_the_dead_letters(shard, clock):
    dead = shard.put(b"poison", key="p")
    for _ in range(3):
        lease = shard.take()[0]
        shard.nack(lease.job_id, lease.token, shard.now, error="boom")
    running = shard.put(b"running", key="k")
    shard.put(b"behind", key="k")                             # waiting behind it
    keyless = shard.put(b"held")
    held = {l.job_id: l for l in shard.take(n=2, visibility=30)}
    assert set(held) == {running, keyless}
    shard.cancel(keyless, shard.now)                          # a lease marked cancelled goes too
    shard.put(b"later", delay=60)
    shard.put(b"later, keyed", key="d", delay=60)
    ready = shard.put(b"ready")
    shard.put(b"elsewhere", queue="other")
    shard.set_progress(running, held[running].token, 0.5, "half", shard.now)
    assert shard.purge_queue("default", shard.now) == 6
    assert shard.state.stats()["default"] == dict(EMPTY, dead=1)
    assert [d.job_id for d in shard.state.dead_letters("default")] == [dead]
    assert not shard.state.cancelled and not shard.state.inflight and not shard.state.progress
    for jid, lease in held.items():                           # their leases are not current any more
        for late in (lambda: shard.ack(jid, lease.token, shard.now),
                     lambda: shard.extend(jid, lease.token, shard.now, 5),
                     lambda: shard.nack(jid, lease.token, shard.now)):
            with pytest.raises(JobGone):
                late()
    assert shard.cancel(ready, shard.now) == "gone"
    records = len(shard.log)
    assert shard.purge_queue("default", shard.now) == 0       # nothing left: nothing logged
    assert len(shard.log) == records
    clock.advance(120)                                        # no lease runs out, no delay comes due
    assert shard.take(n=10) == []
    after = shard.put(b"after", key="k")                      # the key is free
    assert [l.job_id for l in shard.take()] == [after]
    assert [l.body for l in shard.take("other")] == [b"elsewhere"]


def test_a_purge_is_replayed_from_the_log(shard, clock):
    """The purge is one logged operation: replaying the log (a restart) deletes the same
    jobs, and nothing purged comes back when its lease or delay would have ended."""
    shard.put(b"a", key="k"), shard.put(b"b", key="k"), shard.put(b"c", delay=30)
    lease = shard.take(visibility=10)[0]
    shard.purge_queue("default", shard.now)
    assert msgpack.unpackb(shard.log[-1], raw=False) == [[ops.PURGE_QUEUE, "default"]]
    clock.advance(60)
    for rebuilt in (shard.replayed(), shard.from_checkpoint()):
        rebuilt.advance(shard.now)
        assert rebuilt.jobs == {} and rebuilt.dequeue("default", shard.now) == []
        with pytest.raises(JobGone):
            rebuilt.ack(lease.job_id, lease.token, shard.now)


def test_purge_queue_of_a_grouped_queue_frees_its_groups(make_config, clock):
    clock.set(T0)
    s = Shard(make_config(queues={"g": {"group_separator": ":", "group_concurrency": 1}}), clock)
    s.put(b"1", key="a:1", queue="g"), s.put(b"2", key="a:2", queue="g"), s.put(b"3", key="b:1", queue="g")
    assert len(s.take("g", n=10)) == 2                        # one per group
    assert s.purge_queue("g", s.now) == 3
    fresh = s.put(b"4", key="a:3", queue="g")
    assert [l.job_id for l in s.take("g", n=10)] == [fresh]   # group a holds no lease any more
    rebuilt = s.replayed()
    rebuilt.advance(s.now)
    # (the limiter's figures are left out: replay keeps a group's line until a dequeue passes it)
    assert sorted(rebuilt.jobs) == sorted(s.state.jobs) == [fresh]
    assert {k: v for k, v in rebuilt.stats()["g"].items() if k != "limits"} == \
        {k: v for k, v in s.state.stats()["g"].items() if k != "limits"}


def test_purge_queue_validates_the_queue_name(shard, make_config):
    with pytest.raises(InvalidJob):
        shard.purge_queue("", shard.now)
    strict = Shard(make_config(declare_queues=True), shard.clock)
    with pytest.raises(InvalidJob):
        strict.purge_queue("undeclared", shard.now)
    assert strict.log == []


# ---------------------------------------------------------------------------- look-up
def test_job_info_names_state_position_deadline_and_error(shard, clock):
    a, b, c = (shard.put(x, key="k") for x in (b"a", b"b", b"c"))
    d = shard.put(b"d", delay=30)
    info = shard.state.job_info(c)
    assert info["state"] == "waiting" and info["position"] == 2 and info["queue"] == "default"
    assert info["key"] == "k" and info["attempts"] == 0 and info["body"] == b"c"
    assert info["enqueued_at"] == pytest.approx(T0, abs=RESOLUTION_S)
    assert shard.state.job_info(d)["state"] == "delayed"
    assert shard.state.job_info(d)["deadline"] == T0 + 30 and shard.state.job_info(d)["position"] is None
    lease = shard.take()[0]
    info = shard.state.job_info(a)
    assert info["state"] == "leased" and info["deadline"] == lease.deadline and info["attempts"] == 1
    shard.nack(a, lease.token, shard.now, delay=5, error="ValueError: bad")
    info = shard.state.job_info(a)
    assert info["state"] == "delayed" and info["error"] == "ValueError: bad" and info["position"] == 0
    assert shard.state.job_info(b)["position"] == 1
    clock.advance(31)
    lease = shard.take(n=5)[0]
    shard.cancel(lease.job_id, shard.now)
    assert shard.state.job_info(lease.job_id)["cancelled"] is True
    with pytest.raises(NotFound):
        shard.state.job_info(12345 << limits.JOB_ID_SHARD_BITS)
    with pytest.raises(NotFound):
        shard.state.job_info((1 << limits.JOB_ID_SHARD_BITS) | 3)


# ---------------------------------------------------------------------------- dead letters
def _kill(shard, n, queue="default"):
    ids = [shard.put(f"dead {i}".encode(), queue=queue) for i in range(n)]
    for attempt in range(3):
        for lease in shard.take(queue, n=n):
            shard.nack(lease.job_id, lease.token, shard.now, error=f"attempt {attempt + 1} failed")
    assert len(shard.state.queues[queue].dead) == n
    return ids


def test_dead_letters_page_by_cursor_with_their_errors(shard):
    ids = _kill(shard, 25)
    pages, after = [], None
    while True:
        page = shard.state.dead_page("default", after, 10)
        if not page:
            break
        pages.append([d.job_id for d in page])
        after = page[-1].job_id
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [j for p in pages for j in p] == sorted(ids)
    assert shard.state.dead_page("default", None, 1)[0].error == "attempt 3 failed"
    # a redrive between two pages does not shift the cursor
    first = shard.state.dead_page("default", None, 10)
    shard.redrive("default", shard.now, [first[3].job_id])
    assert [d.job_id for d in shard.state.dead_page("default", first[-1].job_id, 10)] == sorted(ids)[10:20]
    with pytest.raises(InvalidJob):
        shard.state.dead_page("default", None, DEAD_PAGE_MAX + 1)
    assert len(shard.state.dead_page("default", None, DEAD_PAGE_MAX)) == 24


def test_a_dead_letter_page_fits_one_reply_frame(shard, monkeypatch):
    """dead_page was cut by count only: 260 dead letters of 256 KiB (or 4 of 16 MiB) made a
    reply past the frame limit, which the client drops with the connection, so a page, the
    console's too, failed or skipped that shard. It now stops where the next letter would
    not fit (the first always does), as dead_letters does."""
    ids = sorted(_kill(shard, 6))
    one = validate.job_bytes(b"dead 0", None, "", error="attempt 3 failed")
    monkeypatch.setattr(limits, "REPLY_BYTES_MAX", 2 * one + 1)  # room for two a page
    pages, after = [], None
    while page := shard.state.dead_page("default", after, 10):
        pages.append([d.job_id for d in page])
        after = page[-1].job_id
    assert pages == [ids[0:2], ids[2:4], ids[4:6]]
    monkeypatch.setattr(limits, "REPLY_BYTES_MAX", 1)  # not even one fits: the first still comes
    assert [d.job_id for d in shard.state.dead_page("default", None, 10)] == ids[:1]


def test_purge_selected_dead_letters_is_idempotent(shard):
    ids = _kill(shard, 4)
    keep = shard.put(b"alive")
    assert shard.purge_ids("default", [ids[0], ids[2], ids[2], keep, 99 << 10], shard.now) == 2
    assert shard.purge_ids("default", [ids[0], ids[2]], shard.now) == 0
    assert sorted(shard.state.queues["default"].dead) == [ids[1], ids[3]]
    assert keep in shard.state.jobs
    with pytest.raises(InvalidJob):
        shard.purge_ids("default", list(range(limits.BATCH_JOBS_MAX + 1)), shard.now)
    assert shard.purge_ids("default", [ids[1]] * limits.BATCH_JOBS_MAX, shard.now) == 1


# ---------------------------------------------------------------------------- figures
def test_every_way_to_the_dead_letters_and_out_of_the_queue_is_counted(shard):
    """A job buried by its worker (a task's Fail, an unknown task) was dead-lettered
    without a count: dead_lettered_total and its alert missed most task dead letters. And a
    purge deleted jobs no counter told of. Both count now (``purged``: of the queue, of all
    its dead letters, of chosen ones)."""
    for i in range(6):
        shard.put(b"j%d" % i, key=f"k{i}", queue="q")
    a, b, c = shard.take(queue="q", n=3)
    for lease in (a, b, c):
        shard.bury(lease.job_id, lease.token, shard.now, "failed for good")
    assert shard.state.queue_metrics(shard.now)["q"]["dead_lettered"] == 3
    assert shard.purge_ids("q", [a.job_id], shard.now) == 1
    assert shard.purge_dead("q", shard.now) == 2
    assert shard.purge_queue("q", shard.now) == 3
    m = shard.state.queue_metrics(shard.now)["q"]
    assert (m["dead_lettered"], m["purged"]) == (3, 6)


def test_counters_count_this_process_only(shard, clock):
    jid = shard.put(b"a", key="k")
    shard.put(b"b", key="k")
    shard.put(b"dup", queue="default")
    lease = shard.take()[0]
    shard.nack(lease.job_id, lease.token, shard.now)
    lease = shard.take(visibility=1)[0]
    clock.advance(2)
    lease = shard.take()[0]
    shard.ack(lease.job_id, lease.token, shard.now)
    _kill(shard, 1, queue="other")
    shard.redrive("other", shard.now)
    c = shard.put(b"c")
    shard.cancel(c, shard.now)
    m = shard.state.queue_metrics(shard.now)["default"]
    assert {k: m[k] for k in ("enqueued", "leased", "acked", "nacked", "lease_expiries", "cancelled")} == \
        {"enqueued": 4, "leased": 3, "acked": 1, "nacked": 1, "lease_expiries": 1, "cancelled": 1}
    o = shard.state.queue_metrics(shard.now)["other"]
    assert (o["dead_lettered"], o["redriven"], o["nacked"]) == (1, 1, 3)
    assert jid not in shard.state.jobs
    assert shard.replayed().queue_metrics(shard.now)["default"]["enqueued"] == 0  # not logged


def test_oldest_ready_age_follows_the_first_job_in_line(shard, clock):
    assert shard.state.queue_metrics(shard.now) == {}
    shard.put(b"old")
    clock.advance(10)
    shard.put(b"new")
    shard.put(b"later", delay=5)
    age = shard.state.queue_metrics(shard.now)["default"]["oldest_ready_age_s"]
    assert 10 <= age < 10 + RESOLUTION_S
    clock.advance(20)                                        # the delayed job is due since 15 s
    shard.advance(shard.now)
    assert 30 <= shard.state.queue_metrics(shard.now)["default"]["oldest_ready_age_s"] < 31
    lease = shard.take()[0]                                  # "old" leaves the line
    assert lease.body == b"old"
    assert 20 <= shard.state.queue_metrics(shard.now)["default"]["oldest_ready_age_s"] < 21
    shard.pause("default", shard.now)                        # paused: still ready, still ageing
    clock.advance(100)
    m = shard.state.queue_metrics(shard.now)["default"]
    assert m["paused"] is True and m["paused_at"] == T0 + 30
    assert 120 <= m["oldest_ready_age_s"] < 121
    shard.resume("default", shard.now)
    for l in shard.take(n=10):
        shard.ack(l.job_id, l.token, shard.now)
    assert shard.state.queue_metrics(shard.now)["default"]["oldest_ready_age_s"] is None
    for rebuilt in (shard.replayed(), shard.from_checkpoint()):
        assert rebuilt.enqueue_times.seqs == shard.state.enqueue_times.seqs


def test_enqueue_times_are_bounded_and_never_late():
    t = EnqueueTimes()
    truth = {}
    at = 0.0
    for seq in range(0, 50 * SAMPLES_MAX, 7):
        at += 0.4
        truth[seq] = at
        t.note(seq, at)
    assert len(t.seqs) <= SAMPLES_MAX
    recent = max(truth) - 100
    for seq, when in truth.items():
        est = t.at(seq)
        assert est <= when
        if seq > recent:
            assert when - est < RESOLUTION_S + 0.4
    assert t.at(-1) is None
    t.note(10**9, 1.0)                                       # a clock that steps back is ignored
    assert t.seqs[-1] != 10**9 and t.at(10**9) == t.times[-1]


def test_a_log_from_before_control_ops_still_replays(make_config, clock):
    """Logs written before issue 12 have no PAUSE/CANCEL/ENQUEUE_TIMES: they replay, and
    jobs of a checkpoint without the samples have no enqueue time (no age), not a wrong one."""
    s = ShardState(0, make_config())
    s.apply([ops.META, 5, 1])
    s.apply([ops.JOB, 1 << 10, "default", None, b"old", 0, 0, 0, 2, 0, 0.0, None])
    s.apply([ops.ENQUEUE, 5 << 10, "default", "k", b"new", 0, 0, None, T0])
    s.advance(T0 + 3)
    assert s.job_info(1 << 10)["enqueued_at"] is None
    assert s.job_info(5 << 10)["enqueued_at"] == T0
    assert 3 <= s.queue_metrics(T0 + 3)["default"]["oldest_ready_age_s"] < 4
