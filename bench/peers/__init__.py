"""The queues the benchmark compares, by the names ``--only`` takes.

Each name maps to a factory of a fresh, not yet set up :class:`~bench.peers.base.Adapter`.
Adapters import their client library in ``setup``, so a missing library skips that peer
only.
"""
from __future__ import annotations

from collections.abc import Callable

from .base import Adapter, ClientSpec, SkipPeer, connect
from .beanstalkd import BeanstalkdAdapter
from .persistq import PersistqAdapter
from .redis_peer import RedisAdapter
from .shardq_peer import ShardqAdapter

PEERS: dict[str, Callable[[], Adapter]] = {
    "shardq": ShardqAdapter,
    "beanstalkd": BeanstalkdAdapter,
    "redis": RedisAdapter,
    "persistq": PersistqAdapter,
}

__all__ = ["PEERS", "Adapter", "ClientSpec", "SkipPeer", "connect"]
