"""Distributed engines behind the same :class:`~shardq.client.queue.Queue` protocol.

One module (or a few ``<engine>_*.py`` modules) per engine; each implements the protocol
and depends on it, never the other way round. :func:`for_target` is how
``shardq.connect(target)`` picks one: ``sqs://<region>/<prefix>`` -> :mod:`.sqs`; anything
else is not a backend target (the local shards' data dir).
"""
from __future__ import annotations

SCHEMES = ("sqs://",)


def for_target(target) -> type | None:
    """The backend class for ``target``, or None when it names the local shards."""
    if isinstance(target, str) and target.startswith("sqs://"):
        from .sqs import SqsQueue
        return SqsQueue
    return None
