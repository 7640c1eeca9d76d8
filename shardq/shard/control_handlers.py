"""The shard process's handlers for the control and metrics ops (``wire.CONTROL_ARITY``):
thin wrappers over :class:`~shardq.shard.control.ControlOps`, registered into
``ShardServer._handlers``. Like every handler they run on the loop thread, and what they
change is logged and fsynced before the reply leaves."""
from __future__ import annotations

from ..errors import InvalidJob


def control_handlers(server) -> dict:
    """``{op: handler(args, now, conn, rid)}`` for ``server`` (a ShardServer)."""
    state = server.state

    def pause(args, now, conn, rid):
        return state.pause(args[0], now)

    def resume(args, now, conn, rid):
        return state.resume(args[0], now)

    def cancel(args, now, conn, rid):
        return state.cancel(args[0], now)

    def job(args, now, conn, rid):
        return state.job_info(args[0])

    def dead_page(args, now, conn, rid):
        queue, after, limit = args
        return [[d.job_id, d.key, d.body, d.attempts, d.error] for d in state.dead_page(queue, after, limit)]

    def purge_ids(args, now, conn, rid):
        queue, job_ids = args
        if type(job_ids) is not list:
            raise InvalidJob("purge_ids: job_ids must be an array")
        return state.purge_ids(queue, job_ids, now)

    def metrics(args, now, conn, rid):
        """One call for a whole scrape: the stats plus per-queue figures and the committer's
        histograms. Reads only; the cost is one pass over the queues (not the jobs)."""
        out = server._stats(args, now, conn, rid)
        out["queue_metrics"] = state.queue_metrics(now)
        committer = server.committer
        if committer is not None:
            out["commit_seconds"] = committer.commit_seconds.snapshot()
            out["commit_ops"] = committer.commit_ops.snapshot()
            out["fsyncs"] = committer.fsyncs
        return out

    return {"pause": pause, "resume": resume, "cancel": cancel, "job": job, "dead_page": dead_page,
            "purge_ids": purge_ids, "metrics": metrics}
