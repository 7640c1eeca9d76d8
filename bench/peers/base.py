"""The interface every benchmarked queue implements.

A :class:`Client` does the queue operations. An :class:`Adapter` is a :class:`Client` that
also owns the peer's lifetime: ``setup(tmpdir)`` starts it (a server process, or an
in-process queue) and ``teardown()`` stops it. Figures that need more clients (D, W) ask
the adapter for a :class:`ClientSpec`, a picklable recipe, and call :func:`connect` with it
inside each client process. An adapter whose queue cannot be shared between processes
returns ``None`` from :meth:`Adapter.client_spec`; those figures then run its clients as
threads sharing the adapter, and say so in the results.

A handle is whatever ``dequeue`` returns for one delivery; only the adapter looks inside it
(``body_of``, ``ack``).
"""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple
from collections.abc import Sequence

Item = tuple[bytes, str]  # (body, key)


class SkipPeer(Exception):
    """The peer cannot be set up here; the message is the reason shown in the report."""


class ClientSpec(NamedTuple):
    """How to build a client in another process: ``module.factory(**kwargs)``."""

    module: str
    factory: str
    kwargs: dict[str, Any]


def connect(spec: ClientSpec) -> Client:
    """A new client (own connection) built from ``spec``; call in the process that uses it."""
    factory = getattr(importlib.import_module(spec.module), spec.factory)
    return factory(**spec.kwargs)


class Client:
    """Queue operations. Subclasses implement the single-job ones; the batch ones only when
    ``batch_mode`` is set ("native": one request per batch; "pipeline": one command per job,
    sent together before the replies are read)."""

    batch_mode: str | None = None

    def enqueue(self, body: bytes, key: str) -> None:
        raise NotImplementedError

    def enqueue_many(self, items: Sequence[Item]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no batch enqueue")

    def dequeue(self, wait_s: float) -> Any | None:
        """One leased job, or None if none came within ``wait_s`` seconds."""
        raise NotImplementedError

    def dequeue_many(self, n: int, wait_s: float) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} has no batch dequeue")

    def ack(self, handle: Any) -> None:
        raise NotImplementedError

    def ack_many(self, handles: Sequence[Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no batch ack")

    def body_of(self, handle: Any) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Release this client's connection (never stops the server)."""


class Adapter(Client):
    """A peer under test: its lifetime plus the operations of its main client, ``self.client``
    (set by ``setup``), to which the queue operations are forwarded.

    ``durability`` says, in words, the setting the peer runs at (shown in the report).
    ``thread_safe`` says whether one adapter may be used by many threads at once.
    """

    name = "?"
    durability = "?"
    thread_safe = False
    client: Client

    def enqueue(self, body: bytes, key: str) -> None:
        self.client.enqueue(body, key)

    def enqueue_many(self, items: Sequence[Item]) -> None:
        self.client.enqueue_many(items)

    def dequeue(self, wait_s: float) -> Any | None:
        return self.client.dequeue(wait_s)

    def dequeue_many(self, n: int, wait_s: float) -> list[Any]:
        return self.client.dequeue_many(n, wait_s)

    def ack(self, handle: Any) -> None:
        self.client.ack(handle)

    def ack_many(self, handles: Sequence[Any]) -> None:
        self.client.ack_many(handles)

    def body_of(self, handle: Any) -> bytes:
        return self.client.body_of(handle)

    def setup(self, tmpdir: str) -> None:
        """Start the peer with its data under ``tmpdir``; raise SkipPeer if it cannot run."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Stop the peer and free everything setup took. Safe to call twice."""
        raise NotImplementedError

    def client_spec(self) -> ClientSpec | None:
        """A recipe for clients in other processes; None if clients must be threads."""
        return None

    def server_pids(self) -> list[int]:
        """PIDs of the peer's server processes (for idle CPU); empty if in-process."""
        return []


class ServerAdapter(Adapter):
    """An adapter for a peer that runs as one local server process on ``self._port``;
    subclasses start it in ``setup`` and name their client class in ``client_class``."""

    client_class = "?"

    def __init__(self) -> None:
        self._proc = None
        self.client = None
        self._port = 0

    def teardown(self) -> None:
        from . import servers
        if self.client is not None:
            self.client.close()
            self.client = None
        servers.stop(self._proc)
        self._proc = None

    def client_spec(self) -> ClientSpec:
        return ClientSpec(type(self).__module__, self.client_class, {"port": self._port})

    def server_pids(self) -> list[int]:
        return [self._proc.pid] if self._proc else []
