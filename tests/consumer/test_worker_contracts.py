"""The paths a worker chooses by what its client declares (shardq/client/contracts.py):
``Buries`` (a ``Fail`` is dead-lettered at once, else nacked), ``Settles`` (jobs' reports
go with the acks in one round, else each is made at once through the job's client) and
``JobCalls`` (a job gets the client for calls about itself, else none). Each decision is
checked by what reaches the queue, on FakeQueue variants that offer or lack the contract;
which real client offers which is the table of tests/client/test_contracts.py."""
from __future__ import annotations

import asyncio

import pytest

from shardq.clock import SystemClock
from shardq.consumer.aioworker import AsyncWorker
from shardq.consumer.worker import Worker
from shardq.errors import Fail, Unsupported

from support.fakes import ACKED, DEAD, READY, AsyncFacade, AsyncTask, BuryingQueue, FakeQueue, PlainQueue

FAST = {"poll_s": 0.005, "idle_wait_s": 0.01, "concurrency": 1}


class OneCallQueue(BuryingQueue):
    """Offers the calls about a job, not ``settle_many``: a report is made at once."""

    settle_many = None

    def put_result(self, lease, value, ttl_s) -> None:
        self._maybe_fail("put_result")
        with self._cond:
            self.calls.append(("put_result", lease.job_id, value))


def run_one(q, handler) -> None:
    Worker(q, handler, **FAST).run(max_jobs=1)


@pytest.mark.parametrize("cls, buried", [(FakeQueue, False), (BuryingQueue, True)])
def test_a_fail_is_dead_lettered_at_once_only_where_the_client_declares_bury(cls, buried):
    q = cls(SystemClock(), max_deliveries=5)
    job_id = q.enqueue(b"x")

    def fail(ctx):
        raise Fail("no")
    run_one(q, fail)
    assert [c[1] for c in q.ops("bury")] == ([job_id] if buried else [])
    assert q.state(job_id) == (DEAD if buried else READY)  # else nacked: it waits for max_deliveries


@pytest.mark.parametrize("cls, collected", [(FakeQueue, True), (OneCallQueue, False)])
def test_reports_go_with_the_acks_only_where_the_client_declares_settle_many(cls, collected):
    q = cls(SystemClock())
    job_id = q.enqueue(b"x")

    def keep(ctx):
        ctx.after_commit(lambda: ctx.report("put_result", b"v", 60.0))
    run_one(q, keep)
    assert q.state(job_id) == ACKED
    if collected:  # FakeQueue.put_result would fail the job: the worker never calls it
        assert [r.op for _, r in q.reported] == ["put_result"] and q.ops("put_result") == []
    else:
        assert q.reported == [] and q.ops("put_result") == [("put_result", job_id, b"v")]


@pytest.mark.parametrize("cls", [FakeQueue, PlainQueue])
def test_a_job_gets_a_client_only_where_the_workers_client_declares_the_calls_about_a_job(cls):
    q = cls(SystemClock())
    job_id = q.enqueue(b"x")
    seen = []

    def look(ctx):
        seen.append(ctx.client)
        ctx.progress(0.5, "half")  # recorded where the client keeps progress; logged either way
        if ctx.client is None:
            with pytest.raises(Unsupported, match="ctx.report"):
                ctx.report("put_result", b"v", 60.0)
    run_one(q, look)
    assert q.state(job_id) == ACKED
    if cls is FakeQueue:
        assert seen == [q] and q.progressed == [(job_id, 0.5, "half")]
    else:
        assert seen == [None] and q.progressed == []


class SlowProgress(AsyncFacade):
    """An asyncio client whose progress call takes a while to land."""

    async def progress(self, lease, fraction, note) -> None:
        await asyncio.sleep(0.05)
        self.q.progress(lease, fraction, note)


class _ReportsProgress(AsyncTask):
    """An async task that reports progress and ends."""

    async def run_async(self, task, ctx, args, kwargs):
        ctx.progress(0.5, "half")  # sent without waiting: the job ends before it lands


def test_the_asyncio_runner_lands_the_progress_calls_it_sent_before_it_returns():
    """``ctx.progress`` of an async task is sent without blocking the loop; the runner
    holds those sends and gives them a moment at its end (it used to hand them to the
    client's ``spawn`` where the client had one, else to a bare task that ``asyncio.run``
    cancelled on the way out)."""
    q = BuryingQueue(SystemClock())
    job_id = q.enqueue(b"x")
    AsyncWorker(SlowProgress(q), _ReportsProgress(), **FAST).run(max_jobs=1)
    assert q.state(job_id) == ACKED and q.progressed == [(job_id, 0.5, "half")]


class Hooked:
    """A handler with the optional hook (FinishesDuplicates), as TaskHandler has it."""

    def __init__(self):
        self.ran, self.given_back = [], []

    def __call__(self, ctx):
        self.ran.append(ctx.job_id)

    def finish_duplicate(self, ctx, kept):
        self.given_back.append((ctx.job_id, kept))


def test_a_skipped_delivery_goes_to_the_handlers_declared_hook_only_where_it_has_one():
    """The hook is a declared contract (handling.FinishesDuplicates), looked up once when the
    worker is built; a hook set to None is absent, as isinstance counts it."""
    from shardq.consumer.handling import FinishesDuplicates
    from shardq.consumer.idempotency import MemoryStore
    plain = type("Unhooked", (Hooked,), {"finish_duplicate": None})()
    assert isinstance(Hooked(), FinishesDuplicates) and not isinstance(plain, FinishesDuplicates)
    for handler, given_back in ((Hooked(), [b"first"]), (plain, [])):
        q, store = FakeQueue(SystemClock()), MemoryStore()
        job_id = q.enqueue(b"x")
        with store.transaction() as txn:
            txn.claim(job_id, result=b"first")  # an earlier delivery committed
        Worker(q, handler, idempotency=store, **FAST).run(max_jobs=1)
        assert handler.ran == [] and q.state(job_id) == ACKED
        assert [kept for _, kept in getattr(handler, "given_back", [])] == given_back
