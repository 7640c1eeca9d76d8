"""The shard's handler table, derived from ``wire.REQUESTS``, and its one generic handler.

Every request's arguments become its argument record (:class:`~shardq.protocol.wire.NackArgs`,
...) before anything else sees them. A request whose :class:`~shardq.protocol.wire.Request`
names a state method (``calls``) is served by :func:`state_call`: the record's fields go to
that method by name, with the loop's ``now`` if the method takes one, and what it returns
is the reply. A request that does more (batches answered item by item, waits, rows built for
the reply, the server's own figures) names a ShardServer method instead (``handler``), which
takes the record (:func:`server_call`). Either way the table's entry is
``entry(args, now, conn, rid)`` (:data:`~.control_handlers.Handler`); the arity was checked
before it runs (process.py ``_execute``)."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..protocol.wire import REQUESTS
from .ops import new

if TYPE_CHECKING:
    from .conn import FrameConn
    from .control_handlers import Args, Handler
    from .state import ShardState


class _Server(Protocol):  # what handlers() needs of a ShardServer (process.py)
    state: ShardState


def state_call(state: ShardState, calls: str, record: type[NamedTuple]) -> Handler:
    """The generic handler of a request on ``state``: its argument ``record``'s fields, by
    name, to the state method ``calls`` (and ``now``, if that method takes it)."""
    method = getattr(state, calls)
    if "now" in inspect.signature(method).parameters:
        def handle(args: Args, now: float, conn: FrameConn, rid: int) -> object:
            return method(**record(*args)._asdict(), now=now)
    else:
        def handle(args: Args, now: float, conn: FrameConn, rid: int) -> object:
            return method(**record(*args)._asdict())
    handle.__qualname__ = handle.__name__ = f"state_call[{calls}]"
    return handle


def server_call(method: Callable[[Any, float, FrameConn, int], object], record: type[NamedTuple]) -> Handler:
    """The table's entry of a request served by ``method`` of the server, which takes its
    argument ``record``."""
    def handle(args: Args, now: float, conn: FrameConn, rid: int) -> object:
        return method(new(record, args), now, conn, rid)  # args: a list of its arity (the loop checked)
    handle.__qualname__ = handle.__name__ = f"server_call[{method.__name__}]"
    return handle


def handlers(server: _Server) -> dict[str, Handler]:
    """``{op: entry}`` of every op of ``wire.REQUESTS`` for ``server`` (a ShardServer)."""
    return {name: state_call(server.state, r.calls, r.args) if r.calls is not None
            else server_call(getattr(server, r.handler or ""), r.args)
            for name, r in REQUESTS.items()}
