"""``shardq worker module:function [options]``: run a :class:`~shardq.consumer.worker.Worker`
against a running service.

``shardq worker myapp.tasks [more.modules ...]`` (modules, no colon): run every task of
the modules, one worker per queue of their tasks (``--queue`` to pick some), routing each
job by its task name (:mod:`shardq.tasks.runner`).

It says what it does: a start line (queues, concurrency, mode, idempotency store) once it
is connected, progress every ``--log-every`` jobs and every ``--log-every-s`` seconds, a
last line when it returns; ``--burst`` returns (exit 0) once every queue it serves is
drained (:class:`shardq.consumer.policy.Burst` says exactly when)."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Any
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..limits import LOG_EVERY_S_DEFAULT, LOG_EVERY_S_MAX
from ..pgconn import is_url
from . import common, exits

if TYPE_CHECKING:
    from ..consumer.idempotency import IdempotencyStore
    from ..consumer.metrics import WorkerMetrics
    from ..types import Lease

log = logging.getLogger("shardq.worker")
# the WorkerOptions fields these flags set, named as the flags in a refusal
_FLAGS = {"concurrency": "--concurrency", "prefetch": "--prefetch", "grace_s": "--grace", "log_every": "--log-every",
          "log_every_s": "--log-every-s", "queue name": "--queue"}
_FIELD = re.compile("|".join(rf"\b{re.escape(f)}\b" for f in sorted(_FLAGS, key=len, reverse=True)))


def open_store(target: str) -> IdempotencyStore:
    """The idempotency store ``--idempotency`` names, picked by the URL scheme: a PostgreSQL
    URL opens a :class:`~shardq.consumer.postgres.PostgresStore`, anything else is a SQLite file."""
    if is_url(target):
        from ..consumer.postgres import PostgresStore
        return PostgresStore(target)
    from ..consumer.idempotency import SqliteStore
    return SqliteStore(target)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("handler", nargs="+", metavar="TARGET",
                   help="module:function (one handler), or module(s) of tasks; imported with the "
                        "current directory on sys.path")
    p.add_argument("--queue", action="append", default=None,
                   help="queue to work (default: 'default' for a handler; every queue of the "
                        "tasks for modules); repeat for several")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--mode", choices=("thread", "process"), default="thread")
    p.add_argument("--idempotency", metavar="PATH.sqlite|postgresql://...",
                   help="idempotency store, exactly-once effects through ctx.db: a SQLite file, "
                        "or a PostgreSQL URL (postgresql:// or postgres://; needs shardq[postgres])")
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--grace", type=float, default=30.0, help="seconds running jobs get on SIGTERM")
    p.add_argument("--log-every", type=int, default=1000, metavar="JOBS",
                   help="log a progress line every JOBS finished jobs (default 1000)")
    p.add_argument("--log-every-s", type=float, default=LOG_EVERY_S_DEFAULT, metavar="SECONDS",
                   help=f"and every SECONDS in which a job finished (default {LOG_EVERY_S_DEFAULT:g}; "
                        f"at most {LOG_EVERY_S_MAX:g})")
    p.add_argument("--burst", action="store_true",
                   help="exit 0 once every queue it serves has no job to lease and every job it "
                        "leased is settled (delayed jobs not yet due do not count)")
    common.add_log_level(p)
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics on this address (port 0: any free port; printed)")


def register(sub: common.Subparsers, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("worker", parents=[parent], help="run a handler, or every task of some modules")
    add_arguments(s)
    s.set_defaults(fn=run)


def run(args: argparse.Namespace, connect: Callable[..., Any] | None = None) -> int:
    from ..consumer.handling import load_handler
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.idempotency and not is_url(args.idempotency):
        parent = os.path.dirname(os.path.abspath(args.idempotency))
        if not os.path.isdir(parent):
            raise UsageError(f"--idempotency {args.idempotency}: directory {parent} does not exist")
    from ..config import check_queue_name
    from ..consumer.options import WorkerOptions
    from ..errors import InvalidConfig
    try:  # the runners' own checks, before connecting, told as the flags
        WorkerOptions(concurrency=args.concurrency, mode=args.mode, prefetch=args.prefetch, grace_s=args.grace,
                      log_every=args.log_every, log_every_s=args.log_every_s)
        for queue in args.queue or ():
            check_queue_name(queue, InvalidConfig)
    except InvalidConfig as exc:
        raise UsageError(_FIELD.sub(lambda m: _FLAGS[m.group(0)], str(exc))) from None
    task_mode = not any(":" in t for t in args.handler)
    if not task_mode and len(args.handler) != 1:
        raise UsageError("give one module:function, or module names (no colon) of tasks")
    if not task_mode and args.queue and len(args.queue) != 1:
        raise UsageError("a module:function handler works one --queue")
    tasks = None
    try:
        if task_mode:
            from ..tasks.dispatch import load_tasks
            tasks = load_tasks(args.handler)  # import errors are usage errors, before connecting
        else:
            handler = load_handler(args.handler[0])
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"cannot load {' '.join(args.handler)!r}: {exc}") from None
    if task_mode and not tasks:  # e.g. a plain handler's module with its ":handle" forgotten
        raise UsageError(_no_tasks(args.handler))
    # From here (its code loaded, the command line good) a stop signal is a clean stop, also
    # while it connects: the process handles SIGTERM from now on, which is what a test or a
    # tool that waits for it to be stoppable looks for (SigCgt in /proc/PID/status).
    return common.stoppable_while_starting(
        "shardq worker", lambda: _work(args, connect, task_mode, tasks, None if task_mode else handler))


def _no_tasks(modules: list[str]) -> str:
    """The refusal of modules that declare no task, with the ``module:function`` a plain
    handler is given as (one of the first module's own functions, ``handle`` if it has one)."""
    import importlib
    import inspect
    mod = importlib.import_module(modules[0])  # imported already: load_tasks did
    functions = [n for n, v in vars(mod).items()
                 if inspect.isfunction(v) and v.__module__ == mod.__name__ and not n.startswith("_")]
    name = "handle" if "handle" in functions else functions[0] if functions else "function"
    which = f"{modules[0]!r} declares" if len(modules) == 1 else f"{' '.join(modules)!r} declare"
    return (f"{which} no tasks (@app.task): to run a plain handler, give it as module:function, "
            f"e.g. 'shardq worker {modules[0]}:{name}'")


def _work(args: argparse.Namespace, connect: Callable[..., Any] | None, task_mode: bool, tasks: dict[str, Any] | None,
          handler: Any) -> int:
    from ..consumer.options import WorkerOptions
    from ..consumer.worker import Worker
    target = common.service_dir(args)
    if connect is None:
        import shardq
        connect = shardq.connect
    store = router = None
    try:
        store = open_store(args.idempotency) if args.idempotency else None
        # Requests must time out well inside a lease, so one hung shard cannot stall the
        # heartbeats of jobs on the other shards past their deadlines.
        router = connect(target, request_timeout_s=5.0)
        queues = args.queue or (sorted({t.queue for t in tasks.values()}) if tasks is not None else ["default"])
        for warning in check_queues(router, queues, tasks, args.handler):
            log.warning("%s", warning)
        metrics = _serve_metrics(args)
        options = WorkerOptions(queue=queues[0], concurrency=args.concurrency, mode=args.mode,
                                prefetch=args.prefetch, grace_s=args.grace, log_every=args.log_every,
                                log_every_s=args.log_every_s, burst=args.burst)
        if task_mode:
            from ..tasks.runner import TaskWorkers
            workers = TaskWorkers(args.handler, router, target, args.queue, options,
                                  idempotency_path=args.idempotency, store=store, metrics=metrics)
            workers.build()  # refuses bad options before the start line
            log.info("%s", start_line(args, workers.plan))
            workers.run()
        else:
            worker = Worker(router, handler, options, idempotency=store, metrics=metrics)
            log.info("%s", start_line(args, {queues[0]: args.mode}))
            worker.run()
    finally:
        if router is not None:
            router.close()
        if store is not None:
            store.close()
    return exits.OK


_PENDING = ("ready", "delayed", "waiting", "in_flight")
_MODE_WORDS = {"thread": "threads", "process": "processes", "async": "asyncio"}


def start_line(args: argparse.Namespace, plan: dict[str, str]) -> str:
    """What a worker says when it starts: its queues and the mode of each (``plan``:
    queue -> "thread", "process" or "async"), what it runs, its concurrency, idempotency
    store, progress settings and whether it stops when the queues are drained."""
    task_mode = not any(":" in t for t in args.handler)
    modes = {q: _MODE_WORDS["process" if m == "thread" and args.mode == "process" else m]
             for q, m in sorted(plan.items())}
    queues = ", ".join(f"{q} ({m})" for q, m in modes.items())
    what = f"tasks of {' '.join(args.handler)}" if task_mode else f"handler {args.handler[0]}"
    if not args.idempotency:
        store = "no idempotency store (effects at least once)"
    elif is_url(args.idempotency):
        store = "idempotency store PostgreSQL " + _no_password(args.idempotency)
    else:
        store = f"idempotency store SQLite {args.idempotency}"
    return (f"worker {os.getpid()} started: {what}; {'queues' if len(modes) > 1 else 'queue'} {queues}; "
            f"concurrency {args.concurrency}{' per queue' if len(modes) > 1 else ''}; {store}; "
            f"progress every {args.log_every} jobs and every {args.log_every_s:g}s"
            + ("; --burst: exits once the queues are drained" if args.burst else ""))


def _no_password(url: str) -> str:
    """``url`` with its password, if any, shown as ``***``."""
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def check_queues(router: Any, queues: list[str], tasks: dict[str, Any] | None, targets: list[str]) -> list[str]:
    """Check at start the queues a worker is about to wait on, so a misspelt ``--queue``
    is not an idle worker. Raises UnknownQueue for a queue the service refuses (not
    declared, with ``declare_queues``) and UsageError for a queue of a task worker that no
    task of its modules is sent to and that holds no jobs: nothing could ever run there.
    Returns warnings for a handler's queue the service has never seen and that holds no
    jobs (jobs may still come). Each names the queues that hold jobs. With a shard down the
    counts are incomplete, and only the declaration is checked."""
    from ..client.queue import Queue
    from ..errors import UnknownQueue
    if not isinstance(router, Queue):
        return []  # a stand-in queue object (not a whole Queue) that cannot count its jobs
    st = router.stats()
    complete = all(sh.get("available", True) for sh in st.get("shards", []))
    counts = st.get("queues", {})
    with_jobs = {name: n for name, c in sorted(counts.items())
                 if (n := sum(v for k in _PENDING if isinstance(v := c.get(k), int)))}
    holding = "queues with jobs: " + (", ".join(f"{n} ({c})" for n, c in with_jobs.items()) or "none")
    fatal, warnings = [], []
    for q in queues:
        try:
            router.queue_config(q)
        except UnknownQueue:
            raise UnknownQueue(f"--queue {q}: the service does not declare this queue (declare_queues = "
                               f"true), so no job can ever be sent to it: fix the name, or declare it as "
                               f"[queues.{q}] in the service's config; {holding}") from None
        if not complete or with_jobs.get(q):
            continue
        if tasks is not None and not any(t.queue == q for t in tasks.values()):
            task_queues = ", ".join(sorted({t.queue for t in tasks.values()}))
            fatal.append(f"--queue {q}: no task of {' '.join(targets)} is sent to this queue and it holds "
                         f"no jobs, so nothing could ever run there (the tasks' queues: {task_queues})")
        elif tasks is None and q not in counts:
            warnings.append(f"queue {q!r} holds no jobs and the service has never seen it (a typo?); "
                            f"waiting for jobs there anyway; {holding}")
    if fatal:
        raise UsageError("; ".join(fatal) + f"; {holding}")
    return warnings


def main(argv: list[str] | None = None, connect: Callable[..., Any] | None = None) -> int:
    """The worker command on its own (tests, embedding): parse ``argv``, run, return the exit
    status; errors print ``error: Type: message`` like every ``shardq`` command."""
    from .common import Parser, run_guarded
    p = Parser(prog="shardq worker", parents=[common.common_parser()],
                                description="Run a handler, or every task of some modules.")
    add_arguments(p)
    args = p.parse_args(argv)
    return run_guarded(lambda: run(args, connect))


def _task_name(lease: Lease) -> str:
    """The task a job calls (the metrics label of ``shardq worker MODULE``)."""
    from ..tasks import body as taskbody
    try:
        return taskbody.decode(lease.body)[0]
    except taskbody.BadBody:
        return "(not a task)"


def _serve_metrics(args: argparse.Namespace) -> WorkerMetrics | None:
    """``--metrics HOST:PORT``: a WorkerMetrics served on that address, or None."""
    if not args.metrics:
        return None
    from ..consumer.metrics import WorkerMetrics
    from ..errors import InvalidConfig
    handler_mode = any(":" in t for t in args.handler)  # one module:function, labelled by its name
    metrics = WorkerMetrics(task=" ".join(args.handler), task_of=None if handler_mode else _task_name)
    try:
        host, port = metrics.serve(args.metrics)
    except OSError as e:
        raise InvalidConfig(f"--metrics {args.metrics}: cannot listen: {e.strerror or e}") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"shardq worker: metrics at http://{shown}:{port}/metrics", file=sys.stderr, flush=True)
    return metrics
