"""The shard process's handlers for the results and workflow ops (``put_result`` to
``workflow_ids`` in ``wire.REQUESTS``): thin wrappers over
:class:`~shardq.shard.results.ResultOps` and :class:`~shardq.shard.workflows.WorkflowOps`,
mixins of
:class:`~shardq.shard.process.ShardServer`. Like every handler they run on the loop
thread; what they change (a result, progress, an arrival with the callback it enqueues, a
cancel) is logged and fsynced before the reply leaves, and an arrival's callback job is
offered to waiting consumers in the same iteration, as any enqueue's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import limits
from ..errors import InvalidJob, InvariantViolation, ShardqError
from ..protocol import wire as protocol

if TYPE_CHECKING:
    from ..protocol.wire import ResultRow
    from .conn import FrameConn
    from .control_handlers import Args
    from .results import BarrierInfo
    from .workflows import WorkflowInfo
    from .state import ShardState


class ResultHandlers:
    """Mixin of ShardServer; expects its ``state``."""

    state: ShardState

    def _put_result(self, args: Args, now: float, conn: FrameConn, rid: int) -> None:
        job_id, token, value, ttl_s = args
        self.state.put_result(job_id, token, value, ttl_s, now)

    def _progress(self, args: Args, now: float, conn: FrameConn, rid: int) -> None:
        job_id, token, fraction, note = args
        self.state.set_progress(job_id, token, fraction, note, now)

    def _result(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[ResultRow]:
        return self.state.results_of(args[0], now)

    def _result_sizes(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[ResultRow]:
        return self.state.results_of(args[0], now, sizes=True)

    def _arrive(self, args: Args, now: float, conn: FrameConn, rid: int) -> str:
        barrier_id, index, total, value, ttl_s, callback = args
        return self.state.arrive(barrier_id, index, total, value, ttl_s, callback, now)

    def _arrive_many(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[str | list[str]]:
        (arrivals,) = args
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

    def _barrier(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[BarrierInfo | None]:
        return self.state.barrier_info(args[0], now)

    def _barrier_values(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[bytes]:
        return self.state.barrier_values(args[0], now)

    def _cancel_barrier(self, args: Args, now: float, conn: FrameConn, rid: int) -> str:
        barrier_id, ttl_s = args
        return self.state.cancel_barrier(barrier_id, ttl_s, now)

    def _put_workflow(self, args: Args, now: float, conn: FrameConn, rid: int) -> str:
        wf_id, spec = args
        return self.state.put_workflow(wf_id, spec, now)

    def _end_workflow(self, args: Args, now: float, conn: FrameConn, rid: int) -> str:
        wf_id, state, error, ttl_s = args
        return self.state.end_workflow(wf_id, state, error, ttl_s, now)

    def _workflow(self, args: Args, now: float, conn: FrameConn, rid: int) -> WorkflowInfo:
        return self.state.workflow(args[0], now)

    def _workflow_ids(self, args: Args, now: float, conn: FrameConn, rid: int) -> list[str]:
        after, limit = args
        return self.state.running_workflows(after, limit)
