"""The shard's handler table, derived from ``wire.REQUESTS``, and its one generic handler.

A request whose :class:`~shardq.protocol.wire.Request` names a state method (``calls``)
is served by :func:`state_call`: the wire's arguments become the request's argument record
(:class:`~shardq.protocol.wire.NackArgs`, ...), whose fields are passed to that method by
name, with the loop's ``now`` if the method takes one; what it returns is the reply. A
request that does more (batches answered item by item, waits, rows built for the reply,
the server's own figures) names a ShardServer method instead (``handler``). Either way a
handler is ``handler(args, now, conn, rid)`` (:data:`~.control_handlers.Handler`); the
arity was checked before it runs (process.py ``_execute``)."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..protocol.wire import REQUESTS

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


def handlers(server: _Server) -> dict[str, Handler]:
    """``{op: handler}`` of every op of ``wire.REQUESTS`` for ``server`` (a ShardServer)."""
    return {name: state_call(server.state, r.calls, r.args) if r.calls is not None else getattr(server, r.handler or "")
            for name, r in REQUESTS.items()}
