"""Distributed engines behind the same :class:`~shardq.client.queue.Queue` protocol.

One module (or a few ``<engine>_*.py`` modules) per engine; each implements the protocol
and depends on it, never the other way round. :func:`for_target` is how
``shardq.connect(target)`` (:func:`connect`, here so that the layers above the client may
call it without the facade) picks one: ``sqs://<region>/<prefix>`` -> :mod:`.sqs`; anything
else is not a backend target (the local shards' data dir).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..client.queue import Queue

SCHEMES = ("sqs://",)


def connect(target: Any, **options: Any) -> Queue:
    """``shardq.connect``: the backend :func:`for_target` names, else a router to the local
    shards of the data dir ``target``."""
    from ..client.router import Router
    # (typed as any class: Router is not yet a Queue to mypy, its ids being list[int] where
    # the protocol's are list[int | str], and a list is invariant; the client's to settle)
    make: type[Any] = for_target(target) or Router
    queue: Queue = make(target, **options)
    return queue


def for_target(target: object) -> type[Any] | None:
    """The backend class for ``target``, or None when it names the local shards."""
    if isinstance(target, str) and target.startswith("sqs://"):
        from .sqs import SqsQueue
        return SqsQueue
    return None
