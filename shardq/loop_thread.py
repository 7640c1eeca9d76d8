"""An asyncio event loop that runs forever in a daemon thread of its own: how a listener on
:class:`.aio_listener.AioListener` lives inside ``serve``'s synchronous process (the console's and
the SQS listener's: shardq/sqs_api/server.py)."""
from __future__ import annotations

import asyncio
import logging
import selectors
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A new event loop, running in a daemon thread named ``name`` from construction on;
    :meth:`call` runs a coroutine on it from another thread, :meth:`close` ends it.
    ``selector``: the loop's (the SQS listener's busy-polls: :mod:`.spin_selector`)."""

    def __init__(self, name: str, selector: selectors.BaseSelector | None = None) -> None:
        self.loop = asyncio.new_event_loop() if selector is None else asyncio.SelectorEventLoop(selector)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``coro``'s result, run on the loop; TimeoutError past ``timeout_s`` (it runs on)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def finish(self, coro: Coroutine[Any, Any, Any], timeout_s: float, log: logging.Logger, event: str) -> None:
        """Run ``coro`` (a listener's orderly stop) on the loop, then :meth:`close` it; a stop that
        fails or passes ``timeout_s`` is logged as ``event`` (on ``log``) and the loop ends all the same."""
        try:
            self.call(coro, timeout_s)
        except Exception:  # noqa: BLE001 - stopping goes on: the loop ends below whatever failed
            log.exception("event=%s", event)
        self.close()

    def close(self, join_s: float = 10.0) -> None:
        """Stop the loop and wait up to ``join_s`` for its thread; the loop is closed once it
        has stopped (a loop still running is left to the daemon thread's end)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(join_s)
        if not self.loop.is_running():
            self.loop.close()
