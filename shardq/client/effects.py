"""The effects of the client engine and their runners: what an operation asks its executor to
do, the operations every call is made of (the retry after a broken connection, one
transmission, the wait for any of many waiting calls) and the loops that run an operation in
a thread or a coroutine. No I/O here: an executor (:mod:`.router`, :mod:`.aio`) does the effects.

An operation (:data:`Op`) is a generator that yields **effects** and is sent what became of
them; its return value is what the caller gets:

* :class:`Send` -- make these calls (pipelined, one frame per shard) and wait for all;
  sent, per call, ``(value, was_resent)``; with ``errors=True`` an error stands in its
  call's place, otherwise the first one is thrown into the operation.
* :class:`Owner` -- the shard of all jobs of a queue placed because it declares limits
  (docs/limits.md), asked once per client (the executor shares the question).
* :class:`Sleep` -- wait (a back-off while shards are down).

What does not wait (release leases, note settled ones, open a session, read the clock) is
no effect: the operation calls its client's method (:class:`~.engine.Calls`).

A :class:`Send` is itself done by an operation, :func:`deliver`: the retry after a broken
connection, written once; it sends each call once (:func:`transmit`: the effects
:class:`Submit`, :class:`Collect`, :class:`Abandon`), told of a broken connection
(:class:`~.core.ConnectionLost`) instead of re-sending.
"""
from __future__ import annotations

from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..errors import Closed, ShardUnavailable, TooManyConnections, UnknownQueue
from .channel import closed_after_write
from .core import UNSENT, Call, ConnectionLost, after_break, no_answer
from .routing import leases_of

if TYPE_CHECKING:
    from .engine import Calls

T = TypeVar("T")


# ---------------------------------------------------------------------- effects
class Send(NamedTuple):
    """Make ``calls`` and wait for every reply. ``retry_s``: how long a call whose
    connection broke may be sent again (None: the client's ``retry_s``); ``timeout_s``: how
    long to wait for all (None: each call the client's request timeout); ``errors``: an
    error is sent back in its call's place instead of thrown."""
    calls: Sequence[tuple[int, str, list[Any]]]
    retry_s: float | None = None
    timeout_s: float | None = None
    errors: bool = False


class Owner(NamedTuple):
    """The owner shard of ``queue`` if it is placed, else None; asked of shard ``ask``."""
    queue: str
    ask: int


class Sleep(NamedTuple):
    """Wait ``seconds`` (a back-off while shards are down)."""
    seconds: float


class Park(NamedTuple):
    """Send each waiting call (``dequeue_wait``, ``watch``) whose shard is connected now.
    Sent ``(token, handles)``: per call a handle, or None where it was not sent; the
    ``token`` (the executor's own) goes back with the handles in :class:`Wake` and
    :class:`Abandon`."""
    calls: list[Call]


class Wake(NamedTuple):
    """Wait until more than ``settled`` of ``handles`` are answered, or ``deadline`` passes
    (the executor's clock). Sent, per handle, :data:`OPEN` or what it was answered: its
    value or its error (a broken connection's too)."""
    token: Any
    calls: list[Call]
    handles: list[Any]
    deadline: float
    settled: int


class Abandon(NamedTuple):
    """Give up the ``handles`` still open: a waiting dequeue is withdrawn (what it leases
    anyway is released when its reply comes), a watch forgotten. Sent, per handle, what it
    was answered (as :class:`Wake`), or :data:`OPEN` for one abandoned."""
    token: Any
    calls: Sequence[tuple[int, str, list[Any]]]
    handles: list[Any]


OPEN: Any = object()  # a handle not answered (yet): Wake's and Abandon's outcome for it


class Submit(NamedTuple):
    """Make ``calls`` once, pipelined: the calls to one shard go in their order on one
    connection, so a later one never reaches the shard before an earlier one that broke.
    Connecting may take until ``deadline`` (the executor's clock). Sent, per call, a handle
    (for :class:`Collect` and :class:`Abandon`)."""
    calls: Sequence[tuple[int, str, list[Any]]]
    deadline: float


class Collect(NamedTuple):
    """Wait for the replies of ``handles`` (a :class:`Submit`'s): ``timeout_s`` at most for
    all together (None: each its request timeout). Sent, per handle, :data:`OPEN` or what it
    was answered (as :class:`Wake`)."""
    calls: Sequence[tuple[int, str, list[Any]]]
    handles: list[Any]
    timeout_s: float | None


Effect = Send | Owner | Sleep | Park | Wake | Abandon | Submit | Collect
Op = Generator[Effect, Any, T]


def deliver(ex: Calls, calls: Sequence[tuple[int, str, list[Any]]], deadline: float,
            timeout_s: float | None = None, errors: bool = False,
            got: list[Any] | None = None) -> Op[list[Any]]:
    """How both clients do a :class:`Send`: the retry after a broken connection, written
    once. The calls are transmitted (:func:`transmit`); those whose connection broke are
    decided by :func:`~.core.after_break` (re-sent, in their order, until ``deadline`` on
    ``ex``'s clock; or ShardUnavailable / OutcomeUnknown) and transmitted again, until each
    has its outcome. An ``enqueue`` without a session gets one of its shard
    (:class:`~.core.Sessions`), kept open until its outcome is known: a re-sent enqueue
    carries the session of the first, so the shard answers with the first's ids. Returns
    ``(value, was_resent)`` per call, in order; an error stands in its place with
    ``errors``, else the first one is raised. ``got``: the outcomes of a first
    transmission the executor made itself (the threaded fast path).

    A call written once and closed before its re-send was answered (the client closed
    meanwhile) gets :class:`~shardq.errors.OutcomeUnknown`, not
    :class:`~shardq.errors.Closed`: its first writing may have been applied."""
    opened = [(shard, args) for shard, op, args in calls if op == "enqueue" and args[1] is None]
    for shard, args in opened:
        args[1] = ex._session(shard)
    out: list[Any] = [None] * len(calls)
    resent = [False] * len(calls)
    todo = list(range(len(calls)))
    try:
        while todo:
            if got is None:
                try:
                    got = yield from transmit(ex, [calls[i] for i in todo], deadline, timeout_s)
                except Closed as closed:  # (the executor refused to send: closed before the re-send)
                    if not any(resent[i] for i in todo):
                        raise
                    got = [closed] * len(todo)  # each in its place: the ones written before are unknown
            again = []
            expired: bool | None = None
            for i, outcome in zip(todo, got):
                if type(outcome) is ConnectionLost:
                    if expired is None:
                        expired = ex._now() >= deadline
                    shard, op, _ = calls[i]
                    error = after_break(shard, op, outcome.sent, expired, outcome, resent[i])
                    if error is None:
                        resent[i] = resent[i] or outcome.sent
                        again.append(i)
                        continue
                    outcome = error
                elif resent[i] and isinstance(outcome, Closed):
                    # written before the break: a caller told Closed would take it as never
                    # applied, and an enqueue made again would be a duplicate
                    outcome = closed_after_write(calls[i][0], calls[i][1])
                elif resent[i] and type(outcome) in (ShardUnavailable, TooManyConnections):
                    # written before the break, then out of reach until the deadline: likewise
                    outcome = after_break(calls[i][0], calls[i][1], False, True, outcome, written=True) or outcome
                out[i] = outcome if isinstance(outcome, BaseException) else (outcome, resent[i])
            todo, got = again, None
    finally:
        for shard, args in opened:
            ex._done(shard, args[1])
    if not errors:
        for outcome in out:
            if isinstance(outcome, BaseException):
                raise outcome
    return out


def call(shard: int, op: str, args: list[Any], retry_s: float | None = None) -> Op[Any]:
    """One request; its value (its error is raised)."""
    ((value, _),) = yield Send([Call(shard, op, args)], retry_s)
    return value


_RAISE: Any = object()


def call_all(calls: Sequence[tuple[int, str, list[Any]]], retry_s: float | None = None, *,
             absent: Any = _RAISE) -> Op[list[Any]]:
    """Several requests at once; their values in order (the first error is raised).
    ``retry_s``: how long a shard that is down is tried (None: the client's ``retry_s``).
    ``absent``: the value of a shard that answered UnknownQueue while another answered,
    the calls being about one queue: a queue the config no longer declares (``declare_queues``)
    is held by the shards that still hold its jobs only; UnknownQueue when every shard said so."""
    if not calls:
        return []
    if absent is _RAISE:
        return [value for value, _ in (yield Send(calls, retry_s))]
    got = yield Send(calls, retry_s, errors=True)
    for r in got:
        if isinstance(r, BaseException) and not isinstance(r, UnknownQueue):
            raise r
    if all(isinstance(r, UnknownQueue) for r in got):
        raise got[0]
    return [absent if isinstance(r, UnknownQueue) else r[0] for r in got]


def wait_any(c: Calls, calls: list[Call], limit_s: float, short_s: float,
             first: bool = False) -> Op[list[Any] | None]:
    """Leave the waiting ``calls`` (``dequeue_wait`` or ``watch``) at the shards that are
    connected now, and wait until one is answered with something (a non-empty value or an
    error; with ``first``, any reply), or every one is, or ``limit_s`` passes (``short_s``
    when a shard could not be asked: it is looked at again soon). The calls still open are
    then abandoned (:class:`Abandon`). Returns, per call, its value, its error, None
    (abandoned, or its connection broke) or :data:`~.core.UNSENT` (its shard was not
    connected); None instead of the list when no shard could be asked. Stopped by an
    error (a cancelled caller), it abandons them too and hands back
    unstarted the leases of the waiting dequeues answered, which nobody will take."""
    token, handles = yield Park(calls)
    parked = sum(h is not None for h in handles)
    if not parked:
        return None
    deadline = c._now() + (limit_s if parked == len(calls) else short_s)
    settled = 0
    try:
        while True:
            got = yield Wake(token, calls, handles, deadline, settled)
            done = [a for a, h in zip(got, handles) if h is not None and a is not OPEN]
            # A lease, an error or a broken connection ends the wait (the caller's next
            # round reaches a restarted shard again); so does the end of every shard's wait.
            # (An error is true, as a non-empty value is: ``any`` alone, no generator.)
            if ((done and first) or any(done)
                    or len(done) == parked or c._now() >= deadline):
                break
            settled = len(done)
    except GeneratorExit:
        raise
    except BaseException:
        _release_answered(c, calls, (yield Abandon(token, calls, handles)), "dequeue_wait")
        raise
    got = yield Abandon(token, calls, handles)
    return [UNSENT if h is None else None if a is OPEN or isinstance(a, (ConnectionLost, ShardUnavailable)) else a
            for a, h in zip(got, handles)]


def _release_answered(c: Calls, calls: Sequence[tuple[int, str, list[Any]]], got: list[Any], dequeue: str) -> None:
    """Hand back unstarted the leases of the ``dequeue`` calls (``dequeue`` or
    ``dequeue_wait``) among ``calls`` whose replies ``got`` (an :class:`Abandon`'s
    outcomes) came before their caller left: nobody will take them."""
    taken = [lease for (_, op, args), a in zip(calls, got) if op == dequeue and type(a) is list
             for _, lease in leases_of(args[0], a)]
    if taken:
        c._release(taken)


def transmit(c: Calls, calls: Sequence[tuple[int, str, list[Any]]], deadline: float,
             timeout_s: float | None = None) -> Op[list[Any]]:
    """Make ``calls`` once, pipelined (:class:`Submit`), and wait for every reply; connecting
    may take until ``deadline``, ``timeout_s`` as :class:`Send`'s. Returns, per call, its
    value, its error, or a :class:`~.core.ConnectionLost` when its connection broke before
    the reply (what happens next is :func:`deliver`'s decision, not the executor's). A call
    not answered in time is abandoned, and so is every one still open when it is stopped;
    stopped (a cancelled caller), it hands back unstarted the leases of the dequeues already
    answered, which nobody will take (a cancel can land after a reply has come, before its
    caller ran again)."""
    handles = yield Submit(calls, deadline)
    try:
        got = yield Collect(calls, handles, timeout_s)
    except GeneratorExit:
        raise
    except BaseException:
        _release_answered(c, calls, (yield Abandon(None, calls, handles)), "dequeue")
        raise
    if OPEN in got:  # (identity first: no value equals it)
        got = yield Abandon(None, calls, handles)
    wait_s = timeout_s or c.request_timeout_s
    return [no_answer(s, op, wait_s) if a is OPEN else a for (s, op, _), a in zip(calls, got)]


# ---------------------------------------------------------------------- the executors
#: The method of an executor that does each effect: given the effect, it returns its outcome
#: (an error is raised). Each executor binds them once (``_bind_effects``).
HANDLERS = {Send: "_do_send", Owner: "_learn_owner", Sleep: "_sleep", Park: "_park", Wake: "_wake",
            Abandon: "_abandon", Submit: "_submit", Collect: "_collect"}


class SyncExecutor:
    """Runs operations to completion in the calling thread (:class:`~.router.Router`)."""

    _handlers: dict[type, Callable[[Any], Any]]  # effect type -> the bound method doing it

    def _bind_effects(self) -> None:
        self._handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}

    def _drive(self, op: Op[T]) -> T:
        """Run one operation to its end in this thread: do what each effect it yields
        says, and send it the outcome (an error is thrown into it)."""
        handlers = self._handlers
        outcome: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.send(outcome) if error is None else op.throw(error)
            except StopIteration as stop:
                value: T = stop.value  # the operation's return value
                return value
            try:
                outcome, error = handlers[type(effect)](effect), None
            except BaseException as e:  # noqa: BLE001 - the operation decides, then raises it
                outcome, error = None, e

    def _bind(self, fn: Callable[..., Op[T]]) -> Callable[..., T]:
        def method(*args: Any, **kwargs: Any) -> T:
            return self._drive(fn(self, *args, **kwargs))
        return method


class AsyncExecutor:
    """Runs operations as coroutines (:class:`~.aio.AsyncQueue`); its effects' methods
    (:data:`HANDLERS`) are coroutine functions."""

    _handlers: dict[type, Callable[[Any], Coroutine[Any, Any, Any]]]

    def _bind_effects(self) -> None:
        self._handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}

    async def _drive(self, op: Op[T]) -> T:
        """Run one operation to its end as this coroutine, as :meth:`SyncExecutor._drive`
        does in a thread (a cancellation is thrown into it too)."""
        handlers = self._handlers
        outcome: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.send(outcome) if error is None else op.throw(error)
            except StopIteration as stop:
                value: T = stop.value  # the operation's return value
                return value
            try:
                outcome, error = await handlers[type(effect)](effect), None
            except BaseException as e:  # noqa: BLE001 - the operation decides, then raises it
                outcome, error = None, e

    def _bind(self, fn: Callable[..., Op[T]]) -> Callable[..., Coroutine[Any, Any, T]]:
        async def method(*args: Any, **kwargs: Any) -> T:
            return await self._drive(fn(self, *args, **kwargs))
        return method
