"""Running one job: the handler's context, the exactly-once-effect transaction, backoff.

:meth:`Runs.run` is the idempotent consumer. With a store it skips a job id already
processed; otherwise it runs the handler inside the store's transaction, claims the job id
(UNIQUE) in that same transaction, checks the lease is still ours, and only then commits,
so the handler's writes through ``ctx.db`` and the "processed" mark land together or not
at all. The ack comes after the commit (the worker core's round, :mod:`shardq.consumer.core`).
"""
from __future__ import annotations

import asyncio
import enum
import importlib
import logging
import multiprocessing
import os
import queue
import random
import signal
import threading
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable
from collections.abc import Callable

from .. import limits
from ..client.contracts import JobCalls
from ..errors import Closed, Fail, InvalidJob, Retry, ShardqError, Unsupported, UsageError
from .idempotency import IdempotencyStore
from ..types import Lease

log = logging.getLogger("shardq.worker")



class AsyncTask(Protocol):
    is_async: bool


class AsyncHandler(Protocol):
    """What the asyncio worker runs jobs with (:class:`shardq.tasks.dispatch.TaskHandler`, a
    layer above, or a :class:`PlainHandler`): a plain handler that a thread calls for sync
    tasks, and the async path on the loop for async ones."""

    def __call__(self, ctx: Context) -> Any: ...

    def task_of(self, body: bytes) -> AsyncTask | None: ...

    def resolve(self, ctx: Any) -> tuple[Any, list[Any], dict[str, Any]]: ...

    async def run_async(self, task: Any, ctx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any: ...


class PlainHandler:
    """A handler that is no App's tasks, for the asyncio worker, as :class:`~.worker.Worker`
    takes one: ``async def handle(ctx)`` is awaited on the loop, a plain ``def handle(ctx)``
    runs in a thread."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        # (an object whose __call__ is an async def counts too: the method is looked at)
        self.is_async = asyncio.iscoroutinefunction(fn) or asyncio.iscoroutinefunction(type(fn).__call__)

    def __call__(self, ctx: Context) -> Any:
        return self.fn(ctx)

    def task_of(self, body: bytes) -> PlainHandler:
        return self

    def resolve(self, ctx: Any) -> tuple[Any, list[Any], dict[str, Any]]:
        return self, [], {}

    async def run_async(self, task: Any, ctx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        return await self.fn(ctx)


def async_handler(handler: Any) -> AsyncHandler:
    """``handler`` as the asyncio worker runs it: an App's tasks as they are, a plain
    function of the job's context as a :class:`PlainHandler`; UsageError for anything else."""
    if callable(getattr(handler, "task_of", None)):
        return cast(AsyncHandler, handler)
    if callable(handler):
        return PlainHandler(handler)
    raise UsageError(f"AsyncWorker: the handler must be a function of the job's context or an App's tasks, "
                     f"got {type(handler).__name__}")


class Outcome(enum.StrEnum):
    """The outcome of one run of a job. RETRY: the handler raised Retry (nack with its
    delay); BURY: it raised Fail (dead-letter now). A str, so it logs and pickles as its
    value (process mode sends it back from the child)."""

    DONE = "done"
    DUPLICATE = "duplicate"
    FAILED = "failed"
    LOST = "lost"
    EXPIRED = "expired"
    SKIPPED = "skipped"
    RETRY = "retry"
    BURY = "bury"


DONE, DUPLICATE, FAILED, LOST, EXPIRED, SKIPPED, RETRY, BURY = (
    Outcome.DONE, Outcome.DUPLICATE, Outcome.FAILED, Outcome.LOST, Outcome.EXPIRED, Outcome.SKIPPED,
    Outcome.RETRY, Outcome.BURY)
#: (outcome, error text, retry delay in seconds or None)
Result = tuple[Outcome, "str | None", "float | None"]


class Abandoned(BaseException):
    """Raised in a job's thread when its runner has given the job up (the asyncio runner's
    grace period ended and its task was cancelled: :mod:`.aiotxn`). The transaction rolls
    back and :meth:`Runs.run` returns LOST without logging a failure: the attempt did not
    fail, its lease was released, and nobody settles its outcome. A BaseException, so no
    handler's ``except Exception`` takes it for its own error."""


class Report(NamedTuple):
    """A call about a finished job, made after its effect committed and before its ack:
    ``op`` is ``"arrive"`` (args: shard, barrier, index, total, value, ttl_s, callback) or
    ``"put_result"`` (args: value, ttl_s; the lease is the job's)."""
    op: str
    args: tuple[Any, ...]


#: What :meth:`Context.report` may ask for.
REPORT_OPS = frozenset(("arrive", "put_result"))


class Context:
    """What a handler gets. ``db`` is where the idempotency transaction writes (None
    without a store): a DB-API cursor for SQLite, a psycopg cursor for PostgreSQL.
    ``session`` is an SQLAlchemy ORM session in that same transaction when the store was
    built from an engine or sessionmaker, else None. ``lease`` is the lease as it was when
    the handler started; the worker tracks later heartbeats itself.

    ``extend(seconds)``: this job's lease now ends ``seconds`` from now, and the worker's
    heartbeats renew it by ``seconds`` from then on (instead of the queue's visibility
    timeout); returns the new deadline, LeaseLost if the lease is already gone. The worker's
    loop makes the call (it is the only thread that talks to the queue).

    ``progress(fraction, note)`` (or ``progress(note)``): how far the job got, a fraction
    in [0, 1] (or None) and a short note. Logged (INFO, logger ``shardq.worker``), kept as
    ``ctx.fraction`` and ``ctx.note``, and written to the job's shard where the worker's
    client keeps progress (the local shards: ``app.status(job_id)`` and ``shardq job
    show`` read it); a failure to write it is logged, never the job's failure. If the job
    then fails, the note is added to its error text, so a dead letter says how far it got.

    ``client``: the worker's client for calls about this job
    (:class:`~shardq.client.contracts.JobCalls`; None in process mode, and where the
    worker's client has no such calls: SQS). ``keep(value)``, ``after_commit(fn)`` and
    ``report(...)`` are for layers built on the worker (tasks keep their results this
    way): ``value`` is kept with the job's processed mark by an idempotency store, and
    ``fn()`` runs once the effect committed (right after the handler without a store),
    before the ack; if it raises, the attempt fails. ``report(op, *args)`` (from ``fn``)
    asks for a call about the finished job (:data:`REPORT_OPS`) that must land before its
    ack: a worker that collects them (``reports``, a list) makes them itself, pipelined
    with other jobs' and before this job's ack (:meth:`.policy.Policy.reported` says what
    their answers mean); otherwise the call is made at once through ``client``
    (Unsupported without one).
    """

    __slots__ = ("job_id", "key", "body", "attempt", "queue", "lease", "db", "session", "note", "fraction",
                 "client", "kept", "reports", "_after", "_extend")

    def __init__(self, lease: Lease, db: Any = None, extend: Callable[[float], float] | None = None, *,
                 session: Any = None, client: JobCalls | None = None, reports: list[Report] | None = None):
        self.job_id, self.key, self.body = lease.job_id, lease.key, lease.body
        self.attempt, self.queue, self.lease, self.db = lease.attempt, lease.queue, lease, db
        self.session = session
        self.note: str | None = None
        self.fraction: float | None = None
        self.client = client
        self.kept: bytes | None = None
        self.reports = reports
        self._after: Callable[[], None] | None = None
        self._extend = extend

    def extend(self, seconds: float) -> float:
        if self._extend is None:
            raise Unsupported("ctx.extend needs the worker's thread or asyncio mode (not process mode)")
        return self._extend(seconds)

    def progress(self, fraction: float | str | None = None, note: str | None = None) -> None:
        if isinstance(fraction, str) and note is None:
            fraction, note = None, fraction  # progress("note"), as before fractions
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise InvalidJob(f"ctx.progress: the fraction must be a number in [0, 1] or None, got {fraction!r}")
            fraction = float(fraction)
        self.fraction = fraction
        if note is not None:
            self.note = cut_bytes(str(note), limits.PROGRESS_NOTE_BYTES_MAX)
        log.info("job %s attempt %d: progress: %s%s", self.job_id, self.attempt,
                 "" if fraction is None else f"{fraction:.0%} ", self.note or "")
        self._report()

    def _report(self) -> None:
        if self.client is None:
            return  # logged above: no client keeps progress here (process mode, SQS)
        try:
            self.client.progress(self.lease, self.fraction, self.note)
        except ShardqError as exc:
            log.warning("job %s: progress not recorded: %s: %s", self.job_id, type(exc).__name__, exc)

    def keep(self, value: bytes) -> None:
        self.kept = value

    def after_commit(self, fn: Callable[[], None]) -> None:
        self._after = fn

    def report(self, op: str, *args: Any) -> None:
        """A call about this finished job, made before its ack (see the class docstring):
        ``report("arrive", shard, barrier, index, total, value, ttl_s, callback)`` or
        ``report("put_result", value, ttl_s)``."""
        if op not in REPORT_OPS:
            raise ValueError(f"ctx.report: unknown op {op!r}; one of {sorted(REPORT_OPS)}")
        if self.reports is not None:
            self.reports.append(Report(op, args))
        elif self.client is None:
            raise Unsupported(f"ctx.report({op!r}) needs a worker whose client keeps results and barriers "
                              "(thread or asyncio mode on the local shards' service)")
        elif op == "put_result":
            self.client.put_result(self.lease, *args)
        else:
            self.client.arrive(*args)

    def run_after(self) -> None:
        """Run what :meth:`after_commit` asked for (the effect has committed)."""
        if self._after is not None:
            self._after()

    @property
    def has_after(self) -> bool:
        """Whether :meth:`after_commit` asked for something (an asyncio runner need not
        hop to a thread for nothing)."""
        return self._after is not None

    def __repr__(self) -> str:
        return f"Context(job_id={self.job_id}, queue={self.queue!r}, attempt={self.attempt})"


Handler = Callable[[Context], Any]


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in ``[0, min(cap_s, base_s * 2**(attempt-1))]``."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(max(attempt, 1) - 1, 64)))


def error_text(exc: BaseException) -> str:
    """``"Type: message"``, cut to ``limits.ERROR_TEXT_BYTES_MAX`` UTF-8 bytes. A Retry or
    Fail is its message alone: the handler that raised it wrote the reason."""
    try:
        text = str(exc) if isinstance(exc, (Retry, Fail)) else f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a __str__ that raises
        text = type(exc).__name__
    return cut_text(text)


def cut_text(text: str) -> str:
    """``text`` cut to ``limits.ERROR_TEXT_BYTES_MAX`` UTF-8 bytes (on a character boundary)."""
    return cut_bytes(text, limits.ERROR_TEXT_BYTES_MAX)


def cut_bytes(text: str, max_bytes: int) -> str:
    """``text`` cut to ``max_bytes`` UTF-8 bytes (on a character boundary), as text the wire
    takes: a lone surrogate (an OS error's undecodable file name) becomes ``?``, else the
    nack or bury carrying it was refused and the job ran again when its lease ended."""
    return text.encode("utf-8", "replace")[:max_bytes].decode("utf-8", "ignore")


@runtime_checkable
class FinishesDuplicates(Protocol):
    """A handler's optional hook (:class:`shardq.tasks.dispatch.TaskHandler` has it): a
    delivery skipped because an earlier one committed goes to ``finish_duplicate(ctx,
    kept)`` with what that one kept (``ctx.keep``), so a layer can report a skipped step's
    result again. Looked up once, by ``isinstance``, when a :class:`Runs` is made."""

    def finish_duplicate(self, ctx: Context, kept: bytes | None) -> None: ...


class Runs:
    """How one worker runs its jobs, decided once when it is made, whichever runner runs
    them (a runner thread, a pool process, an asyncio task): ``handler`` and its
    :class:`FinishesDuplicates` hook, the idempotency ``store``, the ``client`` a job's own
    calls go to (None: the job gets none), and whether a job's ``ctx.report`` calls are
    collected for the worker's settle round (``collect``) or made at once through
    ``client``. :meth:`run` runs one job."""

    def __init__(self, handler: Handler, store: IdempotencyStore | None, client: JobCalls | None = None, *,
                 collect: bool = False):
        self.handler, self.store, self.client, self.collect = handler, store, client, collect
        self.finish_duplicate = handler.finish_duplicate if isinstance(handler, FinishesDuplicates) else None

    def run(self, lease: Lease, may_commit: Callable[[], bool] | None = None,
            extend: Callable[[float], float] | None = None, reports: list[Report] | None = None, *,
            max_deliveries: int | None = None, handler: Handler | None = None,
            context: Callable[..., Context] | None = None) -> Result:
        """Run one job (in a runner thread, or in a pool process with ``may_commit=None``).

        With a store: skip if seen; else handler, claim, lease check, commit, in that order.
        The claim comes last so the write lock is held as briefly as the handler allows, and
        the lease check comes after the claim, right before the commit. Returns
        ``(outcome, error, delay_s)``; a handler that raises :class:`~shardq.errors.Retry` or
        :class:`~shardq.errors.Fail` rolls back like any failure and gives RETRY or BURY. Whatever
        else it raises, SystemExit, KeyboardInterrupt and a CancelledError of its own included,
        rolls back and gives FAILED: a handler never ends its runner (every runner keeps this
        rule: the asyncio one's :mod:`.aiotxn`). Only :class:`Abandoned` (the runner gave the
        job up) rolls back and gives LOST, logged as no failure.
        ``max_deliveries`` (the queue's, if known) tells a retry on the last delivery apart in
        the log (see :func:`failure_result`).

        What the handler asked with ``ctx.after_commit`` runs after the commit (without a store:
        after the handler), before this returns DONE; what it kept with ``ctx.keep`` is claimed
        with the mark. A job skipped as seen goes to the :class:`FinishesDuplicates` hook, if
        the handler has one, with what the first delivery kept (tasks report a skipped step's
        result this way). ``reports``: the job's list the context collects ``ctx.report``
        calls in, for the worker to make before the ack (where ``collect``; else they are made
        at once); it holds something only when this returns DONE or DUPLICATE. ``handler``
        runs instead of the worker's (the asyncio runner's bridge to an ``async def`` task);
        ``context`` makes the handler's context (with :class:`Context`'s arguments; the
        asyncio runner's makes an async one).
        """
        ctx = None
        make, run, store = context or Context, handler or self.handler, self.store
        reports = reports if self.collect else None
        try:
            if store is None:
                ctx = make(lease, None, extend, client=self.client, reports=reports)
                run(ctx)
                ctx.run_after()
                return DONE, None, None
            if store.seen(lease.job_id):
                if self.finish_duplicate is not None:
                    ctx = make(lease, None, extend, client=self.client, reports=reports)
                    self.finish_duplicate(ctx, store.kept_result(lease.job_id))
                return DUPLICATE, None, None
            with store.transaction() as txn:
                ctx = make(lease, txn.db, extend, session=txn.session, client=self.client, reports=reports)
                run(ctx)
                claimed = txn.claim(lease.job_id) if ctx.kept is None else txn.claim(lease.job_id, result=ctx.kept)
                if not claimed:
                    txn.abort()  # another delivery committed it while we ran
                    return DUPLICATE, None, None
                if may_commit is not None and not may_commit():
                    txn.abort()  # lease lost: roll back, the redelivery wins
                    return LOST, None, None
            ctx.run_after()
            return DONE, None, None
        except Abandoned:  # given up by its runner: rolled back, and no failed attempt (nobody settles it)
            if reports:
                reports.clear()
            return LOST, None, None
        except BaseException as exc:  # noqa: BLE001 - a handler must never kill its runner
            return failed(exc, lease, ctx, reports, max_deliveries)


def execute(handler: Handler, lease: Lease, store: IdempotencyStore | None,
            may_commit: Callable[[], bool] | None = None,
            extend: Callable[[float], float] | None = None, *,
            max_deliveries: int | None = None, client: JobCalls | None = None,
            reports: list[Report] | None = None) -> Result:
    """One job run as a worker's :class:`Runs` of ``handler`` runs it (:meth:`Runs.run`)."""
    return Runs(handler, store, client, collect=True).run(lease, may_commit, extend, reports,
                                                          max_deliveries=max_deliveries)


def failed(exc: BaseException, lease: Lease, ctx: Context | None, reports: list[Report] | None,
           max_deliveries: int | None) -> Result:
    """The outcome of an attempt that raised ``exc`` (:func:`failure_result`): the handler's
    error, or the store's around it. A store error (down at BEGIN, at the claim, at COMMIT or
    at ROLLBACK) is FAILED with ``"Type: message"``, so the job is nacked with backoff and its
    dead letter says why; the transaction was rolled back (or never committed). A failed
    attempt reports nothing: what it collected in ``reports`` is dropped."""
    if reports:
        reports.clear()
    return failure_result(exc, lease, ctx, max_deliveries=max_deliveries)


def failure_result(exc: BaseException, lease: Lease, ctx: Context | None, *,
                   max_deliveries: int | None = None) -> Result:
    """The outcome of a handler that raised ``exc``: RETRY, BURY or FAILED, with the error
    text (plus the last progress note, if the handler left one).

    Logged once per attempt, on logger ``shardq.worker``. A Retry or Fail that wraps an
    error (a task that raised: :class:`~shardq.tasks.dispatch.TaskHandler` turns the
    exception into one ``from`` it) logs that error's traceback, at WARNING when the job
    will run again and at ERROR when this was its last attempt (Fail, or a retry on the
    queue's ``max_deliveries``-th delivery); the traceback's innermost frames also go into
    the error text, within ``limits.ERROR_TEXT_BYTES_MAX``. A Retry or Fail raised on
    purpose, with no error behind it, is its message alone (INFO for a Retry). Any other
    exception (a raw handler's) is logged with its traceback at WARNING; its error text is
    ``"Type: message"``.
    """
    note = f" (last progress: {ctx.note})" if ctx is not None and ctx.note else ""
    if not isinstance(exc, (Retry, Fail)):
        log.warning("job %s attempt %d failed", lease.job_id, lease.attempt, exc_info=exc)
        return FAILED, cut_text(error_text(exc) + note), None
    text = cut_text(error_text(exc) + note)
    cause = _error_behind(exc)
    last = isinstance(exc, Fail) or (max_deliveries is not None and lease.attempt >= max_deliveries)
    if cause is None:
        if isinstance(exc, Fail):
            log.error("job %s attempt %d: failed for good: %s", lease.job_id, lease.attempt, text)
        elif last:
            log.error("job %s attempt %d: retry requested on its last delivery (%d of %d); the queue "
                      "dead-letters it: %s", lease.job_id, lease.attempt, lease.attempt, max_deliveries, text)
        else:
            log.info("job %s attempt %d: retry requested (%s)", lease.job_id, lease.attempt, text)
    else:
        what = ("failed for good" if isinstance(exc, Fail) else
                f"failed its last delivery ({lease.attempt} of {max_deliveries})" if last else "failed, will retry")
        log.log(logging.ERROR if last else logging.WARNING, "job %s attempt %d %s: %s",
                lease.job_id, lease.attempt, what, text, exc_info=cause)
        text = with_traceback(text, cause)
    return (BURY, text, None) if isinstance(exc, Fail) else (RETRY, text, exc.delay_s)


def _error_behind(exc: BaseException) -> BaseException | None:
    """The first exception in ``exc``'s ``__cause__`` chain that is not a Retry or Fail:
    the error a task raised, which its handler turned into a Retry or Fail. None when the
    Retry or Fail was raised on purpose."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if not isinstance(e, (Retry, Fail)):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def with_traceback(text: str, exc: BaseException) -> str:
    """``text``, a newline and ``exc``'s traceback, all within ``limits.ERROR_TEXT_BYTES_MAX``
    UTF-8 bytes. ``text`` is kept whole; a traceback too long for the rest keeps its last
    lines (the innermost frames and the exception), cut at a line start. A lone surrogate in
    either (an undecodable file name in the exception's message, a frame's source line)
    becomes ``?``, as :func:`cut_bytes` does, so the wire takes the whole."""
    text = cut_text(text)
    room = limits.ERROR_TEXT_BYTES_MAX - len(text.encode("utf-8", "replace")) - 1
    raw = "".join(traceback.format_exception(exc)).rstrip("\n").encode("utf-8", "replace")
    tb = raw.decode("utf-8")
    if len(raw) > room:
        head = "Traceback (innermost frames; the rest cut):\n"
        room -= len(head)
        if room <= 0:
            return text
        tail = raw[-room:]
        if raw[-room - 1:-room] != b"\n":  # starts inside a line: drop that part
            tail = tail[tail.find(b"\n") + 1:] if b"\n" in tail else b""
        if not tail:
            return text
        tb = head + tail.decode("utf-8", "replace")
    return text + "\n" + tb


# ---------------------------------------------------------------------------- pool processes
# Process-local state of a pool process, set once by its initializer (never used in the parent).
_CHILD: dict[str, Any] = {}


def _log_setup() -> tuple[int, str | None]:
    """The parent's root log level and its first handler's format, for a spawned child
    (which starts with none: only WARNING and above, bare, reached stderr)."""
    root = logging.getLogger()
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    return root.level, getattr(formatter, "_fmt", None)


def _child_init(handler: Handler, spec: tuple[Any, ...] | None, parent_pid: int | None = None,
                log_setup: tuple[int, str | None] | None = None) -> None:
    # The parent handles SIGINT/SIGTERM (a terminal or a service manager signals the whole
    # group); children finish their job and are SIGKILLed if the grace period ends. A parent
    # SIGKILLed sends nothing: the children notice it gone and end too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if log_setup is not None:  # the parent's lines: level and format (shardq worker --log-level)
        level, fmt = log_setup
        logging.basicConfig(level=level, format=fmt or logging.BASIC_FORMAT)
    if parent_pid is not None:
        from ..stopping import exit_with_parent
        exit_with_parent(parent_pid)
    store = None
    if spec is not None:
        factory, args, kwargs = spec
        store = factory(*args, **kwargs)
    _CHILD["runs"] = Runs(handler, store)


def _child_run(lease: Lease, max_deliveries: int | None = None) -> Result:
    # No lease check before the commit here (the lease lives in the parent); the UNIQUE
    # claim still keeps the effect to one commit. See docs/guarantees.md.
    runs: Runs = _CHILD["runs"]
    return runs.run(lease, max_deliveries=max_deliveries)


class ProcessPool:
    """The thread runner's process mode: ``size`` spawned processes, one a runner (a
    single-process executor each, lent to one runner thread at a time), each running jobs
    with ``handler`` and the store ``spec`` reopens (:func:`_child_run`). A child that dies
    fails its own job only and is replaced: one executor of all would fail every job
    running beside it while their processes ran them on (their redeliveries running at
    once, past the queue's caps, and dead-lettered for a crash not theirs)."""

    def __init__(self, size: int, handler: Handler, spec: tuple[Any, ...] | None):
        self._args = handler, spec
        self._lock = threading.Lock()
        self._closed = False
        self._free: queue.SimpleQueue[ProcessPoolExecutor] = queue.SimpleQueue()
        self._made: list[ProcessPoolExecutor] = []  # every one not retired, for close()
        for _ in range(size):
            self._free.put(self._make())

    def _make(self) -> ProcessPoolExecutor:
        handler, spec = self._args
        one = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_child_init, initargs=(handler, spec, os.getpid(), _log_setup()))
        with self._lock:
            if self._closed:  # (a replacement made as close() ran: it would never be shut down)
                one.shutdown(wait=False)
            else:
                self._made.append(one)
        return one

    def run(self, lease: Lease, max_deliveries: int) -> Result:
        if self._closed:
            raise Closed("the worker's process pool is closed")
        one = self._free.get()  # (as many as runners: one is free for each)
        try:
            result: Result = one.submit(_child_run, lease, max_deliveries).result()
            return result
        except BrokenProcessPool:
            with self._lock:
                closed = self._closed  # (close() killed it: the job is the stop's to count, abandoned)
                if not closed:
                    self._made.remove(one)
            if closed:
                return FAILED, f"not finished: the worker stopped while job {lease.job_id} ran", None
            one.shutdown(wait=False, cancel_futures=True)
            one = self._make()
            return FAILED, f"BrokenProcessPool: a worker process died running job {lease.job_id}", None
        finally:
            self._free.put(one)

    def close(self, kill: bool) -> None:
        """``kill``: a child may still run a job; it ignores SIGTERM/SIGINT (the group gets
        them too), so SIGKILL."""
        with self._lock:
            self._closed, made, self._made = True, self._made, []
        for one in made:
            if kill:
                procs = getattr(one, "_processes", None) or {}  # no public API before 3.14
                for proc in list(procs.values()):
                    proc.kill()
            one.shutdown(wait=not kill, cancel_futures=True)


def load_handler(spec: str) -> Handler:
    """Import ``"package.module:function"`` (the attribute may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected module:function, got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    handler: Handler = obj
    return handler
