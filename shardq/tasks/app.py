"""Tasks: a decorated function is a job type; ``.send()`` enqueues a call of it.

::

    app = shardq.App("var/shardq")

    @app.task(queue="emails", key=lambda user_id, **_: f"user-{user_id}", retries=4,
              backoff=shardq.Exponential(base_s=1, cap_s=300))
    def send_welcome(ctx, user_id: int, template: str = "default"): ...

    send_welcome.send(42, template="short")           # -> job id, once the job is durable

* The body is msgpack ``{"t": name, "a": args, "k": kwargs, "v": 1}`` (:mod:`.taskbody`);
  the call is checked against the function's signature and msgpack at ``send()``, so a bad
  call fails in the producer with :class:`~shardq.errors.InvalidJob`, not in a worker.
* ``key=`` (a string, or a function of the call's arguments) gives per-key FIFO. The
  function gets the arguments by parameter name (defaults filled in), however the call
  passed them: ``key=lambda user_id, **_: f"user-{user_id}"``.
* ``retries``: deliveries after the first. A failure on attempt ``n <= retries`` is retried
  after the task's backoff (full jitter); after that the job is dead-lettered with the error.
  The count is the job's durable delivery count (``lease.attempt``), so a worker crash
  uses a retry too. The queue's ``max_deliveries`` is the hard limit (the service counts
  every delivery; a worker cannot lift it): whichever limit comes first dead-letters the
  job (``retries=None``: only the queue's limit), so ``retries`` works as written up to
  ``max_deliveries - 1`` (4 with the default), and the worker warns at start about a task
  whose retries its queue cuts short.
* A failure is logged with its traceback once per attempt (WARNING, or ERROR on the last),
  and the traceback's last lines follow ``"Type: message"`` in the job's error text.
* ``send()`` keeps the function's signature (minus ``ctx``) for type checkers (ParamSpec).

The app depends on the :class:`~shardq.client.queue.Queue` protocol only.
"""
from __future__ import annotations

import asyncio
import inspect
import random
import shutil
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Concatenate, Generic,
                    ParamSpec, TypeVar, overload)
from collections.abc import Callable, Iterable

from .. import limits
from ..client.contracts import Results
from ..clock import Clock, SystemClock
from ..errors import Closed, InvalidConfig, InvalidJob, JobFailed, NotFound, Unsupported
from ..protocol import validate
from ..types import JobId
from . import body as taskbody

if TYPE_CHECKING:
    from ..client.aio import AsyncQueue
    from ..client.queue import Queue
    from ..schedules import Schedule
    from .workflow import Signature

P = ParamSpec("P")
R = TypeVar("R")

#: The most ``retries`` a task takes: one delivery fewer than the largest ``max_deliveries``
#: the service's config accepts (1,000,000, config.py): more could never run, and the
#: advice to raise the queue's ``max_deliveries`` would name a value the config refuses.
RETRIES_MAX = 999_999


@dataclass(frozen=True)
class Exponential:
    """Full-jitter exponential backoff: before retry ``n`` (after attempt ``n`` failed) wait
    ``uniform(0, min(cap_s, base_s * 2**(n-1)))`` seconds."""

    base_s: float = 1.0
    cap_s: float = 300.0

    def __post_init__(self) -> None:
        if not (isinstance(self.base_s, (int, float)) and isinstance(self.cap_s, (int, float))
                and 0 <= self.base_s <= self.cap_s <= limits.DELAY_S_MAX):
            raise InvalidConfig(f"Exponential: need 0 <= base_s <= cap_s <= {limits.DELAY_S_MAX:.0f}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0 ** min(max(attempt, 1) - 1, 64)))


class Task(Generic[P, R]):
    """One task. Call it like the function (``task(ctx, ...)``) to run it inline, in tests."""

    def __init__(self, app: App, fn: Callable[..., Any], name: str, queue: str,
                 key: str | Callable[..., str] | None, retries: int | None, backoff: Exponential,
                 keep_result: float | None = None):
        self.app, self.fn, self.name, self.queue = app, fn, name, queue
        self.key, self.retries, self.backoff = key, retries, backoff
        self.keep_result = keep_result
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = inspect.signature(fn)
        if not self.signature.parameters:
            raise InvalidConfig(f"task {name}: the function must take ctx as its first parameter")
        self.__doc__, self.__wrapped__ = fn.__doc__, fn

    def __call__(self, ctx: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = self.fn(ctx, *args, **kwargs)
        return result

    def __repr__(self) -> str:
        return f"<task {self.name} queue={self.queue!r}>"

    # ------------------------------------------------------------------ sending
    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature: this call, not sent yet, for :func:`~shardq.tasks.workflow.chain`,
        :func:`~shardq.tasks.workflow.group` and :func:`~shardq.tasks.workflow.chord`. In a
        chain the step gets the previous step's result as its first argument after ``ctx``,
        before ``args``."""
        from .workflow import Signature
        return Signature(self, tuple(args), dict(kwargs))

    def send(self, *args: P.args, **kwargs: P.kwargs) -> JobId:
        """Enqueue a call; returns the job id once the job is durable."""
        return self._queue().enqueue(**self.job(args, kwargs))

    def _queue(self) -> Queue:
        """The app's queue; Unsupported if this task keeps results and it cannot."""
        q = self.app.queue
        if self.keep_result and not issubclass(type(q), Results):  # isinstance, by the class: see _results_of
            _results_of(q)  # raises
        return q

    def send_with(self, *, delay: float = 0, priority: int = 0,
                  dedup_id: str | None = None) -> Callable[P, JobId]:
        """``task.send_with(delay=60, priority=5, dedup_id="welcome-42")(42)``."""
        def send(*args: P.args, **kwargs: P.kwargs) -> JobId:
            return self._queue().enqueue(**self.job(args, kwargs, delay, priority, dedup_id))
        return send

    def send_many(self, calls: Iterable[tuple[tuple[Any, ...] | list[Any], dict[str, Any]]]) -> list[JobId]:
        """Enqueue many calls ``[(args, kwargs), ...]`` in one batch call; ids in order.

        Every call is checked before anything is sent: here (signature, key function,
        msgpack), then by the client's ``enqueue_many`` over the whole batch (keys, each
        body against its queue's ``max_body_bytes``), so bad input sends nothing, however
        many calls. Once checked, the client sends the batch as one request per shard (more
        past ``limits.BATCH_JOBS_MAX`` jobs or ``limits.REQUEST_BYTES_MAX`` bytes; on SQS,
        batches of 10), each all-or-nothing: one that fails (ShardUnavailable, QueueFull)
        raises with the other requests' jobs in. To retry such a batch without doubles,
        give each call a dedup id (``app.queue.enqueue_many([task.job(args, kwargs,
        dedup_id=...), ...])``) and send it again within the queue's ``dedup_window``."""
        jobs: list[dict[str, Any]] = []
        for call in calls:
            if not (isinstance(call, (tuple, list)) and len(call) == 2
                    and isinstance(call[0], (tuple, list)) and isinstance(call[1], dict)):
                raise InvalidJob(f"task {self.name}: send_many takes (args, kwargs) pairs, got {call!r:.80}")
            jobs.append(self.job(call[0], call[1]))
        # One call, never cut here: each part would be checked alone, and a call the queue
        # refuses after the 10,000th would leave the first 10,000 in.
        return self._queue().enqueue_many(jobs)

    async def send_async(self, *args: P.args, **kwargs: P.kwargs) -> JobId:
        """``await task.send_async(...)``: enqueue through the app's asyncio client."""
        q = await self.app.aio()  # the asyncio client keeps results (contracts.AsyncResults)
        return await q.enqueue(**self.job(args, kwargs))

    def job(self, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any], delay: float = 0, priority: int = 0,
            dedup_id: str | None = None) -> dict[str, Any]:
        """The enqueue arguments of one call, checked (signature, key, msgpack)."""
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise InvalidJob(f"task {self.name}: {exc}") from None
        key = self.key
        if callable(key):
            bound.apply_defaults()
            named = dict(list(bound.arguments.items())[1:])  # by parameter name, without ctx
            try:
                key = key(**named)
            except Exception as exc:  # noqa: BLE001 - a failing user key function is the caller's InvalidJob
                raise InvalidJob(f"task {self.name}: the key function failed: {type(exc).__name__}: {exc}") from None
            if not isinstance(key, str):
                raise InvalidJob(f"task {self.name}: the key function must return a str, got {key!r:.80}")
        steps = taskbody.Steps(float(self.keep_result), None, None) if self.keep_result else taskbody.NO_STEPS
        body = taskbody.encode(self.name, args, kwargs, self.signature, steps)
        return {"body": body, "key": key, "queue": self.queue, "delay": delay, "priority": priority,
                "dedup_id": dedup_id}


_PENDING = object()


def _results_of(q: Queue) -> Results:
    """``q`` as a client that keeps results; Unsupported where it keeps none (SQS). On a
    send, where it counts, ``issubclass(type(q), Results)`` asks the same of the class
    (the methods are the class's), cached: about 0.25 us, where ``isinstance`` against a
    protocol takes about 8 us on Python 3.11."""
    if not isinstance(q, Results):
        raise Unsupported(f"results need the local shards' service; {type(q).__name__} keeps none "
                          "(docs/workflows.md)")
    return q


def _no_arguments_needed(fn: Any) -> None:
    """InvalidConfig if a call of ``fn`` (a task, or the function to make one of) with no
    arguments besides ctx does not bind: what ``@app.periodic`` sends at each tick."""
    task = fn if isinstance(fn, Task) else None
    try:
        signature = task.signature if task is not None else inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise InvalidConfig(f"@app.periodic needs a function, got {fn!r:.80} ({exc})") from None
    if not signature.parameters:
        return  # no ctx: Task() says so
    try:
        signature.bind(None)
    except TypeError as exc:
        name = task.name if task is not None else \
            f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        raise InvalidConfig(f"@app.periodic: task {name} is called with no arguments at each tick, but it needs "
                            f"some ({exc}): give its parameters defaults, or schedule a task that takes none"
                            ) from None


def _job_id(value: Any) -> int:
    """A job id of the local shards, checked as the client checks one (InvalidJob)."""
    return validate.integer("job_id", value)


def _settled(r: Any, unpack: Callable[[bytes], Any]) -> Any:
    """A job's value once it succeeded; _PENDING while it may still; JobFailed, NotFound."""
    if r.state == "succeeded":
        return unpack(r.value)
    if r.state == "dead":
        raise JobFailed(f"job {r.job_id} failed: {r.error}", job_id=r.job_id, error=r.error)
    if r.state == "gone":
        raise NotFound(f"job {r.job_id}: no result kept (its task has no keep_result, the result expired, "
                       "or the job was cancelled or never enqueued)")
    return _PENDING


class App:
    """A set of tasks and the queue they are sent to.

    ``App("var/shardq")`` connects (lazily, on the first send) to a running ``shardq serve``;
    ``App(router=q)`` uses any :class:`~shardq.client.queue.Queue`; ``shardq.App.embedded()``
    starts a private service in a temp dir and ``shardq.App.run_worker()`` runs the tasks in
    this process (tests; shardq/service/embedded.py, a layer that may start a service and
    run a worker). Import a module of tasks and nothing connects. ``clock`` times the waits
    of :meth:`result` and of its workflows' ``result`` (the system clock by default).
    """

    def __init__(self, target: str | None = None, *, router: Queue | None = None, config: Any = None,
                 clock: Clock | None = None):
        if (target is None) == (router is None):
            raise InvalidConfig("App needs a target (a data dir) or router=, not both")
        from .. import config as config_mod
        #: the service's config (a TOML path, a dict of its schema or a Config; None: not
        #: known here), so that each task's ``retries`` is checked against its queue's
        #: ``max_deliveries`` when it is declared, not only when a worker starts
        self.config = None if config is None else config_mod.load(config)
        self.target = target
        self.clock = clock or SystemClock()
        self._queue = router
        self._owns_queue = router is None  # a router given to us is the caller's to close
        self._aio: dict[Any, Any] = {}  # event loop -> its asyncio client
        self._owned_dir: str | None = None
        self._closed = False
        self.tasks: dict[str, Task[..., Any]] = {}
        self.schedules: list[Schedule] = []  # from @periodic

    @property
    def queue(self) -> Queue:
        """The queue client (connected on first use); Closed once :meth:`close` ran."""
        if self._closed:
            raise Closed("app is closed")
        if self._queue is None:
            from ..backends import connect
            self._queue = connect(self.target)
        return self._queue

    async def aio(self) -> AsyncQueue:
        """The asyncio client of the running event loop (one per loop, connected once).
        InvalidConfig for an app made with ``router=``: it has no data dir to connect to."""
        if self._closed:
            raise Closed("app is closed")
        loop = asyncio.get_running_loop()
        q: AsyncQueue | None = self._aio.get(loop)
        if q is None:
            self._forget_closed_loops()
            if self.target is None:
                raise InvalidConfig("this App was made with router=, so it has no data dir for an asyncio "
                                    "client: make it with App(target) to use the *_async calls")
            from ..client import aio
            q = self._aio[loop] = await aio.connect(self.target)
        return q

    # ------------------------------------------------------------------ declaring
    @overload
    def task(self, fn: Callable[Concatenate[Any, P], R], /) -> Task[P, R]: ...

    @overload
    def task(self, *, queue: str = "default", key: str | Callable[..., str] | None = None,
             retries: int | None = None, backoff: Exponential | None = None,
             name: str | None = None,
             keep_result: float | None = None) -> Callable[[Callable[Concatenate[Any, P], R]], Task[P, R]]: ...

    # mypy reports the implementation as not accepting overload 2's parameters while fn is
    # positional-only (it accepts them: all keyword-only, fn left out); without the "/" it
    # passes, but fn would become a keyword too.
    def task(self, fn: Callable[..., Any] | None = None, /, *, queue: str = "default",  # type: ignore[misc]
             key: str | Callable[..., str] | None = None, retries: int | None = None,
             backoff: Exponential | None = None, name: str | None = None,
             keep_result: float | None = None) -> Any:
        """Declare a task. ``name`` defaults to ``module.qualname``; keep it stable, it is
        how workers find the function (a renamed task's queued jobs would be dead-lettered
        as unknown). ``keep_result``: seconds the service keeps each job's return value
        (``app.result(job_id)``); default: not kept, except inside a workflow."""
        from ..config import check_queue_name
        check_queue_name(queue, InvalidConfig)
        if retries is not None and (type(retries) is not int or not 0 <= retries <= RETRIES_MAX):
            raise InvalidConfig(f"retries must be None or an int in [0, {RETRIES_MAX}] (the first delivery and "
                                f"{RETRIES_MAX} retries take the largest max_deliveries, {RETRIES_MAX + 1})")
        self._check_retries(queue, retries)
        if key is not None and not (isinstance(key, str) or callable(key)):
            raise InvalidConfig("key must be None, a string or a function of the task's arguments")
        if backoff is not None and not isinstance(backoff, Exponential):
            raise InvalidConfig("backoff must be a shardq.Exponential")
        if keep_result is not None and (isinstance(keep_result, bool) or not isinstance(keep_result, (int, float))
                                        or not 0 < keep_result <= limits.KEEP_RESULT_S_MAX):
            raise InvalidConfig(f"keep_result must be None or seconds in (0, {limits.KEEP_RESULT_S_MAX:.0f}]")

        def decorate(f: Callable[..., Any]) -> Task[..., Any]:
            if isinstance(f, Task):
                raise InvalidConfig(f"@app.task over the task {f.name} (@app.periodic, or @app.task twice): "
                                    "put @app.periodic(...) above @app.task(...)")
            task_name = name or f"{f.__module__}.{f.__qualname__}"
            if not isinstance(task_name, str) or not task_name:
                raise InvalidConfig("a task name must be a non-empty string")
            if task_name in self.tasks and self.tasks[task_name].fn is not f:
                raise InvalidConfig(f"two tasks are named {task_name!r}")
            t: Task[..., Any] = Task(self, f, task_name, queue, key, retries, backoff or Exponential(), keep_result)
            self.tasks[task_name] = t
            return t

        return decorate if fn is None else decorate(fn)

    def _check_retries(self, queue: str, retries: int | None) -> None:
        """With the service's config known (``config=``): InvalidConfig for ``retries``
        past what the queue's ``max_deliveries`` lets run (``max_deliveries - 1``: the
        service dead-letters the job at its limit whatever the task says), naming the most
        allowed. Without it the worker warns at start instead (tasks/runner.py)."""
        if retries is None or self.config is None:
            return
        cfg = self.config.queue(queue)
        if cfg is None:  # not declared, with declare_queues = true: its sends are refused anyway
            return
        if retries > cfg.max_deliveries - 1:
            raise InvalidConfig(f"retries={retries} is more than queue {queue!r} allows: it dead-letters a job "
                                f"after max_deliveries = {cfg.max_deliveries} deliveries, so the most allowed is "
                                f"retries={cfg.max_deliveries - 1} (or raise max_deliveries to {retries + 1} "
                                "in the service's config)")

    def periodic(self, *, cron: str | None = None, every_s: float | None = None,
                 timezone: str = "UTC", catch_up: bool = True, name: str | None = None,
                 queue: str | None = None, key: str | None = None) -> Callable[[Any], Task[..., Any]]:
        """Run a task (no arguments besides ctx) on a schedule: ``cron`` (5 fields, in
        ``timezone``) or every ``every_s`` seconds. ``shardq serve`` fires the ticks of the
        modules listed in its config's ``service.schedule_modules`` (see docs/tasks.md).
        Stack it on ``@app.task(...)`` (above it) to choose the queue, key and retries there;
        a ``queue`` given to both must be the same (InvalidConfig)."""
        from ..schedules import Schedule

        def decorate(fn: Any) -> Task[..., Any]:
            # Each tick calls the task with no arguments: one that needs some is refused now,
            # as .send() would refuse the call, not by every tick failing in a worker.
            _no_arguments_needed(fn)
            if isinstance(fn, Task) and queue is not None and queue != fn.queue:
                raise InvalidConfig(f"@app.periodic(queue={queue!r}) over @app.task(queue={fn.queue!r}) of "
                                    f"{fn.name}: the ticks go to the task's queue; give it once, to @app.task")
            t = fn if isinstance(fn, Task) else self.task(queue=queue or "default", key=key)(fn)
            sched_key = key if key is not None else t.job((), {})["key"]  # (a key function's, too)
            body = taskbody.encode(t.name, (), {}, t.signature)
            self.schedules.append(Schedule.create(name or t.name, cron=cron, every_s=every_s,
                                                  timezone=timezone, catch_up=catch_up,
                                                  queue=t.queue, key=sched_key, body=body,
                                                  task=t.name))
            return t

        return decorate

    # ------------------------------------------------------------------ results
    def status(self, job_id: JobId) -> dict[str, Any]:
        """What the service says of one job's outcome: ``state`` (``succeeded``, or the live
        job's: ``ready``, ``delayed``, ``waiting``, ``leased``, ``dead``; or ``gone``),
        ``attempts``, ``progress``, ``note``, ``error``, ``result_bytes``, ``expires_at``."""
        (r,) = _results_of(self.queue).results([_job_id(job_id)])
        return {"job_id": r.job_id, "state": r.state, "attempts": r.attempts, "progress": r.fraction,
                "note": r.note, "error": r.error, "result_bytes": None if r.value is None else len(r.value),
                "expires_at": r.expires_at}

    def result(self, job_id: JobId, timeout: float | None = None) -> Any:
        """The return value of a job of a task with ``keep_result``, once it succeeded.
        JobFailed (with its error) if it was dead-lettered, TimeoutError if not done within
        ``timeout`` seconds (None or ``math.inf``: no limit; NaN is refused with InvalidJob),
        NotFound if its result is gone (not kept, or expired)."""
        from .workflow import POLL_FIRST_S, _deadline, _next_wait, _retry_left, unpack
        q = _results_of(self.queue)
        ids = [_job_id(job_id)]
        deadline = _deadline(timeout, self.clock)
        wait = POLL_FIRST_S
        while True:
            left = _retry_left(deadline, self.clock)
            (r,) = q.results(ids) if left is None else q.results(ids, retry_s=left)
            value = _settled(r, unpack)
            if value is not _PENDING:
                return value
            wait = _next_wait(wait, deadline, f"job {job_id} (still {r.state})", self.clock)
            time.sleep(wait)

    async def result_async(self, job_id: JobId, timeout: float | None = None) -> Any:
        """As :meth:`result`, with this loop's asyncio client."""
        from .workflow import POLL_FIRST_S, _deadline, _next_wait, _retry_left, unpack
        q = await self.aio()  # the asyncio client keeps results (contracts.AsyncResults)
        ids = [_job_id(job_id)]
        deadline = _deadline(timeout, self.clock)
        wait = POLL_FIRST_S
        while True:
            left = _retry_left(deadline, self.clock)
            (r,) = await (q.results(ids) if left is None else q.results(ids, retry_s=left))
            value = _settled(r, unpack)
            if value is not _PENDING:
                return value
            wait = _next_wait(wait, deadline, f"job {job_id} (still {r.state})", self.clock)
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        """Close this event loop's asyncio client."""
        q = self._aio.pop(asyncio.get_running_loop(), None)
        if q is not None:
            await q.close()

    def _forget_closed_loops(self) -> None:
        """Drop the asyncio clients of event loops that ended without :meth:`aclose` (a loop
        per call or per request: ``asyncio.run``, Flask's async views), freeing their
        connections at once: each held a connection per shard until the shards' limit
        turned every client of the service away."""
        for loop in [loop for loop in self._aio if loop.is_closed()]:
            self._aio.pop(loop)._loop_gone()

    def close(self) -> None:
        """Close the client this app opened (and stop the embedded service); every later
        call through the app raises Closed, as a closed client's do (it used to connect
        again). Asyncio clients belong to their event loops: close them with :meth:`aclose`
        (those of loops that have ended are closed here)."""
        self._closed = True
        self._forget_closed_loops()
        if self._queue is not None and self._owns_queue:
            self._queue.close()
            self._queue = None
        if self._owned_dir:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

