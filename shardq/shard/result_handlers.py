"""The shard process's handler of the one results op that does more than call its state
method (the others, ``put_result`` to ``workflow_ids`` in ``wire.REQUESTS``, are served by
the generic handler, :mod:`.calls`): ``arrive_many``, which answers each arrival on its
own. A mixin of :class:`~shardq.shard.process.ShardServer`. Like every handler it runs on
the loop thread; what it changes (arrivals, with the callbacks they enqueue) is logged and
fsynced before the reply leaves, and a callback job is offered to waiting consumers in the
same iteration, as any enqueue's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import limits
from ..errors import InvalidJob, InvariantViolation, ShardqError
from ..protocol import wire as protocol

if TYPE_CHECKING:
    from .conn import FrameConn
    from .state import ShardState


class ResultHandlers:
    """Mixin of ShardServer; expects its ``state``."""

    state: ShardState

    def _arrive_many(self, args: protocol.ArriveManyArgs, now: float, conn: FrameConn,
                     rid: int) -> list[str | list[str]]:
        arrivals = args.arrivals
        if type(arrivals) is not list or len(arrivals) > limits.BATCH_JOBS_MAX:
            raise InvalidJob(f"arrive_many: expected at most {limits.BATCH_JOBS_MAX} arrivals")
        out: list[str | list[str]] = []  # per arrival: arrive's answer, or the error (protocol.error_payload)
        for item in arrivals:
            try:
                if type(item) is not list or len(item) != 6:
                    raise InvalidJob("arrive_many: each arrival is [barrier_id, index, total, value, ttl_s, callback]")
                barrier_id, index, total, value, ttl_s, callback = item
                out.append(self.state.arrive(barrier_id, index, total, value, ttl_s, callback, now))
            except ShardqError as e:
                if isinstance(e, InvariantViolation):
                    raise
                out.append(protocol.error_payload(e))
        return out
