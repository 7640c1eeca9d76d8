"""Random operation sequences against a reference model (hypothesis, stateful).

The machine drives an :class:`Engine` on a real directory -- enqueue (a few keys, delays,
priorities), dequeue, ack, nack (with delay), extend, stale acks, late acks (the token of a
lease that ran out while nothing leased the job again: it still deletes the job; a nack or
extend with it does not), clock jumps, redrive, reopen (close + open on the same directory)
and compaction -- and a model written with plain dicts and lists. After every step it
checks: the set of live jobs, which are leased, which hold a lapsed lease an ack may still
use, dead letters, delivery counts, per-key FIFO (a dequeued keyed job is the oldest live
job of its key; never two leases of one key), and that dequeue never hands out a job whose
lease is live and returns the highest priorities available. A failure prints the steps and
a reproduction blob.
"""
from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shardq import config as shardq_config
from shardq.clock import FakeClock
from shardq.errors import LeaseLost
from shardq.shard.durable import Engine
from shardq.shard.state import JobState

MAX_DELIVERIES = 3
VISIBILITY = 10.0
KEYS = [None, "a", "b", "c"]


class ModelJob:
    def __init__(self, jid, key, priority, ready_at, order):
        self.id = jid
        self.key = key
        self.priority = priority
        self.ready_at = ready_at
        self.order = order
        self.attempts = 0
        self.lease: tuple[int, float] | None = None  # (token, expires_at)
        self.dead = False
        self.old_tokens: list[int] = []   # superseded or settled: LeaseLost for ack, nack, extend
        self.lapsed: int | None = None    # the lease that ran out, nothing leased since: an ack deletes


class QueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="shardq-model-")
        self.clock = FakeClock()
        self.config = shardq_config.parse({
            "limits": {"segment_bytes": 4096, "compact_min_bytes": 4096},
            "queue_defaults": {"max_deliveries": MAX_DELIVERIES, "visibility_timeout": VISIBILITY},
        })
        self.engine = Engine(self.dir, self.config, clock=self.clock)
        self.jobs: dict[int, ModelJob] = {}
        self.key_order: dict[str, list[int]] = {}
        self.counter = 0

    def teardown(self):
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the model
    @property
    def now(self):
        return self.clock.now()

    def model_advance(self):
        expired = sorted((j.lease[1], j.lease[0], j.id) for j in self.jobs.values()
                         if j.lease and j.lease[1] <= self.now)
        for _, _, jid in expired:
            job = self.jobs[jid]
            token = job.lease[0]
            job.lease = None
            if job.attempts >= MAX_DELIVERIES:
                job.old_tokens.append(token)  # dead-lettered at its expiry: no late ack
                self.kill(job)
            else:
                job.lapsed = token

    def kill(self, job):
        job.dead = True
        if job.key is not None:
            self.key_order[job.key].remove(job.id)

    def is_head(self, job):
        return job.key is None or self.key_order[job.key][0] == job.id

    def available(self):
        return [j for j in self.jobs.values()
                if not j.dead and j.lease is None and self.is_head(j) and j.ready_at <= self.now]

    def live_leases(self):
        return sorted(jid for jid, j in self.jobs.items() if j.lease is not None)

    def pick(self, ids, i):
        return self.jobs[ids[i % len(ids)]]

    # ------------------------------------------------------------------ rules
    @rule(key=st.sampled_from(KEYS), delay=st.sampled_from([0, 0, 0, 3, 15]),
          priority=st.sampled_from([0, 0, 1, 5]))
    def enqueue(self, key, delay, priority):
        self.model_advance()
        jid = self.engine.enqueue(b"job-%d" % self.counter, key=key, delay=delay, priority=priority)
        assert jid not in self.jobs
        self.counter += 1
        self.jobs[jid] = ModelJob(jid, key, priority, self.now + delay if delay else 0, self.counter)
        if key is not None:
            self.key_order.setdefault(key, []).append(jid)

    @rule(max_jobs=st.sampled_from([1, 1, 2, 5]), visibility=st.sampled_from([None, 3.0, VISIBILITY]))
    def dequeue(self, max_jobs, visibility):
        self.model_advance()
        avail = {j.id: j for j in self.available()}
        leases = self.engine.dequeue(max_jobs=max_jobs, visibility=visibility)
        got = [lease.job_id for lease in leases]
        assert len(set(got)) == len(got)
        assert len(got) == min(max_jobs, len(avail)), f"got {got}, available {sorted(avail)}"
        for lease in leases:
            assert lease.job_id in avail, f"job {lease.job_id} was not available (leased, waiting or delayed)"
        keys = [avail[j].key for j in got if avail[j].key is not None]
        assert len(set(keys)) == len(keys), "two leases of one key"
        rest = [j.priority for jid, j in avail.items() if jid not in got]
        if got and rest:
            assert min(avail[j].priority for j in got) >= max(rest), "a higher priority was passed over"
        for lease in leases:
            job = avail[lease.job_id]
            job.attempts += 1
            assert lease.attempt == job.attempts
            assert lease.deadline == self.now + (visibility or VISIBILITY)
            job.lease = (lease.token, lease.deadline)
            if job.lapsed is not None:  # fenced by the new lease
                job.old_tokens.append(job.lapsed)
                job.lapsed = None

    @precondition(lambda self: self.live_leases())
    @rule(i=st.integers(0, 100))
    def ack(self, i):
        self.model_advance()
        ids = self.live_leases()
        if not ids:
            return
        job = self.pick(ids, i)
        self.engine.ack(job.id, job.lease[0])
        self.forget(job)

    def forget(self, job):
        del self.jobs[job.id]
        if job.key is not None:
            self.key_order[job.key].remove(job.id)

    @precondition(lambda self: self.live_leases())
    @rule(i=st.integers(0, 100), delay=st.sampled_from([0, 0, 2, 20]))
    def nack(self, i, delay):
        self.model_advance()
        ids = self.live_leases()
        if not ids:
            return
        job = self.pick(ids, i)
        self.engine.nack(job.id, job.lease[0], delay=delay, error="nope")
        token, job.lease = job.lease[0], None
        if job.attempts >= MAX_DELIVERIES:
            job.old_tokens.append(token)
            self.kill(job)
        elif delay:
            job.old_tokens.append(token)
            job.ready_at = self.now + delay
        else:  # ready again at once: an ack with its token still deletes it, as after an expiry
            job.lapsed, job.ready_at = token, 0

    @precondition(lambda self: self.live_leases())
    @rule(i=st.integers(0, 100), seconds=st.sampled_from([1.0, 5.0, 30.0]))
    def extend(self, i, seconds):
        self.model_advance()
        ids = self.live_leases()
        if not ids:
            return
        job = self.pick(ids, i)
        assert self.engine.extend(job.id, job.lease[0], seconds) == self.now + seconds
        job.lease = (job.lease[0], self.now + seconds)

    @precondition(lambda self: any(j.old_tokens for j in self.jobs.values()))
    @rule(i=st.integers(0, 100), op=st.sampled_from(["ack", "nack", "extend"]))
    def stale_token(self, i, op):
        self.model_advance()
        ids = sorted(jid for jid, j in self.jobs.items() if j.old_tokens)
        if not ids:
            return
        job = self.pick(ids, i)
        token = job.old_tokens[i % len(job.old_tokens)]
        with pytest.raises(LeaseLost):
            if op == "ack":
                self.engine.ack(job.id, token)
            elif op == "nack":
                self.engine.nack(job.id, token)
            else:
                self.engine.extend(job.id, token, 10)

    @precondition(lambda self: any(j.lapsed is not None or j.lease for j in self.jobs.values()))
    @rule(i=st.integers(0, 100), op=st.sampled_from(["ack", "ack", "nack", "extend"]))
    def lapsed_token(self, i, op):
        """The token of a lease whose deadline passed while nothing leased the job again:
        an ack deletes the job (its key's next job moves up); a nack or extend gets LeaseLost."""
        self.model_advance()
        ids = sorted(jid for jid, j in self.jobs.items() if j.lapsed is not None)
        if not ids:
            return
        job = self.pick(ids, i)
        if op == "ack":
            self.engine.ack(job.id, job.lapsed)
            self.forget(job)
            return
        with pytest.raises(LeaseLost):
            if op == "nack":
                self.engine.nack(job.id, job.lapsed)
            else:
                self.engine.extend(job.id, job.lapsed, 10)

    @rule(seconds=st.sampled_from([0.5, 1, 3, 5, 10, 11, 30]))
    def advance_clock(self, seconds):
        self.clock.advance(seconds)

    @precondition(lambda self: any(j.dead for j in self.jobs.values()))
    @rule()
    def redrive(self):
        self.model_advance()
        order = [d.job_id for d in self.engine.dead_letters(limit=10**6)]  # in order of death
        assert set(order) == {jid for jid, j in self.jobs.items() if j.dead}
        assert self.engine.redrive() == len(order)
        assert self.engine.dead_letters() == []
        for jid in order:  # back to the tail of its key, with a fresh delivery count
            job = self.jobs[jid]
            job.dead = False
            job.attempts = 0
            job.ready_at = 0
            if job.key is not None:
                self.key_order.setdefault(job.key, []).append(jid)

    @rule()
    def reopen(self):
        self.engine.close()
        self.engine = Engine(self.dir, self.config, clock=self.clock)

    @rule()
    def compact(self):
        self.engine.compact()

    # ------------------------------------------------------------------ checks
    @invariant()
    def matches_the_model(self):
        self.model_advance()
        stats = self.engine.stats().get("default", {})
        state = self.engine.state
        assert set(state.jobs) == set(self.jobs)
        for jid, job in self.jobs.items():
            real = state.jobs[jid]
            assert real.attempts == job.attempts, f"job {jid} attempts"
            assert (real.state is JobState.LEASED) == (job.lease is not None), f"job {jid} leased?"
            if job.lease is not None:
                assert state.inflight[jid] == job.lease
            assert (real.state is JobState.DEAD) == job.dead, f"job {jid} dead?"
        assert state.lapsed == {jid: j.lapsed for jid, j in self.jobs.items() if j.lapsed is not None}
        dead = [d.job_id for d in self.engine.dead_letters(limit=10**6)]
        assert set(dead) == {jid for jid, j in self.jobs.items() if j.dead}
        q = state.queues.get("default")
        real_keys = {k: [j.id for j in dq] for k, dq in q.keys.items()} if q else {}
        assert real_keys == {k: v for k, v in self.key_order.items() if v}, "per-key order"
        leased_keys = [j.key for j in self.jobs.values() if j.lease and j.key is not None]
        assert len(leased_keys) == len(set(leased_keys)), "two leases of one key"
        if self.jobs:
            assert stats["in_flight"] == len(self.live_leases())
            assert stats["dead"] == len(dead)
            assert stats["ready"] == len(self.available())


TestQueueModel = QueueMachine.TestCase
TestQueueModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                   print_blob=True, suppress_health_check=[HealthCheck.too_slow])
