"""Every exception shardq raises, in one place.

All derive from :class:`ShardqError`. The name says who caused the error:

* your input: :class:`InvalidJob`, :class:`UnknownQueue`, :class:`ProtocolError`,
  :class:`NotFound`, :class:`UsageError`
* your setup: :class:`InvalidConfig` and its kinds :class:`ShardCountMismatch`,
  :class:`NotADataDir`, :class:`DataDirLocked`, :class:`DataDirNotWritable`; :class:`AuthError`
* your lease: :class:`LeaseLost` (and :class:`Cancelled`: an operator cancelled the job)
* capacity: :class:`QueueFull`
* the backend: :class:`Unsupported` (a feature this backend cannot provide)
* the service: :class:`ShardUnavailable` (and :class:`OutcomeUnknown`,
  :class:`TooManyConnections`, :class:`ServiceNotRunning`), :class:`Closed`
* the disk: :class:`CorruptLog`, :class:`LogFailed`
* a bug in shardq: :class:`InvariantViolation` (the shard crashes; its log rebuilds the state)
* raised by a task to steer its job (not errors of shardq): :class:`Retry`, :class:`Fail`
* a result asked for that will never come: :class:`JobFailed` (a job or a workflow
  failed), :class:`WorkflowCancelled` (a workflow was cancelled)
* your database (PostgreSQL store, outbox): :class:`StoreUnavailable`; the outbox relay
  fell behind its dedup window: :class:`OutboxBehind`

Errors cross the wire by class name (:data:`BY_NAME`), so a client gets the same type the
shard raised.
"""
from __future__ import annotations


class ShardqError(Exception):
    """Base class of every shardq error."""


class InvalidJob(ShardqError, ValueError):
    """A request was malformed: wrong type, out-of-range value, oversized body or key."""


class UnknownQueue(InvalidJob):
    """The queue is not declared and the service requires declared queues."""


class InvalidConfig(ShardqError, ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""


class ProtocolError(ShardqError):
    """A frame could not be decoded or names an unknown operation."""


class AuthError(ShardqError):
    """Authentication failed, or the key file / socket directory is unsafe."""


class NotFound(ShardqError, KeyError):
    """The job id does not exist on its shard (never enqueued, or already deleted)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class LeaseLost(ShardqError):
    """The lease token is not the job's current lease: it expired, the job was leased
    again, or the job was already acked. Nothing was changed."""


class JobGone(LeaseLost):
    """The job no longer exists: it was acked (by this lease or, after a redelivery, by
    another worker). A retried ack that gets this knows its first attempt succeeded."""


class Cancelled(LeaseLost):
    """The job was cancelled (``cancel``) while you held its lease: stop working on it. An
    ``extend`` changes nothing; an ``ack`` or ``nack`` removes the job at once (otherwise it
    is removed when the lease ends). The job is never delivered again."""


class Unsupported(ShardqError):
    """The backend cannot provide this feature faithfully (the message names the feature
    and the backend); nothing was changed. Arguments are never silently ignored."""


class QueueFull(ShardqError):
    """A capacity limit was reached (backpressure). Retry later. On the local shards (the
    request is refused whole): the shard holds ``limits.max_pending_jobs`` jobs, or
    ``limits.max_dedup_ids`` dedup ids, or, for a queue name it does not hold yet,
    ``limits.QUEUES_MAX`` queues. On SQS: SQS answered ``OverLimit`` (too many messages
    in flight)."""


class ShardUnavailable(ShardqError):
    """A shard did not answer in time (crashed, restarting or hung)."""


class TooManyConnections(ShardUnavailable):
    """The shard holds as many client connections as ``limits.max_connections`` allows
    and turned this one away before reading any request: nothing was sent. The router
    tries again until its ``retry_s`` runs out, then raises this. Close idle routers, or
    raise the limit (docs/operations.md)."""


class OutcomeUnknown(ShardUnavailable):
    """The request reached (or may have reached) the shard, but no reply came: the
    connection broke and re-sending was not safe (a second ``dequeue`` would lease a second
    job; a second ``purge`` could act on another set), or the shard stayed out of reach
    until ``retry_s``, or it did not answer within the request timeout, or the client was
    closed. It may or may not have been applied: check the state (``stats``,
    ``dead_letters``, the job) before acting again; an enqueue made again may add a second
    job unless it carries a ``dedup_id``."""


class ServiceNotRunning(ShardUnavailable):
    """No ``shardq serve`` (nor ``shardq.open``) runs on the data dir: its supervisor lock
    is free and no shard socket answers. Raised when a client is created, within a
    second, instead of after ``retry_s``; a service that runs while a shard restarts is
    waited for as before. A :class:`ShardUnavailable`, so handlers of that still catch it."""


class Closed(ShardqError):
    """The router or log was closed by its owner."""


class ShardCountMismatch(InvalidConfig):
    """The data dir was created with another number of shards; changing N breaks per-key order."""


class NotADataDir(InvalidConfig):
    """The path given as a data dir holds no shardq service (no ``shardq.json``)."""


class DataDirLocked(InvalidConfig):
    """Another running process holds the data dir's (or a shard directory's) lock; the
    message names its PID when the lock file records one."""


class DataDirNotWritable(InvalidConfig):
    """The service cannot create or write files in its data dir (a read-only file system,
    or permissions): the message names the path and the system's reason."""


class UsageError(ShardqError):
    """A command line was wrong (a missing or malformed argument, a path that does not
    exist), or an API was used where it cannot work (an asyncio client called from an event
    loop other than the one that connected it)."""


class CorruptLog(ShardqError):
    """A log or checkpoint record failed validation somewhere other than a repairable torn
    tail. Carries the file and byte offset of the bad record."""

    def __init__(self, path: str, offset: int, reason: str):
        super().__init__(f"corrupt log {path} at byte offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class NewerFormat(CorruptLog):
    """A log or checkpoint file written by a newer shardq, in a format this version does not
    read. Not damage: nothing is wrong with the file, and ``shardq wal repair`` refuses to
    touch it (it would salvage it as damage). Upgrade shardq, or restore a backup
    (docs/upgrades.md)."""


class LogFailed(ShardqError):
    """A write or fsync failed. The log instance is unusable: nothing after the last
    successful sync is reported durable, and the owner must reopen (replay) the log."""


class InvariantViolation(ShardqError):
    """An internal invariant broke: a bug. The shard process exits and is restarted."""


class Retry(ShardqError):
    """Raised by a task (or handler): run this job again after ``delay_s`` seconds (None:
    the task's backoff). The delivery still counts: after the task's ``retries`` the job
    is dead-lettered instead. ``reason`` is recorded as the job's last error.

    ``delay_s`` is checked here: anything but a number (``int``, ``float``, any
    ``numbers.Real``, a ``Decimal``; not a bool, nor a string such as ``"30s"``) raises
    TypeError, a number that is negative, NaN or infinite ValueError, both naming
    ``delay_s``: a task that gets it wrong fails as with any other error of its own (the
    worker would otherwise have died settling the job). A delay over ``limits.DELAY_S_MAX``
    (a year) is cut to it."""

    def __init__(self, delay_s: float | None = None, reason: str | None = None):
        import decimal
        import math
        import numbers
        if delay_s is not None:
            shown = repr(delay_s) if len(repr(delay_s)) <= 60 else repr(delay_s)[:57] + "..."
            if isinstance(delay_s, bool) or not isinstance(delay_s, (numbers.Real, decimal.Decimal)):
                raise TypeError(f"Retry: delay_s must be a number of seconds or None, "
                                f"got {type(delay_s).__name__} {shown}")
            try:
                seconds = float(delay_s)
            except (ValueError, OverflowError):  # Decimal('sNaN'); an int past float's range
                seconds = math.nan
            if not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"Retry: delay_s must be a finite number of seconds >= 0, got {shown}")
        super().__init__(reason or (f"retry requested in {delay_s} s" if delay_s is not None
                                    else "retry requested"))
        self.delay_s = delay_s
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        """Unpickled as it was, without calling ``__init__`` again on its message (which
        is no delay)."""
        import copyreg
        # copyreg.__newobj__(cls, *args) is cls.__new__(cls, *args), as pickle's own
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__  # type: ignore[attr-defined]


class Fail(ShardqError):
    """Raised by a task (or handler): move this job to the dead-letter queue now, with the
    message as its error. Nothing is retried."""


class StoreUnavailable(ShardqError):
    """The database behind an idempotency store or an outbox could not be reached (refused,
    unknown host, authentication failed, database missing) or dropped the connection.
    Nothing was committed by the call that raised it, unless the message says the outcome of
    a COMMIT is unknown."""


class OutboxBehind(ShardqError):
    """The outbox relay holds rows it first sent to the queue longer ago than the queue's
    dedup window: sending them again could enqueue duplicates, so it stops instead. The
    message names the rows and what to do (docs/guarantees.md, "The dedup window")."""


class JobFailed(ShardqError):
    """A job whose result was asked for failed for good: it was dead-lettered (``error``:
    its last error, ``job_id``: the job; for a workflow, the step that failed, ``step``
    its path and ``task`` its task name). Redriving that job from the dead letters lets
    it, and its workflow, finish. A workflow also fails when its dead step was purged, or
    when its result is gone (docs/workflows.md, "How a workflow ends")."""

    def __init__(self, message: str, job_id: object = None, error: str | None = None,
                 task: str | None = None, step: str | None = None):
        super().__init__(message)
        self.job_id, self.error, self.task, self.step = job_id, error, task, step


class WorkflowCancelled(ShardqError):
    """The workflow whose result was asked for was cancelled: by ``wf.cancel()``, or by a
    cancel of one of its steps' jobs (``shardq job cancel``) before the step reported.
    ``workflow_id``; ``step`` (a path), ``task`` and ``job_id`` (None if not enqueued)
    name the step it stopped at; the message says why."""

    def __init__(self, message: str, workflow_id: str | None = None, step: str | None = None,
                 task: str | None = None, job_id: object = None):
        super().__init__(message)
        self.workflow_id, self.step, self.task, self.job_id = workflow_id, step, task, job_id


#: Wire name -> class, for errors sent from a shard to a client.
BY_NAME: dict[str, type[ShardqError]] = {
    cls.__name__: cls
    for cls in (
        ShardqError, InvalidJob, UnknownQueue, InvalidConfig, ProtocolError, AuthError,
        NotFound, LeaseLost, JobGone, QueueFull, ShardUnavailable, OutcomeUnknown, Closed, ShardCountMismatch,
        NotADataDir, DataDirLocked, UsageError, Unsupported, LogFailed, InvariantViolation,
        Cancelled,
    )
}


def check(condition: bool, message: str) -> None:
    """Always-on invariant check (unlike ``assert``, survives ``python -O``)."""
    if not condition:
        raise InvariantViolation(message)


class SqsApiError(ShardqError):
    """A request to the SQS-compatible listener (:mod:`shardq.sqs_api`) was refused, as AWS
    refuses it: ``code`` is the error's name in AWS's API model (the JSON ``__type``),
    ``query_code`` its legacy query-protocol code (``x-amzn-query-error``), ``status`` the
    HTTP status and ``sender`` whether the caller is at fault (else the service is). The
    codes are listed once, in :mod:`shardq.sqs_api.faults`."""

    def __init__(self, code: str, message: str, query_code: str | None = None, status: int = 400,
                 sender: bool = True):
        super().__init__(message)
        self.code, self.message, self.status, self.sender = code, message, status, sender
        self.query_code = query_code or code
