"""Running task jobs: find the task a body names, call it, turn a failure into a retry or a
dead letter.

:class:`TaskHandler` is a worker handler (``handler(ctx)``) for task jobs. It never lets a
job crash-loop: a body that is not a task body, or names a task this worker does not know,
is dead-lettered at once (``Fail``) with a message that says why and which tasks the worker
knows; a task that raises is retried with its backoff until its ``retries`` are used up,
then dead-lettered with the error text (see :mod:`.tasks`).
"""
from __future__ import annotations

import asyncio
import importlib
import random
from collections.abc import Callable
from typing import Any

from .. import limits
from ..errors import Fail, Retry
from ..client.contracts import JobCalls
from ..consumer.handling import Context, error_text
from .body import NO_STEPS, BadBody, Steps, decode, decode_steps, why
from .app import App, Task
from .reading import FANOUT
from .workflow import pack, unpack

KNOWN_NAMES_SHOWN = 20  # an unknown-task error lists at most this many known names


class TaskHandler:
    """``handler(ctx)`` for the jobs of every task in ``tasks`` (name -> Task).

    Picklable as the list of modules it was loaded from (process mode re-imports them)."""

    def __init__(self, tasks: dict[str, Task[..., Any]], modules: list[str] | None = None,
                 rng: random.Random | None = None):
        self.tasks = dict(tasks)
        self.modules = modules
        self.rng = rng or random.Random()

    @classmethod
    def from_modules(cls, modules: list[str]) -> TaskHandler:
        return cls(load_tasks(modules), modules)

    def __reduce__(self) -> tuple[Callable[[list[str]], TaskHandler], tuple[list[str]]]:
        if self.modules is None:
            raise TypeError("a TaskHandler built from tasks (not modules) cannot be sent to a process")
        return (TaskHandler.from_modules, (self.modules,))

    # ------------------------------------------------------------------ routing
    def resolve(self, ctx: Context) -> tuple[Task[..., Any], list[Any], dict[str, Any]]:
        """The task and arguments of the job; Fail (dead-letter now) if there is none."""
        name, args, kwargs, _ = self._decode(ctx)
        return self._task(name), args, kwargs

    @staticmethod
    def _decode(ctx: Context) -> tuple[str, list[Any], dict[str, Any], Steps]:
        try:
            return decode_steps(ctx.body)
        except BadBody as exc:
            raise Fail(f"{exc}; dead-lettered without running") from None

    def _task(self, name: str) -> Task[..., Any]:
        task = self.tasks.get(name)
        if task is None:
            known = sorted(self.tasks)
            shown = ", ".join(known[:KNOWN_NAMES_SHOWN]) + (" ..." if len(known) > KNOWN_NAMES_SHOWN else "")
            raise Fail(f"unknown task {name!r}: this worker knows {len(known)} task(s): {shown or 'none'}. "
                       "Deploy the task to the workers of this queue, then redrive the dead letter")
        return task

    def failure(self, task: Task[..., Any], attempt: int, exc: BaseException) -> BaseException:
        """What a task's exception means for its job: a Retry (with a delay) or a Fail."""
        if isinstance(exc, Fail):
            return exc
        limit = task.retries
        if limit is not None and attempt > limit:
            what = "asked for a retry" if isinstance(exc, Retry) else error_text(exc)
            return Fail(f"{what} (attempt {attempt}; retries={limit} used up)")
        if isinstance(exc, Retry):
            if exc.delay_s is not None:
                return exc
            return Retry(task.backoff.delay(attempt, self.rng), str(exc))
        return Retry(task.backoff.delay(attempt, self.rng), error_text(exc))

    # ------------------------------------------------------------------ running
    def __call__(self, ctx: Context) -> Any:
        name, args, kwargs, steps = self._decode(ctx)
        _needs_client(ctx, name, steps)
        if name == FANOUT:
            ctx.after_commit(lambda: self._fan_out(ctx, args, steps))
            return None
        task = self._task(name)
        if steps.inputs is not None:
            args = [self._inputs(ctx, steps.inputs)] + args
        try:
            if task.is_async:  # an async task on a thread worker: its own loop, in this thread
                from ..consumer.aiotxn import InlineDb
                if ctx.db is not None:
                    ctx.db = InlineDb(ctx.db)
                value = asyncio.run(task.fn(ctx, *args, **kwargs))
            else:
                value = task.fn(ctx, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the task's failure
            raise self.failure(task, ctx.attempt, exc) from exc
        self._keep(ctx, task, steps, value)
        return value

    async def run_async(self, task: Task[..., Any], ctx: Context, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Await an async task on the running loop (the asyncio worker's path; a sync task
        goes through ``__call__`` in a thread instead). Its inputs, if it is a workflow
        step, are fetched in a thread (the client calls of ``ctx.client`` block)."""
        name, _, _, steps = self._decode(ctx)
        _needs_client(ctx, name, steps)
        if steps.inputs is not None:
            args = [await asyncio.to_thread(self._inputs, ctx, steps.inputs)] + args
        try:
            value = await task.fn(ctx, *args, **kwargs)
        except asyncio.CancelledError as exc:
            if (this := asyncio.current_task()) is not None and this.cancelling():
                raise  # the worker cancels the job (its grace ended): no attempt's outcome
            raise self.failure(task, ctx.attempt, exc) from exc  # the task's own
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the task's failure
            raise self.failure(task, ctx.attempt, exc) from exc
        self._keep(ctx, task, steps, value)
        return value

    # ------------------------------------------------------------------ results and workflows
    def finish_duplicate(self, ctx: Context, kept: bytes | None) -> None:
        """A delivery skipped because an earlier one committed (idempotency store): report
        what that one kept, as it would have (its worker died before the ack)."""
        try:
            name, args, _, steps = decode_steps(ctx.body)
        except BadBody:
            return
        if name == FANOUT:
            self._fan_out(ctx, args, steps)
            return
        if steps.keep_s is None and steps.report is None:
            return
        if kept is None:
            raise Fail(f"job {ctx.job_id} was processed by an earlier delivery whose result the idempotency "
                       "store does not hold (pruned, or kept by a version before results): its result cannot "
                       "be reported; run it again by hand if its workflow needs it")
        self._report(ctx, steps, kept)

    def _keep(self, ctx: Context, task: Task[..., Any], steps: Steps, value: Any) -> None:
        """A task's return value, to be kept and reported once its effect commits."""
        if steps.keep_s is None and steps.report is None:
            return
        try:
            data = pack(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise Fail(f"task {task.name}: its return value cannot be kept: {why(value, exc)}") from None
        if len(data) > limits.RESULT_BYTES_MAX:
            raise Fail(f"task {task.name}: its return value is {len(data)} bytes encoded; results are kept up "
                       f"to {limits.RESULT_BYTES_MAX} (store large data elsewhere and return its name)")
        ctx.keep(data)
        ctx.after_commit(lambda: self._report(ctx, steps, data))

    def _report(self, ctx: Context, steps: Steps, data: bytes) -> None:
        # Both before the ack (ctx.report): a step acked before it arrived would leave its
        # workflow stuck, and a result can only be put while the lease is held.
        _client(ctx)
        if steps.report is not None:
            barrier, shard, index, total, ttl_s, callback = steps.report
            ctx.report("arrive", shard, barrier, index, total, data, ttl_s, callback)
        if steps.keep_s is not None:
            ctx.report("put_result", data, steps.keep_s)

    def _inputs(self, ctx: Context, inputs: list[Any]) -> Any:
        barrier, shard, mode = inputs
        values = _client(ctx).barrier_values(shard, barrier)
        return unpack(values[0]) if mode == "one" else [unpack(v) for v in values]

    def _fan_out(self, ctx: Context, args: list[Any], steps: Steps) -> None:
        """Start the members of a group that follows a step: each arrives at its own barrier
        (one member, counted once), which enqueues it with the input."""
        spawns, ttl_s = args
        client = _client(ctx)
        if steps.inputs is None:  # the builder always sets them: a body made by hand
            raise Fail(f"job {ctx.job_id}: a fan-out body without its inputs (the barrier it reads)")
        barrier, shard, mode = steps.inputs
        values = client.barrier_values(shard, barrier)
        data = values[0] if mode == "one" else pack([unpack(v) for v in values])
        for member_shard, member_barrier, item in spawns:
            ctx.report("arrive", member_shard, member_barrier, 0, 1, data, ttl_s, item)

    def task_of(self, body: bytes) -> Task[..., Any] | None:
        """The task a body names, or None (not a task body, or unknown: ``__call__`` or
        ``resolve`` then says why)."""
        try:
            return self.tasks.get(decode(body)[0])
        except BadBody:
            return None


def _client(ctx: Context) -> JobCalls:
    """The job's client for calls about itself; Fail where the worker gives it none."""
    client = ctx.client
    if client is None:
        raise Fail("this job keeps its result or is a workflow step: that needs a worker in thread or asyncio "
                   "mode (not process mode) on the local shards' service (the SQS backend keeps no results); "
                   "not run here: redrive it to such a worker")
    return client


def _needs_client(ctx: Context, name: str, steps: Steps) -> None:
    """Fail now, before the task runs, for a job that will need the job's client (to keep
    its result, report to its workflow, read its inputs, fan out) where the worker gives it
    none (process mode, SQS): refused only at its report, it would have run and committed
    its effect and idempotency mark, and a redrive would run the effect again."""
    if ctx.client is None and (name == FANOUT or steps != NO_STEPS):
        _client(ctx)


def load_tasks(modules: list[str]) -> dict[str, Task[..., Any]]:
    """Import ``modules`` and collect the tasks of every :class:`App` they define (a
    module attribute that is an App, or a Task)."""
    tasks: dict[str, Task[..., Any]] = {}
    for name in modules:
        mod = importlib.import_module(name)
        for value in list(vars(mod).values()):
            found = value.tasks.values() if isinstance(value, App) else [value] if isinstance(value, Task) else []
            for t in found:
                tasks.setdefault(t.name, t)
    return tasks


def load_apps(modules: list[str]) -> list[App]:
    """The :class:`App` objects defined by ``modules`` (imported)."""
    apps: list[App] = []
    for name in modules:
        mod = importlib.import_module(name)
        for value in vars(mod).values():
            app = value if isinstance(value, App) else value.app if isinstance(value, Task) else None
            if app is not None and all(app is not a for a in apps):
                apps.append(app)
    return apps
