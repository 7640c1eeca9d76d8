"""``shardq worker myapp.tasks``: run every task of the given modules, one worker per queue.

A queue whose tasks are all plain functions gets a threaded :class:`~shardq.consumer.worker.Worker`;
a queue with an ``async def`` task gets an :class:`~shardq.consumer.aioworker.AsyncWorker`
(async tasks on its event loop, plain ones in threads). All of them run in this process,
each in its own thread; SIGTERM/SIGINT stop them all (running jobs get the grace period),
a second signal exits at once. With ``burst`` they share one
:class:`~shardq.consumer.policy.Burst`: all return once every queue is drained.
"""
from __future__ import annotations

import json
import logging
import re
import signal
import threading
import dataclasses
from typing import Any
from collections.abc import Callable

from ..client.queue import Queue
from ..consumer.options import WorkerOptions
from ..errors import InvalidConfig, ShardqError
from .dispatch import TaskHandler, load_tasks
from .app import Task
from ..stopping import install_stop_signals

log = logging.getLogger("shardq.worker")


def plan(tasks: dict[str, Task[..., Any]], queues: list[str] | None) -> dict[str, str]:
    """queue -> "async" or "thread": the mode of each queue's worker."""
    by_queue: dict[str, list[Task[..., Any]]] = {}
    for t in tasks.values():
        by_queue.setdefault(t.queue, []).append(t)
    if queues:
        for q in queues:
            by_queue.setdefault(q, [])
        by_queue = {q: by_queue[q] for q in queues}
    if not by_queue:
        raise InvalidConfig("no tasks found: the modules define no shardq.App with tasks")
    return {q: "async" if any(t.is_async for t in ts) else "thread" for q, ts in by_queue.items()}


def check_retries(tasks: dict[str, Task[..., Any]], queue_config: Callable[[str], dict[str, Any]]) -> list[str]:
    """Warnings for tasks whose ``retries`` the queue's ``max_deliveries`` cuts short.

    The queue's limit is the hard one (the service, or SQS's ``maxReceiveCount``, counts
    every delivery, crashed ones too), so a worker cannot lift it: it can only say, at
    start, which value to set. ``retries <= max_deliveries - 1`` never warns."""
    out = []
    for t in tasks.values():
        if t.retries is None:
            continue
        try:
            limit = int(queue_config(t.queue).get("max_deliveries", 0))
        except ShardqError:
            continue
        if limit and t.retries + 1 > limit:
            out.append(f"task {t.name}: retries={t.retries} allows {t.retries + 1} deliveries, but queue "
                       f"{t.queue!r} dead-letters after max_deliveries={limit}, so {t.retries + 1 - limit} of "
                       f"its retries would never run; raise max_deliveries to at least "
                       f"{t.retries + 1} (config: [queues.{_toml_key(t.queue)}] max_deliveries = {t.retries + 1}) "
                       f"or lower retries to {limit - 1}")
    return out


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


class TaskWorkers:
    """The workers of one ``shardq worker MODULE...`` process."""

    def __init__(self, modules: list[str], router: Queue, target: str, queues: list[str] | None,
                 options: WorkerOptions, idempotency_path: str | None = None, store: Any = None,
                 metrics: Any = None):
        """``options``: every worker's (its ``queue`` aside); ``burst`` True: one
        :class:`~shardq.consumer.policy.Burst` shared by all. ``metrics``: a
        :class:`~shardq.consumer.metrics.WorkerMetrics` every queue's worker reports to."""
        self.modules = modules
        self.tasks = load_tasks(modules)
        self.plan = plan(self.tasks, queues)
        self.router, self.target, self.options, self.metrics = router, target, options, metrics
        self.idempotency_path, self.store = idempotency_path, store
        self.workers: list[Any] = []

    def build(self) -> None:
        from ..consumer.worker import Worker
        for warning in check_retries(self.tasks, self.router.queue_config):
            log.warning("%s", warning)
        from ..consumer.policy import Burst
        o = self.options
        handler = TaskHandler(self.tasks, self.modules)
        burst = Burst(self.plan) if o.burst else False
        for queue, mode in sorted(self.plan.items()):
            options = dataclasses.replace(o, queue=queue, burst=burst)
            if mode == "async":
                from ..consumer.aioworker import AsyncWorker
                w: Any = AsyncWorker(self.target, handler, options, idempotency=self.store, metrics=self.metrics)
            else:
                w = Worker(self.router, handler, options, idempotency=self.store, metrics=self.metrics)
            log.info("queue %r: %s worker, tasks: %s", queue, mode,
                     ", ".join(sorted(t.name for t in self.tasks.values() if t.queue == queue)) or "(none)")
            self.workers.append(w)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def run(self) -> None:
        """Run until every worker returns (stop(), or a signal)."""
        if not self.workers:
            self.build()
        old = install_stop_signals(self.stop, "shardq worker")
        errors: list[BaseException] = []

        def run_one(w: Any) -> None:
            try:
                w.run()
            except BaseException as exc:  # noqa: BLE001 - reported below, the others stop too
                errors.append(exc)
                self.stop()

        threads = [threading.Thread(target=run_one, args=(w,), name=f"shardq-worker-{i}", daemon=True)
                   for i, w in enumerate(self.workers)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)  # wakes for signals
        finally:
            for sig, handler in (old or {}).items():
                signal.signal(sig, handler)
        if errors:
            raise errors[0]

