"""How a task's run ends when it raises what is not an ``Exception``: a CancelledError of its
own (it awaited a task it had cancelled), SystemExit, KeyboardInterrupt.

The rule is the thread runner's (:meth:`shardq.consumer.handling.Runs.run`: a handler never
ends its runner): whatever a task raises is a failed attempt. Its transaction rolls back
(no effect, no processed mark), its job is nacked with the worker's backoff and
dead-lettered at the queue's ``max_deliveries``, and the worker runs on; only the asyncio
runner's own cancellation of a job (its grace period's end, test_aioworker.py) ends a run
with no result. Every scenario runs on the thread runner and the asyncio runner, with and
without an idempotency store, so that the two cannot drift apart; the last one is
``shardq worker --burst`` on a real service.

Before, on the asyncio runner with a store (the task runs in an asyncio task of its own
there, its transaction in a thread): a task's SystemExit or KeyboardInterrupt was raised
out of the event loop, so the worker died holding the job's lease, which stayed in flight
until its visibility timeout; and a task's own CancelledError came back as a bare
``concurrent.futures.CancelledError``, so its failure was logged without the task's
traceback. Synchronisation is by polls with a deadline, never by sleeping.
"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import traceback

import pytest

import shardq
from shardq.clock import FakeClock
from shardq.consumer.aioworker import AsyncWorker
from shardq.consumer.idempotency import MemoryStore
from shardq.consumer.worker import Worker
from shardq.tasks.body import encode
from shardq.tasks.dispatch import TaskHandler
from support.driver_tasks import TopRng, effects, write_effect
from support.fakes import ACKED, DEAD, READY, AsyncFacade, BuryingQueue
from support.service import REPO, Service, wait_until

MAX_DELIVERIES = 3
BACKOFFS = [1.0, 2.0, 4.0]  # a task's default backoff at its jitter's top (TopRng), as any error's

app = shardq.App(router=object())  # type: ignore[arg-type]  # declares tasks only: never called


def _ending(what: str) -> BaseException:
    return SystemExit(3) if what == "SystemExit" else KeyboardInterrupt()


@app.task(name="ends.cancels_itself")
async def cancels_itself(ctx, n: int) -> None:
    if ctx.db is not None:
        await ctx.db.run(write_effect, ctx.job_id)
    sleeper = asyncio.create_task(asyncio.sleep(3600))
    sleeper.cancel()
    await sleeper  # CancelledError here, in a task nobody cancelled


@app.task(name="ends.exits")
async def exits(ctx, n: int, what: str) -> None:
    if ctx.db is not None:
        await ctx.db.run(write_effect, ctx.job_id)
    raise _ending(what)


@app.task(name="ends.exits_sync")
def exits_sync(ctx, n: int, what: str) -> None:
    if ctx.db is not None:
        write_effect(ctx.db, ctx.job_id)
    raise _ending(what)


@app.task(name="ends.raises")
async def raises(ctx, n: int) -> None:
    if ctx.db is not None:
        await ctx.db.run(write_effect, ctx.job_id)
    raise ValueError("an ordinary error")


@app.task(name="ends.exits_once_then_given_up", retries=1)
def exits_with_retries(ctx, n: int, what: str) -> None:
    raise _ending(what)


@app.task(name="ends.ok")
async def ok(ctx, n: int) -> None:
    if ctx.db is not None:
        await ctx.db.run(write_effect, ctx.job_id)


class Run:
    """One worker (``runner``: "thread" or "asyncio") in a thread of its own, on a
    BuryingQueue and a FakeClock; what its ``run()`` raised, if it raised, is kept."""

    def __init__(self, runner: str, store: MemoryStore | None):
        self.clock = FakeClock()
        self.q = BuryingQueue(self.clock, visibility_timeout=30.0, max_deliveries=MAX_DELIVERIES)
        options = dict(queue="default", concurrency=2, idempotency=store, clock=self.clock, rng=TopRng(),
                       backoff_base_s=1.0, backoff_cap_s=300.0, grace_s=5.0, idle_wait_s=0.01,
                       prune_every_s=None)
        handler = TaskHandler(app.tasks, rng=TopRng())
        self.worker = (AsyncWorker(AsyncFacade(self.q), handler, **options) if runner == "asyncio"
                       else Worker(self.q, handler, poll_s=0.005, **options))
        self.raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="ends-worker")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # noqa: BLE001 - kept for the test: run() must not raise
            self.raised = exc

    def send(self, name: str, *args) -> int:
        return self.q.enqueue(encode(name, [0, *args], {}))

    def nacked(self, count: int) -> tuple:
        """The ``count``-th nack, once it came; AssertionError at once if the worker died first."""
        wait_until(lambda: len(self.q.ops("nack")) >= count or not self.thread.is_alive(), 10,
                   what=f"nack {count}")
        assert self.thread.is_alive(), f"the worker died: its run() raised {self.raised!r}"
        return self.q.ops("nack")[count - 1]

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the worker did not stop"


def fails_like_any_error(run: Run, job_id: int, first_line: str) -> None:
    """Nacked with the worker's backoff and ``first_line`` as its error, delivery after
    delivery, dead-lettered on the last; the worker still runs (it runs the next job)."""
    for attempt, backoff in enumerate(BACKOFFS, 1):
        _, jid, delay, error = run.nacked(attempt)
        assert (jid, delay, error.splitlines()[0]) == (job_id, backoff, first_line)
        if attempt < MAX_DELIVERIES:
            assert run.q.state(job_id) == READY and run.q.job(job_id).ready_at == run.clock.now() + delay
            run.clock.advance(delay)
    wait_until(lambda: run.q.state(job_id) == DEAD, 10, what="dead-lettered")
    assert run.q.dead[0].attempts == MAX_DELIVERIES and run.q.dead[0].error.splitlines()[0] == first_line
    after = run.send("ends.ok")
    wait_until(lambda: run.q.state(after) == ACKED or not run.thread.is_alive(), 10, what="the next job acked")
    assert run.thread.is_alive(), f"the worker died: its run() raised {run.raised!r}"
    run.stop()
    assert run.raised is None
    stats = run.worker.stats
    assert (stats.failed, stats.succeeded, stats.abandoned) == (MAX_DELIVERIES, 1, 0)


STORES = pytest.mark.parametrize("with_store", [False, True], ids=["no-store", "store"])


@pytest.mark.parametrize("runner", ["thread", "asyncio"])
def test_an_ordinary_error_fails_so(runner):
    """The reference the others are held to: a ValueError's attempts."""
    run = Run(runner, None)
    fails_like_any_error(run, run.send("ends.raises"), "ValueError: an ordinary error")


@pytest.mark.parametrize("what", ["SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize("runner", ["thread", "asyncio"])
def test_a_task_that_exits_has_its_retries_counted(runner, what):
    """A task's ``retries`` hold for SystemExit and KeyboardInterrupt as for any error
    (TaskHandler passed them by as "not the task's failure", and the worker then failed the
    attempt with its own backoff, ignoring the task's ``retries``: the job ran
    ``max_deliveries`` times)."""
    run = Run(runner, None)
    job_id = run.send("ends.exits_once_then_given_up", what)
    run.clock.advance(run.nacked(1)[2])
    wait_until(lambda: run.q.state(job_id) == DEAD or not run.thread.is_alive(), 10, what="buried")
    assert len(run.q.ops("nack")) == 1 and "retries=1 used up" in run.q.dead[0].error
    run.stop()
    assert run.raised is None


@STORES
@pytest.mark.parametrize("runner", ["thread", "asyncio"])
def test_an_async_task_that_raises_cancelled_error_itself_fails_as_any_error(runner, with_store, caplog):
    """A task whose own code raises CancelledError (it awaited a task it had cancelled) is a
    failed attempt on every runner, with a store as without (5de283c made it so on the
    asyncio runner without one): rolled back, nacked with backoff, dead-lettered at
    ``max_deliveries``, and logged with the task's own traceback. With a store the asyncio
    runner logged a bare ``concurrent.futures.CancelledError`` raised in its own code (the
    task's asyncio task had ended cancelled, which keeps no traceback)."""
    caplog.set_level("WARNING", logger="shardq.worker")
    store = MemoryStore() if with_store else None
    run = Run(runner, store)
    job_id = run.send("ends.cancels_itself")
    fails_like_any_error(run, job_id, "CancelledError: ")
    if store is not None:
        assert effects(store) == {run.q.ops("ack")[0][1]: 1} and not store.seen(job_id)  # (the next job's)
    failures = [r for r in caplog.records if r.getMessage().startswith(f"job {job_id} attempt 1 failed")]
    assert len(failures) == 1 and failures[0].exc_info is not None
    logged = "".join(traceback.format_exception(failures[0].exc_info[1]))
    assert "in cancels_itself" in logged and "await sleeper" in logged, logged


@STORES
@pytest.mark.parametrize("what", ["SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize("runner, kind", [("thread", "sync"), ("thread", "async"), ("asyncio", "async"),
                                          ("asyncio", "sync")], ids=lambda p: p)
def test_a_task_that_raises_system_exit_or_keyboard_interrupt_fails_its_attempt_and_the_worker_runs_on(
        runner, kind, what, with_store):
    """SystemExit and KeyboardInterrupt raised by a task are its failed attempt, as any error
    (the thread runner's rule: a handler never ends its runner): its effect rolled back, its
    job nacked with backoff and dead-lettered at ``max_deliveries``, the worker running on,
    its ``run()`` raising nothing. On the asyncio runner with a store an ``async def``
    task's was raised out of the event loop: the worker died, the job's lease left in
    flight until its visibility timeout."""
    store = MemoryStore() if with_store else None
    run = Run(runner, store)
    job_id = run.send("ends.exits" if kind == "async" else "ends.exits_sync", what)
    fails_like_any_error(run, job_id, "SystemExit: 3" if what == "SystemExit" else "KeyboardInterrupt: ")
    if store is not None:
        assert effects(store) == {run.q.ops("ack")[0][1]: 1} and not store.seen(job_id)  # (the next job's)


# ---------------------------------------------------------------------------- shardq worker --burst
@pytest.fixture(scope="module")
def svc():
    # One delivery: the first failure dead-letters the job, so a burst worker that settles it
    # finds its queue drained at once.
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 1}}) as s:
        yield s


TASKS = ("import shardq\napp = shardq.App({data_dir!r})\n"
         "@app.task(queue={queue!r})\nasync def leave(ctx):\n    raise {what}\n")


@STORES
@pytest.mark.parametrize("what", ["SystemExit(3)", "KeyboardInterrupt"])
def test_a_burst_worker_settles_an_async_task_that_raises_system_exit_and_exits_0(svc, tmp_path, what,
                                                                                   with_store):
    """``shardq worker --burst`` on an async task that raises SystemExit or KeyboardInterrupt:
    the job is failed (here dead-lettered: one delivery), nothing is left in flight, and the
    worker exits 0 once the queue is drained. With ``--idempotency`` it exited 3 (130) at
    once, the job's lease held until its visibility timeout."""
    queue = f"ends-{what[:3].lower()}-{int(with_store)}"
    (tmp_path / "ends_tasks.py").write_text(TASKS.format(data_dir=svc.data_dir, queue=queue, what=what))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store = ["--idempotency", "effects.sqlite"] if with_store else []
    with svc.connect() as q:
        q.enqueue(encode("ends_tasks.leave", [], {}), queue=queue)
        r = subprocess.run([sys.executable, "-m", "shardq", "worker", "ends_tasks", "--data-dir", svc.data_dir,
                            "--burst", *store], capture_output=True, text=True, timeout=60, env=env,
                           cwd=str(tmp_path))
        counts = q.stats()["queues"][queue]
    assert r.returncode == 0, r.stderr
    assert (counts["in_flight"], counts["ready"], counts["dead"]) == (0, 0, 1), counts
    assert re.search(r": 0 ok, 0 duplicate, 1 failed, 0 lost", r.stderr), r.stderr
