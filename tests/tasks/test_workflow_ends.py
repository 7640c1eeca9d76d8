"""How a workflow ends, read from states made by hand (no service): what ``result()``
says of each end its jobs cannot tell alone (the workflow's record decides: a dead step
purged, a result gone), a step that reported between two reads (never taken for a
cancelled one), and the same answers from the threaded and the asyncio drivers of the one
reading (``_drive``, ``_adrive``)."""
from __future__ import annotations

import asyncio

import msgpack
import pytest

import shardq
from shardq.client.results import JobResult
from shardq.errors import NotFound
from shardq.tasks.reading import ENDED, RUNNING, verdict
from shardq.tasks.workflow import Step, Workflow, _adrive, _drive

WF = "wf1"
B1 = (0, "wf1.1")
FIRED = {"total": 1, "arrived": 1, "fired_job": 11, "cancelled": False, "missing": []}


class FakeQueue:
    """What a workflow's reading asks of a client, answered from canned states: each
    ``barriers`` call answers the next of ``reads`` (the marker last, never cancelled)."""
    shards = 1

    def __init__(self, reads: list[dict], results: dict[int, str], record: str | None, error: str | None = None):
        self.reads, self.rows, self.record, self.error = list(reads), results, record, error
        self.ended: list[tuple] = []

    def barriers(self, refs):
        states = self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
        return [states.get(tuple(r)) for r in refs]

    def results(self, job_ids, sizes=False):
        return [JobResult(j, self.rows.get(j, "ready"), msgpack.packb(7) if self.rows.get(j) == "succeeded" else None,
                          None, 1, None, None, None) for j in job_ids]

    def end_workflow(self, wf_id, state, error, ttl_s):
        self.ended.append((wf_id, state, error))
        if self.record is None:
            raise NotFound(f"workflow {wf_id!r} not found")
        if self.record == "running":
            self.record, self.error = state, error
        return self.record

    def workflow(self, wf_id):
        return {"state": self.record, "error": self.error}


class AsyncFake:
    def __init__(self, q: FakeQueue):
        self.q, self.shards = q, q.shards

    def __getattr__(self, name):
        method = getattr(self.q, name)

        async def call(*args):
            return method(*args)
        return call


def two_steps(q) -> Workflow:
    """chain(a, b): step a (job 10) reports to barrier B1, which starts b."""
    steps = [Step("t.a", "0.0", None, 0, None, (0, B1[1], 0)), Step("t.b", "0.1", B1, None, None, None)]
    return Workflow(None, WF, steps, [B1], ["0.1"], [10], True, queue=q)


def one_step(q) -> Workflow:
    return Workflow(None, WF, [Step("t.a", "0.0", None, 0, None, None)], [], ["0.0"], [10], True, queue=q)


def poll(wf: Workflow, driver: str):
    if driver == "thread":
        return _drive(wf.queue, wf._poll(1))
    return asyncio.run(_adrive(AsyncFake(wf.queue), wf._poll(1)))


DRIVERS = ["thread", "asyncio"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_step_that_reported_between_the_two_reads_is_not_taken_for_a_cancelled_one(driver):
    # First read: the barrier knows no arrival; then the step reports, is acked (gone), and
    # the results are read. A second read of the barriers sees its report: it runs on.
    q = FakeQueue([{}, {B1: FIRED}], {10: "gone"}, "running")
    assert poll(two_steps(q), driver) == (False, None)
    assert q.ended == []
    # Gone in both reads: it ended, and result() records the end itself.
    q = FakeQueue([{}], {10: "gone"}, "running")
    with pytest.raises(shardq.WorkflowCancelled, match=r"step 0\.0 \(t\.a, job 10\) is gone") as err:
        poll(two_steps(q), driver)
    assert (err.value.step, err.value.job_id, q.record) == ("0.0", 10, "cancelled")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_gone_step_of_a_workflow_recorded_failed_raises_the_recorded_failure(driver):
    # dead, seen dead by the service's watcher (record: failed), then purged
    q = FakeQueue([{}], {10: "gone"}, "failed", "step 0.0 (t.a, job 10) failed: boom")
    with pytest.raises(shardq.JobFailed, match=r"failed: step 0\.0 \(t\.a, job 10\) failed: boom") as err:
        poll(two_steps(q), driver)
    assert (err.value.error, err.value.step, err.value.task) == ("step 0.0 (t.a, job 10) failed: boom", "0.0", "t.a")


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_result_gone_after_the_workflow_succeeded_or_with_no_record_fails_it(driver):
    for record in ("succeeded", None):
        q = FakeQueue([{}], {10: "gone"}, record)
        with pytest.raises(shardq.JobFailed, match=r"cannot be read: step 0\.0 \(t\.a, job 10\): its job and its "
                                                   r"result are gone") as err:
            poll(one_step(q), driver)
        assert err.value.step == "0.0"
    # A middle step gone with no record kept: cancelled, as the watcher would record it.
    with pytest.raises(shardq.WorkflowCancelled):
        poll(two_steps(FakeQueue([{}], {10: "gone"}, None)), driver)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_workflow_that_succeeded_before_it_was_cancelled_keeps_its_value(driver):
    marker = Workflow(None, WF, [], [], [], [], True)._marker(1)
    q = FakeQueue([{marker: {"cancelled": True}}], {10: "succeeded"}, "succeeded")
    assert poll(one_step(q), driver) == (True, 7)
    q = FakeQueue([{marker: {"cancelled": True}}], {10: "succeeded"}, "running")
    with pytest.raises(shardq.WorkflowCancelled, match="wf.cancel"):  # cancelled before the service saw it end
        poll(one_step(q), driver)


def test_the_watcher_reads_the_same_ends():
    assert two_steps(FakeQueue([{}], {10: "ready"}, "running")).outcome() is None
    state, why = two_steps(FakeQueue([{}], {10: "gone"}, "running")).outcome()
    assert state == "cancelled" and why.startswith("step 0.0 (t.a, job 10) is gone")
    assert two_steps(FakeQueue([{B1: FIRED}], {10: "gone", 11: "succeeded"}, "running")).outcome() == \
        ("succeeded", None)
    assert two_steps(FakeQueue([{}], {10: "dead"}, "running")).outcome()[0] == "failed"


def test_a_fanout_gone_before_it_started_its_members_ends_the_workflow():
    # chain(a, group(b, c)): a's barrier starts the fanout job (20), which starts b and c
    steps = [Step("t.a", "0.0", None, 0, None, (0, "wf1.1", 0)),
             Step("shardq.fanout", "0.1", (0, "wf1.1"), None, None, None),
             Step("t.b", "0.1.0", (0, "wf1.2"), None, None, None),
             Step("t.c", "0.1.1", (0, "wf1.3"), None, None, None)]
    barriers = {(0, "wf1.1"): dict(FIRED, fired_job=20), (0, "wf1.2"): dict(FIRED, fired_job=21),
                (0, "wf1.3"): None}
    jobs = [10, 20, 21, None]
    rows = {20: JobResult(20, "gone", None, None, None, None, None, None)}
    v = verdict(steps, jobs, rows, barriers, ["0.1.0", "0.1.1"], False)
    assert v.state == ENDED and v.step.path == "0.1" and v.recheck
    barriers[(0, "wf1.3")] = dict(FIRED, fired_job=22)
    assert verdict(steps, jobs, rows, barriers, ["0.1.0", "0.1.1"], False).state == RUNNING


def test_a_gone_member_past_the_missing_ones_a_barrier_lists_is_not_taken_for_a_cancelled_one():
    # A chord of 30: the barrier lists its first 20 missing indexes (0..19); member 25 is
    # gone (it arrived and was acked), as a look at every step (status) reads it.
    steps = [Step("t.m", f"0.0.{i}", None, i, None, (0, "wf1.1", i)) for i in range(30)]
    steps.append(Step("t.cb", "0.1", (0, "wf1.1"), None, None, None))
    barrier = {"total": 30, "arrived": 9, "fired_job": None, "cancelled": False, "missing": list(range(20))}
    jobs = list(range(100, 130)) + [None]
    rows = {125: JobResult(125, "gone", None, None, None, None, None, None)}
    assert verdict(steps, jobs, rows, {(0, "wf1.1"): barrier}, ["0.1"], False).state == RUNNING
    rows[103] = JobResult(103, "gone", None, None, None, None, None, None)  # listed missing, and gone
    v = verdict(steps, jobs, rows, {(0, "wf1.1"): barrier}, ["0.1"], False)
    assert v.state == ENDED and v.step.path == "0.0.3" and v.job_id == 103
