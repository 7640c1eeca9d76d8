"""What is the asyncio runner's own: which thread runs an async and a plain task, the
awaitable ``ctx.extend`` and ``ctx.db``, the cancellation of its jobs' asyncio tasks at the
grace period's end; and the App's ``send_async``. Everything else a worker does is tested
once for every runner in test_worker_drivers.py. One real service for the module."""
from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest

import shardq
from shardq.consumer.aioworker import AsyncWorker
from shardq.tasks.dispatch import TaskHandler
from shardq.consumer.idempotency import SqliteStore

from support.driver_tasks import write_effect
from support.fakes import READY, AsyncFacade, AsyncTask, BuryingQueue
from support.service import Service, wait_until
from shardq.clock import FakeClock
from shardq.consumer.idempotency import MemoryStore


@pytest.fixture(scope="module")
def svc():
    with Service(shards=2, config={"queue_defaults": {"max_deliveries": 5, "visibility_timeout": 2}}) as s:
        yield s


@pytest.fixture
def app(svc):
    a = shardq.App(svc.data_dir)
    yield a
    a.close()


def start(app, queue, **kw) -> tuple[AsyncWorker, threading.Thread]:
    w = AsyncWorker(app.target, TaskHandler(app.tasks), queue=queue, idle_wait_s=0.1, **kw)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return w, t


def counts(app, queue) -> dict:
    return app.queue.stats()["queues"].get(queue, {})


def settled(app, queue) -> bool:
    c = counts(app, queue)
    return all(c.get(k, 0) == 0 for k in ("ready", "in_flight", "delayed", "waiting"))


def test_asyncio_runner_runs_async_tasks_on_its_loop_and_plain_ones_in_threads(app, tmp_path):
    """Runner-specific: where the asyncio runner runs what. An ``async def`` task runs on
    the event loop's thread, awaits ``ctx.extend`` and ``ctx.db`` (whose statements run in
    the transaction's own thread); a plain task runs in a thread, off the loop. Retries,
    Fail, unknown names and heartbeats on a real service are the behaviour suite's, on
    every runner (test_worker_drivers.py::test_against_the_real_service)."""
    store = SqliteStore(str(tmp_path / "fx.sqlite"))
    with store.transaction() as txn:
        txn.db.execute("CREATE TABLE fx (job_id INTEGER, n INTEGER, thread TEXT)")
    loop_threads = set()

    @app.task(queue="aw", name="aw.async")
    async def a(ctx, n: int):
        loop_threads.add(threading.current_thread().name)
        deadline = await ctx.extend(30)
        assert deadline > ctx.lease.deadline
        await ctx.db.execute("INSERT INTO fx VALUES (?, ?, ?)", (ctx.job_id, n, "loop"))

    @app.task(queue="aw", name="aw.plain")
    def p(ctx, n: int):
        ctx.db.execute("INSERT INTO fx VALUES (?, ?, ?)", (ctx.job_id, n, threading.current_thread().name))

    ids = a.send_many([((n,), {}) for n in range(5)]) + [p.send(7)]
    w, t = start(app, "aw", concurrency=8, idempotency=store)
    try:
        wait_until(lambda: settled(app, "aw"), 30, 0.05, "every job settled")
    finally:
        w.stop()
        t.join(20)
    assert not t.is_alive()
    rows = sorted(store_rows(store))
    assert [r[1] for r in rows if r[2] == "loop"] == list(range(5))
    (plain,) = [r for r in rows if r[2] != "loop"]
    assert plain[1] == 7 and plain[2] not in loop_threads and len(loop_threads) == 1
    assert {r[0] for r in rows} == set(ids) and w.stats.succeeded == 6


def store_rows(store):
    with store.transaction() as txn:
        txn.db.execute("SELECT job_id, n, thread FROM fx")
        return txn.db.fetchall()


def test_send_async_uses_the_apps_asyncio_client(app):
    """Not a runner's: ``task.send_async`` goes through the App's asyncio client."""
    @app.task(queue="aw-send", key=lambda user_id, **_: f"u{user_id}", name="aw.sent")
    async def sent(ctx, user_id: int, text: str = "hi"):
        pass

    async def main():
        ids = await asyncio.gather(*(sent.send_async(i, text="x") for i in range(50)))
        with pytest.raises(shardq.InvalidJob, match="'user_id'"):
            await sent.send_async({1})
        await app.aclose()
        return ids

    ids = asyncio.run(main())
    leases = app.queue.dequeue_many("aw-send", max_jobs=100)
    assert sorted(l.job_id for l in leases) == sorted(ids)
    assert {l.key for l in leases} == {f"u{i}" for i in range(50)}
    assert msgpack.unpackb(leases[0].body)["k"] == {"text": "x"}
    app.queue.ack_many(leases)


# ---------------------------------------------------------------------------- the event loop's own mechanics
class _Forever(AsyncTask):
    """An async task: writes its effect through ``ctx.db``, then waits for ever; says
    whether it was cancelled."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = False

    async def run_async(self, task, ctx, args, kwargs):
        await ctx.db.run(write_effect, ctx.job_id)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


@pytest.mark.parametrize("how", ["stopped, grace over", "run_async cancelled"])
def test_asyncio_runner_cancels_the_async_jobs_still_running_when_the_grace_period_ends(how):
    """Runner-specific: only an asyncio task can be cancelled. At the grace period's end
    every runner releases the jobs still running (test_worker_drivers.py,
    test_after_the_grace_period_...): a thread runs on with its commit refused, a pool
    process is killed; the asyncio runner cancels their tasks before ``run_async`` returns,
    so on the caller's loop (not asyncio.run, which cancels what is left anyway) nothing
    runs on. Before 00eae35 it looked for them among the jobs the core still held, which
    the release had just emptied: none was cancelled. ``run_async`` cancelled from outside
    (a TaskGroup, anyio, a lifespan's end) is such a stop: before, it ended at once, its
    runner tasks ran on with the client gone and their leases were held until the
    visibility timeout, then the jobs were delivered again (the work done twice)."""
    clock = FakeClock()
    q = BuryingQueue(clock, visibility_timeout=30.0)
    job_id = q.enqueue(b"forever")
    store = MemoryStore(clock=clock)
    task = _Forever()

    async def main():
        w = AsyncWorker(AsyncFacade(q), task, concurrency=1, grace_s=10.0, idempotency=store, clock=clock,
                        idle_wait_s=0.01, prune_every_s=None)
        run = asyncio.create_task(w.run_async())
        await asyncio.wait_for(task.started.wait(), 10)
        if how == "run_async cancelled":
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(run, 10)
        else:
            w.stop()
            clock.advance(11.0)  # past the grace period, not past the lease
            await asyncio.wait_for(run, 10)
        assert task.cancelled, "run_async returned with the job still running"
        return w.stats

    stats = asyncio.run(main())
    assert stats.abandoned == 1 and stats.succeeded == 0
    assert q.ops("nack") == [("nack", job_id, 0.0, None)] and q.state(job_id) == READY  # now, not in 30 s
    assert store.data == {} and not store.seen(job_id)  # its transaction rolled back


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_the_asyncio_runner_takes_a_plain_handler_as_the_thread_worker_does(kind):
    """``AsyncWorker(q, handle)`` with a plain function (no App's tasks): every job raised
    AttributeError ('task_of') in the runner, was never settled, and its lease was extended
    until shutdown (a walkthrough). An ``async def`` is awaited on the loop, a ``def`` runs
    in a thread; a job it fails is nacked as any failed attempt."""
    clock = FakeClock()
    q = BuryingQueue(clock, visibility_timeout=30.0)
    ids = [q.enqueue(b"ok%d" % i) for i in range(3)] + [q.enqueue(b"fail")]
    seen: list[tuple[bytes, bool]] = []  # (body, ran on the loop's thread)
    loop_thread = threading.current_thread()  # asyncio.run's, below

    def check(ctx):
        seen.append((ctx.body, threading.current_thread() is loop_thread))
        if ctx.body == b"fail":
            raise ValueError("no")

    if kind == "async":
        async def handle(ctx):
            check(ctx)
    else:
        def handle(ctx):
            check(ctx)

    w = AsyncWorker(AsyncFacade(q), handle, concurrency=2, clock=clock, idle_wait_s=0.01, prune_every_s=None)
    stats = asyncio.run(asyncio.wait_for(w.run_async(max_jobs=4), 20))  # (before: never returned)
    assert sorted(b for b, _ in seen) == [b"fail", b"ok0", b"ok1", b"ok2"]
    assert {on_loop for _, on_loop in seen} == {kind == "async"}  # on the loop's thread, or off it
    assert (stats.succeeded, stats.failed) == (3, 1)
    assert [q.state(i) for i in ids[:3]] == ["acked"] * 3 and q.ops("nack")[0][1] == ids[3]


def test_the_asyncio_runner_refuses_a_handler_that_is_no_function():
    with pytest.raises(shardq.UsageError, match="must be a function of the job's context or an App's tasks"):
        AsyncWorker(AsyncFacade(BuryingQueue(FakeClock())), "myapp.tasks:handle")


def test_an_async_task_with_a_store_leaves_no_store_connection_per_job(tmp_path):
    """Each job's transaction runs in a thread of its own, whose store connection the store
    kept until close(): one per job, 6,021 open files after 3,000 jobs with SQLite, every
    PostgreSQL connection slot after 194 (a walkthrough). The thread releases its own when
    it ends; the connections held stay a handful, however many jobs ran."""
    clock = FakeClock()
    q = BuryingQueue(clock, visibility_timeout=30.0)
    ids = [q.enqueue(b"job %d" % i) for i in range(60)]
    store = SqliteStore(str(tmp_path / "fx.sqlite"))
    held = []

    class Writes(AsyncTask):
        async def run_async(self, task, ctx, args, kwargs):
            await ctx.db.run(write_effect, ctx.job_id)
            held.append(len(store._conns))

    w = AsyncWorker(AsyncFacade(q), Writes(), concurrency=4, idempotency=store, clock=clock, idle_wait_s=0.01,
                    prune_every_s=None)
    stats = asyncio.run(asyncio.wait_for(w.run_async(max_jobs=60), 60))
    assert stats.succeeded == 60 and [q.state(i) for i in ids] == ["acked"] * 60
    assert max(held) <= 4 + 2 and len(store._conns) <= 2, (max(held), len(store._conns))
    store.close()
