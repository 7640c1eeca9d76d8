"""An asyncio event loop that runs forever in a daemon thread of its own, and the calls other
threads make into it: how the listeners of ``serve`` live inside its synchronous process (the
console's and the SQS API's, on :class:`~shardq.service.aio_listener.AioListener`), and how the
threaded router does its shared way (the asyncio client on its I/O thread:
:class:`~shardq.client.router.Router`)."""
from __future__ import annotations

import asyncio
import logging
import selectors
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

from .errors import Closed

T = TypeVar("T")


class LoopThread:
    """A new event loop, running in a daemon thread named ``name`` from construction on;
    :meth:`call` and :meth:`wait` run a coroutine on it from another thread, :meth:`close`
    ends it. ``selector``: the loop's (the SQS listener's busy-polls: :mod:`.spin_selector`).
    ``owner``: what a call made once it closes is told is closed (:class:`~.errors.Closed`)."""

    def __init__(self, name: str, selector: selectors.BaseSelector | None = None, owner: str = "event loop") -> None:
        self.loop = asyncio.new_event_loop() if selector is None else asyncio.SelectorEventLoop(selector)
        self.owner = owner
        self.closing = False  # set by close(): what starts from then on might never run
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """``coro``'s result, run on the loop; TimeoutError past ``timeout_s`` (it runs on)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def wait(self, start: Callable[[], Awaitable[T]], slice_s: float = 1.0) -> T:
        """Run ``start()`` on the loop (a coroutine as a task, a future as it is) and sleep
        until it ends: its value, or its error raised. The caller sleeps on a plain lock, the
        cheapest wake-up CPython has (a ``concurrent.futures`` future's costs a condition
        more), looking every ``slice_s`` whether the loop was closed meanwhile (then Closed:
        what runs there ends by its own deadlines, or with the loop). An error in the calling
        thread while it sleeps (KeyboardInterrupt) cancels what it started there."""
        reply = _Reply()
        loop = self.loop
        try:
            loop.call_soon_threadsafe(reply.start, self, start)
            while not reply.wait(slice_s):
                if loop.is_closed():
                    raise Closed(f"{self.owner} is closed")
        except RuntimeError:  # its loop is closed
            raise Closed(f"{self.owner} is closed") from None
        except BaseException:
            if not loop.is_closed():
                loop.call_soon_threadsafe(reply.cancel)
            raise
        if reply.error is not None:
            raise reply.error
        return cast(T, reply.value)

    def finish(self, coro: Coroutine[Any, Any, Any], timeout_s: float, log: logging.Logger, event: str) -> None:
        """Run ``coro`` (a listener's orderly stop) on the loop, then :meth:`close` it; a stop that
        fails or passes ``timeout_s`` is logged as ``event`` (on ``log``) and the loop ends all the same."""
        try:
            self.call(coro, timeout_s)
        except Exception:  # noqa: BLE001 - stopping goes on: the loop ends below whatever failed
            log.exception("event=%s", event)
        self.close()

    def close(self, join_s: float = 10.0) -> None:
        """End what is still running on the loop (cancelled, each given its turn to finish,
        for up to ``join_s``), stop the loop and wait up to ``join_s`` for its thread; the
        loop is closed once it has stopped (a loop still running is left to the daemon
        thread's end)."""
        self.closing = True
        try:
            self.call(_cancel_the_rest(), join_s)
        except (TimeoutError, RuntimeError):  # stuck, or closed already: it stops all the same
            pass
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(join_s)
        if not self.loop.is_running():
            self.loop.close()


async def _cancel_the_rest() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


class _Reply:
    """What the loop hands a thread waiting in :meth:`LoopThread.wait`: ``wait`` blocks on a
    plain lock, which the loop releases once."""

    __slots__ = ("_lock", "fut", "value", "error", "owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.fut: asyncio.Future[Any] | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.owner = ""

    def start(self, lt: LoopThread, start: Callable[[], Awaitable[Any]]) -> None:
        self.owner = lt.owner
        try:
            if lt.closing:  # a task made now might never run
                raise Closed(f"{lt.owner} is closed")
            self.fut = asyncio.ensure_future(start())
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread
            self.error = e
            self._lock.release()
        else:
            self.fut.add_done_callback(self._set)

    def _set(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self.error = Closed(f"{self.owner} is closed")  # (cancelled by close(): an interrupted caller has left)
        elif (error := fut.exception()) is not None:
            self.error = error
        else:
            self.value = fut.result()
        self._lock.release()

    def cancel(self) -> None:
        if self.fut is not None:
            self.fut.cancel()

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)
