"""An ack with the job's latest lease token deletes the job even after that lease's
deadline, as long as nothing leased the job again since (SQS's DeleteMessage with the most
recent receipt handle; docs/guarantees.md, "At-least-once delivery"). A newer lease fences
the old token, a job dead-lettered, cancelled or purged is not acked, and nack, extend,
bury and a worker's reports still need a live lease.

Pure state-machine tests on the injected clock (no sleeps), each run against the pure
:class:`ShardState` with an in-memory log and against :class:`Engine` on a real directory.
After every test the harness checks that the log, a checkpoint of the live state, and a
checkpoint followed by the log written after it all rebuild the same state, the tokens an
ack may still use (``ShardState.lapsed``) included: a late ack logged and replayed deletes
the job exactly as it did live, and a late ack right after a restart is taken as it was
before it.
"""
from __future__ import annotations

import msgpack
import pytest

from conftest import config_from, state_digest
from shardq.errors import Cancelled, JobGone, LeaseLost
from shardq.shard import ops
from shardq.shard.durable import Engine
from shardq.shard.jobstate import JobState
from shardq.shard.salvage import _applies
from shardq.shard.state import ShardState

T0 = 1_000_000.0
VIS = 5.0


# ---------------------------------------------------------------------------- harness
def digest(state: ShardState) -> dict:
    """:func:`state_digest` and what it leaves out that a late ack depends on: the lapsed
    tokens, and which ready jobs each plain queue's ready lines reach (and their priorities)."""
    d = state_digest(state)
    d["lapsed"] = dict(state.lapsed)
    # a placed queue's figures since this process started (max seen, tokens) are not rebuilt;
    # its slots in flight are, per queue and per group
    for name, counts in list(d["stats"].items()):
        counts.pop("limits", None)
        if not any(counts.values()) and not any(d["queues"][name].values()):
            del d["stats"][name], d["queues"][name]   # (an empty queue need not survive)
    d["slots"] = {name: (q.counts[JobState.LEASED], {g: line.inflight for g, line in q.lim.lines.items()
                                                     if line.inflight})
                  for name, q in state.queues.items() if q.lim is not None and name in d["stats"]}
    lines = {name: sorted({j.id for line in q.ready.values() for j in line
                           if j.state is JobState.READY and state.jobs.get(j.id) is j})
             for name, q in state.queues.items() if q.lim is None or q.lim.sep is None}
    d["ready_lines"] = {name: ids for name, ids in lines.items() if ids}  # (an empty queue need not survive)
    return d


def lines_are_exact(state: ShardState, queue: str = "default") -> None:
    """Every entry of the queue's ready lines is a ready job, once, and every priority
    listed has a line (no stale entry is left for a dequeue or a router's peek to count)."""
    q = state.queues[queue]
    entries = [j for line in q.ready.values() for j in line]
    assert all(j.state is JobState.READY and state.jobs.get(j.id) is j for j in entries), entries
    assert len({j.id for j in entries}) == len(entries) == q.counts[JobState.READY]
    assert sorted(-p for p in q.prios) == sorted(q.ready) and all(q.ready.values())


class Shard:
    """One shard under test: ``kind`` "state" (ShardState, log kept as a list of records,
    a checkpoint as its snapshot) or "engine" (Engine on a directory: every call fsynced,
    reopen = close + open, checkpoint = compaction)."""

    def __init__(self, kind: str, config, clock, directory: str):
        self.kind, self.config, self.clock, self.directory = kind, config, clock, directory
        if kind == "engine":
            self.engine = Engine(directory, config, clock=clock)
        else:
            self._state = ShardState(0, config)
            self.checkpoint: list[list] = []   # operations of the last checkpoint
            self.log: list[list] = []          # records since

    @property
    def state(self) -> ShardState:
        return self.engine.state if self.kind == "engine" else self._state

    def run(self, name: str, *args, now_at: int | None = None):
        """``state.<name>(*args)`` with the clock's now inserted at ``now_at`` (default: last),
        then the operations made durable."""
        now = self.clock.now()
        args = list(args)
        args.insert(len(args) if now_at is None else now_at, now)
        try:
            return getattr(self.state, name)(*args)
        finally:
            if self.kind == "engine":
                self.engine.shard.commit()
            else:
                produced = self._state.take_ops()
                if produced:
                    self.log.append(msgpack.unpackb(msgpack.packb(produced), raw=False))

    # the calls, as a worker and an operator make them
    def enqueue(self, body, key=None, queue="default", delay=0.0, priority=0):
        return self.run("enqueue", body, key, queue, delay, priority, now_at=1)

    def dequeue(self, queue="default", visibility=VIS, max_jobs=1):
        return self.run("dequeue", queue, visibility, max_jobs, now_at=1)

    def ack(self, job_id, token):
        return self.run("ack", job_id, token)

    def nack(self, job_id, token, delay=0.0, error=None):
        return self.run("nack", job_id, token, delay, error, now_at=2)

    def extend(self, job_id, token, seconds):
        return self.run("extend", job_id, token, seconds, now_at=2)

    def bury(self, job_id, token):
        return self.run("bury", job_id, token, None, now_at=2)

    def stats(self, queue="default"):
        self.run("advance")
        return self.state.stats()[queue]

    def totals(self, queue="default"):
        return self.state.queue_metrics(self.clock.now())[queue]

    def take_checkpoint(self):
        """A checkpoint of the live state now (the log after it goes on from here)."""
        if self.kind == "engine":
            self.engine.compact()
        else:
            self.checkpoint = [op for chunk in self._state.snapshot(chunk_bytes=300)
                               for op in msgpack.unpackb(chunk, raw=False)]
            self.log = []

    def rebuilt(self, checkpoint: bool = True) -> ShardState:
        fresh = ShardState(0, self.config)
        fresh.replay(([self.checkpoint] if checkpoint else []) + self.log)
        return fresh

    def reopen(self):
        """A restart (a crash of the process: what was committed is replayed)."""
        if self.kind == "engine":
            self.engine.close()
            self.engine = Engine(self.directory, self.config, clock=self.clock)
        else:
            self._state = self.rebuilt()

    def check_recovery(self):
        self.run("advance")
        live = digest(self.state)
        now = self.clock.now()
        if self.kind == "engine":
            self.reopen()
            self.engine.stats()
            assert digest(self.engine.state) == live, "reopening the engine does not rebuild the state"
            self.engine.compact()
            self.reopen()
            self.engine.stats()
            assert digest(self.engine.state) == live, "reopening after compaction does not rebuild the state"
            self.engine.close()
            return
        again = self.rebuilt()
        again.advance(now)
        assert digest(again) == live, "the checkpoint and the log after it do not rebuild the state"
        fresh = ShardState(0, self.config)
        fresh.replay(msgpack.unpackb(c, raw=False) for c in self._state.snapshot(chunk_bytes=300))
        fresh.advance(now)
        assert digest(fresh) == live, "a checkpoint of the live state does not rebuild it"


@pytest.fixture
def clock():
    from shardq.clock import FakeClock
    return FakeClock(T0)


@pytest.fixture(params=["state", "engine"])
def make_shard(request, tmp_path, clock):
    made = []

    def make(**cfg):
        cfg.setdefault("visibility_timeout", VIS)
        shard = Shard(request.param, config_from(**cfg), clock, str(tmp_path / f"shard{len(made)}"))
        made.append(shard)
        return shard

    yield make
    for shard in made:
        shard.check_recovery()


@pytest.fixture
def shard(make_shard):
    return make_shard()


# ---------------------------------------------------------------------------- the rule
def test_a_late_ack_deletes_a_keyless_job_nobody_leased_again(shard, clock):
    a = shard.enqueue(b"a")
    b = shard.enqueue(b"b")
    [lease] = shard.dequeue()
    assert lease.job_id == a
    clock.advance(VIS + 1)                        # the deadline passed: a is ready again, behind b
    assert shard.stats()["ready"] == 2 and shard.stats()["in_flight"] == 0
    assert shard.state.lapsed == {a: lease.token}
    shard.ack(a, lease.token)                     # the handler overran; nobody had the job since
    assert a not in shard.state.jobs and shard.state.lapsed == {}
    assert shard.stats() == {"ready": 1, "delayed": 0, "waiting": 0, "in_flight": 0, "dead": 0, "keys": 0}
    assert shard.state.ready_priorities("default", 10) == [[0, 1]]   # a's entry went with it
    lines_are_exact(shard.state)
    t = shard.totals()
    assert (t["leased"], t["lease_expiries"], t["acked"]) == (1, 1, 1)
    [nxt] = shard.dequeue()
    assert nxt.job_id == b
    assert shard.dequeue() == []                  # a is never delivered again
    with pytest.raises(JobGone):
        shard.ack(a, lease.token)                 # a second ack: gone (as after a timely one)
    shard.ack(b, nxt.token)
    assert shard.totals()["acked"] == 2


def test_a_late_ack_of_a_key_head_lets_the_keys_next_job_go(shard, clock):
    k1 = shard.enqueue(b"k1", key="k")
    k2 = shard.enqueue(b"k2", key="k")
    [lease] = shard.dequeue()
    clock.advance(VIS)                            # at the deadline itself the lease is over
    st = shard.stats()
    assert (st["ready"], st["waiting"], st["in_flight"], st["keys"]) == (1, 1, 0, 1)
    assert shard.state.jobs[k1].state is JobState.READY   # still the head of k: k2 waits behind it
    shard.ack(k1, lease.token)
    assert shard.state.jobs[k2].state is JobState.READY
    assert [k.id for k in shard.state.queues["default"].keys["k"]] == [k2]
    lines_are_exact(shard.state)
    [nxt] = shard.dequeue()
    assert (nxt.job_id, nxt.attempt) == (k2, 1)
    shard.ack(nxt.job_id, nxt.token)
    assert shard.stats()["keys"] == 0


def test_a_late_ack_with_priorities_takes_the_job_out_of_its_priority(shard, clock):
    hi = shard.enqueue(b"hi", priority=5)
    lo = shard.enqueue(b"lo", priority=0)
    hi2 = shard.enqueue(b"hi2", priority=5)
    leases = shard.dequeue(max_jobs=2)
    assert [le.job_id for le in leases] == [hi, hi2]
    clock.advance(VIS + 1)
    shard.stats()                                 # (a peek reads the state as of the last advance)
    assert shard.state.ready_priorities("default", 10) == [[5, 2], [0, 1]]
    shard.ack(hi, leases[0].token)
    assert shard.state.ready_priorities("default", 10) == [[5, 1], [0, 1]]
    shard.ack(hi2, leases[1].token)
    assert shard.state.ready_priorities("default", 10) == [[0, 1]]   # priority 5's line is gone
    lines_are_exact(shard.state)
    assert [le.job_id for le in shard.dequeue(max_jobs=10)] == [lo]


def test_a_newer_lease_fences_the_old_token_and_stays_valid(shard, clock):
    jid = shard.enqueue(b"x", key="k")
    [old] = shard.dequeue()
    clock.advance(VIS + 1)
    [new] = shard.dequeue()
    assert (new.job_id, new.attempt) == (jid, 2) and new.token != old.token
    before = digest(shard.state)
    for call in (lambda: shard.ack(jid, old.token), lambda: shard.nack(jid, old.token),
                 lambda: shard.extend(jid, old.token, 30)):
        with pytest.raises(LeaseLost) as e:
            call()
        assert not isinstance(e.value, JobGone)
    assert digest(shard.state) == before          # the old handle changed nothing
    shard.extend(jid, new.token, 30)              # the new delivery holds
    clock.advance(31)                             # ... and runs out in turn
    with pytest.raises(LeaseLost):
        shard.ack(jid, old.token)                 # the old token stays fenced
    shard.ack(jid, new.token)                     # the latest one still deletes
    assert shard.stats()["keys"] == 0 and jid not in shard.state.jobs


def test_a_job_dead_lettered_when_its_lease_ran_out_is_not_acked(make_shard, clock):
    shard = make_shard(max_deliveries=2)
    jid = shard.enqueue(b"x", key="k")
    [first] = shard.dequeue()
    clock.advance(VIS + 1)
    [second] = shard.dequeue()                    # attempt 2 of 2
    assert second.job_id == jid and second.attempt == 2
    other = shard.enqueue(b"y")
    [lo] = shard.dequeue()
    assert lo.job_id == other
    clock.advance(VIS + 1)                        # both run out; jid has had its deliveries
    assert shard.stats()["dead"] == 1
    assert shard.state.lapsed == {other: lo.token}
    for token in (first.token, second.token):
        with pytest.raises(LeaseLost):
            shard.ack(jid, token)
    assert [d.job_id for d in shard.state.dead_letters("default")] == [jid]
    shard.ack(other, lo.token)                    # one not dead-lettered is taken
    assert shard.run("redrive", "default", now_at=1) == 1
    with pytest.raises(LeaseLost):                # a redriven job starts afresh: no old token acks it
        shard.ack(jid, second.token)
    [again] = shard.dequeue()
    assert (again.job_id, again.attempt) == (jid, 1)
    shard.ack(jid, again.token)


def test_nack_extend_bury_and_reports_still_need_a_live_lease(shard, clock):
    jid = shard.enqueue(b"x", key="k")
    [lease] = shard.dequeue()
    shard.run("put_result", jid, lease.token, b"kept", 60.0)
    shard.run("set_progress", jid, lease.token, 0.5, "half")
    clock.advance(VIS + 1)
    shard.stats()
    before = digest(shard.state)
    for call in (lambda: shard.nack(jid, lease.token, 3, "e"), lambda: shard.extend(jid, lease.token, 30),
                 lambda: shard.bury(jid, lease.token),
                 lambda: shard.run("put_result", jid, lease.token, b"v", 60.0),
                 lambda: shard.run("set_progress", jid, lease.token, 0.9, None)):
        with pytest.raises(LeaseLost, match="expired"):
            call()
    assert digest(shard.state) == before          # nothing changed; the job is still ready
    assert shard.state.jobs[jid].state is JobState.READY
    shard.ack(jid, lease.token)                   # only an ack may still settle it
    [row] = shard.state.results_of([jid], clock.now())
    assert (row.state, row.value) == ("succeeded", b"kept")   # its result outlives it, as after any ack
    assert jid not in shard.state.progress


def test_a_nack_that_makes_a_job_ready_at_once_keeps_its_token_for_an_ack(shard, clock):
    """SQS's ChangeMessageVisibility 0 is a nack of delay 0: the message is visible again,
    and AWS still deletes it with that receive's handle while nobody received it since (a
    walkthrough found shardq deleted nothing). A nack with a delay, or a new lease, fences
    the token as before."""
    a = shard.enqueue(b"a", key="k")
    b = shard.enqueue(b"b", key="k")
    [lease] = shard.dequeue()
    shard.nack(a, lease.token, 0, "visible again")
    assert shard.state.lapsed == {a: lease.token}
    shard.ack(a, lease.token)                     # deleted; the key's next job goes
    assert a not in shard.state.jobs and shard.state.lapsed == {}
    lines_are_exact(shard.state)
    [nxt] = shard.dequeue()
    assert nxt.job_id == b
    shard.nack(b, nxt.token, 30, "later")         # a delay: the token is spent
    assert shard.state.lapsed == {}
    with pytest.raises(LeaseLost):
        shard.ack(b, nxt.token)
    clock.advance(31)
    [again] = shard.dequeue()
    shard.nack(b, again.token, 0, "visible again")
    [third] = shard.dequeue()                     # leased again: the nacked token is fenced
    with pytest.raises(LeaseLost):
        shard.ack(b, again.token)
    shard.ack(b, third.token)


def test_a_cancelled_or_purged_job_is_not_acked_late(shard, clock):
    a = shard.enqueue(b"a", key="a")
    b = shard.enqueue(b"b", key="b")
    c = shard.enqueue(b"c", queue="other")
    d = shard.enqueue(b"d", key="d")
    la, lb, ld = shard.dequeue(max_jobs=3)
    [lc] = shard.dequeue(queue="other")
    assert shard.run("cancel", b) == "cancelling"   # b: marked while leased
    clock.advance(VIS + 1)                          # a, c, d ready again; b's marked lease ended: gone
    shard.stats()
    assert shard.state.lapsed == {a: la.token, c: lc.token, d: ld.token}
    assert shard.run("cancel", a) == "cancelled"
    assert shard.run("purge_queue", "other") == 1
    for jid, token in ((a, la.token), (b, lb.token), (c, lc.token)):
        with pytest.raises(JobGone):
            shard.ack(jid, token)
    assert shard.state.lapsed == {d: ld.token}
    shard.ack(d, ld.token)
    assert shard.totals()["cancelled"] == 2 and shard.totals()["acked"] == 1


def test_a_marked_lease_acked_in_time_is_still_cancelled(shard, clock):
    """(Unchanged: the live lease of a job marked cancelled.) And a late ack never meets a
    mark: a marked job is deleted when its lease ends."""
    jid = shard.enqueue(b"x")
    [lease] = shard.dequeue()
    shard.run("cancel", jid)
    with pytest.raises(Cancelled):
        shard.ack(jid, lease.token)
    other = shard.enqueue(b"y")
    [late] = shard.dequeue()
    clock.advance(VIS + 1)
    shard.ack(other, late.token)
    assert shard.state.jobs == {}


# ---------------------------------------------------------------------------- durability
def test_a_late_ack_survives_a_restart_and_so_does_the_token_it_may_use(shard, clock):
    acked = shard.enqueue(b"acked", key="k")
    behind = shard.enqueue(b"behind", key="k")
    kept = shard.enqueue(b"kept")
    l1, l2 = shard.dequeue(max_jobs=2)
    assert (l1.job_id, l2.job_id) == (acked, kept)
    clock.advance(VIS + 1)
    shard.ack(acked, l1.token)                    # logged as an ack of a job replay finds leased
    shard.reopen()
    assert acked not in shard.state.jobs
    assert shard.state.jobs[behind].state is JobState.READY
    shard.stats()
    assert shard.state.lapsed == {kept: l2.token}  # derived again from the lease and the clock
    shard.ack(kept, l2.token)                     # taken after the restart as before it
    [nxt] = shard.dequeue()
    assert nxt.job_id == behind
    shard.ack(behind, nxt.token)


def test_the_token_an_ack_may_use_survives_a_checkpoint(shard, clock):
    jid = shard.enqueue(b"x", key="k")
    nxt = shard.enqueue(b"y", key="k")
    [lease] = shard.dequeue()
    clock.advance(VIS + 1)
    shard.stats()
    shard.take_checkpoint()                       # the job is ready in it, with its lapsed token
    shard.reopen()
    assert shard.state.lapsed == {jid: lease.token}
    shard.ack(jid, lease.token)
    shard.reopen()                                # the checkpoint, then the late ack logged after it
    assert jid not in shard.state.jobs and shard.state.jobs[nxt].state is JobState.READY


def test_a_late_ack_of_a_job_delayed_by_its_backoff_in_replay(shard, clock):
    """A job nacked with a backoff keeps its ``ready_at``; leased again and run out, it is
    ready live, but a checkpoint's replay places it DELAYED until the first advance (replay
    has no clock). The late ack logged after the checkpoint meets it there."""
    jid = shard.enqueue(b"x", key="k")
    nxt = shard.enqueue(b"y", key="k")
    [first] = shard.dequeue()
    shard.nack(jid, first.token, 3.0, "boom")     # backoff: delayed 3 s, the head of k
    assert shard.stats()["delayed"] == 1
    clock.advance(3)
    [second] = shard.dequeue()
    assert (second.job_id, second.attempt) == (jid, 2)
    clock.advance(VIS + 1)
    assert shard.stats()["ready"] == 1 and shard.state.jobs[jid].ready_at > 0
    shard.take_checkpoint()
    shard.ack(jid, second.token)
    if shard.kind == "state":
        replayed = ShardState(0, shard.config)
        replayed.replay([shard.checkpoint])
        assert replayed.jobs[jid].state is JobState.DELAYED and replayed.lapsed == {jid: second.token}
        replayed.replay(shard.log)                # the late ack, on the delayed job
        assert jid not in replayed.jobs and replayed.lapsed == {}
        assert replayed.jobs[nxt].state is not JobState.WAITING
        assert list(replayed.jobs) == [nxt]
    shard.reopen()
    assert jid not in shard.state.jobs
    [lease] = shard.dequeue()
    assert lease.job_id == nxt


def test_a_checkpoint_writes_the_lapsed_token_in_its_job_record(clock):
    """The format does not change: the JOB record's token, 0 for a job not leased until now,
    holds the token of the lease that ran out (a reader before that ignored it)."""
    s = ShardState(0, config_from(visibility_timeout=VIS))
    a = s.enqueue(b"a", T0)
    b = s.enqueue(b"b", T0)
    [lease] = s.dequeue("default", T0)
    s.advance(T0 + VIS + 1)
    records = {op[1]: ops.read(ops.Job, op) for chunk in s.snapshot()
               for op in msgpack.unpackb(chunk, raw=False) if op[0] == ops.JOB}
    assert (records[a].state, records[a].token, records[a].expires_at) == (JobState.READY, lease.token, 0.0)
    assert (records[b].state, records[b].token) == (JobState.READY, 0)


def test_salvage_applies_a_late_ack_only_where_the_checkpoint_holds_its_token(clock):
    """``shardq wal repair`` drops an ack whose job is not leased (its lease record was in
    the damaged bytes: the job comes back), except the ack of a lapsed lease, whose job the
    checkpoint holds ready with that lease's token."""
    s = ShardState(0, config_from(visibility_timeout=VIS))
    a = s.enqueue(b"a", T0)
    b = s.enqueue(b"b", T0)
    [lease] = s.dequeue("default", T0)
    s.advance(T0 + VIS + 1)
    salvaged = ShardState(0, s.config)
    salvaged.replay(msgpack.unpackb(c, raw=False) for c in s.snapshot())
    assert _applies(salvaged, [ops.ACK, a]) and not _applies(salvaged, [ops.ACK, b])
    salvaged.apply([ops.ACK, a])
    assert set(salvaged.jobs) == {b}
    assert lease.job_id == a


# ---------------------------------------------------------------------------- limits
def test_a_late_ack_on_a_placed_queue_keeps_its_slots_exact(make_shard, clock):
    shard = make_shard(queues={"api": {"concurrency": 1, "visibility_timeout": VIS}})
    a = shard.enqueue(b"a", queue="api")
    b = shard.enqueue(b"b", queue="api")
    [la] = shard.dequeue(queue="api")
    assert shard.dequeue(queue="api") == []       # the one slot is taken
    clock.advance(VIS + 1)                        # its lease ran out: the slot is free again
    shard.ack(a, la.token)
    st = shard.stats("api")
    assert (st["in_flight"], st["ready"], st["limits"]["in_flight"]) == (0, 1, 0)
    lines_are_exact(shard.state, "api")
    [lb] = shard.dequeue(queue="api")
    assert lb.job_id == b
    assert shard.dequeue(queue="api") == []


def test_a_late_ack_in_a_grouped_queue_never_leases_its_stale_entry(make_shard, clock):
    shard = make_shard(queues={"g": {"group_separator": "/", "group_concurrency": 1,
                                     "visibility_timeout": VIS}})
    a1 = shard.enqueue(b"a1", key="a/1", queue="g")
    a2 = shard.enqueue(b"a2", key="a/2", queue="g")
    b1 = shard.enqueue(b"b1", key="b/1", queue="g")
    leases = shard.dequeue(queue="g", max_jobs=10)
    assert [le.job_id for le in leases] == [a1, b1]   # one per group
    clock.advance(VIS + 1)
    st = shard.stats("g")
    assert (st["ready"], st["in_flight"]) == (3, 0)
    shard.ack(a1, leases[0].token)
    assert shard.stats("g")["ready"] == 2
    got = shard.dequeue(queue="g", max_jobs=10)
    assert sorted(le.job_id for le in got) == sorted([a2, b1])  # a1 never again
    assert shard.dequeue(queue="g", max_jobs=10) == []
    for le in got:
        shard.ack(le.job_id, le.token)
    assert shard.stats("g")["in_flight"] == 0 and shard.state.jobs == {}


def test_a_late_ack_far_behind_a_backlog_leaves_an_entry_no_dequeue_leases(monkeypatch):
    """The job is looked for from the end of its ready line up to ``DROP_READY_SCAN_MAX``
    entries (a bounded cost on the shard's loop); one further in stays as a stale entry,
    as a job cancelled while ready does: passed over by dequeue, never leased, and the
    counts stay exact."""
    from shardq.shard import core
    monkeypatch.setattr(core, "DROP_READY_SCAN_MAX", 4)
    s = ShardState(0, config_from(visibility_timeout=VIS))
    near, far = s.enqueue(b"near", T0), s.enqueue(b"far", T0)
    ln, lf = s.dequeue("default", T0, max_jobs=2)
    now = T0 + VIS + 1
    s.advance(now)                                          # far is last in line, near before it
    behind = [s.enqueue(b"b%d" % i, now) for i in range(3)]  # near: 5th from the end, far: 4th
    s.ack(near, ln.token, now)                              # beyond the scan: its entry stays
    s.ack(lf.job_id, lf.token, now)                         # within it: taken out
    q = s.queues["default"]
    assert [j.id for j in q.ready[0]] == [near] + behind
    assert s.stats()["default"]["ready"] == 3
    got = s.dequeue("default", now, max_jobs=10)
    assert [le.job_id for le in got] == behind              # the stale entry is passed over
    assert 0 not in q.ready and q.prios == []
    assert far == lf.job_id
