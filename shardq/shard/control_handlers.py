"""The shard process's handlers of the control and metrics ops (``wire.CONTROL_ARITY``)
that do more than call their state method (pause, resume, cancel and job are served by the
generic handler, :mod:`.calls`): dead-letter pages as reply rows, purge_ids, metrics and
backup_cut. A mixin of :class:`~shardq.shard.process.ShardServer`, named by
``wire.REQUESTS`` like every handler. Like every handler they run on the loop thread, and
what they change is logged and fsynced before the reply leaves. ``backup_cut`` changes
nothing: it fixes where a backup's copy of the log ends (docs/backup.md)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from ..errors import InvalidJob, InvariantViolation
from ..protocol import wire

if TYPE_CHECKING:
    from ..clock import Clock
    from .committer import Committer
    from .conn import FrameConn
    from .durable import BackupCut, DurableShard
    from .process import ShardStats
    from .state import ShardState

#: A request's arguments as the wire decoded them: msgpack values, as many as the op's
#: ``wire.ARITY`` (checked before a handler runs). The handler table (:mod:`.calls`) makes
#: them the request's argument record (``wire.NackArgs``, ...) before a method of the server
#: or the state sees them; each value is checked by the state method it reaches.
Args: TypeAlias = list[Any]
#: An entry of the handler table: (args, now (wall clock), the client's connection, the
#: request id) -> what the reply carries (a msgpack value), or process._DEFERRED for a reply
#: sent later.
Handler: TypeAlias = "Callable[[Args, float, FrameConn, int], object]"


class ControlHandlers:
    """Mixin of ShardServer; expects its ``state``, ``shard``, ``clock``, ``committer`` and
    ``_stats``."""

    state: ShardState
    shard: DurableShard
    clock: Clock
    committer: Committer | None   # None until ShardServer.serve() starts it

    if TYPE_CHECKING:
        def _stats(self, args: wire.NoArgs, now: float, conn: FrameConn, rid: int) -> ShardStats: ...

    def _dead_page(self, args: wire.DeadPageArgs, now: float, conn: FrameConn, rid: int) -> list[wire.DeadRow]:
        queue, after, limit = args.queue, args.after, args.limit
        # (this shard's job ids are ints; the DeadLetter type also allows str ids, types.JobId)
        return [wire.DeadRow(d.job_id, d.key, d.body, d.attempts, d.error)  # type: ignore[arg-type]  # int ids here
                for d in self.state.dead_page(queue, after, limit)]

    def _purge_ids(self, args: wire.PurgeIdsArgs, now: float, conn: FrameConn, rid: int) -> int:
        queue, job_ids = args.queue, args.job_ids
        if type(job_ids) is not list:
            raise InvalidJob("purge_ids: job_ids must be an array")
        return self.state.purge_ids(queue, job_ids, now)

    def _metrics(self, args: wire.NoArgs, now: float, conn: FrameConn, rid: int) -> ShardStats:
        """One call for a whole scrape: the stats plus per-queue figures, the results and
        workflow counters and the committer's histograms. Reads only; the cost is one pass
        over the queues (not the jobs)."""
        out = self._stats(args, now, conn, rid)
        out["queue_metrics"] = self.state.queue_metrics(now)
        out["workflow_counters"] = self.state.workflow_counters()
        committer = self.committer
        if committer is not None:
            out["commit_seconds"] = committer.commit_seconds.snapshot()
            out["commit_ops"] = committer.commit_ops.snapshot()
            out["fsyncs"] = committer.fsyncs
        return out

    def _backup_cut(self, args: wire.BackupCutArgs, now: float, conn: FrameConn, rid: int) -> BackupCut:
        """Take this shard's backup cut: every write before it is synced and in the copy;
        none after it is (docs/backup.md).

        On the loop thread, so no compaction runs meanwhile: wait for the committer to have
        written, synced and answered everything submitted before this iteration, sync what
        batched leases left unsynced, write a sync mark (the copy's last writes are then
        vouched for), and hard-link the log files into a staging dir
        (:meth:`~.durable.DurableShard.stage_backup`). Requests of this iteration read
        before this one are logged after the cut, and answered after it. The loop pauses
        for one drain and at most one fdatasync, as before a compaction."""
        committer = self.committer
        if committer is None:  # never: requests are served by the loop, which serve() starts with it
            raise InvariantViolation("backup_cut before the shard serves")
        committer.drain()
        committer.submit([], [], [], inline=True, sync=True)
        committer.drain()
        committer.write_mark()  # False only while it flushes replies to a slow reader
        cut = self.shard.stage_backup(args.stage)
        # Every job numbered up to durable_seq is in the copy, and none after it: the
        # restore checks that its replay ends there.
        cut["shard"] = self.shard.shard_index
        cut["time"] = self.clock.now()
        cut["job_seq"] = committer.durable_seq
        return cut

