"""The queue's semantics, one contract suite run against two implementations:

* ``state``: the pure :class:`ShardState` with an in-memory log (the operations it emits,
  msgpack round-tripped); "reopen" replays that log into a new state;
* ``engine``: :class:`Engine` on a real directory (one fsync per call); "reopen" closes it
  and opens a new one on the same directory.

After every test the fixture checks recovery: the state rebuilt from the log (and, for the
engine, from a checkpoint after compaction) equals the live one.
"""
from __future__ import annotations

import math

import msgpack
import pytest

from shardq import limits
from shardq.errors import InvalidJob, JobGone, LeaseLost, NotFound, QueueFull, UnknownQueue
from shardq.shard import ops
from shardq.shard.durable import Engine
from shardq.shard.state import ShardState

T0 = 1_000_000.0


# ---------------------------------------------------------------------------- harness
class StateShard:
    """ShardState + FakeClock + a list of committed records, with Engine's call signatures."""

    kind = "state"

    def __init__(self, config, clock):
        self.config = config
        self.clock = clock
        self.state = ShardState(0, config)
        self.log: list[bytes] = []
        self.check_on_teardown = True

    def _run(self, fn, *args):
        try:
            return fn(*args)
        finally:
            produced = self.state.take_ops()
            if produced:
                self.log.append(msgpack.packb(produced))

    def enqueue(self, body, key=None, queue="default", delay=0.0, priority=0, dedup_id=None):
        return self._run(self.state.enqueue, body, self.clock.now(), key, queue, delay, priority, dedup_id)

    def enqueue_many(self, items, session=None):
        return self._run(self.state.enqueue_many, items, self.clock.now(), session)

    def dequeue(self, queue="default", visibility=None, max_jobs=1):
        return self._run(self.state.dequeue, queue, self.clock.now(), visibility, max_jobs)

    def ack(self, job_id, token):
        return self._run(self.state.ack, job_id, token, self.clock.now())

    def nack(self, job_id, token, delay=0.0, error=None, delivered=True):
        return self._run(self.state.nack, job_id, token, self.clock.now(), delay, error, delivered)

    def extend(self, job_id, token, seconds):
        return self._run(self.state.extend, job_id, token, self.clock.now(), seconds)

    def bury(self, job_id, token, error=None):
        return self._run(self.state.bury, job_id, token, self.clock.now(), error)

    def redrive(self, queue="default", job_ids=None):
        return self._run(self.state.redrive, queue, self.clock.now(), job_ids)

    def dead_letters(self, queue="default", limit=1000):
        return self.state.dead_letters(queue, limit)

    def stats(self):
        self._run(self.state.advance, self.clock.now())
        return self.state.stats()

    def durable_size(self):
        return len(self.log)

    def replayed(self, config=None) -> ShardState:
        fresh = ShardState(0, config or self.config)
        for record in self.log:
            for op in msgpack.unpackb(record, raw=False):
                fresh.apply(op)
        return fresh

    def reopen(self, config=None):
        self.config = config or self.config
        self.state = self.replayed(self.config)

    def check_recovery(self, digest):
        self.stats()
        live = digest(self.state)
        now = self.clock.now()
        replayed = self.replayed()
        replayed.advance(now)
        assert digest(replayed) == live, "replaying the log does not rebuild the state"
        from_checkpoint = ShardState(0, self.config)
        for record in self.state.snapshot(chunk_bytes=300):
            for op in msgpack.unpackb(record, raw=False):
                from_checkpoint.apply(op)
        from_checkpoint.advance(now)
        assert digest(from_checkpoint) == live, "the checkpoint does not rebuild the state"


class EngineShard:
    kind = "engine"

    def __init__(self, config, clock, directory):
        self.config = config
        self.clock = clock
        self.directory = directory
        self.engine = Engine(directory, config, clock=clock)
        self.check_on_teardown = True

    def __getattr__(self, name):  # enqueue, dequeue, ack, ... as Engine has them
        return getattr(self.engine, name)

    @property
    def state(self):
        return self.engine.state

    def durable_size(self):
        log = self.engine.shard.log
        return (tuple(log.segments), log.writer.size)

    def reopen(self, config=None):
        self.config = config or self.config
        self.engine.close()
        self.engine = Engine(self.directory, self.config, clock=self.clock)

    def check_recovery(self, digest):
        self.engine.stats()
        live = digest(self.engine.state)
        self.reopen()
        self.engine.stats()
        assert digest(self.engine.state) == live, "reopening the engine does not rebuild the state"
        self.engine.compact()
        self.reopen()
        self.engine.stats()
        assert digest(self.engine.state) == live, "reopening after compaction does not rebuild the state"
        self.engine.close()


@pytest.fixture(params=["state", "engine"])
def make_shard(request, tmp_path, clock, make_config, digest):
    made = []

    def make(**cfg):
        config = make_config(**cfg)
        if request.param == "state":
            shard = StateShard(config, clock)
        else:
            shard = EngineShard(config, clock, str(tmp_path / f"shard{len(made)}"))
        made.append(shard)
        return shard

    yield make
    for shard in made:
        if shard.check_on_teardown:
            shard.check_recovery(digest)


@pytest.fixture
def shard(make_shard):
    return make_shard()


def ids(leases):
    return [lease.job_id for lease in leases]


# ---------------------------------------------------------------------------- basics
def test_happy_path(shard):
    jid = shard.enqueue(b"hello", key="k")
    [lease] = shard.dequeue()
    assert (lease.job_id, lease.body, lease.key, lease.queue, lease.attempt) == (jid, b"hello", "k", "default", 1)
    assert lease.deadline == T0 + limits.VISIBILITY_TIMEOUT_S_DEFAULT
    assert shard.stats()["default"]["in_flight"] == 1
    shard.ack(jid, lease.token)
    assert shard.dequeue() == []
    assert shard.stats()["default"] == {"ready": 0, "delayed": 0, "waiting": 0, "in_flight": 0,
                                        "dead": 0, "keys": 0}


def test_lease_expiry_redelivers_the_same_job_as_attempt_2(shard, clock):
    jid = shard.enqueue(b"x")
    [first] = shard.dequeue(visibility=10)
    clock.advance(10.5)
    [second] = shard.dequeue(visibility=10)
    assert second.job_id == jid and second.body == b"x"
    assert (first.attempt, second.attempt) == (1, 2)
    assert second.token != first.token
    with pytest.raises(LeaseLost):
        shard.ack(jid, first.token)
    shard.ack(jid, second.token)


def test_a_redelivered_keyless_job_goes_to_the_back_a_keyed_one_keeps_its_place(shard, clock):
    """guarantees.md, "Per-key FIFO": keyless jobs are FIFO within a priority only until a
    redelivery; a keyed job stays the head of its key."""
    a = shard.enqueue(b"a")
    b = shard.enqueue(b"b")
    [lease] = shard.dequeue(visibility=10)
    assert lease.job_id == a
    clock.advance(10.5)  # expired: ready again, behind b
    got = [l.job_id for l in shard.dequeue(max_jobs=2)]
    assert got == [b, a]
    k1 = shard.enqueue(b"k1", key="k", queue="keyed")
    k2 = shard.enqueue(b"k2", key="k", queue="keyed")
    [lease] = shard.dequeue(queue="keyed")
    shard.nack(k1, lease.token)
    assert [l.job_id for l in shard.dequeue(queue="keyed")] == [k1]
    assert k2 != k1


def test_no_double_delivery_while_leased(shard, clock):
    shard.enqueue(b"only")
    [lease] = shard.dequeue(visibility=10)
    assert shard.dequeue(max_jobs=10) == []
    clock.advance(9.999)
    assert shard.dequeue(max_jobs=10) == []
    assert shard.stats()["default"]["in_flight"] == 1


def test_the_lease_deadline_itself_is_already_expired(shard, clock):
    """Document-by-test: at ``now == deadline`` the lease is over: extend refused, the job
    ready again and redelivered. Until it is, an ack with that lease's token still deletes
    it; once it is, the old token is fenced."""
    a = shard.enqueue(b"a")
    b = shard.enqueue(b"b")
    la, lb = shard.dequeue(visibility=10, max_jobs=2)
    clock.set(la.deadline)
    assert shard.stats()["default"]["ready"] == 2
    with pytest.raises(LeaseLost):
        shard.extend(a, la.token, 30)
    shard.ack(b, lb.token)                       # nothing leased b again: deleted
    [again] = shard.dequeue()
    assert (again.job_id, again.attempt) == (a, 2)
    with pytest.raises(LeaseLost):
        shard.ack(a, la.token)
    shard.ack(a, again.token)


def test_ack_after_the_deadline_deletes_the_job_if_not_redelivered(shard, clock, digest):
    """As SQS's DeleteMessage with the most recent receipt handle: an ack with the job's
    latest token deletes it even after the deadline, while nothing leased it again
    (tests/shard/test_late_ack.py). A nack or extend still needs the live lease."""
    jid = shard.enqueue(b"x")
    [lease] = shard.dequeue(visibility=5)
    clock.advance(6)
    for call in (lambda: shard.nack(jid, lease.token), lambda: shard.extend(jid, lease.token, 30)):
        with pytest.raises(LeaseLost):
            call()
    shard.ack(jid, lease.token)
    assert shard.dequeue() == []
    assert shard.stats()["default"] == {"ready": 0, "delayed": 0, "waiting": 0, "in_flight": 0,
                                        "dead": 0, "keys": 0}


def test_stale_tokens_are_rejected_and_change_nothing(shard, clock, digest):
    jid = shard.enqueue(b"x", key="k")
    [old] = shard.dequeue(visibility=5)
    clock.advance(5)
    [new] = shard.dequeue(visibility=30)
    shard.stats()
    before, size = digest(shard.state), shard.durable_size()
    for token in (old.token, new.token + 1000, 0):
        for call in (lambda: shard.ack(jid, token), lambda: shard.nack(jid, token, 3, "e"),
                     lambda: shard.extend(jid, token, 60)):
            with pytest.raises(LeaseLost):
                call()
    assert digest(shard.state) == before and shard.durable_size() == size
    # The current lease still works after all that.
    assert shard.extend(jid, new.token, 60) == clock.now() + 60
    shard.ack(jid, new.token)
    with pytest.raises(JobGone):  # acked: a retried ack learns its first attempt won
        shard.ack(jid, new.token)


def test_extend_moves_the_deadline(shard, clock):
    jid = shard.enqueue(b"x")
    [lease] = shard.dequeue(visibility=10)
    clock.advance(8)
    assert shard.extend(jid, lease.token, 10) == T0 + 18
    clock.advance(5)  # past the original deadline
    assert shard.dequeue() == []
    shard.ack(jid, lease.token)


# ---------------------------------------------------------------------------- keys and order
def test_per_key_order_with_one_in_flight_many_keys_interleaved(shard):
    keys = [f"k{i}" for i in range(8)]
    expected = {k: [] for k in keys}
    for n in range(4):
        for k in keys:
            expected[k].append(shard.enqueue(f"{k}-{n}".encode(), key=k))
    for n in range(4):
        batch = shard.dequeue(max_jobs=100)
        assert sorted(lease.key for lease in batch) == sorted(keys), "exactly one lease per key"
        for lease in batch:
            assert lease.job_id == expected[lease.key][n]
        assert shard.dequeue(max_jobs=100) == []
        for lease in reversed(batch):
            shard.ack(lease.job_id, lease.token)
    assert shard.dequeue(max_jobs=100) == []


def test_a_leased_head_blocks_its_key_until_settled(shard, clock):
    a = shard.enqueue(b"a", key="k")
    b = shard.enqueue(b"b", key="k")
    [la] = shard.dequeue(visibility=10)
    assert la.job_id == a and shard.dequeue() == []
    assert shard.stats()["default"]["waiting"] == 1
    shard.nack(a, la.token)  # released: still the head
    [la2] = shard.dequeue()
    assert (la2.job_id, la2.attempt) == (a, 2)
    shard.ack(a, la2.token)
    assert ids(shard.dequeue()) == [b]


def test_keyless_jobs_are_independent(shard):
    jids = [shard.enqueue(f"{i}".encode()) for i in range(5)]
    batch = shard.dequeue(max_jobs=10)
    assert ids(batch) == jids  # all at once, FIFO within one priority
    shard.ack(batch[3].job_id, batch[3].token)
    shard.nack(batch[1].job_id, batch[1].token)
    assert ids(shard.dequeue(max_jobs=10)) == [jids[1]]


def test_a_long_backlog_under_one_key_never_hides_other_keys(shard):
    shard.enqueue_many([(b"hot", "hot", "default", 0, 0, None)] * 5000)
    cold = shard.enqueue(b"cold", key="cold")
    got = shard.dequeue(max_jobs=10)
    assert len(got) == 2 and got[1].job_id == cold


def test_delayed_job_is_invisible_until_due(shard, clock):
    jid = shard.enqueue(b"later", delay=10)
    assert shard.stats()["default"]["delayed"] == 1
    clock.advance(9.999)
    assert shard.dequeue() == []
    clock.set(T0 + 10)
    assert ids(shard.dequeue()) == [jid]


def test_a_delayed_head_holds_back_its_key(shard, clock):
    a = shard.enqueue(b"a", key="k", delay=10)
    b = shard.enqueue(b"b", key="k")
    other = shard.enqueue(b"o", key="other")
    assert ids(shard.dequeue(max_jobs=10)) == [other]
    clock.advance(10)
    [la] = shard.dequeue(max_jobs=10)
    assert la.job_id == a
    shard.ack(a, la.token)
    assert ids(shard.dequeue()) == [b]


def test_nack_with_delay_moves_the_job_to_delayed_not_a_long_lease(shard, clock):
    """A retry delay longer than the visibility timeout never causes an early redelivery."""
    a = shard.enqueue(b"a", key="k")
    b = shard.enqueue(b"b", key="k")
    [la] = shard.dequeue(visibility=5)
    shard.nack(a, la.token, delay=60, error="retry later")
    st = shard.stats()["default"]
    assert (st["delayed"], st["in_flight"], st["waiting"]) == (1, 0, 1)
    with pytest.raises(LeaseLost):
        shard.ack(a, la.token)
    clock.advance(59)  # far past the 5 s visibility: nothing, and b stays behind a
    assert shard.dequeue(max_jobs=10) == []
    clock.advance(1)
    [again] = shard.dequeue(max_jobs=10)
    assert (again.job_id, again.attempt) == (a, 2)
    shard.ack(a, again.token)
    assert ids(shard.dequeue()) == [b]


def test_priorities_higher_first_across_keys(shard):
    low = shard.enqueue(b"low", priority=1)
    high = shard.enqueue(b"high", key="x", priority=9)
    mid = shard.enqueue(b"mid", key="y", priority=5)
    neg = shard.enqueue(b"neg", priority=-3)
    mid2 = shard.enqueue(b"mid2", priority=5)
    assert ids(shard.dequeue(max_jobs=10)) == [high, mid, mid2, low, neg]


def test_fifo_within_a_key_wins_over_priority(shard):
    """Document-by-test: a high-priority job behind a low-priority head of its key waits."""
    head = shard.enqueue(b"head", key="k", priority=0)
    urgent = shard.enqueue(b"urgent", key="k", priority=100)
    keyless = shard.enqueue(b"keyless", priority=5)
    batch = shard.dequeue(max_jobs=10)
    assert ids(batch) == [keyless, head]
    shard.ack(head, batch[1].token)
    assert ids(shard.dequeue()) == [urgent]


# ---------------------------------------------------------------------------- dead letters
def test_dead_letter_after_max_deliveries_by_expiry(make_shard, clock):
    s = make_shard(max_deliveries=3)
    jid = s.enqueue(b"poison", key="k")
    for attempt in (1, 2, 3):
        [lease] = s.dequeue(visibility=1)
        assert lease.attempt == attempt
        clock.advance(1)
    assert s.dequeue() == []
    [dl] = s.dead_letters()
    assert (dl.job_id, dl.body, dl.key, dl.attempts) == (jid, b"poison", "k", 3)
    assert "expired" in dl.error
    assert s.stats()["default"]["dead"] == 1


def test_dead_letter_via_nack_keeps_the_error(make_shard):
    s = make_shard(max_deliveries=2)
    jid = s.enqueue(b"bad")
    [l1] = s.dequeue()
    s.nack(jid, l1.token, error="first")
    [l2] = s.dequeue()
    s.nack(jid, l2.token, delay=30, error="boom")  # the last allowed delivery: no retry
    assert s.dequeue() == []
    [dl] = s.dead_letters()
    assert (dl.job_id, dl.attempts, dl.error) == (jid, 2, "boom")


def test_bury_dead_letters_at_once_whatever_the_count_and_unblocks_the_key(make_shard, digest):
    s = make_shard(max_deliveries=5)
    a = s.enqueue(b"a", key="k")
    b = s.enqueue(b"b", key="k")
    [la] = s.dequeue()
    before = digest(s.state)
    with pytest.raises(LeaseLost):
        s.bury(a, la.token + 1, "wrong token")
    assert digest(s.state) == before  # refused: nothing changed
    s.bury(a, la.token, "Fail: no such user")
    [dl] = s.dead_letters()
    assert (dl.job_id, dl.attempts, dl.error) == (a, 1, "Fail: no such user")
    assert ids(s.dequeue()) == [b]  # the key moved on
    with pytest.raises(LeaseLost):
        s.bury(a, la.token)  # no live lease any more
    assert s.redrive() == 1


def test_redrive_returns_count_and_restarts_attempts(make_shard, clock):
    s = make_shard(max_deliveries=1)
    a = s.enqueue(b"a", key="k")
    b = s.enqueue(b"b")
    for lease in s.dequeue(max_jobs=10):
        s.nack(lease.job_id, lease.token, error="nope")
    assert {d.job_id for d in s.dead_letters()} == {a, b}
    assert s.redrive(job_ids=[b]) == 1
    assert [d.job_id for d in s.dead_letters()] == [a]
    assert s.redrive() == 1
    assert s.dead_letters() == []
    batch = s.dequeue(max_jobs=10)
    assert sorted(ids(batch)) == sorted([a, b]) and {x.attempt for x in batch} == {1}


def test_redrive_goes_to_the_tail_of_its_key(make_shard):
    s = make_shard(max_deliveries=1)
    a = s.enqueue(b"a", key="k")
    [la] = s.dequeue()
    b = s.enqueue(b"b", key="k")
    s.nack(a, la.token)  # dead: b is the head now
    assert s.redrive() == 1
    [lb] = s.dequeue()
    assert lb.job_id == b
    s.ack(b, lb.token)
    assert ids(s.dequeue()) == [a]


def test_dead_lettering_a_head_unblocks_its_key(make_shard, clock):
    s = make_shard(max_deliveries=1)
    a = s.enqueue(b"a", key="k")
    b = s.enqueue(b"b", key="k")
    [la] = s.dequeue(visibility=3)
    clock.advance(3)  # expired on its last allowed delivery
    assert ids(s.dequeue()) == [b]
    assert [d.job_id for d in s.dead_letters()] == [a]


def test_redrive_of_unknown_ids_is_rejected_whole(make_shard, digest):
    s = make_shard(max_deliveries=1)
    a = s.enqueue(b"a")
    [la] = s.dequeue()
    s.nack(a, la.token)
    live = s.enqueue(b"live")
    s.stats()
    before = digest(s.state)
    for bad in ([a, live], [a, 999 << limits.JOB_ID_SHARD_BITS]):
        with pytest.raises(NotFound):
            s.redrive(job_ids=bad)
    assert digest(s.state) == before


def test_redrive_with_a_repeated_id_moves_it_once(make_shard):
    """Regression: a repeated id once applied REDRIVE twice (KeyError half-way)."""
    s = make_shard(max_deliveries=1)
    a = s.enqueue(b"a")
    [la] = s.dequeue()
    s.nack(a, la.token)
    assert s.redrive(job_ids=[a, a]) == 1
    assert s.dead_letters() == [] and ids(s.dequeue()) == [a]


def test_lowered_max_deliveries_after_a_restart(make_shard, make_config):
    """Regression: a ready job over a (lowered) ``max_deliveries`` is dead-lettered inside
    ``dequeue``, promoting the next job of its key; when that one had a higher priority,
    ``prios.pop(0)`` removed the wrong priority (KeyError, job stranded)."""
    s = make_shard(max_deliveries=5)
    j = s.enqueue(b"j", key="k", priority=0)
    k = s.enqueue(b"k", key="k", priority=5)
    for _ in range(2):
        [lease] = s.dequeue()
        s.nack(j, lease.token)
    s.reopen(make_config(max_deliveries=1))
    assert ids(s.dequeue()) == [k]
    assert [d.job_id for d in s.dead_letters()] == [j]


# ---------------------------------------------------------------------------- dedup and sessions
def test_dedup_within_the_window_returns_the_first_id(make_shard, clock):
    s = make_shard(dedup_window=100)
    first = s.enqueue(b"1", key="k", dedup_id="d")
    clock.advance(50)
    assert s.enqueue(b"2", key="k", dedup_id="d") == first
    assert s.stats()["default"]["ready"] + s.stats()["default"]["waiting"] == 1
    [lease] = s.dequeue()
    s.ack(first, lease.token)
    # Document-by-test: the window runs from the first enqueue, whatever became of the job.
    assert s.enqueue(b"3", key="k", dedup_id="d") == first
    assert s.dequeue() == []


def test_dedup_is_scoped_per_key_and_per_queue(make_shard):
    s = make_shard(dedup_window=100)
    a = s.enqueue(b"a", key="k1", dedup_id="d")
    b = s.enqueue(b"b", key="k2", dedup_id="d")
    c = s.enqueue(b"c", dedup_id="d")
    d = s.enqueue(b"d", queue="other", dedup_id="d")
    assert len({a, b, c, d}) == 4
    assert s.enqueue(b"again", dedup_id="d") == c
    assert s.enqueue(b"again", queue="other", dedup_id="d") == d
    assert s.enqueue(b"again", key="k2", dedup_id=b"d") != b  # bytes and str ids differ


def test_dedup_expires_after_the_window(make_shard, clock):
    s = make_shard(dedup_window=100)
    first = s.enqueue(b"1", dedup_id="d")
    clock.advance(99.5)
    assert s.enqueue(b"1", dedup_id="d") == first
    clock.set(T0 + 100)  # document-by-test: at exactly created + window it is a new job
    second = s.enqueue(b"2", dedup_id="d")
    assert second != first
    assert len(s.dequeue(max_jobs=10)) == 2


def test_dedup_within_one_batch(make_shard):
    s = make_shard(dedup_window=100)
    got = s.enqueue_many([(b"a", None, "default", 0, 0, "x"), (b"b", None, "default", 0, 0, "x"),
                          (b"c", None, "default", 0, 0, None)])
    assert got[0] == got[1] != got[2]
    assert len(s.dequeue(max_jobs=10)) == 2


def test_dedup_ids_at_max_dedup_ids_refuse_a_new_one_and_still_answer_a_resend(make_shard, clock):
    """Each dedup id is kept for its window, acked or not: past ``max_dedup_ids`` a batch that
    would add one more is refused whole (QueueFull), a resend of a kept id is answered as
    ever, a job without a dedup id is taken, and ids whose window ended make room again."""
    s = make_shard(dedup_window=100, max_dedup_ids=1000)
    first = s.enqueue_many([(b"x", f"k{i % 7}", "default", 0, 0, f"d{i}") for i in range(1000)])
    jobs = len(s.state.jobs)
    with pytest.raises(QueueFull, match="holds 1000 dedup ids"):
        s.enqueue_many([(b"y", None, "default", 0, 0, None), (b"z", None, "default", 0, 0, "new")])
    assert len(s.state.jobs) == jobs  # the batch added nothing
    assert s.enqueue_many([(b"again", "k3", "default", 0, 0, "d3")]) == [first[3]]  # a resend, at the limit
    assert len(s.enqueue_many([(b"plain", None, "default", 0, 0, None)])) == 1
    clock.advance(99)
    with pytest.raises(QueueFull):
        s.enqueue(b"z", dedup_id="new")
    clock.advance(1)  # every window has ended: room again, counted after dropping them
    assert s.enqueue(b"z", dedup_id="new") not in first
    assert s.state.dedup_held == 1


def test_session_retry_returns_the_same_ids(shard):
    items = [(b"a", "k", "default", 0, 0, None), (b"b", None, "default", 0, 0, None)]
    first = shard.enqueue_many(items, session=(7, 1, 1))
    assert shard.enqueue_many(items, session=(7, 1, 1)) == first
    assert shard.stats()["default"]["ready"] == 2
    other_client = shard.enqueue_many(items, session=(8, 1, 1))
    assert set(other_client).isdisjoint(first)
    second = shard.enqueue_many(items[:1], session=(7, 2, 1))
    assert shard.enqueue_many(items[:1], session=(7, 1, 1)) == first  # seq 1 still kept (low=1)
    assert shard.enqueue_many(items[:1], session=(7, 2, 2)) == second
    # low=2 pruned seq 1: the router promises not to retry it; a late retry runs again.
    again = shard.enqueue_many(items[:1], session=(7, 1, 2))
    assert again != first[:1]


class _CountingSeqs(dict):
    """A session's seqs that count every key an iteration over them yields."""

    looked = 0

    def __iter__(self):
        for key in dict.__iter__(self):
            _CountingSeqs.looked += 1
            yield key


def test_a_session_prunes_from_its_oldest_and_stops_at_the_first_still_open(shard):
    """Found at the shards' sockets: each enqueue (and its replay) walked every seq of its
    client's session to prune those below ``low``: a client whose ``low`` never advanced
    made enqueues 8 us -> 1.6 ms and a replay of 60,000 take 38 s (quadratic). It looks at
    the oldest ones only, and stops at the first still open."""
    items = [(b"a", None, "default", 0, 0, None)]
    shard.enqueue_many(items, session=(9, 1, 1))
    shard.state.sessions[9][1] = seqs = _CountingSeqs(shard.state.sessions[9][1])
    _CountingSeqs.looked = 0
    n = 2_000
    for seq in range(2, n + 2):  # low stuck at 1: nothing is pruned
        shard.enqueue_many(items, session=(9, seq, 1))
    assert len(seqs) == n + 1 and _CountingSeqs.looked <= 2 * n  # (was n * n / 2: 2,000,000)
    for seq in range(n + 2, n + 12):  # low follows: every older seq goes
        shard.enqueue_many(items, session=(9, seq, seq))
    assert list(seqs) == [n + 11]


def test_sessions_expire_after_their_ttl(shard, clock):
    items = [(b"a", None, "default", 0, 0, None)]
    first = shard.enqueue_many(items, session=(7, 1, 1))
    clock.advance(limits.CLIENT_SESSION_TTL_S + 1)
    assert shard.enqueue_many(items, session=(7, 1, 1)) != first


def test_a_client_seen_again_keeps_its_session_and_the_others_still_expire_on_time(shard, clock):
    # advance() looks at sessions only when the oldest one comes due: a client seen again
    # moves to the back, and the next one in line must still expire at its own TTL.
    items = [(b"a", None, "default", 0, 0, None)]
    first = shard.enqueue_many(items, session=(7, 1, 1))
    clock.advance(1)
    second = shard.enqueue_many(items, session=(8, 1, 1))
    clock.advance(limits.CLIENT_SESSION_TTL_S - 2)
    shard.enqueue_many(items, session=(7, 2, 1))  # client 7 seen again: kept
    clock.advance(3)  # client 8 is now past its TTL, client 7 is not
    assert shard.enqueue_many(items, session=(7, 1, 1)) == first
    assert shard.enqueue_many(items, session=(8, 1, 1)) != second


def test_client_sessions_at_their_count_limit_forget_the_least_recently_seen(shard, clock):
    """CLIENT_SESSIONS_MAX clients are remembered; past it the least recently seen one is
    forgotten (a resend of its would be a new job), never one seen later."""
    items = [(b"a", None, "default", 0, 0, None)]
    first = shard.enqueue_many(items, session=(1, 1, 1))
    now = clock.now()
    for cid in range(2, limits.CLIENT_SESSIONS_MAX + 1):  # logged with the next call, as enqueues would be
        shard.state._emit(ops.Session(cid, 1, 1, [cid << 10], now))
    shard.state.advance(now)
    assert len(shard.state.sessions) == limits.CLIENT_SESSIONS_MAX  # at the limit: every one kept
    assert shard.enqueue_many(items, session=(2, 1, 1)) == [2 << 10]  # client 2 seen again: now the newest
    shard.enqueue_many(items, session=(limits.CLIENT_SESSIONS_MAX + 1, 1, 1))  # one client more
    shard.state.advance(clock.now())
    assert len(shard.state.sessions) == limits.CLIENT_SESSIONS_MAX
    assert 1 not in shard.state.sessions and 2 in shard.state.sessions and 3 in shard.state.sessions
    assert shard.enqueue_many(items, session=(2, 1, 1)) == [2 << 10]
    assert shard.enqueue_many(items, session=(1, 1, 1)) != first


def test_a_session_of_any_integer_kind_or_a_bad_one_is_checked_like_before(shard):
    items = [(b"a", None, "default", 0, 0, None)]
    for bad in [(7, -1, 1), (7, 1, True), (7, 1, 2**63), (2**63, 1, 1), (7, -2**63, 1), (7, "1", 1), (7, 1),
                None.__class__]:
        with pytest.raises(InvalidJob):
            shard.enqueue_many(items, session=bad)
    top = 2**63 - 1  # each at its largest: accepted, and answered again as the same request
    at_top = shard.enqueue_many(items, session=(top, top, top))
    assert shard.enqueue_many(items, session=(top, top, top)) == at_top

    class Seq(int):
        pass
    first = shard.enqueue_many(items, session=(Seq(9), Seq(1), Seq(1)))
    assert shard.enqueue_many(items, session=(9, 1, 1)) == first


# ---------------------------------------------------------------------------- bad input
BODY_MAX = 1024


def _setup_for_bad_input(make_shard):
    s = make_shard(declare_queues=True, max_body_bytes=BODY_MAX,
                   queues={"default": {}, "other": {}})
    ctx = {}
    ctx["a"] = s.enqueue(b"a", key="k")
    ctx["b"] = s.enqueue(b"b", key="k")
    ctx["c"] = s.enqueue(b"c")
    [ctx["lease"]] = s.dequeue()
    ctx["d"] = s.enqueue(b"d", key="j")
    return s, ctx


def enq(**kw):
    return lambda s, ctx: s.enqueue(**{"body": b"ok", **kw})


NAN, INF = math.nan, math.inf
OK_ITEM = (b"ok", None, "default", 0, 0, None)
BAD_INPUT = [
    ("body str", enq(body="text"), InvalidJob),
    ("body int", enq(body=123), InvalidJob),
    ("body None", enq(body=None), InvalidJob),
    ("body empty", enq(body=b""), InvalidJob),
    ("body oversized", enq(body=b"x" * (BODY_MAX + 1)), InvalidJob),
    ("key int", enq(key=5), InvalidJob),
    ("key bytes", enq(key=b"k"), InvalidJob),
    ("key empty", enq(key=""), InvalidJob),
    ("key oversized", enq(key="k" * (limits.KEY_BYTES_MAX + 1)), InvalidJob),
    ("key oversized utf8", enq(key="\u00e9" * (limits.KEY_BYTES_MAX // 2 + 1)), InvalidJob),
    ("delay negative", enq(delay=-1), InvalidJob),
    ("delay NaN", enq(delay=NAN), InvalidJob),
    ("delay inf", enq(delay=INF), InvalidJob),
    ("delay str", enq(delay="5"), InvalidJob),
    ("delay bool", enq(delay=True), InvalidJob),
    ("delay too long", enq(delay=limits.DELAY_S_MAX * 2), InvalidJob),
    ("priority bool", enq(priority=True), InvalidJob),
    ("priority float", enq(priority=1.5), InvalidJob),
    ("priority str", enq(priority="3"), InvalidJob),
    ("priority too high", enq(priority=limits.PRIORITY_MAX + 1), InvalidJob),
    ("priority too low", enq(priority=limits.PRIORITY_MIN - 1), InvalidJob),
    ("queue int", enq(queue=5), InvalidJob),
    ("queue empty", enq(queue=""), InvalidJob),
    ("queue name too long", enq(queue="q" * (limits.QUEUE_NAME_BYTES_MAX + 1)), InvalidJob),
    ("queue undeclared", enq(queue="nope"), UnknownQueue),
    ("dedup_id int", enq(dedup_id=5), InvalidJob),
    ("dedup_id empty", enq(dedup_id=""), InvalidJob),
    ("dedup_id too long", enq(dedup_id="d" * (limits.DEDUP_ID_BYTES_MAX + 1)), InvalidJob),
    ("batch empty", lambda s, c: s.enqueue_many([]), InvalidJob),
    ("batch too large", lambda s, c: s.enqueue_many([OK_ITEM] * (limits.BATCH_JOBS_MAX + 1)), InvalidJob),
    ("batch item not a tuple", lambda s, c: s.enqueue_many([b"ok"]), InvalidJob),
    ("batch item short", lambda s, c: s.enqueue_many([(b"ok", None)]), InvalidJob),
    ("batch all or nothing", lambda s, c: s.enqueue_many([OK_ITEM, (b"", None, "default", 0, 0, None)]),
     InvalidJob),
    ("session not ints", lambda s, c: s.enqueue_many([OK_ITEM], session=("a", 1, 1)), InvalidJob),
    ("session negative", lambda s, c: s.enqueue_many([OK_ITEM], session=(-1, 1, 1)), InvalidJob),
    ("dequeue max_jobs 0", lambda s, c: s.dequeue(max_jobs=0), InvalidJob),
    ("dequeue batch too large", lambda s, c: s.dequeue(max_jobs=limits.BATCH_JOBS_MAX + 1), InvalidJob),
    ("dequeue max_jobs bool", lambda s, c: s.dequeue(max_jobs=True), InvalidJob),
    ("dequeue max_jobs str", lambda s, c: s.dequeue(max_jobs="1"), InvalidJob),
    ("dequeue visibility 0", lambda s, c: s.dequeue(visibility=0), InvalidJob),
    ("dequeue visibility negative", lambda s, c: s.dequeue(visibility=-1), InvalidJob),
    ("dequeue visibility NaN", lambda s, c: s.dequeue(visibility=NAN), InvalidJob),
    ("dequeue visibility str", lambda s, c: s.dequeue(visibility="30"), InvalidJob),
    ("dequeue visibility too long", lambda s, c: s.dequeue(visibility=limits.VISIBILITY_TIMEOUT_S_MAX + 1),
     InvalidJob),
    ("dequeue undeclared queue", lambda s, c: s.dequeue(queue="nope"), UnknownQueue),
    ("dequeue queue int", lambda s, c: s.dequeue(queue=5), InvalidJob),
    ("ack job_id str", lambda s, c: s.ack("x", c["lease"].token), InvalidJob),
    ("ack job_id negative", lambda s, c: s.ack(-1, c["lease"].token), InvalidJob),
    ("ack job_id huge", lambda s, c: s.ack(2**63, c["lease"].token), InvalidJob),
    ("ack job_id float", lambda s, c: s.ack(float(c["a"]), c["lease"].token), InvalidJob),
    ("ack token str", lambda s, c: s.ack(c["a"], "t"), InvalidJob),
    ("ack unknown job id", lambda s, c: s.ack(999 << limits.JOB_ID_SHARD_BITS, 1), JobGone),
    ("ack job of another shard", lambda s, c: s.ack((1 << limits.JOB_ID_SHARD_BITS) | 3, 1), NotFound),
    ("ack a job never leased", lambda s, c: s.ack(c["c"], c["lease"].token), LeaseLost),
    ("nack delay negative", lambda s, c: s.nack(c["a"], c["lease"].token, delay=-1), InvalidJob),
    ("nack delay NaN", lambda s, c: s.nack(c["a"], c["lease"].token, delay=NAN), InvalidJob),
    ("nack error not str", lambda s, c: s.nack(c["a"], c["lease"].token, error=5), InvalidJob),
    ("extend 0", lambda s, c: s.extend(c["a"], c["lease"].token, 0), InvalidJob),
    ("extend negative", lambda s, c: s.extend(c["a"], c["lease"].token, -5), InvalidJob),
    ("extend NaN", lambda s, c: s.extend(c["a"], c["lease"].token, NAN), InvalidJob),
    ("extend too long", lambda s, c: s.extend(c["a"], c["lease"].token, limits.VISIBILITY_TIMEOUT_S_MAX + 1),
     InvalidJob),
    ("redrive unknown id", lambda s, c: s.redrive(job_ids=[c["c"]]), NotFound),
    ("redrive undeclared queue", lambda s, c: s.redrive(queue="nope"), UnknownQueue),
    ("dead_letters undeclared queue", lambda s, c: s.dead_letters(queue="nope"), UnknownQueue),
]

# Regression: falsy values of the wrong type once skipped validation (``if delay:``):
# priority None raised TypeError inside ``_apply_enqueue`` with the job half-added.
BAD_INPUT_FALSY = [
    ("priority None", enq(priority=None), InvalidJob),
    ("priority empty str", enq(priority=""), InvalidJob),
    ("priority False", enq(priority=False), InvalidJob),
    ("delay empty str", enq(delay=""), InvalidJob),
    ("delay False", enq(delay=False), InvalidJob),
    ("nack delay False", lambda s, c: s.nack(c["a"], c["lease"].token, delay=False), InvalidJob),
    # Regression: a session that is not a 3-tuple failed unpacking with a bare ValueError.
    ("session too short", lambda s, c: s.enqueue_many([OK_ITEM], session=(1, 2)), InvalidJob),
]


@pytest.mark.parametrize("name,call,error", BAD_INPUT + BAD_INPUT_FALSY,
                         ids=[case[0] for case in BAD_INPUT + BAD_INPUT_FALSY])
def test_bad_input_is_a_typed_error_and_changes_nothing(make_shard, digest, name, call, error):
    s, ctx = _setup_for_bad_input(make_shard)
    s.stats()
    before, size = digest(s.state), s.durable_size()
    try:
        with pytest.raises(error):
            call(s, ctx)
    except BaseException:
        s.check_on_teardown = False
        raise
    assert digest(s.state) == before
    assert s.durable_size() == size
    # ...and the queue behaves as if the call never happened.
    assert sorted(ids(s.dequeue(max_jobs=10))) == sorted([ctx["c"], ctx["d"]])
    s.ack(ctx["a"], ctx["lease"].token)
    [lb] = s.dequeue(max_jobs=10)
    assert lb.job_id == ctx["b"]


def test_queue_full_is_backpressure_not_a_dead_end(make_shard, digest):
    s = make_shard(max_pending_jobs=3)
    a, b, c = (s.enqueue(bytes([65 + i])) for i in range(3))
    s.stats()
    before = digest(s.state)
    with pytest.raises(QueueFull):
        s.enqueue(b"d")
    with pytest.raises(QueueFull):
        s.enqueue_many([OK_ITEM])
    assert digest(s.state) == before
    batch = s.dequeue(max_jobs=10)
    assert ids(batch) == [a, b, c]
    s.ack(a, batch[0].token)
    s.nack(b, batch[1].token)
    s.extend(c, batch[2].token, 60)
    d = s.enqueue(b"d")
    with pytest.raises(QueueFull):  # all or nothing: 1 slot is not enough for 2
        s.enqueue_many([OK_ITEM, OK_ITEM])
    assert ids(s.dequeue(max_jobs=10)) == [b, d]


def test_dead_letters_count_toward_max_pending(make_shard):
    """Document-by-test: a dead letter still holds its slot until redriven or purged."""
    s = make_shard(max_pending_jobs=1, max_deliveries=1)
    a = s.enqueue(b"a")
    [la] = s.dequeue()
    s.nack(a, la.token)
    with pytest.raises(QueueFull):
        s.enqueue(b"b")


def test_an_undelivered_nack_does_not_count_as_a_delivery(make_shard, clock):
    """``nack(delivered=False)`` (a worker's unstarted prefetch): the job is ready at once
    and its delivery count goes back, durably."""
    s = make_shard(max_deliveries=2)
    jid = s.enqueue(b"x", key="k")
    for _ in range(3):  # more than max_deliveries prefetches handed back: never dead
        [lease] = s.dequeue()
        assert lease.attempt == 1
        s.nack(jid, lease.token, 30, "ignored", False)
    assert s.dead_letters() == []
    [lease] = s.dequeue()
    s.nack(jid, lease.token)
    s.reopen()
    [lease] = s.dequeue()
    assert lease.attempt == 2
