"""One behaviour suite for every worker runner.

Each scenario is one test taking the ``driver`` fixture, so it runs on the thread runner
(:class:`~shardq.consumer.worker.Worker`), the process runner (``Worker(mode="process")``: the
task runs in a pool process) and the asyncio runner (:class:`~shardq.consumer.aioworker.AsyncWorker`),
with a plain and an ``async def`` task (the process runner with a plain one: its start-up
costs): a scenario cannot be written for one runner only. The tasks are
tests/support/driver_tasks.py's; what one does is a function of that module the test picks,
and it reports back through files, so the same scenario runs in a pool process. Every
runner works against the in-memory FakeQueue of tests/support/fakes.py (the asyncio one
through a thin async facade over the same object) on a FakeClock, so a lease expires only
when a test moves the clock, and all see the same injected failures: a shard that is down
for one op (``FakeQueue.unavailable``), an idempotency store that fails at BEGIN, at the
claim, at COMMIT or at ROLLBACK (:class:`~support.driver_tasks.FlakyStore`). Where a runner
differs by design (process mode keeps no results and checks the lease before the commit in
the parent only: docs/guarantees.md; the asyncio runner prefetches nothing), the scenario
says what each one does. A few scenarios run a plain handler (no task: support.driver_tasks.Raw),
a worker process (signals), or the real service (shard processes, one for the module, a
queue per runner, through the router and the asyncio client). What stays in
test_worker.py and test_aioworker.py is one runner's own mechanism, and says so.

Synchronisation is by events and by polls with a deadline, never by sleeping.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from support.service import REPO, Service, wait_until
from support.fakes import ACKED, DEAD, LEASED, READY, AsyncFacade, BuryingQueue, FakeQueue
from shardq.clock import FakeClock
from shardq.consumer.aioworker import AsyncWorker
from shardq.consumer.idempotency import IdempotencyStore, MemoryStore, SqliteStore
from support.driver_tasks import (Ctl, FlakyStore, Raw, TopRng, boom, effects, fail_as, fail_first,
                                  fail_first_after_effect, fail_job_zero, handler, hold, hold_first, log_attempt,
                                  log_n, nothing, service_work, sigterm_first, undecodable, wait_sent, chaos)
from shardq.consumer.policy import Burst
from shardq.limits import LOG_EVERY_S_MAX
from shardq.errors import InvalidConfig
from shardq.tasks.body import NO_STEPS, Steps, encode
from shardq.consumer.worker import Worker
from shardq.consumer.options import CONCURRENCY_MAX, WorkerOptions
from shardq.limits import DELAY_S_MAX, QUEUE_NAME_BYTES_MAX

VISIBILITY_S = 30.0
MAX_DELIVERIES = 4
NEVER = 10**9  # FakeQueue.unavailable count: down until the test brings the shard back


# ---------------------------------------------------------------------------- drivers
class Driver:
    """One worker runner running one kind of task, on a FakeQueue and a FakeClock.

    ``define(work)`` picks what the task does (a function of support.driver_tasks, see
    there); the task then writes its effect through ``ctx.db`` when there is a store.
    ``start(store)`` runs the worker in a thread until ``stop()``."""

    def __init__(self, runner: str, kind: str, tmp: str):
        self.runner, self.kind, self.tmp = runner, kind, tmp
        self.ctl = Ctl(tmp)
        self.clock = FakeClock()
        self.q = BuryingQueue(self.clock, visibility_timeout=VISIBILITY_S, max_deliveries=MAX_DELIVERIES)
        self.keep_result: float | None = None
        self.worker = None
        self._thread: threading.Thread | None = None

    def define(self, work, keep_result: float | None = None) -> None:
        """``keep_result``: the task keeps its return value (``n``) that long: its worker
        reports it (``ctx.report``) before the ack."""
        self.keep_result = keep_result
        self.ctl.put_work(work)

    def send(self, n: int = 0, job_id: int | None = None) -> int:
        """``job_id``: deliver that id (again), as after a crash between the commit and the ack."""
        steps = NO_STEPS if self.keep_result is None else Steps(self.keep_result, None, None)
        name = "suite.task" if self.kind == "sync" else "suite.atask"
        return self.q.enqueue(encode(name, [n, self.ctl.path], {}, steps=steps), job_id=job_id)

    def store(self, flaky: bool = False) -> IdempotencyStore:
        """An idempotency store the runner can use: in memory, or SQLite for the process
        runner (its pool processes open it again); ``flaky``: a FlakyStore around it."""
        store = (SqliteStore(os.path.join(self.tmp, "idem.sqlite"), clock=self.clock)
                 if self.runner == "process" else MemoryStore(clock=self.clock))
        return FlakyStore(store, self.tmp) if flaky else store

    def send_raw(self) -> int:
        """A job for a plain handler (``start(raw=True)``): its body is the control directory."""
        return self.q.enqueue(self.ctl.path.encode())

    def start(self, store: IdempotencyStore | None = None, max_jobs: int | None = None, raw: bool = False,
              **options) -> None:
        """``options``: more arguments of the worker (``burst``, ``log_every_s``...);
        ``max_jobs``: ``run(max_jobs)``; ``raw``: a plain handler (:class:`Raw`), no task."""
        self.build(store, raw, **options)
        self._thread = threading.Thread(target=self.worker.run, args=(max_jobs,), daemon=True, name="suite-worker")
        self._thread.start()

    def build(self, store: IdempotencyStore | None = None, raw: bool = False, **options):
        """The worker :meth:`start` runs (``worker.run()`` in this thread is the test's)."""
        common = dict(queue="default", concurrency=2, idempotency=store, clock=self.clock,
                      rng=TopRng(), backoff_base_s=1.0, backoff_cap_s=300.0, grace_s=5.0,
                      idle_wait_s=0.01, prune_every_s=None)
        common.update(options)
        work = Raw() if raw else handler()
        if self.runner == "asyncio":
            self.worker = AsyncWorker(AsyncFacade(self.q), work, **common)
        else:
            self.worker = Worker(self.q, work, mode=self.runner, poll_s=0.005, **common)
        return self.worker

    def returned(self) -> bool:
        """Whether the worker's ``run`` has returned (by itself, unless stop() was called)."""
        return self._thread is not None and not self._thread.is_alive()

    def stop(self) -> None:
        if self.worker is not None and self._thread is not None:  # else run() was the test's
            self.worker.stop()
            self._thread.join(10)
            assert not self._thread.is_alive(), "the worker did not stop"

    def unavailable(self, op: str) -> int:
        with self.q._cond:
            return self.q.calls.count(("unavailable", op))


@pytest.fixture(params=[("thread", "sync"), ("thread", "async"), ("process", "sync"), ("asyncio", "async"),
                        ("asyncio", "sync")], ids=lambda p: f"{p[0]}-{p[1]}")
def driver(request, tmp_path):
    d = Driver(*request.param, str(tmp_path))
    yield d
    d.ctl.set("release")  # a task still held lets go
    d.stop()


# ---------------------------------------------------------------------------- scenarios
def test_success_is_acked_with_its_effect_once(driver):
    store = driver.store()
    driver.define(nothing)
    ids = [driver.send(n) for n in range(3)]
    driver.start(store)
    wait_until(lambda: all(driver.q.state(i) == ACKED for i in ids), what="every job acked")
    driver.stop()
    assert effects(store) == {i: 1 for i in ids} and all(store.seen(i) for i in ids)
    assert driver.worker.stats.succeeded == 3 and driver.worker.stats.failed == 0


def test_the_workers_metrics_count_its_jobs_time_its_handlers_and_its_leases_in_hand(driver):
    """Every runner reports to ``--metrics`` (the worker core counts, times and holds):
    the asyncio runner took no metrics, so ``shardq worker --metrics`` showed nothing of a
    queue with an ``async def`` task (walkthrough: 7 ok, no series)."""
    from shardq.consumer.metrics import WorkerMetrics
    metrics = WorkerMetrics(task="suite")
    driver.define(fail_job_zero)
    ids = [driver.send(n) for n in range(4)]  # job 0 fails its first delivery, the others pass
    driver.start(metrics=metrics)
    wait_until(lambda: sum(driver.q.state(i) == ACKED for i in ids) == 3, what="three jobs acked")
    driver.stop()

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"task": "suite", **labels}) or 0.0

    assert value("shardq_worker_jobs_total", outcome="done") == 3
    assert value("shardq_worker_jobs_total", outcome="failed") >= 1
    assert value("shardq_worker_handler_seconds_count") >= 4  # each run timed, the failed one too
    assert metrics.registry.get_sample_value("shardq_worker_in_flight") == 0  # none held once stopped


def test_run_max_jobs_returns_once_that_many_leases_are_settled(driver):
    """``run(max_jobs)``: never more leased than that (the prefetch too), the rest left ready.
    The asyncio runner took no ``max_jobs`` (its core did): it does now (issue 45)."""
    driver.define(nothing)
    ids = [driver.send(n) for n in range(5)]
    driver.start(max_jobs=3, concurrency=2, prefetch=2)
    wait_until(driver.returned, what="run(max_jobs=3) returning by itself")
    assert (driver.worker.stats.leased, driver.worker.stats.succeeded) == (3, 3)
    assert [driver.q.state(i) for i in ids] == [ACKED] * 3 + [READY] * 2
    assert driver.q.job(ids[3]).attempts == 0


def test_an_effect_written_before_an_error_rolls_back_and_leaves_no_mark(driver):
    store = driver.store()
    driver.define(fail_first_after_effect)
    job_id = driver.send()
    driver.start(store)
    wait_until(lambda: driver.q.ops("nack"), what="the failed attempt nacked")
    assert effects(store) == {} and not store.seen(job_id)
    (_, jid, delay, error), = driver.q.ops("nack")
    assert (jid, delay, error.splitlines()[0]) == (job_id, 1.0, "RuntimeError: after the write")
    driver.clock.advance(1.0)  # the backoff
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the retry acked")
    driver.stop()
    assert effects(store) == {job_id: 1} and store.seen(job_id) and driver.q.job(job_id).attempts == 2


def test_a_plain_handler_gets_the_workers_backoff_capped_and_its_last_failure_is_not_delayed(driver):
    """A plain handler (no task, so no task's retry policy): the worker's own full-jitter
    backoff, doubling up to ``backoff_cap_s``; the failure that dead-letters is not delayed."""
    driver.define(boom)
    job_id = driver.send_raw()
    driver.start(raw=True, backoff_base_s=1.0, backoff_cap_s=3.0)
    delays = []
    for attempt in range(1, MAX_DELIVERIES + 1):
        wait_until(lambda: len(driver.q.ops("nack")) == attempt, what=f"nack {attempt}")
        _, jid, delay, error = driver.q.ops("nack")[-1]
        assert (jid, error.splitlines()[0]) == (job_id, f"ValueError: boom {attempt}")
        delays.append(delay)
        if delay:
            assert driver.q.state(job_id) == READY and driver.q.job(job_id).ready_at == driver.clock.now() + delay
            driver.clock.advance(delay)  # delayed, not a long lease: nothing runs before this
    assert delays == [1.0, 2.0, 3.0, 0.0]
    wait_until(lambda: driver.q.state(job_id) == DEAD, what="dead-lettered")
    driver.stop()
    assert driver.q.dead[0].attempts == MAX_DELIVERIES
    assert driver.q.dead[0].error.splitlines()[0] == f"ValueError: boom {MAX_DELIVERIES}"
    assert driver.worker.stats.failed == MAX_DELIVERIES


def test_an_error_is_nacked_with_backoff_then_dead_lettered_with_its_text(driver):
    driver.define(boom)
    job_id = driver.send()
    driver.start()
    delays = []
    for attempt in range(1, MAX_DELIVERIES + 1):
        wait_until(lambda: len(driver.q.ops("nack")) == attempt, what=f"nack {attempt}")
        _, jid, delay, error = driver.q.ops("nack")[-1]
        assert jid == job_id and error.splitlines()[0] == f"ValueError: boom {attempt}"
        assert "Traceback" in error  # the task's traceback, in the error text
        delays.append(delay)
        driver.clock.advance(delay)  # the job waits out its backoff in the delayed state
    assert delays == [1.0, 2.0, 4.0, 8.0]  # the task's Exponential(1, 300), full jitter at the top
    wait_until(lambda: driver.q.state(job_id) == DEAD, what="dead-lettered")
    dead = driver.q.dead[0]
    assert dead.attempts == MAX_DELIVERIES and dead.error.splitlines()[0] == f"ValueError: boom {MAX_DELIVERIES}"
    driver.stop()
    assert driver.worker.stats.failed == MAX_DELIVERIES


def test_an_error_text_the_wire_cannot_carry_is_made_text_it_can(driver):
    """A lone surrogate in an error (an OS error's undecodable file name) made the bury's
    text unencodable: the client refused it, and the Fail ran again when its lease ended."""
    driver.define(undecodable)
    job_id = driver.send()
    driver.start()
    wait_until(lambda: driver.q.state(job_id) == DEAD, what="dead-lettered")
    driver.stop()
    error = driver.q.dead[0].error
    assert "bad file ?.csv" in error and error.encode("utf-8")
    assert driver.q.dead[0].attempts == 1


@pytest.mark.parametrize("op", ["ack", "nack", "bury"])
def test_a_settlement_that_meets_a_shard_down_is_retried_and_lands_when_it_is_back(driver, op):
    """The outbox: an ack, a nack or a bury that got ShardUnavailable is kept and retried,
    with the lease held (not lost, not redelivered), until the shard answers."""
    driver.define(functools.partial(fail_as, op))
    job_id = driver.send()
    driver.q.unavailable[op] = NEVER
    driver.start()
    wait_until(lambda: driver.unavailable(op) >= 3, what=f"{op} retried while the shard is down")
    assert driver.q.state(job_id) == LEASED and driver.q.job(job_id).attempts == 1
    with driver.q._cond:
        driver.q.unavailable[op] = 0  # the shard is back
    if op == "ack":
        wait_until(lambda: driver.q.state(job_id) == ACKED, what="the ack landed")
    elif op == "nack":
        wait_until(lambda: driver.q.ops("nack"), what="the nack landed")
        assert driver.q.ops("nack") == [("nack", job_id, 1.0, driver.q.job(job_id).error)]
        assert driver.q.job(job_id).error.startswith("ValueError: try again")
        assert driver.q.state(job_id) == READY and driver.q.job(job_id).ready_at == driver.clock.now() + 1.0
    else:
        wait_until(lambda: driver.q.state(job_id) == DEAD, what="the bury landed")
        assert driver.q.dead[0].error == "no such user" and driver.q.dead[0].attempts == 1
    driver.stop()
    stats = driver.worker.stats
    assert stats.unavailable >= 3 and stats.lost == 0
    assert (stats.succeeded, stats.failed) == ((1, 0) if op == "ack" else (0, 1))


def test_a_kept_result_lands_before_the_ack_which_waits_while_its_shard_is_down(driver):
    """A finished job's reports (here its kept result) are made by the runner before its
    ack; one that meets an unavailable shard is retried, the lease held and the ack unsent,
    until it lands; then the ack goes. The process runner keeps no results (its pool
    processes have no client): such a job is dead-lettered at once, saying so."""
    driver.define(nothing, keep_result=60.0)
    job_id = driver.send(7)
    driver.q.unavailable["report"] = NEVER
    driver.start()
    if _refuses_results(driver, job_id):
        return
    wait_until(lambda: driver.unavailable("report") >= 3, what="the report retried while its shard is down")
    assert driver.q.state(job_id) == LEASED and driver.q.ops("ack") == [] and driver.q.reported == []
    with driver.q._cond:
        driver.q.unavailable["report"] = 0  # the shard is back
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the ack, after the report")
    driver.stop()
    calls = driver.q.calls
    assert calls.index(("report", "put_result", job_id)) < next(i for i, c in enumerate(calls) if c[0] == "ack")
    (got_id, report), = driver.q.reported
    assert got_id == job_id and report.op == "put_result" and report.args == (b"\x07", 60.0)
    stats = driver.worker.stats
    assert (stats.succeeded, stats.failed, stats.lost) == (1, 0, 0) and stats.unavailable >= 3


def test_a_refused_report_fails_the_attempt_with_its_text_and_is_not_acked(driver):
    """A report the shard refuses (a barrier over its limit, a callback's queue full) is a
    failed attempt: nacked with backoff and the refusal's text, never acked."""
    driver.define(nothing, keep_result=60.0)
    job_id = driver.send(1)
    driver.q.refuse_reports = "barrier b: its values would take 33554433 bytes"
    driver.start()
    if _refuses_results(driver, job_id):
        return
    wait_until(lambda: driver.q.ops("nack"), what="the nack")
    driver.stop()
    (_, jid, delay, error), = driver.q.ops("nack")
    assert jid == job_id and delay == 1.0 and error == "InvalidJob: barrier b: its values would take 33554433 bytes"
    assert driver.q.ops("ack") == [] and driver.q.reported == [] and driver.q.state(job_id) == READY
    assert (driver.worker.stats.succeeded, driver.worker.stats.failed) == (0, 1)


def _refuses_results(driver, job_id) -> bool:
    """The process runner: the job that keeps a result is dead-lettered with the reason."""
    if driver.runner != "process":
        return False
    wait_until(lambda: driver.q.state(job_id) == DEAD, what="dead-lettered")
    driver.stop()
    assert "needs a worker in thread or asyncio mode" in driver.q.dead[0].error and driver.q.reported == []
    assert driver.q.ops("ack") == [] and driver.worker.stats.failed == 1
    return True


def test_an_ack_still_unsent_when_the_lease_ends_is_given_up_and_the_redelivery_acks(driver):
    """Past the lease's deadline the outbox gives the ack up (the queue redelivers the job);
    the store's mark makes the redelivery a duplicate, acked once the shard is back."""
    store = driver.store()
    driver.define(nothing)
    job_id = driver.send()
    driver.q.unavailable["ack"] = NEVER
    driver.start(store)
    wait_until(lambda: driver.unavailable("ack") >= 1, what="the ack met the shard down")
    assert store.seen(job_id)
    driver.clock.advance(VISIBILITY_S + 1)
    wait_until(lambda: driver.q.job(job_id).attempts == 2, what="the redelivery")
    wait_until(lambda: driver.worker.stats.lost == 1, what="the first ack given up")
    with driver.q._cond:
        driver.q.unavailable["ack"] = 0
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the duplicate acked")
    driver.stop()
    assert effects(store) == {job_id: 1}
    assert driver.worker.stats.duplicates == 1 and driver.worker.stats.succeeded == 0


@pytest.mark.parametrize("point", ["begin", "claim", "commit"])
def test_an_idempotency_store_error_is_a_failed_attempt_with_its_text(driver, point):
    """The store down at BEGIN, at the claim or at COMMIT: the attempt fails (rolled back,
    nacked with the worker's backoff and the error text), it is not left to expire."""
    store = driver.store(flaky=True)
    store.arm(point)
    driver.define(nothing)
    job_id = driver.send()
    driver.start(store)
    wait_until(lambda: driver.q.ops("nack"), what="the failed attempt nacked")
    assert driver.q.ops("nack") == [
        ("nack", job_id, 1.0, f"StoreDown: the database went away at {point.upper()}")]
    assert effects(store) == {} and not store.seen(job_id)
    driver.clock.advance(1.0)  # the backoff; the store is back
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the retry acked")
    driver.stop()
    assert effects(store) == {job_id: 1} and driver.q.job(job_id).attempts == 2
    assert driver.worker.stats.failed == 1 and driver.worker.stats.succeeded == 1


def test_a_failed_rollback_is_a_failed_attempt_with_its_text(driver):
    """The task fails and rolling its transaction back fails too (the connection is gone):
    the store's error is the attempt's failure, nacked, never a silent lease expiry."""
    store = driver.store(flaky=True)
    store.arm("rollback")
    driver.define(fail_first)
    job_id = driver.send()
    driver.start(store)
    wait_until(lambda: driver.q.ops("nack"), what="the failed attempt nacked")
    assert driver.q.ops("nack") == [("nack", job_id, 1.0, "StoreDown: the database went away at ROLLBACK")]
    driver.clock.advance(1.0)
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the retry acked")
    driver.stop()
    assert effects(store) == {job_id: 1} and driver.worker.stats.failed == 1


def test_heartbeats_keep_a_job_that_outlives_its_lease(driver):
    driver.define(hold)
    job_id = driver.send()
    driver.start()
    assert driver.ctl.wait("started")
    extended = lambda: [op for op in driver.q.ops("extend") if op[3]]  # noqa: E731 - the successful ones
    driver.clock.advance(VISIBILITY_S / 2 + 1)  # past half the lease: a heartbeat is due
    wait_until(lambda: len(extended()) >= 1, what="the first heartbeat")
    driver.clock.advance(VISIBILITY_S / 2 + 5)  # past the first deadline, before the extended one
    wait_until(lambda: len(extended()) >= 2, what="the second heartbeat")
    driver.ctl.set("release")
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="acked")
    driver.stop()
    assert driver.ctl.read("attempts") == [1] and driver.q.job(job_id).attempts == 1
    assert driver.worker.stats.succeeded == 1 and driver.worker.stats.lost == 0


def test_a_heartbeat_that_meets_a_shard_down_ends_its_tick_and_an_answer_resets_the_backoff(driver, caplog):
    """After ShardUnavailable the heartbeat extends no other lease in that tick (the next
    tick starts again with the first), and the next lease it extends resets the backoff, so
    a later outage waits the minimum again. The asyncio runner used to extend the other
    leases of the tick and keep doubling its backoff (issue 45)."""
    driver.define(hold)
    ids = [driver.send(n) for n in range(2)]
    with caplog.at_level(logging.WARNING, logger="shardq.worker"):
        driver.start()
        wait_until(lambda: len(driver.ctl.read("running")) == 2, what="both jobs running")
        extended = lambda: [op[1] for op in driver.q.ops("extend") if op[3]]  # noqa: E731 - the successful ones
        with driver.q._cond:
            driver.q.unavailable["extend"] = 1
        driver.clock.advance(VISIBILITY_S / 2 + 1)
        wait_until(lambda: len(extended()) >= 2, what="both leases extended after the outage")
        assert extended()[:2] == ids  # the tick ended at the outage: the next one began with ids[0]
        with driver.q._cond:
            driver.q.unavailable["extend"] = 1
        driver.clock.advance(VISIBILITY_S / 2 + 1)
        wait_until(lambda: len(extended()) >= 4, what="both leases extended after the second outage")
        driver.ctl.set("release")
        wait_until(lambda: all(driver.q.state(i) == ACKED for i in ids), what="both acked")
        driver.stop()
    waits = [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records
             if r.getMessage().startswith("extend: shard unavailable")]
    assert waits == ["0.1s", "0.1s"]  # reset by the extend that answered in between
    assert driver.worker.stats.unavailable == 2 and driver.worker.stats.lost == 0


def test_a_lease_lost_while_running_is_not_acked_and_its_effect_rolls_back(driver):
    """The lease expires under a running job (no heartbeat came in time) and a second
    runner leases the job again: the heartbeat finds the first lease lost, the late finish
    commits nothing; the redelivery runs, commits its effect once and is acked. The process
    runner checks the lease in the parent only (docs/guarantees.md): the late finish commits
    in its pool process and acks late (fenced by the redelivery, which finds the mark, or
    deleting the job before one); the effect is once all the same."""
    store = driver.store()
    driver.define(hold_first)
    job_id = driver.send()
    driver.start(store)
    assert driver.ctl.wait("started")
    driver.clock.advance(VISIBILITY_S + 1)  # past the deadline before any heartbeat
    wait_until(lambda: any(not op[3] for op in driver.q.ops("extend")), what="a heartbeat finding it lost")
    driver.ctl.set("release")
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the redelivery acked")
    driver.stop()
    assert effects(store) == {job_id: 1}
    (_, _, token), = driver.q.ops("ack")
    assert token == driver.q.job(job_id).history[-2][1]  # the second lease's ack, the only one
    stats = driver.worker.stats
    leases = sum(1 for event in driver.q.job(job_id).history if event[0] == "lease")
    assert stats.succeeded + stats.duplicates + stats.lost == leases  # each delivery counted once
    if driver.runner == "process":
        # The late finish committed and acked late: the ack deleted the job before a
        # redelivery, was fenced by it (lost), or found the job it acked gone; a redelivery
        # found the mark (duplicate)
        assert driver.ctl.read("attempts") == [1]
    else:
        # The late finish rolled back (lost), or found the redelivery's commit first
        # (duplicate) and acked late: fenced, or the job gone by then
        assert driver.ctl.read("attempts") == [1, 2] and stats.succeeded == 1 and leases == 2


def test_a_run_past_its_lease_acks_late_and_its_job_is_not_run_again(driver):
    """No store, one runner, nothing prefetched: the lease runs out under a running job
    (its heartbeat finds it lost) and nobody leases the job meanwhile; the run's effect is
    done, so the worker acks all the same, and the late ack deletes the job, as a shard's
    does (docs/guarantees.md). Before, the worker sent nothing and the job ran again."""
    driver.define(hold_first)
    job_id = driver.send()
    driver.start(concurrency=1, prefetch=0)
    assert driver.ctl.wait("started")
    driver.clock.advance(VISIBILITY_S + 1)
    wait_until(lambda: any(not op[3] for op in driver.q.ops("extend")), what="a heartbeat finding it lost")
    driver.ctl.set("release")
    wait_until(lambda: driver.q.state(job_id) == ACKED, what="the job acked")
    driver.stop()
    assert driver.ctl.read("attempts") == [1]
    assert (driver.worker.stats.succeeded, driver.worker.stats.lost) == (1, 0)


def test_a_prefetched_lease_is_heartbeated_while_it_waits_for_a_runner(driver):
    """One runner, prefetch 1: the thread and process runners hold a second lease while the
    first job runs, and extend it too; waiting did not burn a delivery. The asyncio runner
    starts each job as it is leased (prefetch 0): it holds one lease, the second job waits
    in the queue, unleased."""
    driver.define(hold)
    a, b = driver.send(0), driver.send(1)
    driver.start(concurrency=1, prefetch=1)
    assert driver.ctl.wait("started")
    prefetches = driver.runner != "asyncio"
    if prefetches:
        wait_until(lambda: driver.q.max_leased == 2, what="a running, b prefetched")
    extended = lambda: {op[1] for op in driver.q.ops("extend") if op[3]}  # noqa: E731 - the successful ones
    for step in (1, 2):  # 16 s, then 32 s: past the first deadline (30)
        driver.clock.advance(16)
        wait_until(lambda: len([op for op in driver.q.ops("extend") if op[3]]) >= step * (2 if prefetches else 1),
                   what="the leases held extended")
    assert extended() == ({a, b} if prefetches else {a})
    assert driver.q.max_leased == (2 if prefetches else 1) and driver.q.job(b).attempts == (1 if prefetches else 0)
    driver.ctl.set("release")
    wait_until(lambda: driver.q.state(b) == ACKED, what="both acked")
    driver.stop()
    assert driver.q.state(a) == ACKED and driver.q.job(b).attempts == 1 and driver.worker.stats.lost == 0


def test_stop_releases_the_prefetched_leases_at_once_uncounted(driver):
    """stop(): the leases not started yet are released at once (``delivered=False``: not a
    delivery), while the running jobs finish. The asyncio runner prefetches nothing: there
    is nothing to release."""
    driver.define(hold)
    ids = [driver.send(n) for n in range(4)]
    driver.start(concurrency=2, prefetch=1)
    prefetches = driver.runner != "asyncio"
    wait_until(lambda: len(driver.ctl.read("running")) == 2, what="2 running")
    wait_until(lambda: driver.q.max_leased == (3 if prefetches else 2), what="1 prefetched")
    driver.worker.stop()
    if prefetches:
        wait_until(lambda: driver.q.ops("nack"), what="the pending lease released")
        assert driver.q.ops("nack") == [("nack", ids[2], 0.0, None)]
    assert not driver.returned()  # still waiting for the running jobs
    driver.ctl.set("release")
    wait_until(driver.returned, what="the worker returning")
    assert [driver.q.state(i) for i in ids] == [ACKED, ACKED, READY, READY]
    assert driver.q.job(ids[2]).attempts == 0 and driver.q.job(ids[3]).attempts == 0
    stats = driver.worker.stats
    assert (stats.succeeded, stats.released) == (2, 1 if prefetches else 0)
    assert driver.q.ops("nack") == ([("nack", ids[2], 0.0, None)] if prefetches else [])


def test_stop_lets_running_jobs_finish_within_the_grace_period(driver):
    driver.define(hold)
    ids = [driver.send(n) for n in range(2)]
    driver.start()
    wait_until(lambda: len(driver.ctl.read("running")) == 2, what="both jobs running")
    driver.worker.stop()
    assert not driver.returned()  # waiting for the running jobs
    driver.ctl.set("release")
    wait_until(driver.returned, what="the worker returning once they finished")
    assert [driver.q.state(i) for i in ids] == [ACKED, ACKED]
    assert driver.worker.stats.succeeded == 2 and driver.worker.stats.abandoned == 0


def test_after_the_grace_period_running_jobs_are_released_and_not_acked(driver, caplog):
    """The grace period runs on the worker's clock (the asyncio runner used the event loop's
    own, so a worker on another clock waited out ``grace_s`` in real time): once it is
    over, the jobs still running are released for redelivery and counted abandoned (the
    last line says so: it did not), and whatever they wrote rolls back."""
    caplog.set_level(logging.INFO, logger="shardq.worker")
    store = driver.store()
    driver.define(hold)
    job_id = driver.send()
    driver.start(store, grace_s=10.0)
    try:
        assert driver.ctl.wait("started")
        driver.worker.stop()
        driver.clock.advance(11.0)  # past the grace period, not past the lease
        wait_until(lambda: driver.q.ops("nack"), timeout=5, what="the release after the grace period")
        assert driver.q.ops("nack") == [("nack", job_id, 0.0, None)] and driver.q.state(job_id) == READY
        assert driver.worker.stats.abandoned == 1
    finally:
        driver.ctl.set("release")  # asyncio.run() waits for the threads it started before it returns
    wait_until(driver.returned, what="the worker returning")
    # The abandoned job ends after all (a runner thread lets go, a pool process was killed,
    # an asyncio task was cancelled): its transaction must not commit.
    wait_until(lambda: not any(t.name.startswith("shardq-runner") for t in threading.enumerate()),
               what="the runner threads ending")
    assert driver.q.ops("ack") == [] and driver.worker.stats.succeeded == 0
    assert effects(store) == {} and not store.seen(job_id)
    assert any(r.getMessage().startswith("queue default: stopped after") and
               r.getMessage().endswith("; 1 abandoned (running when the grace period ended)") for r in caplog.records)


def test_a_lease_delivered_after_its_deadline_is_not_started(driver):
    """Delivered late (celery#7918): the deadline has passed before the job could start,
    so it is not run; its redelivery is."""
    driver.define(log_attempt)
    job_id = driver.send()
    driver.q.deliver_expired = 1
    driver.start(burst=True)
    wait_until(driver.returned, what="the burst worker returning")
    assert driver.ctl.read("attempts") == [2] and driver.q.state(job_id) == ACKED
    assert (driver.worker.stats.expired, driver.worker.stats.succeeded) == (1, 1)


def test_a_job_already_processed_is_not_run_again_and_is_acked(driver):
    store = driver.store()
    driver.define(log_n)
    job_id = driver.send()
    with store.transaction() as txn:
        txn.claim(job_id)
    driver.start(store, burst=True)
    wait_until(driver.returned, what="the burst worker returning")
    assert driver.ctl.read("ran") == [] and driver.q.state(job_id) == ACKED and driver.worker.stats.duplicates == 1


def test_a_job_id_delivered_again_after_its_commit_runs_once_and_both_are_acked(driver):
    """As after a crash between the commit and the ack: the second delivery finds the mark."""
    store = driver.store()
    driver.define(log_n)
    driver.send(1, job_id=100)
    driver.send(2, job_id=100)
    driver.start(store, concurrency=1, burst=True)
    wait_until(driver.returned, what="the burst worker returning")
    assert driver.ctl.read("ran") == [1] and effects(store) == {100: 1} and store.seen(100)
    assert [j.state for j in driver.q.jobs.values()] == [ACKED, ACKED]
    assert (driver.worker.stats.succeeded, driver.worker.stats.duplicates) == (1, 1)


def test_two_deliveries_of_one_id_running_at_once_commit_one_effect(driver):
    """Both are past the seen check before either commits: the UNIQUE claim lets one commit,
    the other is a duplicate; both are acked."""
    store = driver.store()
    driver.define(hold)
    driver.send(1, job_id=7)
    driver.send(2, job_id=7)
    driver.start(store, burst=True)
    wait_until(lambda: len(driver.ctl.read("running")) == 2, what="both running")
    driver.ctl.set("release")
    wait_until(driver.returned, what="the burst worker returning")
    assert effects(store) == {7: 1} and all(j.state == ACKED for j in driver.q.jobs.values())
    assert (driver.worker.stats.succeeded, driver.worker.stats.duplicates) == (1, 1)


def test_a_worker_never_holds_more_than_concurrency_plus_prefetch(driver):
    """Saturated (every runner busy), a worker holds ``concurrency + prefetch`` leases: the
    thread and process runners prefetch, the asyncio runner starts each job as it is leased
    (its prefetch is 0)."""
    driver.define(hold)
    for n in range(8):
        driver.send(n)
    driver.start(concurrency=3, prefetch=1, burst=True)
    wait_until(lambda: len(driver.ctl.read("running")) == 3, what="three running")
    wait_until(lambda: driver.q.max_leased == (3 if driver.runner == "asyncio" else 4), what="the prefetch")
    driver.ctl.set("release")
    wait_until(driver.returned, what="the burst worker returning")
    assert driver.q.max_leased == (3 if driver.runner == "asyncio" else 4)
    assert all(j.state == ACKED for j in driver.q.jobs.values()) and driver.worker.stats.succeeded == 8


def test_the_idempotency_store_is_pruned_when_the_worker_starts_and_every_prune_every_s(driver):
    """Every runner prunes its store (the asyncio runner used to keep every mark for ever)."""
    store = driver.store()
    with store.transaction() as txn:
        txn.claim(1)
    driver.clock.advance(store.retention_s + 1)  # the mark is past its retention
    driver.define(nothing)
    driver.start(store, prune_every_s=3600.0)
    wait_until(lambda: not store.seen(1), what="the old mark pruned")
    driver.stop()


def test_outages_of_the_config_the_dequeue_and_the_ack_are_waited_out(driver):
    driver.define(nothing)
    ids = [driver.send(n) for n in range(2)]
    # acks: in one ack_many on the threaded runner, one ack per job on the asyncio one
    driver.q.unavailable.update({"queue_config": 1, "dequeue_many": 2, "ack": 1})
    driver.start(burst=True)
    wait_until(driver.returned, what="the burst worker returning")
    assert [driver.q.state(i) for i in ids] == [ACKED, ACKED]
    assert driver.worker.stats.unavailable == 4 and driver.worker.stats.succeeded == 2


# ---------------------------------------------------------------------------- burst, progress
def test_burst_returns_once_the_queue_is_drained_and_every_job_settled(driver):
    """``burst``: the worker returns by itself, with every job it leased settled (here two
    acks that met a shard down first, so they waited in the outbox), and leaves a job
    whose retry is delayed and not yet due for the next start (as RQ's burst does)."""
    driver.define(fail_job_zero)
    ids = [driver.send(n) for n in range(5)]
    driver.q.unavailable["ack"] = driver.q.unavailable["ack_many"] = 2
    driver.start(burst=True)
    wait_until(driver.returned, what="the burst worker returning by itself")
    assert [driver.q.state(i) for i in ids[1:]] == [ACKED] * 4
    delayed = driver.q.job(ids[0])
    assert delayed.state == READY and delayed.ready_at == driver.clock.now() + 1.0  # its backoff
    stats = driver.worker.stats
    assert (stats.succeeded, stats.failed, stats.lost) == (4, 1, 0) and stats.unavailable >= 2


def test_a_burst_worker_on_an_empty_queue_returns_at_once(driver):
    driver.define(nothing)
    driver.start(burst=True)
    wait_until(driver.returned, what="the burst worker returning")
    assert driver.worker.stats.leased == 0


def test_a_progress_line_every_log_every_jobs(driver, caplog):
    driver.define(nothing)
    for n in range(5):
        driver.send(n)
    with caplog.at_level(logging.INFO, logger="shardq.worker"):
        driver.start(concurrency=1, log_every=2, burst=True)
        wait_until(driver.returned, what="the burst worker returning")
    lines = [r.getMessage() for r in caplog.records if " jobs in " in r.getMessage()]
    assert len(lines) == 2 and all(line.startswith("queue default: 2 jobs in ") for line in lines)
    assert "failed" in lines[0] and "in flight" in lines[0]


def test_progress_every_n_seconds_as_well_as_every_n_jobs(driver, caplog):
    """Fewer jobs than ``log_every``: a line once ``log_every_s`` has passed, and none
    while no job finished; a last line when the worker returns."""
    driver.define(nothing)
    ids = [driver.send(n) for n in range(3)]
    with caplog.at_level(logging.INFO, logger="shardq.worker"):
        driver.start(log_every=1000, log_every_s=5.0)
        wait_until(lambda: all(driver.q.state(i) == ACKED for i in ids), what="every job acked")
        progress = lambda: [r.getMessage() for r in caplog.records if " jobs in " in r.getMessage()]  # noqa: E731
        assert progress() == []
        driver.clock.advance(5.0)
        wait_until(progress, what="a progress line after log_every_s")
        driver.send(9)  # finishes less than log_every_s after the last line: no line
        wait_until(lambda: driver.worker.stats.succeeded == 4, what="the fourth job")
        driver.stop()
    assert progress() == ["queue default: 3 jobs in 5.0s (0.6/s); total 3 ok, 0 duplicate, 0 failed, "
                          "0 lost, 0 expired; in flight 0"]
    assert "queue default: stopped after 5.0s: 4 ok, 0 duplicate, 0 failed, 0 lost, 0 expired" in [
        r.getMessage() for r in caplog.records]


RUNNERS = ["thread", "process", "asyncio"]


def runner_class(runner: str):
    """The runner's class, and the setting that picks it (process mode)."""
    return (AsyncWorker, {}) if runner == "asyncio" else (Worker, {"mode": runner})


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("options, words", [
    ({"log_every": 0}, "log_every must be an int >= 1"),
    ({"log_every": -3}, "log_every must be an int >= 1"),
    ({"log_every": 2.5}, "log_every must be an int >= 1"),
    ({"log_every_s": 0}, "log_every_s must be a number of seconds in"),
    ({"log_every_s": LOG_EVERY_S_MAX * 2}, "log_every_s must be a number of seconds in"),
    ({"burst": "yes"}, "burst must be a bool or a Burst"),
    ({"concurrency": 0}, r"concurrency must be an int in \[1, 1024\], got 0"),
    ({"concurrency": CONCURRENCY_MAX + 1}, "concurrency must be an int in"),
    ({"heartbeat_fraction": 1.0}, "heartbeat_fraction must be in"),
    ({"backoff_base_s": 2.0, "backoff_cap_s": 1.0}, "backoff_base_s <= backoff_cap_s"),
    ({"backoff_cap_s": DELAY_S_MAX + 1}, "backoff_cap_s <= limits.DELAY_S_MAX"),
    ({"grace_s": -1.0}, r"grace_s must be a number of seconds >= 0, got -1\.0"),
    ({"poll_s": 0}, r"poll_s must be a number of seconds > 0, got 0"),
    ({"idle_wait_s": float("nan")}, r"idle_wait_s must be a number of seconds >= 0, got nan"),
    ({"queue": ""}, "queue name must be a non-empty string"),
    ({"queue": "q" * 129}, "queue name must be a non-empty string of at most 128 bytes"),
    ({"queue": 7}, "queue name must be a non-empty string"),
    ({"request_timeout_s": 0}, "request_timeout_s must be"),
    ({"prefetch": -1}, "prefetch must be an int in"),
    ({"concurrency": 4, "prefetch": 5}, "prefetch must be an int in"),
    ({"mode": "fork"}, "mode must be 'thread' or 'process'"),
])
def test_bad_options_are_refused_the_same_way_by_every_driver(runner, options, words):
    """One record (:class:`WorkerOptions`) checks every setting for every runner:
    ``AsyncWorker(log_every=0)`` used to start and then divide by zero on its first job, and
    it took backoffs that the threaded worker refuses."""
    q = FakeQueue(FakeClock())
    cls, mode = runner_class(runner)
    with pytest.raises(InvalidConfig, match=words):
        cls(q, handler(), **{**mode, **options})
    with pytest.raises(InvalidConfig, match=words):
        WorkerOptions(**options)
    # the limits themselves are fine
    cls(q, handler(), **mode, log_every=1, log_every_s=LOG_EVERY_S_MAX, concurrency=CONCURRENCY_MAX,
        backoff_base_s=DELAY_S_MAX, backoff_cap_s=DELAY_S_MAX, queue="q" * QUEUE_NAME_BYTES_MAX)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_worker_takes_one_frozen_options_record_or_its_fields_as_keywords(runner):
    q = FakeQueue(FakeClock())
    cls, mode = runner_class(runner)
    options = WorkerOptions(queue="q1", concurrency=3, grace_s=2.0, **mode)
    assert cls(q, handler(), options).options == options
    assert cls(q, handler(), queue="q1", concurrency=3, grace_s=2.0, **mode).options == options
    assert options.prefetch == 1  # None: max(1, concurrency // 4), resolved in the record
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.concurrency = 5  # type: ignore[misc]
    with pytest.raises(InvalidConfig, match="not both"):
        cls(q, handler(), options, concurrency=4)
    with pytest.raises(InvalidConfig, match="options must be a WorkerOptions"):
        cls(q, handler(), "q1")


def test_a_shared_burst_waits_for_the_job_one_queue_sends_to_another(driver):
    """Queue a's job sends a job to queue b after b's worker found b empty: the workers of
    both queues (the driver's runner on a, another runner on b: asyncio, or the thread
    runner beside an asyncio a; one Burst) return only once that job is done too. The send
    is made by the test while a's job runs (a pool process has no client of its own)."""
    b_found_nothing = threading.Event()
    q, burst = driver.q, Burst(["default", "b"])
    plain_dequeue = q.dequeue_many

    def watched(queue, max_jobs=100, wait=0.0, visibility=None):
        out = plain_dequeue(queue, max_jobs=max_jobs, wait=wait, visibility=visibility)
        if queue == "b" and not out and not b_found_nothing.is_set():
            # b's first "nothing" arrives only after a's job sent b a job, was acked, and
            # a's worker found a empty: the answer is stale by then, and must not count
            b_found_nothing.set()
            wait_until(lambda: q.state(first) == ACKED and burst._empty["default"] is not None, what="a drained")
        return out

    q.dequeue_many = watched  # the instance's: the asyncio facade calls it too
    driver.define(wait_sent)
    first = driver.send()
    done_in_b: list[int] = []
    on_b = _PlainHandler(done_in_b.append)
    b_worker = (Worker(q, on_b, queue="b", clock=driver.clock, poll_s=0.005, idle_wait_s=0.01, prune_every_s=None,
                       burst=burst) if driver.runner == "asyncio" else
                AsyncWorker(AsyncFacade(q), on_b, queue="b", clock=driver.clock, idle_wait_s=0.01, burst=burst))
    b_thread = threading.Thread(target=b_worker.run, daemon=True)
    b_thread.start()
    driver.start(burst=burst)
    assert driver.ctl.wait("running") and b_found_nothing.wait(10)
    q.enqueue(b"for b", queue="b")  # a's job's send
    driver.ctl.set("sent")
    wait_until(lambda: driver.returned() and not b_thread.is_alive(), what="both burst workers returning")
    assert q.state(first) == ACKED and len(done_in_b) == 1 and q.state(done_in_b[0]) == ACKED


# ---------------------------------------------------------------------------- signals
def test_sigterm_to_a_worker_running_in_the_main_thread_stops_it_gracefully(driver):
    """``run()`` in the main thread takes SIGTERM and SIGINT over while it runs (a stop, as
    stop()) and gives them back when it returns. The asyncio runner took no signals (the
    SIGTERM killed the process; only the CLI's TaskWorkers installed them): it does now."""
    caught_here = []

    def fallback(signum, frame):  # a runner that takes no signals: a failure, not a killed pytest
        caught_here.append(signum)
        driver.worker.stop()

    before = signal.signal(signal.SIGTERM, fallback)
    try:
        driver.define(functools.partial(sigterm_first, os.getpid()))  # the pool process's parent, too
        ids = [driver.send(n) for n in range(3)]
        stats = driver.build(concurrency=1, prefetch=1).run()
        assert caught_here == [], "the runner left SIGTERM to the process's own handler"
        assert driver.q.state(ids[0]) == ACKED and stats.succeeded >= 1
        assert signal.getsignal(signal.SIGTERM) is fallback  # given back
    finally:
        signal.signal(signal.SIGTERM, before)


SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from support.fakes import AsyncFacade, FakeQueue
    from support.driver_tasks import AsyncHold, Ctl, Raw, hold
    from shardq.clock import SystemClock
    from shardq.consumer.aioworker import AsyncWorker
    from shardq.consumer.worker import Worker
    runner, ctl = sys.argv[1], sys.argv[2]
    Ctl(ctl).put_work(hold)
    q = FakeQueue(SystemClock())
    q.enqueue(ctl.encode())
    options = dict(concurrency=1, grace_s=0.2, idle_wait_s=0.01, prune_every_s=None)
    if runner == "asyncio":
        AsyncWorker(AsyncFacade(q), AsyncHold(), **options).run()
    else:
        Worker(q, Raw(), mode=runner, poll_s=0.01, **options).run()
    print("returned", q.ops("nack"), flush=True)
""")


def _spawn_blocked_worker(runner: str, ctl: Ctl) -> subprocess.Popen:
    """A worker process whose one job never ends (it waits for a release that never comes)."""
    script = SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script, runner, ctl.path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert ctl.wait("started", 30), proc.stderr.read() if proc.poll() is not None else "no start"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("runner", RUNNERS)
def test_sigterm_then_the_grace_period_exits_0_and_releases_the_running_job(runner, tmp_path, sig):
    """SIGHUP (the terminal or ssh session closed) too: it killed the worker without a
    word (exit 129), its running job held until its lease ran out."""
    proc = _spawn_blocked_worker(runner, Ctl(str(tmp_path)))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "returned [('nack', 1, 0.0, None)]" in out


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_second_signal_exits_at_once(runner, tmp_path):
    proc = _spawn_blocked_worker(runner, Ctl(str(tmp_path)))
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and "second signal" in err and "returned" not in out


# ---------------------------------------------------------------------------- simulation
@pytest.mark.parametrize("seed", range(6))
def test_seeded_chaos_keeps_effects_exactly_once(driver, seed, monkeypatch):
    """Random task failures, pauses that outlive the lease (the fence must roll back; the
    process runner's late commit in its pool process makes the redelivery a duplicate),
    duplicate deliveries and shard outages, in rounds: every job ends acked or dead, no
    effect is committed twice, every mark has its effect and every acked job's effect is
    there. Outcomes are a function of (seed, job id, attempt); thread timing still varies,
    so the seed narrows, not replays."""
    import shardq.consumer.policy as policy_mod

    monkeypatch.setattr(policy_mod, "UNAVAILABLE_BACKOFF_S_MIN", 0.001)
    monkeypatch.setattr(policy_mod, "UNAVAILABLE_BACKOFF_S_MAX", 0.004)
    q, rng, store = driver.q, random.Random(seed), driver.store()
    driver.define(functools.partial(chaos, seed))
    ids = [driver.send(n) for n in range(30)]
    for job_id in rng.sample(ids, 8):
        driver.send(0, job_id=job_id)  # delivered twice
    resumed: set = set()
    pauser_done = threading.Event()

    def pauser():  # a paused attempt: the clock moves past its lease, then it goes on
        while not pauser_done.is_set():
            for job_attempt in driver.ctl.read("pause"):
                if job_attempt not in resumed:
                    resumed.add(job_attempt)
                    driver.clock.advance(VISIBILITY_S + 1)
                    driver.ctl.set("resumed-{}-{}".format(*job_attempt))
            pauser_done.wait(0.005)  # a poll interval: pauses are logged to files

    def quiet() -> bool:  # nothing leased, nothing due: the round is over
        with q._cond:
            q._advance()
            now = driver.clock.now()
            return not any(j.state == LEASED or (j.state == READY and j.ready_at <= now) for j in q.jobs.values())

    threading.Thread(target=pauser, daemon=True).start()
    try:
        for round_ in range(60):
            with q._cond:
                q.unavailable = {op: rng.randrange(2) for op in ("dequeue_many", "ack_many", "ack", "extend", "nack")}
            if round_ == 0:
                driver.start(store, concurrency=4, backoff_cap_s=5.0)
            else:
                driver.clock.advance(rng.choice([1, 5, 31]))
            wait_until(quiet, what=f"seed {seed}: the round settling")
            if all(j.state in (ACKED, DEAD) for j in q.jobs.values()):
                break
        driver.stop()
    finally:
        pauser_done.set()
    states = {j.uid: j.state for j in q.jobs.values()}
    assert set(states.values()) <= {ACKED, DEAD}, f"seed {seed}: {states}"
    done = effects(store)
    assert all(v == 1 for v in done.values()), f"seed {seed}: an effect committed twice: {done}"
    assert {i for i in ids if store.seen(i)} == set(done), f"seed {seed}: effect and mark disagree"
    acked = {j.job_id for j in q.jobs.values() if j.state == ACKED}
    assert acked <= set(done), f"seed {seed}: acked without its effect"
    assert resumed and q.ops("nack"), f"seed {seed}: no pause past a lease, or no failure"


# ---------------------------------------------------------------------------- the real service
@pytest.fixture(scope="module")
def service():
    """One service (shard processes) for the module: each runner works a queue of its own."""
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 2, "visibility_timeout": 2}}) as svc:
        yield svc


@pytest.mark.parametrize("runner", RUNNERS)
def test_against_the_real_service(service, runner, tmp_path):
    """The client API each runner uses (the router, the asyncio client), against shard
    processes on real time, with plain and ``async def`` tasks mixed: failures retried then
    dead-lettered with their text, a Fail buried at once, an unknown task name dead-lettered
    (never a crash loop), a job longer than its 2 s lease kept by heartbeats, every effect
    once in the SQLite store."""
    queue, ctl = f"real-{runner}", Ctl(str(tmp_path))
    ctl.put_work(service_work)
    q = service.connect()
    store = SqliteStore(str(tmp_path / "effects.sqlite"))
    worker = None
    try:
        def send(n: int, name: str | None = None) -> int:
            name = name or ("suite.quick" if n % 2 == 0 else "suite.aquick")
            return q.enqueue(encode(name, [n, ctl.path], {}), key=f"k{n % 4}", queue=queue)

        ids = {n: send(n) for n in [*range(20), 99]}
        gone = send(1, "suite.gone")
        options = dict(queue=queue, concurrency=4, idempotency=store, prune_every_s=None, idle_wait_s=0.05)
        worker = (AsyncWorker(service.data_dir, handler(), **options) if runner == "asyncio" else
                  Worker(q, handler(), mode=runner, poll_s=0.005, **options))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()

        def settled() -> bool:
            c = q.stats()["queues"].get(queue, {})
            return c.get("dead") == 3 and all(c.get(k, 0) == 0 for k in ("ready", "in_flight", "delayed", "waiting"))

        wait_until(settled, 60, 0.05, "every job settled")
        worker.stop()
        thread.join(20)
        assert not thread.is_alive()
        done = [i for n, i in ids.items() if n not in (7, 99)]
        assert effects(store) == {i: 1 for i in done}
        dead = {d.job_id: (d.attempts, d.error.splitlines()[0]) for d in q.dead_letters(queue)}
        assert dead[ids[7]] == (2, "ValueError: seven") and dead[ids[99]] == (1, "never")
        assert dead[gone][0] == 1 and dead[gone][1].startswith("unknown task 'suite.gone'")
        ran = ctl.read("ran")
        assert sorted(a for n, a in ran if n == 13) == [1, 2] and [a for n, a in ran if n == 5] == [1]
        stats = worker.stats
        assert (stats.succeeded, stats.lost) == (19, 0)
    finally:
        if worker is not None:
            worker.stop()
        q.close()
        store.close()


class _PlainHandler:
    """A plain handler for the asyncio worker (no tasks): runs ``fn(job_id)`` in a thread."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, ctx):
        self.fn(ctx.job_id)

    def task_of(self, body):
        return None
