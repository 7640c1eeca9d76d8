"""What the tasks layer asks of its client, decided by the declared contracts
(shardq/client/contracts.py), without a service: results and workflows need a client that
offers ``Results`` (else ``Unsupported`` and nothing is sent), a step that keeps or reports
its result needs a worker whose jobs get ``JobCalls`` (else the job fails with the reason),
and ``Workflow.load`` takes an app or a ``Results`` client. tests/backends/test_sqs_backend.py
checks the same refusals on the SQS backend."""
from __future__ import annotations

import pytest

import shardq
from shardq.client.contracts import Results
from shardq.clock import SystemClock
from shardq.consumer.worker import Worker
from shardq.errors import NotFound, Unsupported
from shardq.tasks.dispatch import TaskHandler
from shardq.tasks.workflow import Workflow

from support.fakes import DEAD, BuryingQueue, PlainQueue
from support.task_apps import make_app


def test_results_and_workflows_on_a_client_without_them_are_refused_and_nothing_is_sent():
    q = PlainQueue(SystemClock())
    app, kept, plain = make_app(q)
    with pytest.raises(Unsupported, match="PlainQueue keeps none"):
        kept.send()
    with pytest.raises(Unsupported, match="PlainQueue keeps no results"):
        shardq.chain(plain.s(), plain.s()).send()
    with pytest.raises(Unsupported, match="PlainQueue keeps none"):
        app.status(1)
    with pytest.raises(Unsupported, match="PlainQueue keeps no workflow records"):
        Workflow.load(app, "wf1")
    assert q.jobs == {}  # nothing was sent


@pytest.mark.parametrize("cls, client", [(BuryingQueue, True), (PlainQueue, False)])
def test_a_step_that_keeps_its_result_fails_with_the_reason_on_a_worker_that_gives_it_no_client(cls, client):
    q = cls(SystemClock())
    app, kept, _ = make_app(q)
    job_id = q.enqueue(kept.job((), {})["body"])
    Worker(q, TaskHandler(app.tasks), poll_s=0.005, idle_wait_s=0.01, concurrency=1).run(max_jobs=1)
    if client:  # the result goes with the ack (FakeQueue's settle_many)
        assert [r.op for _, r in q.reported] == ["put_result"] and q.ops("bury") == []
    else:
        assert q.state(job_id) == DEAD and q.reported == []
        assert "needs a worker in thread or asyncio mode" in q.ops("bury")[0][2]


def results_client(workflow):
    """A client offering Results whose ``workflow`` call is ``workflow`` (the rest unused)."""
    def unused(self, *args, **kwargs):
        raise AssertionError("not asked")
    names = {n for n, v in vars(Results).items() if callable(v) and not n.startswith("_")}
    cls = type("Records", (), {**{n: unused for n in names}, "workflow": lambda self, wf_id: workflow(wf_id)})
    return cls()


def test_workflow_load_takes_a_results_client_or_an_app():
    def gone(wf_id):
        raise NotFound(f"workflow {wf_id!r} not found")
    q = results_client(gone)
    assert isinstance(q, Results)
    with pytest.raises(NotFound, match="wf1"):  # a client: asked directly
        Workflow.load(q, "wf1")
    with pytest.raises(NotFound, match="wf2"):  # an app: its queue is asked
        Workflow.load(make_app(q)[0], "wf2")


def test_the_calls_a_workflow_reading_yields_are_methods_of_both_results_contracts():
    """The reading is driven by name (``getattr(q, call)``); mypy checks each yielded name
    is a ReadCall, this that each ReadCall is a call of the Results contracts."""
    from typing import get_args

    from shardq.client.contracts import AsyncResults
    from shardq.tasks.workflow import ReadCall

    def methods(proto) -> set[str]:
        return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    assert set(get_args(ReadCall)) <= methods(Results) & methods(AsyncResults)
    assert len(get_args(ReadCall)) == 4
