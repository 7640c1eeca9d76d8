"""Reading a workflow: what its steps' jobs, their results and its barriers say (pure: no
I/O, nothing but what it is given). :class:`~shardq.tasks.workflow.Workflow` asks the
shards, and reads their answers here.

* ``step_jobs``: each step's job id, from the first batch or the barrier that enqueued it;
* ``watched``: the jobs ``result()`` looks at (never every member of a large chord);
* ``verdict``: how the workflow stands: running, succeeded, failed, or ended otherwise
  (cancelled, a step gone before it reported, a result gone: docs/workflows.md, "How a
  workflow ends");
* ``status_rows``: the rows of ``Workflow.status()``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .workflow import Step

#: The internal task that starts a group that follows a step (tasks/workflow.py).
FANOUT = "shardq.fanout"
#: Members watched per barrier no member has arrived at yet (``watched``): as many as a
#: shard lists of a known barrier's missing members.
UNSEEN_WATCHED = 20
#: barrier (shard, id) -> its state as the shard lists it (None: not known there)
Barriers = dict[tuple[int, str], dict[str, Any] | None]


def step_jobs(steps: list[Step], first_ids: list[int], barriers: Barriers) -> list[int | None]:
    """Each step's job id: from the first batch, or the callback its barrier fired (None:
    not enqueued yet)."""
    out: list[int | None] = []
    for step in steps:
        if step.barrier is None:
            out.append(first_ids[step.index] if step.index is not None else None)
        else:
            state = barriers.get(step.barrier)
            out.append(state.get("fired_job") if state else None)
    return out


# What a look says of a workflow (``verdict``), from its jobs, results and barriers alone.
# ENDED: it will never finish, and its record says how it ended (``Workflow._answer``): a
# dead step purged reads, from the jobs alone, as a cancelled one.
RUNNING, SUCCEEDED, FAILED, ENDED = "running", "succeeded", "failed", "ended"


class Verdict(NamedTuple):
    """How a workflow stands (``verdict``). ``step`` and ``job_id`` name the step it failed
    or stopped at, and ``why`` says so in a sentence that names it (``error``: a dead
    step's last error); ``values``: the final steps' values (msgpack; None where only sizes
    were read) once every one succeeded; ``lost``: ENDED by a final step whose result is
    gone; ``recheck``: ENDED by a step gone before its report counted, as barriers read
    before the results say (a step reports before its ack: a fresh read confirms it)."""
    state: str
    step: Step | None = None
    job_id: int | None = None
    why: str | None = None
    error: str | None = None
    values: list[Any] | None = None
    lost: bool = False
    recheck: bool = False


def _named(step: Step, job_id: int | None) -> str:
    return f"step {step.path} ({step.task}" + ("" if job_id is None else f", job {job_id}") + ")"


def verdict(steps: list[Step], jobs: list[int | None], results: dict[int, Any],
            barriers: Barriers, finals: list[str], cancelled: bool) -> Verdict:
    """How the workflow stands; the first that holds: FAILED (a step dead-lettered); ENDED
    by ``wf.cancel()`` (``cancelled``: its marker says so); SUCCEEDED (every final step's
    result kept); ENDED by a barrier cancelled before it started its step, by a step whose
    job is gone before its value reached its barrier (a group's fanout job: before it
    started every member), or by a final step whose job and result are both gone; else
    RUNNING. A step whose result was not read counts as running."""
    for step, job_id in zip(steps, jobs):
        r = results.get(job_id) if job_id is not None else None
        if r is not None and r.state == "dead":
            return Verdict(FAILED, step, job_id, f"{_named(step, job_id)} failed: {r.error}", r.error)
    by_path = {step.path: job_id for step, job_id in zip(steps, jobs)}
    kept = [results.get(j) for j in (by_path.get(p) for p in finals) if j is not None]
    done = len(kept) == len(finals) and all(r is not None and r.state == "succeeded" for r in kept)
    values = [r.value for r in kept if r is not None] if done else None
    final = set(finals)
    if cancelled:
        at, at_job, what = _stopped_at(steps, jobs, results, barriers, final)
        why = "the workflow was cancelled (wf.cancel())"
        return Verdict(ENDED, at, at_job, why if at is None else f"{_named(at, at_job)} {what}: {why}",
                       values=values)
    if values is not None:
        return Verdict(SUCCEEDED, values=values)
    for step, job_id in zip(steps, jobs):
        b = barriers.get(step.barrier) if step.barrier is not None and job_id is None else None
        if b and b.get("cancelled"):
            return Verdict(ENDED, step, None, f"{_named(step, None)} not started: the barrier that starts it was "
                           "cancelled (wf.cancel())")
    for step, job_id in zip(steps, jobs):
        r = results.get(job_id) if job_id is not None else None
        if r is None or r.state != "gone":
            continue
        if step.path in final:
            return Verdict(ENDED, step, job_id, f"{_named(step, job_id)}: its job and its result are gone (its job "
                           "cancelled, e.g. by shardq job cancel, or purged; or its result expired)", lost=True)
        if step.reports is not None and _not_arrived(step.reports, barriers):
            return Verdict(ENDED, step, job_id, f"{_named(step, job_id)} is gone before its value reached the next "
                           "step: its job was cancelled (shardq job cancel) or purged from the dead letters",
                           recheck=True)
        if step.task == FANOUT and not all((barriers.get(b) or {}).get("fired_job") is not None
                                           for b in _spawned(steps, step)):
            return Verdict(ENDED, step, job_id, f"{_named(step, job_id)} is gone before it started every member of "
                           "its group: its job was cancelled (shardq job cancel) or purged from the dead letters",
                           recheck=True)
    return Verdict(RUNNING)


def _stopped_at(steps: list[Step], jobs: list[int | None], results: dict[int, Any],
                barriers: Barriers, final: set[str]) -> tuple[Step | None, int | None, str]:
    """The step a cancelled workflow stopped at: the first whose result was read and is
    neither kept nor counted by its barrier (running, or cancelled), else the first not
    enqueued; and what became of it."""
    for step, job_id in zip(steps, jobs):
        r = results.get(job_id) if job_id is not None else None
        if r is None or r.state == "succeeded":
            continue
        if r.state != "gone":
            return step, job_id, "not finished"
        if step.path in final or (step.reports is not None and _reported_state(step.reports, barriers) != "succeeded"):
            return step, job_id, "cancelled"
    for step, job_id in zip(steps, jobs):
        if job_id is None:
            return step, None, "not started"
    return None, None, ""


def _not_arrived(reports: tuple[int, str, int], barriers: Barriers) -> bool:
    """Whether the barrier a step reports to shows that the step has not arrived: it knows
    no arrival at all, or lists the step's index among its missing ones (only the first
    are listed: an index past them is not known to be missing)."""
    shard, bid, index = reports
    b = barriers.get((shard, bid))
    return b is None or (b.get("fired_job") is None and not b.get("cancelled") and index in (b.get("missing") or []))


def _spawned(steps: list[Step], fanout: Step) -> list[tuple[int, str]]:
    """The barriers a group's fanout job arrives at: those that start its members (member
    ``j`` is the step at ``<path>.j``, or, for a chain, ``<path>.j.0``)."""
    out = []
    for step in steps:
        if step.barrier is not None and step.path.startswith(fanout.path + "."):
            extra = step.path.count(".") - fanout.path.count(".")
            if extra == 1 or (extra == 2 and step.path.endswith(".0")):
                out.append(step.barrier)
    return out


def status_rows(steps: list[Step], jobs: list[int | None], results: dict[int, Any],
                barriers: Barriers) -> list[dict[str, Any]]:
    """One row per step: what ``Workflow.status()`` returns."""
    rows = []
    for step, job_id in zip(steps, jobs):
        row: dict[str, Any] = {"step": step.path, "task": step.task, "job_id": job_id}
        r = results.get(job_id) if job_id is not None else None
        if r is not None:
            state = r.state
            if state == "gone" and step.reports is not None:
                state = _reported_state(step.reports, barriers)
            elif state == "gone" and step.task == FANOUT:
                state = _fanout_state(steps, step, barriers)
            row.update(state=state, attempts=r.attempts, progress=r.fraction, note=r.note, error=r.error,
                       result_bytes=r.value_bytes)
        else:
            b = barriers.get(step.barrier) if step.barrier is not None else None
            state = "cancelled" if b and b.get("cancelled") else "pending"
            row.update(state=state, attempts=0, progress=None, note=None, error=None, result_bytes=None)
            if b is not None:
                row.update(arrived=b.get("arrived"), total=b.get("total"))
        rows.append(row)
    return rows


def _fanout_state(steps: list[Step], fanout: Step, barriers: Barriers) -> str:
    """The state of a group's fanout job once it is gone (it keeps no result): ``succeeded``
    if it started every member (each member's barrier fired), ``cancelled`` if one of those
    barriers was cancelled, else ``gone`` (cancelled or purged before it started them all)."""
    started = [barriers.get(b) for b in _spawned(steps, fanout)]
    if started and all(b and b.get("fired_job") is not None for b in started):
        return "succeeded"
    if any(b and b.get("cancelled") for b in started):
        return "cancelled"
    return "gone"


def _reported_state(reports: tuple[int, str, int], barriers: Barriers) -> str:
    """The state of a step whose job is gone and whose value went to a barrier, not kept:
    ``succeeded`` if the barrier counted it, ``cancelled`` if the barrier was cancelled,
    else ``gone`` (cancelled or purged before it arrived)."""
    shard, bid, index = reports
    b = barriers.get((shard, bid))
    if not b:
        return "gone"
    if b.get("cancelled"):
        return "cancelled"
    if b.get("fired_job") is not None:
        return "succeeded"
    missing = b.get("missing") or []
    if index in missing:
        return "gone"
    # the barrier lists its first missing indexes only: below the last one listed (or with
    # fewer than all listed) an index not listed has arrived
    shown_all = b.get("total", 0) - b.get("arrived", 0) == len(missing)
    return "succeeded" if shown_all or (missing and index < missing[-1]) else "gone"


def watched(steps: list[Step], jobs: list[int | None], barriers: Barriers,
            finals: list[str]) -> list[int]:
    """The jobs ``result()`` looks at: the final steps (their values), the fanout jobs, and
    the members a barrier is still missing (the first it lists: a dead one is among them,
    or will be once the others arrived). Never all of a large chord's members at each look."""
    missing: set[tuple[int, str, int]] = set()
    for (shard, bid), b in barriers.items():
        if b and b.get("fired_job") is None and not b.get("cancelled"):
            missing.update((shard, bid, i) for i in b.get("missing") or [])
    # A barrier no member has arrived at yet is unknown to its shard: its first members
    # enqueued are watched as a known one's first missing would be (a chain step that
    # died before its barrier ever saw an arrival is one of them).
    unseen: dict[tuple[int, str], list[int]] = {}
    for step, job_id in zip(steps, jobs):
        if step.reports is not None and job_id is not None and barriers.get(step.reports[:2]) is None:
            unseen.setdefault(step.reports[:2], []).append(step.reports[2])
    for (shard, bid), indexes in unseen.items():
        missing.update((shard, bid, i) for i in sorted(indexes)[:UNSEEN_WATCHED])
    final = set(finals)
    return [job_id for step, job_id in zip(steps, jobs)
            if job_id is not None and (step.path in final or step.task == FANOUT or step.reports in missing)]
