"""The shard process's handlers of the control and metrics ops (``wire.CONTROL_ARITY``)
that do more than call their state method (pause, resume, cancel and job are served by the
generic handler, :mod:`.calls`): dead-letter pages as reply rows, purge_ids, metrics (whole,
and in pages: :func:`metrics_page`) and backup_cut. A mixin of
:class:`~shardq.shard.process.ShardServer`, named by ``wire.REQUESTS`` like every handler.
Like every handler they run on the loop thread, and what they change is logged and fsynced
before the reply leaves. ``backup_cut`` changes nothing: it fixes where a backup's copy of
the log ends (docs/backup.md)."""
from __future__ import annotations

import os
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from .. import limits
from ..errors import InvalidJob, InvariantViolation
from ..protocol import validate, wire

if TYPE_CHECKING:
    from ..clock import Clock
    from .committer import Committer
    from .conn import FrameConn
    from .core import QueueState
    from .durable import BackupCut, DurableShard
    from .process import ShardServer, ShardStats
    from .queues import QueueStats
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


#: What one queue's entries of a metrics page take at most besides its name (which each of
#: the two maps of a page holds once, as a key) and the rate strings of a run-time override
#: (counted apart: a rate is written as the operator wrote it): its ``stats`` entry with
#: every figure a limited queue shows (every limit overridden, a fence, a 16-character
#: group separator of 4-byte characters, every number at its widest) and its
#: ``queue_metrics`` entry. Measured once (tests/shard/test_metrics_pages.py builds that
#: queue) and rounded up; a limited queue's entries take about 430 bytes, a plain one's 180.
QUEUE_FIGURES_BYTES_MAX = 1024
#: What page 0 keeps for the shard-wide figures of ``metrics`` (the commit histograms, the
#: workflow counters, ...: about 900 bytes).
SHARD_FIGURES_BYTES_MAX = 16 * 1024


def queue_page_bytes(name: str) -> int:
    """What one queue takes in a metrics page at most, estimated without encoding anything:
    its name twice (a key of ``queues`` and of ``queue_metrics``; a msgpack str header is at
    most 5 bytes) and :data:`QUEUE_FIGURES_BYTES_MAX`."""
    return 2 * ((len(name) if name.isascii() else len(name.encode())) + 5) + QUEUE_FIGURES_BYTES_MAX


class _Seen:
    """``target`` with some attributes replaced: a method of ``target``'s class run on this
    object reads the replacements, and everything else from ``target``. Read-only use only."""

    def __init__(self, target: object, **instead: Any) -> None:
        self.__dict__.update(instead)
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def metrics_page(state: ShardState, start: int, now: float, budget: int
                 ) -> tuple[dict[str, QueueStats], dict[str, dict[str, float | None]], int | None]:
    """One page of the per-queue part of ``metrics``: the ``stats`` and the figures
    (``queue_metrics``) of the queues from position ``start`` in the order the state made
    them, as many as :func:`queue_page_bytes` says fit in ``budget`` (at least one), and the
    position of the next page's first queue (None: this page reaches the last queue).

    The state only ever adds queues, each at the end of ``state.queues`` (core.py: ``_queue``
    and ``_logged_queue``; nothing removes one), so a position names the same queue for the
    life of the process. The entries are the state's own ``stats`` and ``queue_metrics``,
    run over the page's queues alone (:class:`_Seen`; both read the queues through
    ``self.queues`` only): one pass over the page, not over the shard."""
    queues = state.queues
    page: dict[str, QueueState] = {}
    used = 0
    for name in islice(queues, start, None):
        q = queues[name]
        used += queue_page_bytes(name)
        if q.lim is not None and q.lim.override:  # a rate is a string of any length
            used += sum(len(v.encode()) for v in q.lim.override.values() if isinstance(v, str))
        if used > budget and page:
            break
        page[name] = q
    end = start + len(page)
    seen = cast("ShardState", _Seen(state, queues=page))
    cls = type(state)
    return cls.stats(seen), cls.queue_metrics(seen, now), (end if end < len(queues) else None)


class ControlHandlers:
    """Mixin of ShardServer; expects its ``state``, ``shard``, ``clock``, ``committer`` and
    ``_stats``."""

    state: ShardState
    shard: DurableShard
    clock: Clock
    committer: Committer | None   # None until ShardServer.serve() starts it
    #: What a ``metrics_page`` reply takes at most, estimated (:func:`metrics_page`).
    metrics_page_bytes: int = limits.METRICS_PAGE_BYTES

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
        over the queues (not the jobs). Kept for clients before ``metrics_page``: at
        ``limits.QUEUES_MAX`` queues with long names and limits its reply passes the frame
        limit (the client refuses it)."""
        out = self._stats(args, now, conn, rid)
        out["queue_metrics"] = self.state.queue_metrics(now)
        self._shard_figures(cast("dict[str, Any]", out))
        return out

    def _metrics_page(self, args: wire.MetricsPageArgs, now: float, conn: FrameConn, rid: int) -> dict[str, Any]:
        """One page of ``metrics`` (:func:`metrics_page`; wire.py says what it holds): the
        queues from ``start``, ``next`` and ``pid``; page 0 also every shard-wide figure of
        ``metrics``, read as ``stats`` reads them but with the page's queues alone. Reads
        only; the cost is one pass over the page's queues."""
        start = validate.integer("start", args.start)
        budget = self.metrics_page_bytes
        first = start == 0
        stats, figures, after = metrics_page(self.state, start, now,
                                             budget - SHARD_FIGURES_BYTES_MAX if first else budget)
        out: dict[str, Any]
        if first:  # _stats itself, with the page's queue stats in place of the whole shard's
            server = cast("ShardServer", _Seen(self, state=_Seen(self.state, stats=lambda: stats)))
            out = dict(type(self)._stats(server, wire.NoArgs(), now, conn, rid))
            self._shard_figures(out)
        else:
            out = {"shard": self.shard.shard_index, "pid": os.getpid(), "queues": stats}
        out["queue_metrics"] = figures
        out["next"] = after
        return out

    def _shard_figures(self, out: dict[str, Any]) -> None:
        """What ``metrics`` adds to ``stats`` besides the queues: the results and workflow
        counters and the committer's histograms."""
        out["workflow_counters"] = self.state.workflow_counters()
        committer = self.committer
        if committer is not None:
            out["commit_seconds"] = committer.commit_seconds.snapshot()
            out["commit_ops"] = committer.commit_ops.snapshot()
            out["fsyncs"] = committer.fsyncs

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

