"""A coroutine started at once, in the caller's loop turn, and made a task only if it waits:
what Python 3.12's eager tasks do (``asyncio.Task(..., eager_start=True)``), for 3.11.

The HTTP listener (:mod:`.aio_listener`) starts each request's handler this way. As a task
created with ``create_task``, its first step would run one loop turn after the request's
read: for a lone SendMessage, the read, then the handler (which asks the shards' client to
send), then the client's flush, each a turn of the loop and a ``select`` of its own. Run at
once, the handler's first step shares the read's turn, and a handler that never waits (an
error answered at once) needs no task at all.

Guarantee: the coroutine runs exactly as a task would run it, the first step excepted,
which runs in the caller's frame: no ``asyncio.current_task()`` there (so no
``asyncio.timeout`` before the first wait; the listener's handlers use none), and an
exception it raises reaches the caller. From its first wait on it is the returned task's:
what it waits for, the values and exceptions it is sent (a cancellation included) and its
result are the task's, unchanged."""
from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> tuple[asyncio.Task[T] | None, T | None]:
    """(None, its result) if ``coro`` ended in its first step; else (the task that runs the
    rest, None)."""
    try:
        first = coro.send(None)
    except StopIteration as done:
        return None, done.value
    return loop.create_task(_rest(coro, first)), None


@types.coroutine
def _rest(coro: Coroutine[Any, Any, T], waiting: Any) -> Generator[Any, Any, T]:
    """The rest of ``coro``, which yielded ``waiting`` (a future, usually): each value it
    yields goes to the task, each the task sends or throws goes back to it."""
    while True:
        try:
            try:
                sent = yield waiting
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - a cancellation, thrown in by the task: the coroutine's
                waiting = coro.throw(e)
            else:
                waiting = coro.send(sent)
        except StopIteration as done:  # (from the coroutine: the task never throws one in)
            result: T = done.value
            return result
