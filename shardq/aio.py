"""``import shardq.aio`` and ``from shardq.aio import connect``: the asyncio client,
:mod:`shardq.client.aio` itself (this module puts that one in its place, so that
``shardq.aio`` is one module however it was reached: ``import shardq`` then
``shardq.aio``, as the docs write it, works without this file)."""
import sys

from .client import aio as _aio
from .client.aio import AsyncQueue, connect

__all__ = ["AsyncQueue", "connect"]
sys.modules[__name__] = _aio
