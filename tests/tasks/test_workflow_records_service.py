"""Workflow records (docs/design.md, "Workflow records"), with an embedded service and its
watcher: each sent workflow is recorded on its home shard and loadable by id from another
client; the watcher records how it ended (succeeded, failed with the failed step, or
cancelled by ``wf.cancel()``); the shards count them (stats, metrics)."""
from __future__ import annotations

import zlib

import msgpack
import pytest

import shardq
from shardq import chain, chord, group
from shardq.tasks.workflow import Step, Workflow, from_spec, spec_of

from support.task_apps import drain
from support.service import wait_until

SHARDS = 2


@pytest.fixture(scope="module")
def app():
    a = shardq.App.embedded(shards=SHARDS, config={"queue_defaults": {"max_deliveries": 1}})
    yield a
    a.close()


def ended(app, wf_id: str) -> dict:
    """The workflow's record once the watcher recorded its end."""
    wait_until(lambda: app.queue.workflow(wf_id)["state"] != "running", 30, 0.05,
               f"the watcher recording how {wf_id} ended")
    return app.queue.workflow(wf_id)


def totals(app) -> dict[str, int]:
    out: dict[str, int] = {}
    for sh in app.queue.shard_metrics():
        for key, value in (sh.get("workflow_counters") or {}).items():
            if key.startswith("workflows_"):
                out[key] = out.get(key, 0) + value
    return out


def test_records_say_how_each_workflow_ended_and_the_shards_count_them(app):
    @app.task
    def add(ctx, x: int, y: int) -> int:
        return x + y

    @app.task
    def total(ctx, values: list) -> int:
        return sum(values)

    @app.task
    def broken(ctx, x: int) -> int:
        raise shardq.Fail(f"no such account {x}")

    before = totals(app)
    ok = chord(group(add.s(i, i) for i in range(5)), total.s()).send()
    bad = chain(add.s(1, 2), broken.s(), total.s()).send()
    stop = chain(add.s(3, 4), total.s()).send()
    for wf in (ok, bad, stop):
        assert app.queue.workflow(wf.id)["state"] == "running"
    assert stop.cancel()["barriers_cancelled"] == 1
    assert app.queue.workflow(stop.id)["state"] == "cancelled"  # wf.cancel() ends it at once

    # Another client loads a workflow by its id and reads the same steps.
    with shardq.connect(app.queue.data_dir) as other:
        loaded = Workflow.load(other, ok.id)
        assert [s.path for s in loaded.steps] == [s.path for s in ok.steps]
        assert loaded.status() == ok.status()

    drain(app)
    assert ok.result(timeout=10) == 20
    assert ended(app, ok.id)["state"] == "succeeded"
    record = ended(app, bad.id)
    assert record["state"] == "failed" and record["ended_at"] >= record["started_at"]
    assert record["error"].startswith("step 0.1 (") and "no such account 3" in record["error"]
    assert record["expires_at"] == pytest.approx(record["ended_at"] + 86400.0)
    assert Workflow.load(app, bad.id).outcome()[0] == "failed"

    after = totals(app)
    for key, more in (("workflows_started", 3), ("workflows_succeeded", 1), ("workflows_failed", 1),
                      ("workflows_cancelled", 1)):
        assert after.get(key, 0) - before.get(key, 0) == more, key
    kept = {}
    for sh in app.queue.stats()["shards"].values() if isinstance(app.queue.stats()["shards"], dict) else []:
        for state, n in (sh.get("workflows") or {}).items():
            kept[state] = kept.get(state, 0) + n
    if kept:
        assert kept["succeeded"] >= 1 and kept["failed"] >= 1 and kept["cancelled"] >= 1


def test_an_unknown_workflow_is_not_found(app):
    with pytest.raises(shardq.NotFound, match="never recorded"):
        Workflow.load(app, "nosuchworkflow")


@pytest.mark.parametrize("spec, match", [
    (b"not zlib", "cannot read"),
    (zlib.compress(msgpack.packb([2, [], [], [], [], True])), "format 2"),
    (zlib.compress(msgpack.packb([1, [[5, "0.0", None, 0, None]], [], ["0.0"], [7], True])), "malformed"),
    (zlib.compress(msgpack.packb([1, [["t", "0.0", [0, "b", 1], None, None]], [], ["0.0"], [], True])), "malformed"),
    (zlib.compress(msgpack.packb([1, [["t", "0.0", None, 0, None]], [[0, 5]], ["0.0"], [7], True])), "malformed"),
    (zlib.compress(msgpack.packb([1, [["t", "0.0", None, 0, None]], [], ["0.0"], [-1], True])), "malformed"),
])
def test_a_record_this_version_cannot_read_is_refused_with_invalid_job(spec, match):
    with pytest.raises(shardq.InvalidJob, match=match):
        from_spec(spec)


def test_a_record_reads_back_as_it_was_written():
    steps = [Step("t.a", "0.0", None, 0, None, (1, "w.1", 0)), Step("t.b", "0.1", (1, "w.1"), None, None, None)]
    spec = spec_of(steps, [(1, "w.1")], ["0.1"], [5120], True)
    assert from_spec(spec) == (steps, [(1, "w.1")], ["0.1"], [5120], True)
