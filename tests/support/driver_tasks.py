"""The tasks of the worker behaviour suite (tests/consumer/test_worker_drivers.py), the same
for every runner: the thread and asyncio runners run them in the test's process, the process
runner in its pool processes, which import this module (so it stays light).

A job's arguments are ``[n, ctl]``: ``ctl`` is the test's control directory, where the test
leaves what the task does (``work``: a picklable ``work(ctx, n, ctl)``, one of the functions
below or a ``functools.partial`` of one) and where the task tells the test what happened (a
:class:`Ctl`'s events and logs are files, so they cross processes). With an idempotency store
the task then writes its effect through ``ctx.db``: a row for SQLite (the process runner's
store), a counter for the in-memory store. :class:`FlakyStore` fails at named points, which
the test arms as files, so a store reopened in a pool process fails the same way. A work
function may return an exception: the task raises it after writing its effect. :class:`Raw`
is the same for a plain handler (no task).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import random
import signal
import time
from typing import Any

import shardq
from shardq.consumer.idempotency import IdempotencyStore, MemoryStore, SqliteStore, Txn
from shardq.tasks.dispatch import TaskHandler, load_tasks

app = shardq.App(router=object())  # type: ignore[arg-type]  # declares tasks only: never called
EFFECTS = "CREATE TABLE IF NOT EXISTS effect (job_id INTEGER)"


class Ctl:
    """The control directory of one test."""

    def __init__(self, path: str):
        self.path = path

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def set(self, name: str) -> None:
        with open(self._file(name), "a"):
            pass

    def wait(self, name: str, timeout: float = 10.0) -> bool:
        """Whether event ``name`` is set within ``timeout`` (polled: it may come from another process)."""
        end = time.monotonic() + timeout
        while not os.path.exists(self._file(name)):
            if time.monotonic() >= end:
                return False
            time.sleep(0.002)
        return True

    def log(self, name: str, value: Any) -> None:
        with open(self._file(name), "a") as f:  # one write of one line: appends do not interleave
            f.write(f"{value!r}\n")

    def read(self, name: str) -> list[Any]:
        try:
            with open(self._file(name)) as f:
                return [eval(line) for line in f]  # noqa: S307 - what log() wrote: reprs of ints and strs
        except FileNotFoundError:
            return []

    def put_work(self, work: Any) -> None:
        with open(self._file("work.pickle"), "wb") as f:
            pickle.dump(work, f)

    def work(self) -> Any:
        with open(self._file("work.pickle"), "rb") as f:
            return pickle.load(f)


def write_effect(db: Any, job_id: int) -> None:
    if hasattr(db, "execute"):  # SQLite
        db.execute(EFFECTS)
        db.execute("INSERT INTO effect (job_id) VALUES (?)", (job_id,))
    else:
        db[("effect", job_id)] = db.get(("effect", job_id), 0) + 1


@app.task(name="suite.task")
def task(ctx: Any, n: int, ctl: str) -> int:
    c = Ctl(ctl)
    then = c.work()(ctx, n, c)
    if ctx.db is not None:
        write_effect(ctx.db, ctx.job_id)
    if isinstance(then, BaseException):
        raise then  # what the work returned, raised after the effect: it must roll back
    return n


@app.task(name="suite.atask")
async def atask(ctx: Any, n: int, ctl: str) -> int:
    c = Ctl(ctl)
    then = await asyncio.to_thread(c.work(), ctx, n, c)
    if ctx.db is not None:
        await ctx.db.run(write_effect, ctx.job_id)
    if isinstance(then, BaseException):
        raise then
    return n


@app.task(name="suite.quick", backoff=shardq.Exponential(0, 0))
def quick(ctx: Any, n: int, ctl: str) -> int:
    """As :func:`task`, retried at once (a real service's clock is real)."""
    return task.fn(ctx, n, ctl)


@app.task(name="suite.aquick", backoff=shardq.Exponential(0, 0))
async def aquick(ctx: Any, n: int, ctl: str) -> int:
    return await atask.fn(ctx, n, ctl)


class Raw:
    """A plain handler, no task (``Worker(q, fn)``, ``shardq worker mod:fn``): the job's
    body is the control directory; failures get the worker's backoff, not a task's.
    Picklable (module-level), and an asyncio runner's handler too (it names no task, so
    the runner calls it in a thread)."""

    def __call__(self, ctx: Any) -> None:
        c = Ctl(ctx.body.decode())
        then = c.work()(ctx, 0, c)
        if ctx.db is not None:
            write_effect(ctx.db, ctx.job_id)
        if isinstance(then, BaseException):
            raise then

    def task_of(self, body: bytes) -> None:
        return None


class TopRng:
    """Full jitter at its upper bound, so every backoff is predictable."""

    def uniform(self, a: float, b: float) -> float:
        return b


def handler() -> TaskHandler:
    """The suite's handler: this module's tasks, backoffs at their top; picklable (a pool
    process builds it again)."""
    return _Handler(load_tasks([__name__]), [__name__], rng=TopRng())  # type: ignore[arg-type]


class _Handler(TaskHandler):
    def __reduce__(self) -> Any:
        return (handler, ())


# ---------------------------------------------------------------------------- stores
class StoreDown(ConnectionError):
    """What a store raises when its database is gone (PostgreSQL down, a lost connection)."""


class FlakyStore(IdempotencyStore):
    """A store (in memory, or SQLite for the process runner) whose next operations fail at
    named points: ``arm("begin")`` makes the next transaction fail at BEGIN; also
    ``"claim"``, ``"commit"`` (the COMMIT fails: nothing lands) and ``"rollback"`` (rolling
    back after a failed task fails). An armed point is a file, taken by one process only."""

    def __init__(self, inner: IdempotencyStore, ctl: str):
        self.inner, self.ctl = inner, ctl
        self.retention_s = inner.retention_s

    def arm(self, point: str) -> None:
        Ctl(self.ctl).set(f"fail-{point}")

    def trip(self, point: str) -> None:
        try:
            os.unlink(os.path.join(self.ctl, f"fail-{point}"))
        except FileNotFoundError:
            return
        raise StoreDown(f"the database went away at {point.upper()}")

    @contextlib.contextmanager
    def transaction(self) -> Any:
        self.trip("begin")
        with self.inner.transaction() as txn:
            try:
                yield _FlakyTxn(self, txn)
            except BaseException:
                self.trip("rollback")  # raised inside: the inner transaction rolls back too
                raise
            # Raised inside too: nothing lands, as when the database's COMMIT (or the
            # ROLLBACK of an aborted transaction) fails.
            self.trip("rollback" if txn.aborted else "commit")

    def seen(self, job_id: Any) -> bool:
        return self.inner.seen(job_id)

    def kept_result(self, job_id: Any) -> bytes | None:
        return self.inner.kept_result(job_id)

    def prune(self, now: float) -> int:
        return self.inner.prune(now)

    def close(self) -> None:
        self.inner.close()

    def _bound_service(self, service_id: str) -> str:
        return self.inner._bound_service(service_id)

    def reopen_spec(self) -> Any:
        return (_reopen_flaky, (self.inner.reopen_spec(), self.ctl), {})


def _reopen_flaky(spec: Any, ctl: str) -> FlakyStore:
    factory, args, kwargs = spec
    return FlakyStore(factory(*args, **kwargs), ctl)


class _FlakyTxn(Txn):
    def __init__(self, store: FlakyStore, inner: Txn):
        super().__init__()
        self._store, self._inner = store, inner
        self.db, self.session = inner.db, inner.session

    def claim(self, job_id: Any, result: bytes | None = None) -> bool:
        self._store.trip("claim")
        return self._inner.claim(job_id, result)

    def abort(self) -> None:
        self._inner.abort()
        self.aborted = True


def effects(store: IdempotencyStore) -> dict[int, int]:
    """How many times each job's effect committed."""
    inner = store.inner if isinstance(store, FlakyStore) else store
    if isinstance(inner, MemoryStore):
        return {k[1]: v for k, v in inner.data.items()}
    assert isinstance(inner, SqliteStore)
    with inner.transaction() as txn:
        txn.db.execute(EFFECTS)
        rows = txn.db.execute("SELECT job_id, count(*) FROM effect GROUP BY job_id").fetchall()
        txn.abort()
    return dict(rows)


# ---------------------------------------------------------------------------- what the task does
def nothing(ctx: Any, n: int, ctl: Ctl) -> None:
    pass


def boom(ctx: Any, n: int, ctl: Ctl) -> None:
    raise ValueError(f"boom {ctx.attempt}")


def undecodable(ctx: Any, n: int, ctl: Ctl) -> None:
    """Fails for good with a text holding a lone surrogate, as an OS error's undecodable
    file name does."""
    raise shardq.Fail("bad file \udcff.csv")


def fail_as(op: str, ctx: Any, n: int, ctl: Ctl) -> None:
    """``op`` is the settlement the run ends with: ack, nack (an error), bury (Fail)."""
    if op == "nack":
        raise ValueError("try again")
    if op == "bury":
        raise shardq.Fail("no such user")


def fail_first_after_effect(ctx: Any, n: int, ctl: Ctl) -> BaseException | None:
    """The first attempt fails after the task wrote its effect."""
    return RuntimeError("after the write") if ctx.attempt == 1 else None


def wait_sent(ctx: Any, n: int, ctl: Ctl) -> None:
    """Say it runs, then wait until the test has sent a job to another queue on its behalf
    (the job's "send", made where the queue is)."""
    ctl.set("running")
    assert ctl.wait("sent", 20)


LONGER_THAN_THE_LEASE_S = 2.5  # the real-service queue's lease is 2 s


def service_work(ctx: Any, n: int, ctl: Ctl) -> None:
    """The real-service scenario: job 7 always fails, 13 fails once, 99 gives up (Fail), 5
    runs longer than its lease; each logs ``(n, attempt)``."""
    ctl.log("ran", (n, ctx.attempt))
    if n == 7:
        raise ValueError("seven")
    if n == 13 and ctx.attempt == 1:
        raise ValueError("unlucky")
    if n == 99:
        raise shardq.Fail("never")
    if n == 5:
        time.sleep(LONGER_THAN_THE_LEASE_S)  # the job's own length, not a wait for anything


def chaos(seed: int, ctx: Any, n: int, ctl: Ctl) -> None:
    """The seeded chaos run's task: what an attempt does is a function of (seed, job id,
    attempt): fail (30%), or pause until the test has moved the clock past its lease (10%:
    it logs ``pause`` and waits for ``resumed-JOB-ATTEMPT``), or succeed."""
    roll = random.Random(f"{seed}/{ctx.job_id}/{ctx.attempt}").random()
    if roll < 0.3:
        raise RuntimeError(f"roll {roll:.2f}")
    if roll < 0.4:
        ctl.log("pause", (ctx.job_id, ctx.attempt))
        assert ctl.wait(f"resumed-{ctx.job_id}-{ctx.attempt}", 20)


def sigterm_first(pid: int, ctx: Any, n: int, ctl: Ctl) -> None:
    """Job 0's first attempt sends SIGTERM to ``pid`` (the worker's process): once, for a
    second signal would exit it at once."""
    if n == 0 and ctx.attempt == 1:
        os.kill(pid, signal.SIGTERM)


class AsyncHold:
    """A handler whose one task never ends, as an ``async def`` would on the asyncio runner
    (a thread there would hold ``asyncio.run`` until it ends): sets ``started`` in the
    control directory (the job's body) and waits for ever, until cancelled."""

    is_async = True

    def __call__(self, ctx: Any) -> None:
        raise AssertionError("an async task: never run in a thread")

    def task_of(self, body: bytes) -> AsyncHold:
        return self

    def resolve(self, ctx: Any) -> tuple[Any, list[Any], dict[str, Any]]:
        return self, [], {}

    async def run_async(self, task: Any, ctx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        Ctl(ctx.body.decode()).set("started")
        await asyncio.Event().wait()


def fail_first(ctx: Any, n: int, ctl: Ctl) -> None:
    if ctx.attempt == 1:
        raise ValueError("the task failed first")


def fail_job_zero(ctx: Any, n: int, ctl: Ctl) -> None:
    if n == 0:
        raise ValueError("later")


def log_attempt(ctx: Any, n: int, ctl: Ctl) -> None:
    ctl.log("attempts", ctx.attempt)


def log_n(ctx: Any, n: int, ctl: Ctl) -> None:
    ctl.log("ran", n)


def hold(ctx: Any, n: int, ctl: Ctl) -> None:
    """Log the attempt and ``n``, say it started, and run until the test sets ``release``."""
    ctl.log("attempts", ctx.attempt)
    ctl.log("running", n)
    ctl.set("started")
    assert ctl.wait("release", 20)


def hold_first(ctx: Any, n: int, ctl: Ctl) -> None:
    """The first attempt holds (as :func:`hold`); a later one only logs its attempt."""
    ctl.log("attempts", ctx.attempt)
    if ctx.attempt == 1:
        ctl.set("started")
        assert ctl.wait("release", 20)
