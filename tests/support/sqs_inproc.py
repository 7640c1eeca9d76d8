"""The SQS API in process, called like a function: an :class:`~shardq.sqs_api.api.SqsApi`
over an asyncio client of its own, on an event loop in a thread of its own (as the listener
runs it), for tests that call its actions without HTTP."""
from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import shardq
from shardq.clock import Clock
from shardq.config import SqsApiConfig
from shardq.sqs_api.api import SqsApi
from shardq.sqs_api.catalog import Catalog
from shardq.loop_thread import LoopThread


class InProcessApi:
    """``api.call(action, params, host)`` waits for the action's answer (or raises its
    error); every other attribute is the SqsApi's (``q``, ``memos``, ``catalog``, ``clock``);
    ``api.run(coro)`` runs a coroutine on its loop (``api.run(api.memos.sweep())``)."""

    def __init__(self, data_dir: str, catalog: Catalog, cfg: SqsApiConfig | None = None,
                 clock: Clock | None = None) -> None:
        self._loop = LoopThread("sqs-inproc")
        try:
            q = self._loop.call(shardq.aio.connect(data_dir), 60)
        except BaseException:
            self._loop.close()
            raise
        self.sqs = SqsApi(q, catalog, cfg or SqsApiConfig(), clock)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return self._loop.call(coro, timeout)

    def call(self, action: str, params: dict[str, Any], host: str) -> dict[str, Any]:
        result: dict[str, Any] = self.run(self.sqs.call(action, params, host))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sqs, name)

    def close(self) -> None:
        """End the API's background work, close its client, end the loop."""
        try:
            self.run(self.sqs.close())
            self.run(self.sqs.q.close())
        finally:
            self._loop.close()
