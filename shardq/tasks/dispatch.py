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
from typing import Any

from ..errors import Fail, Retry
from ..consumer.handling import Context, error_text
from .body import BadBody, decode
from .app import App, Task

KNOWN_NAMES_SHOWN = 20  # an unknown-task error lists at most this many known names


class TaskHandler:
    """``handler(ctx)`` for the jobs of every task in ``tasks`` (name -> Task).

    Picklable as the list of modules it was loaded from (process mode re-imports them)."""

    def __init__(self, tasks: dict[str, Task], modules: list[str] | None = None,
                 rng: random.Random | None = None):
        self.tasks = dict(tasks)
        self.modules = modules
        self.rng = rng or random.Random()

    @classmethod
    def from_modules(cls, modules: list[str]) -> TaskHandler:
        return cls(load_tasks(modules), modules)

    def __reduce__(self):
        if self.modules is None:
            raise TypeError("a TaskHandler built from tasks (not modules) cannot be sent to a process")
        return (TaskHandler.from_modules, (self.modules,))

    # ------------------------------------------------------------------ routing
    def resolve(self, ctx: Context) -> tuple[Task, list, dict]:
        """The task and arguments of the job; Fail (dead-letter now) if there is none."""
        try:
            name, args, kwargs = decode(ctx.body)
        except BadBody as exc:
            raise Fail(f"{exc}; dead-lettered without running") from None
        task = self.tasks.get(name)
        if task is None:
            known = sorted(self.tasks)
            shown = ", ".join(known[:KNOWN_NAMES_SHOWN]) + (" ..." if len(known) > KNOWN_NAMES_SHOWN else "")
            raise Fail(f"unknown task {name!r}: this worker knows {len(known)} task(s): {shown or 'none'}. "
                       "Deploy the task to the workers of this queue, then redrive the dead letter")
        return task, args, kwargs

    def failure(self, task: Task, attempt: int, exc: BaseException) -> BaseException:
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
        task, args, kwargs = self.resolve(ctx)
        try:
            if task.is_async:  # an async task on a thread worker: its own loop, in this thread
                from ..consumer.aiotxn import InlineDb
                if ctx.db is not None:
                    ctx.db = InlineDb(ctx.db)
                return asyncio.run(task.fn(ctx, *args, **kwargs))
            return task.fn(ctx, *args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: not the task's failure
            raise self.failure(task, ctx.attempt, exc) from exc

    async def run_async(self, task: Task, ctx: Context, args: list, kwargs: dict) -> Any:
        """Await an async task on the running loop (the asyncio worker's path; a sync task
        goes through ``__call__`` in a thread instead)."""
        try:
            return await task.fn(ctx, *args, **kwargs)
        except Exception as exc:
            raise self.failure(task, ctx.attempt, exc) from exc

    def task_of(self, body: bytes) -> Task | None:
        """The task a body names, or None (not a task body, or unknown: ``__call__`` or
        ``resolve`` then says why)."""
        try:
            return self.tasks.get(decode(body)[0])
        except BadBody:
            return None


def load_tasks(modules: list[str]) -> dict[str, Task]:
    """Import ``modules`` and collect the tasks of every :class:`App` they define (a
    module attribute that is an App, or a Task)."""
    tasks: dict[str, Task] = {}
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
