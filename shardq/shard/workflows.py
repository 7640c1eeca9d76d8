"""Workflow records, a mixin of :class:`~shardq.shard.state.ShardState` (docs/design.md,
"Workflow records"): what a workflow is, kept on its home shard so that any process (the
console, ``shardq workflow show``, the service's watcher) can read its steps, and how it
ended, so that the service counts workflows started, succeeded, failed and cancelled.

A record is observability, never control: the barriers and the jobs run a workflow with or
without it. It is put once, by the process that sends the workflow, after the workflow's
first jobs are enqueued (a second put of the same id changes nothing); it ends once
(``end_workflow``: the service's watcher, which computes the workflow's state from its
jobs and barriers, or ``Workflow.cancel``; a second end changes nothing). A running record
is kept for ever, as its barriers are (a dead member may be redriven weeks later); an
ended one until its expiry. Both operations are logged and fsynced before the reply.
"""
from __future__ import annotations

from typing import Any, TypedDict

from .. import limits
from ..errors import InvalidJob, NotFound
from ..protocol import validate
from . import ops
from .core import (WORKFLOW_ENDS, WORKFLOWS_CANCELLED, WORKFLOWS_FAILED, WORKFLOWS_STARTED, WORKFLOWS_SUCCEEDED,
                   StateCore, WorkflowRecord)

#: What ``put_workflow`` answers.
PUT, KNOWN = "put", "known"
RUNNING = "running"
_ENDED_COUNTER = {"succeeded": WORKFLOWS_SUCCEEDED, "failed": WORKFLOWS_FAILED, "cancelled": WORKFLOWS_CANCELLED}


class WorkflowInfo(TypedDict):
    """What :meth:`WorkflowOps.workflow` says of one record."""
    spec: bytes
    state: str               # "running", "succeeded", "failed" or "cancelled"
    error: str | None
    started_at: float
    ended_at: float | None
    expires_at: float | None


def _wf_id(value: object) -> str:
    if type(value) is not str or not value:
        raise InvalidJob(f"a workflow id must be a non-empty string, got {value!r:.60}")
    if len(value) * 4 > limits.BARRIER_ID_BYTES_MAX and len(value.encode("utf-8", "surrogatepass")) \
            > limits.BARRIER_ID_BYTES_MAX:
        raise InvalidJob(f"a workflow id is at most {limits.BARRIER_ID_BYTES_MAX} bytes (UTF-8)")
    return value


class WorkflowOps(StateCore):
    """Workflow records; a mixin of ShardState (see the module docstring)."""

    def put_workflow(self, wf_id: str, spec: bytes, now: float) -> str:
        """Keep the record of workflow ``wf_id`` (``spec``: bytes, at most
        ``limits.WORKFLOW_SPEC_BYTES_MAX``), running. PUT, or KNOWN if a record of that id
        is kept already (nothing changes: a re-sent put)."""
        self.advance(now)
        wf_id = _wf_id(wf_id)
        if type(spec) is not bytes or len(spec) > limits.WORKFLOW_SPEC_BYTES_MAX:
            raise InvalidJob(f"a workflow record is bytes of at most {limits.WORKFLOW_SPEC_BYTES_MAX} "
                             "(limits.WORKFLOW_SPEC_BYTES_MAX)")
        if wf_id in self.workflows:
            return KNOWN
        self._emit(ops.Workflow(wf_id, spec, now))
        self.workflow_totals[WORKFLOWS_STARTED] += 1
        return PUT

    def _apply_workflow(self, wf_id: str, spec: bytes, started_at: float, state: str | None = None,
                        error: str | None = None, ended_at: float | None = None,
                        expires_at: float | None = None) -> None:
        w = WorkflowRecord(spec, started_at)
        if state is not None:  # from a checkpoint: an ended record
            w.state, w.error, w.ended_at, w.expires_at = state, error, ended_at, expires_at
            if expires_at is not None:
                self._workflow_expires(wf_id, expires_at)
        old = self.workflows.get(wf_id)
        if old is not None:
            self.workflow_counts[old.state or RUNNING] -= 1
        self.workflow_counts[w.state or RUNNING] += 1
        self.workflows[wf_id] = w

    def end_workflow(self, wf_id: str, state: str, error: str | None, ttl_s: float, now: float) -> str:
        """Record how workflow ``wf_id`` ended (``state``: ``"succeeded"``, ``"failed"``
        with the failed step's ``error``, or ``"cancelled"``); the record is then kept
        ``ttl_s`` seconds. Returns the state it has now: a record that ended already keeps
        its first end. NotFound if no record of that id is kept."""
        self.advance(now)
        wf_id = _wf_id(wf_id)
        if state not in WORKFLOW_ENDS:
            raise InvalidJob(f"a workflow ends {', '.join(WORKFLOW_ENDS)}; got {state!r:.40}")
        if error is not None:
            error = _error_text(error)
        ttl = validate.seconds("ttl_s", ttl_s, hi=limits.KEEP_RESULT_S_MAX, positive=True)
        w = self.workflows.get(wf_id)
        if w is None:
            raise NotFound(f"workflow {wf_id!r} not found: never recorded, or ended and expired")
        if w.state is not None:
            return w.state
        self._emit(ops.WorkflowEnd(wf_id, state, error, now, now + ttl))
        self.workflow_totals[_ENDED_COUNTER[state]] += 1
        return state

    def _apply_workflow_end(self, wf_id: str, state: str, error: str | None, ended_at: float,
                            expires_at: float) -> None:
        w = self.workflows.get(wf_id)
        if w is None:  # its record was lost (a salvaged log): the end alone says nothing to show
            return
        self.workflow_counts[w.state or RUNNING] -= 1
        self.workflow_counts[state] += 1
        w.state, w.error, w.ended_at, w.expires_at = state, error, ended_at, expires_at
        self._workflow_expires(wf_id, expires_at)

    def workflow(self, wf_id: str, now: float) -> WorkflowInfo:
        """The record of ``wf_id``; NotFound if none is kept (or it ended and expired)."""
        wf_id = _wf_id(wf_id)
        w = self.workflows.get(wf_id)
        if w is None or (w.expires_at is not None and w.expires_at <= now):
            raise NotFound(f"workflow {wf_id!r} not found: never recorded here, or ended and expired")
        return {"spec": w.spec, "state": w.state or RUNNING, "error": w.error, "started_at": w.started_at,
                "ended_at": w.ended_at, "expires_at": w.expires_at}

    def running_workflows(self, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` (at most ``limits.BATCH_JOBS_MAX``) ids of running workflows, in
        id order, after ``after`` (None: from the first)."""
        limit = validate.count("limit", limit, limits.BATCH_JOBS_MAX)
        if after is not None:
            after = _wf_id(after)
        ids = sorted(wid for wid, w in self.workflows.items() if w.state is None and (after is None or wid > after))
        return ids[:limit]

    def workflow_states(self) -> dict[str, int]:
        """Workflow records kept, by state (running, succeeded, failed, cancelled), as of
        the last ``advance``: counted as records come and go, not by a pass over them."""
        return dict(self.workflow_counts)

    def workflow_checkpoint_ops(self) -> list[tuple[ops.Workflow, int]]:
        """(operation, an upper bound of its encoded size) per record kept, with its end."""
        now = self._now
        return [(ops.Workflow(wid, w.spec, w.started_at, w.state, w.error, w.ended_at, w.expires_at),
                 len(w.spec) + 8 * len(wid) + 4 * len(w.error or "") + 96)
                for wid, w in self.workflows.items() if w.expires_at is None or w.expires_at > now]


def _error_text(value: Any) -> str:
    if type(value) is not str:
        raise InvalidJob(f"error must be a string, got {type(value).__name__}")
    raw = value.encode("utf-8", "replace")
    return raw[:limits.ERROR_TEXT_BYTES_MAX].decode("utf-8", "ignore") if len(raw) > limits.ERROR_TEXT_BYTES_MAX \
        else value
