"""The worker core on its own (no queue, no thread, a FakeClock): the jobs in hand, the
heartbeat, ``ctx.extend`` and settling, as every runner executes them. The runners'
behaviour is tested once for all of them in tests/consumer/test_worker_drivers.py; this
pins the decisions, effect by effect."""
from __future__ import annotations

import contextlib

import pytest

from shardq.clock import FakeClock
from shardq.consumer.core import Extend, JobState, WorkerCore
from shardq.consumer.options import WorkerOptions
from shardq.consumer.handling import DONE, FAILED, Report
from shardq.consumer.policy import ACK, NACK, NOTHING, UNAVAILABLE_BACKOFF_S_MIN, Burst
from shardq.errors import InvalidJob, JobGone, LeaseLost, ShardUnavailable
from shardq.limits import VISIBILITY_TIMEOUT_S_MAX
from shardq.types import Lease


class TopRng:
    def uniform(self, a, b):
        return b


def make_core(clock: FakeClock) -> WorkerCore:
    core = WorkerCore(WorkerOptions(heartbeat_fraction=0.5, backoff_base_s=1.0, backoff_cap_s=10.0), clock,
                      lock=contextlib.nullcontext(), rng=TopRng())
    core.policy.configure({"visibility_timeout": 30, "max_deliveries": 4})
    return core


def leases(clock: FakeClock, n: int) -> list[Lease]:
    return [Lease(i, None, b"", "default", 1, 10 + i, clock.now() + 30.0) for i in range(1, n + 1)]


def run(steps, answer):
    """Execute a core operation: ``answer(effect)`` is what the queue answers."""
    effects = []
    try:
        effect = next(steps)
        while True:
            effects.append(effect)
            effect = steps.send(answer(effect))
    except StopIteration as stop:
        return effects, stop.value


def test_leased_jobs_are_held_with_their_first_heartbeat_at_the_fraction():
    clock = FakeClock()
    core = make_core(clock)
    core.backoff.failed()
    jobs = core.leased(leases(clock, 2), clock.now())
    assert [j.state for j in jobs] == [JobState.PENDING] * 2 and list(core.jobs.values()) == jobs
    assert [j.extend_at for j in jobs] == [clock.now() + 15.0] * 2
    assert core.stats.leased == 2 and core.backoff.s == 0.0  # an answer resets the backoff


def test_heartbeat_extends_due_leases_one_at_a_time_and_stops_at_the_first_outage():
    clock = FakeClock()
    core = make_core(clock)
    a, b, c = core.leased(leases(clock, 3), clock.now())
    c.state = JobState.FINISHED  # being settled: no more heartbeats
    assert run(core.heartbeat(clock.now()), lambda e: e.lease)[0] == []  # nothing due yet
    clock.advance(16.0)
    effects, _ = run(core.heartbeat(clock.now()), lambda e: ShardUnavailable("down"))
    assert effects == [Extend(a, a.lease, 30.0)]  # the tick ended at the outage: b not tried
    assert core.stats.unavailable == 1 and core.backoff.s == UNAVAILABLE_BACKOFF_S_MIN
    answered = lambda e: e.lease._replace(deadline=clock.now() + 30.0)  # noqa: E731
    effects, _ = run(core.heartbeat(clock.now()), answered)
    assert [e.job for e in effects] == [a, b] and core.backoff.s == 0.0  # the answer reset it
    assert a.lease.deadline == clock.now() + 30.0 and a.extend_at == clock.now() + 15.0


def test_a_heartbeat_that_finds_the_lease_lost_marks_it_and_goes_on():
    clock = FakeClock()
    core = make_core(clock)
    a, b = core.leased(leases(clock, 2), clock.now())
    clock.advance(16.0)
    effects, _ = run(core.heartbeat(clock.now()),
                     lambda e: LeaseLost("stale") if e.job is a else e.lease)
    assert [e.job for e in effects] == [a, b] and a.lost and not b.lost
    clock.advance(20.0)
    assert [e.job for e in run(core.heartbeat(clock.now()), lambda e: e.lease)[0]] == [b]  # a: no more


@pytest.mark.parametrize("seconds", [0, -1, VISIBILITY_TIMEOUT_S_MAX + 1])
def test_ctx_extend_out_of_range_is_refused_before_any_call(seconds):
    clock = FakeClock()
    core = make_core(clock)
    job, = core.leased(leases(clock, 1), clock.now())
    with pytest.raises(InvalidJob):
        next(core.extend(job, seconds))


def test_ctx_extend_sets_the_lease_length_of_later_heartbeats_and_a_lost_lease_raises():
    clock = FakeClock()
    core = make_core(clock)
    job, = core.leased(leases(clock, 1), clock.now())
    effects, deadline = run(core.extend(job, VISIBILITY_TIMEOUT_S_MAX),
                            lambda e: e.lease._replace(deadline=clock.now() + e.seconds))
    assert effects[0].seconds == VISIBILITY_TIMEOUT_S_MAX and deadline == clock.now() + VISIBILITY_TIMEOUT_S_MAX
    assert job.lease_s == VISIBILITY_TIMEOUT_S_MAX
    with pytest.raises(LeaseLost):
        run(core.extend(job, 5.0), lambda e: LeaseLost("stale"))
    assert job.lost
    with pytest.raises(LeaseLost):  # known lost: no call at all
        next(core.extend(job, 5.0))


def test_an_ack_that_meets_an_outage_waits_in_the_outbox_until_it_lands_or_the_lease_ends():
    clock = FakeClock()
    core = make_core(clock)
    a, b = core.leased(leases(clock, 2), clock.now())
    settle = core.finished(a, (DONE, None, None))
    assert settle.op == ACK and core.stats.succeeded == 0  # counts when it lands
    assert core.answered(a, settle, ShardUnavailable("down")) and core.stats.unavailable == 1
    assert core.outbox_due() == [(a, settle)]
    assert not core.answered(a, settle, None) and core.stats.succeeded == 1 and a.ref not in core.jobs
    settle_b = core.finished(b, (DONE, None, None))
    core.answered(b, settle_b, ShardUnavailable("down"))
    clock.advance(31.0)  # past b's deadline: given up, counted lost, out of hand
    assert core.outbox_due() == [] and core.stats.lost == 1 and core.jobs == {}


def test_a_failure_counts_at_once_and_stays_in_hand_until_its_nack_lands():
    clock = FakeClock()
    core = make_core(clock)
    job, = core.leased(leases(clock, 1), clock.now())
    settle = core.finished(job, (FAILED, "E: x", None))
    assert (settle.op, settle.delay_s, core.stats.failed) == (NACK, 1.0, 1) and job.ref in core.jobs
    assert not core.answered(job, settle, None) and core.jobs == {} and core.stats.failed == 1


def test_reports_land_before_the_ack_an_outage_keeps_what_did_not_land_a_refusal_fails_it():
    clock = FakeClock()
    core = make_core(clock)
    a, b, c = core.leased(leases(clock, 3), clock.now())
    r1, r2 = Report("put_result", (b"1", 60.0)), Report("arrive", (0, "bar", 0, 2, b"", 60.0, []))
    for job in (a, b, c):
        job.reports[:] = [r1, r2]
    ok = core.finished(a, (DONE, None, None))
    assert core.reported(a, ok, [None, None]) == (ok, None) and a.reports == []
    ok_b = core.finished(b, (DONE, None, None))
    down = ShardUnavailable("down")
    assert core.reported(b, ok_b, [None, down]) == (None, down) and b.reports == [r2]
    ok_c = core.finished(c, (DONE, None, None))
    decided, _ = core.reported(c, ok_c, [InvalidJob("barrier full"), None])
    assert decided.op == NACK and decided.error == "InvalidJob: barrier full" and core.stats.failed == 1
    lost, _ = core.reported(a, ok, [JobGone("gone")])
    assert lost.op == NOTHING and core.stats.lost == 1 and a.ref not in core.jobs


def test_a_job_let_go_makes_the_burst_answers_asked_while_it_was_held_stale():
    """Queue b's worker asks (and will find nothing); meanwhile a's job, held all along
    without a's loop turning, sends b a job and is settled; a then finds a empty. b's
    answer, asked while a held that job, must not end the burst (it once could)."""
    clock = FakeClock()
    core = make_core(clock)
    burst = Burst(["a", "b"])
    job, = core.leased(leases(clock, 1), clock.now())
    b_token = burst.asking()          # b's dequeue, asked while a holds its job
    core.forget(job)                  # a's job settled (it sent b a job)
    a_token = core.burst_token(burst, "a")
    assert not burst.answered("a", a_token, 0, 0)
    assert not burst.answered("b", b_token, 0, 0)  # stale: b asks again and finds the job
    assert burst.answered("b", burst.asking(), 0, 0)  # b's next empty answer counts
