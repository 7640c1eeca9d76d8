"""Results and workflows in the Prometheus metrics (issue 34; docs/operations.md, "Metrics"):
what each shard keeps now (``shardq_results_kept``, ``shardq_workflow_barriers{state}``,
``shardq_workflows{state}``) and what it did since it started (``shardq_results_stored_total``,
``shardq_workflow_barriers_fired_total``, ``shardq_workflow_barriers_cancelled_total``,
``shardq_workflows_{started,succeeded,failed,cancelled}_total``),
scraped from the HTTP listener of an embedded service after a small chord ran and a
chain was cancelled. Then the counters in the pure state: counted on the live path only,
so a repeat counts nothing and replaying the log counts nothing again."""
from __future__ import annotations

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardq import chain, chord, group
from shardq.shard.state import ShardState

from conftest import config_from
from support.http_calls import request
from support.task_apps import embedded_with_http
from support.service import wait_until

TOKEN = "workflow-metrics-token-0123456789"
T0 = 1_000_000.0
CALLBACK = [b"callback-body", None, "default", 0, 0]


@pytest.fixture(scope="module")
def app():
    with embedded_with_http(TOKEN, {"queues": {"default": {}, "idle": {}}}) as a:
        yield a


def scrape(app) -> dict:
    """{(name, ((label, value), ...)): value} of every sample of one scrape."""
    status, _, data = request(app.url, "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, data[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(data.decode()) for s in fam.samples}


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def shards_of(samples: dict, name: str) -> set[str]:
    return {dict(ls)["shard"] for n, ls in samples if n == name}


def test_a_chord_and_a_cancelled_chain_show_in_the_metrics(app):
    before = scrape(app)
    for name in ("shardq_results_kept", "shardq_results_stored_total", "shardq_workflow_barriers_fired_total",
                 "shardq_workflow_barriers_cancelled_total"):
        assert total(before, name) == 0 and shards_of(before, name) == {"0", "1"}, name
    for state in ("open", "fired", "cancelled"):
        assert total(before, "shardq_workflow_barriers", state=state) == 0

    @app.task(key=lambda d: f"doc-{d}", keep_result=3600)
    def score(ctx, d: int) -> int:
        return d * d

    @app.task
    def summarize(ctx, results: list) -> int:
        return sum(results)

    @app.task(queue="idle")
    def never(ctx, x: int = 0) -> int:
        return x

    members = 4
    wf = chord(group(score.s(d) for d in range(members)), summarize.s()).send()
    # half run: its member on queue idle (which nobody runs) never arrives, so its barrier stays open
    waiting = chord(group(score.s(members), never.s(2)), never.s()).send()
    app.run_worker("default", idle_wait_s=0.05, poll_s=0.01)
    assert wf.result(timeout=10) == sum(d * d for d in range(members))
    stopped = chain(never.s(1), never.s()).send()
    assert len(wf.barriers) == len(waiting.barriers) == len(stopped.barriers) == 1
    stopped.cancel()

    m = scrape(app)
    # every member that ran (their task keeps results) and the callback (a workflow's last step) kept theirs
    assert total(m, "shardq_results_kept") == members + 2
    assert total(m, "shardq_results_stored_total") == members + 2
    assert total(m, "shardq_workflow_barriers_fired_total") == 1  # the callback, enqueued once
    # wf.cancel() cancels each barrier not fired, and the workflow's marker (tasks/workflow.py)
    assert total(m, "shardq_workflow_barriers_cancelled_total") == 2
    assert total(m, "shardq_workflow_barriers", state="open") == 1  # the chord half run
    assert total(m, "shardq_workflow_barriers", state="fired") == 1
    assert total(m, "shardq_workflow_barriers", state="cancelled") == 2
    [(shard, _)] = wf.barriers
    assert total(m, "shardq_workflow_barriers_fired_total", shard=str(shard)) == 1
    waiting.cancel()
    after = scrape(app)
    assert total(after, "shardq_workflow_barriers", state="open") == 0
    assert total(after, "shardq_workflow_barriers", state="cancelled") == 4
    assert total(after, "shardq_workflow_barriers_cancelled_total") == 4

    # Whole workflows: three sent, two cancelled at once by wf.cancel(); the chord that ran
    # is recorded succeeded by the service's watcher within a few seconds.
    assert total(after, "shardq_workflows_started_total") == 3
    assert total(after, "shardq_workflows_cancelled_total") == 2
    assert total(after, "shardq_workflows", state="cancelled") == 2
    wait_until(lambda: total(scrape(app), "shardq_workflows_succeeded_total") == 1, 30, 0.1,
               "the watcher recording the chord succeeded")
    last = scrape(app)
    assert total(last, "shardq_workflows", state="succeeded") == 1
    assert total(last, "shardq_workflows", state="running") == 0
    assert total(last, "shardq_workflows_failed_total") == 0
    assert shards_of(last, "shardq_workflows_started_total") == {"0", "1"}


# ---------------------------------------------------------------------------- the counters
def test_the_counters_count_the_live_path_once_and_replay_counts_nothing():
    state = ShardState(0, config_from())
    log: list = []

    def run(name: str, *args):
        try:
            return getattr(state, name)(*args, T0)
        finally:
            log.extend(msgpack.unpackb(msgpack.packb(state.take_ops()), raw=False))

    [job_id] = run("enqueue_many", [(b"job", None, "default", 0, 0, None)])
    [lease] = state.dequeue("default", T0, None, 1)
    log.extend(msgpack.unpackb(msgpack.packb(state.take_ops()), raw=False))
    run("put_result", job_id, lease.token, b"\x01", 60)
    run("put_result", job_id, lease.token, b"\x02", 60)  # stored again: counted again
    assert run("arrive", "b1", 0, 2, b"\x01", 60, CALLBACK) == "counted"
    assert run("arrive", "b1", 0, 2, b"\x01", 60, CALLBACK) == "repeated"
    assert run("arrive", "b1", 1, 2, b"\x02", 60, CALLBACK) == "fired"
    assert run("arrive", "b1", 1, 2, b"\x02", 60, CALLBACK) == "repeated"
    assert run("cancel_barrier", "b1", 60) == "fired"  # too late: not a cancel
    assert run("cancel_barrier", "b2", 60) == "cancelled"
    assert run("cancel_barrier", "b2", 60) == "cancelled"  # already: not counted again
    assert run("put_workflow", "wf1", b"spec") == "put"
    assert run("put_workflow", "wf1", b"spec") == "known"  # a re-sent put: not counted again
    assert run("end_workflow", "wf1", "failed", "boom", 60) == "failed"
    assert run("end_workflow", "wf1", "succeeded", None, 60) == "failed"  # its first end kept: not counted
    want = {"results_stored": 2, "barriers_fired": 1, "barriers_cancelled": 1, "workflows_started": 1,
            "workflows_succeeded": 0, "workflows_failed": 1, "workflows_cancelled": 0}
    assert state.workflow_counters() == want
    assert state.workflow_stats() == {"results": 1, "barriers": {"open": 0, "fired": 1, "cancelled": 1}}

    replayed = ShardState(0, config_from())
    replayed.replay([log])
    assert replayed.workflow_stats() == state.workflow_stats()  # what is kept is logged ...
    assert replayed.workflow_counters() == dict.fromkeys(want, 0)  # ... what was done is not
    assert replayed.workflow_states() == state.workflow_states() == {
        "running": 0, "succeeded": 0, "failed": 1, "cancelled": 0}
