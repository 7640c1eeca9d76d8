"""What a new user meets at the ends of the task and workflow paths (review u1): a later
step's options checked before anything is sent, ``result()`` recording a failure it reads,
a group's fan-out step shown as it ended, timeouts that are not numbers, arguments that
are not UTF-8, ids out of range, ``@app.periodic`` on a task that needs arguments, and
``retries`` at its largest. Against an embedded service (2 shards) where the service is
needed; nothing sleeps to synchronise."""
from __future__ import annotations

import asyncio
import gc
import math
import os
import warnings

import msgpack
import pytest

import shardq
from shardq import chain, group
from shardq.cli import exits
from shardq.cli.main import main
from shardq.client.results import JobResult
from shardq.clock import FakeClock
from shardq.config import load as load_config
from shardq.tasks.app import RETRIES_MAX
from shardq.tasks.reading import FANOUT, status_rows
from shardq.tasks.runner import check_retries
from shardq.tasks.workflow import Signature, Step, Workflow, _adrive, _drive, describe

from support.task_apps import drain, fresh_tasks, jobs_held

SMALL_BODY = 300  # queue "small"'s max_body_bytes


@pytest.fixture(scope="module")
def app():
    a = shardq.App.embedded(shards=2, config={"queue_defaults": {"max_deliveries": 2},
                                              "queues": {"small": {"max_body_bytes": SMALL_BODY}}})
    yield a
    a.close()


@pytest.fixture
def fresh(app):
    with fresh_tasks(app) as a:
        yield a


# ---------------------------------------------------------------------------- 1: a later step's options
@pytest.mark.parametrize("options, refusal", [
    ({"delay": -1}, "delay must be"), ({"delay": 1e12}, "delay must be"), ({"delay": math.nan}, "delay must be"),
    ({"priority": 2**40}, "priority must be"), ({"priority": 1.5}, "priority must be")])
def test_a_steps_delay_and_priority_are_checked_at_set_as_send_with_checks_them(fresh, options, refusal):
    @fresh.task
    def receipt(ctx, cents: int) -> str:
        return f"charged {cents}"

    with pytest.raises(shardq.InvalidJob, match=refusal):
        receipt.send_with(**options)(5)
    with pytest.raises(shardq.InvalidJob, match=refusal):
        receipt.s().set(**options)


def test_every_steps_job_is_checked_at_send_and_a_refused_workflow_sends_nothing(fresh):
    charged: list[int] = []

    @fresh.task
    def charge(ctx, cents: int) -> int:
        charged.append(cents)
        return cents

    @fresh.task
    def receipt(ctx, cents: int, note: str = "") -> str:
        return f"charged {cents}"

    @fresh.task(key=lambda cents, **_: "")
    def keyed(ctx, cents: int) -> str:
        return "k"

    @fresh.task(queue="small")
    def small(ctx, cents: int, note: str = "") -> str:
        return note

    bad = [(Signature(receipt, delay=-1), "delay must be"),          # made without .set()
           (Signature(receipt, priority=2**40), "priority must be"),
           (keyed.s(), "key must not be empty"),
           (small.s("x" * SMALL_BODY), f"over the max_body_bytes of queue 'small' \\({SMALL_BODY}\\)")]
    for later, refusal in bad:
        for shape in (lambda s: chain(charge.s(500), s), lambda s: chain(charge.s(500), group(s, receipt.s())),
                      lambda s: chain(charge.s(500), receipt.s(), s)):
            with pytest.raises(shardq.InvalidJob, match=refusal) as err:
                shape(later).send()
            assert str(err.value).startswith("step 0.")  # names the step
    assert jobs_held(fresh) == 0  # nothing was sent
    # What fits runs, and the step before it runs once.
    wf = chain(charge.s(500), receipt.s().set(delay=0, priority=5), small.s("x" * 10)).send()
    drain(fresh)
    drain(fresh, "small")
    assert wf.result(timeout=10) == "x" * 10 and charged == [500]


# ---------------------------------------------------------------------------- 4: result() records a failure
class RecordingQueue:
    """A workflow's client answered from canned states: step 0.0 (job 10) dead; the record
    keeps its first end, as the service does."""
    shards = 1

    def __init__(self, record: str | None = "running"):
        self.record, self.ended = record, []

    def barriers(self, refs):
        return [None for _ in refs]

    def results(self, job_ids, sizes=False):
        return [JobResult(j, "dead" if j == 10 else "ready", None, "Fail: no" if j == 10 else None, 1, None,
                          None, None) for j in job_ids]

    def end_workflow(self, wf_id, state, error, ttl_s):
        self.ended.append((wf_id, state))
        if self.record is None:
            raise shardq.NotFound(f"workflow {wf_id!r} not found")
        if self.record == "running":
            self.record = state
        return self.record


class AsyncOf:
    def __init__(self, q):
        self.q, self.shards = q, q.shards

    def __getattr__(self, name):
        method = getattr(self.q, name)

        async def call(*args):
            return method(*args)
        return call


def two_steps(q) -> Workflow:
    steps = [Step("t.a", "0.0", None, 0, None, (0, "wf1.1", 0)), Step("t.b", "0.1", (0, "wf1.1"), None, None, None)]
    return Workflow(None, "wf1", steps, [(0, "wf1.1")], ["0.1"], [10], True, queue=q)


@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_result_records_a_failed_end_it_reads_before_it_raises(driver):
    def poll(q):
        wf = two_steps(q)
        if driver == "thread":
            return _drive(q, wf._poll(1))
        return asyncio.run(_adrive(AsyncOf(q), wf._poll(1)))

    q = RecordingQueue("running")
    with pytest.raises(shardq.JobFailed, match=r"step 0\.0 \(t\.a, job 10\) failed: Fail: no") as err:
        poll(q)
    assert (err.value.step, q.ended, q.record) == ("0.0", [("wf1", "failed")], "failed")
    for record in ("cancelled", None):  # an end recorded first is kept; no record: JobFailed all the same
        q = RecordingQueue(record)
        with pytest.raises(shardq.JobFailed):
            poll(q)
        assert q.ended == [("wf1", "failed")] and q.record == record


def test_a_failed_workflow_is_recorded_failed_by_result_and_keeps_it_after_a_redrive(fresh):
    fail = [True]

    @fresh.task
    def first(ctx) -> int:
        return 1

    @fresh.task
    def second(ctx, x: int) -> int:
        if fail[0]:
            raise shardq.Fail("not yet")
        return x + 1

    wf = chain(first.s(), second.s()).send()
    drain(fresh)
    with pytest.raises(shardq.JobFailed) as err:
        wf.result(timeout=10)
    assert fresh.queue.workflow(wf.id)["state"] == "failed"  # at once, not when the watcher looks
    fail[0] = False
    assert fresh.queue.redrive("default", job_ids=[err.value.job_id]) == 1
    drain(fresh)
    assert wf.result(timeout=10) == 2
    assert fresh.queue.workflow(wf.id)["state"] == "failed"  # its first end


# ---------------------------------------------------------------------------- 5: the fan-out step
def test_a_group_after_a_step_lists_its_fanout_step_as_succeeded(fresh):
    @fresh.task
    def a(ctx) -> int:
        return 2

    @fresh.task
    def b(ctx, x: int) -> int:
        return x * 10

    @fresh.task
    def c(ctx, x: int) -> int:
        return x * 100

    @fresh.task
    def d(ctx, xs: list) -> list:
        return xs

    wf = chain(a.s(), group(b.s(), c.s()), d.s()).send()
    drain(fresh)
    assert wf.result(timeout=10) == [20, 200]
    rows = wf.status()
    assert [(r["step"], r["task"] == FANOUT, r["state"]) for r in rows] == [
        ("0.0", False, "succeeded"), ("0.1", True, "succeeded"), ("0.1.0", False, "succeeded"),
        ("0.1.1", False, "succeeded"), ("0.2", False, "succeeded")]
    assert describe(fresh.queue, wf.id)["steps_by_state"] == {"succeeded": 5}


def test_a_gone_fanout_step_reads_as_what_became_of_its_members_barriers():
    steps = [Step("t.a", "0.0", None, 0, None, (0, "wf1.1", 0)), Step(FANOUT, "0.1", (0, "wf1.1"), None, None, None),
             Step("t.b", "0.1.0", (0, "wf1.2"), None, None, None), Step("t.c", "0.1.1", (0, "wf1.3"), None, None, None)]
    fired = {"total": 1, "arrived": 1, "fired_job": 21, "cancelled": False, "missing": []}
    gone = {20: JobResult(20, "gone", None, None, None, None, None, None)}

    def fanout_state(b2, b3):
        barriers = {(0, "wf1.1"): dict(fired, fired_job=20), (0, "wf1.2"): b2, (0, "wf1.3"): b3}
        return status_rows(steps, [10, 20, None, None], gone, barriers)[1]["state"]

    assert fanout_state(fired, dict(fired, fired_job=22)) == "succeeded"
    assert fanout_state(fired, {"total": 1, "arrived": 0, "fired_job": None, "cancelled": True}) == "cancelled"
    assert fanout_state(fired, None) == "gone"  # cancelled or purged before it started c


# ---------------------------------------------------------------------------- 6: timeouts
class Bounded(FakeClock):
    """A clock read a few times at most: a wait that would go on for ever fails instead."""

    def __init__(self, reads: int = 5):
        super().__init__()
        self.reads = reads

    def monotonic(self) -> float:
        self.reads -= 1
        if self.reads < 0:
            raise AssertionError("still waiting: its timeout never passes")
        return super().monotonic()


def test_a_nan_timeout_is_refused_and_an_infinite_one_waits_without_limit(fresh):
    @fresh.task(keep_result=60, queue="nobody")
    def idle(ctx, *previous) -> int:
        return 1

    @fresh.task(keep_result=60)
    def done(ctx) -> int:
        return 7

    job_id = idle.send()
    wf = chain(idle.s(), idle.s()).send()
    with shardq.App(fresh.target, clock=Bounded()) as bounded:
        for bad in (math.nan, "2", True):
            with pytest.raises(shardq.InvalidJob, match="timeout must be None or a number of seconds"):
                bounded.result(job_id, timeout=bad)
            with pytest.raises(shardq.InvalidJob, match="timeout must be None or a number of seconds"):
                Workflow.load(bounded, wf.id).result(timeout=bad)

        async def main():
            try:
                with pytest.raises(shardq.InvalidJob, match="timeout"):
                    await bounded.result_async(job_id, timeout=math.nan)
                with pytest.raises(shardq.InvalidJob, match="timeout"):
                    await Workflow.load(bounded, wf.id).result_async(timeout=math.nan)
            finally:
                await bounded.aclose()

        asyncio.run(main())
        finished = done.send()
        drain(fresh)
        assert bounded.result(finished, timeout=math.inf) == 7
        with pytest.raises(TimeoutError):
            bounded.result(job_id, timeout=-math.inf)


# ---------------------------------------------------------------------------- 7: text that is not UTF-8
def test_an_argument_holding_a_lone_surrogate_is_refused_saying_so(fresh):
    @fresh.task
    def ingest(ctx, path: str, names: list | None = None) -> None: ...

    name = os.fsdecode(b"/data/caf\xe9.csv")  # '/data/caf\udce9.csv'
    with pytest.raises(shardq.InvalidJob) as err:
        ingest.send(name)
    text = str(err.value)
    assert "argument 'path' (position 0)" in text and "not valid UTF-8" in text and "lone surrogate" in text
    assert r"'\udce9' at index 9" in text and "not a msgpack type" not in text
    with pytest.raises(shardq.InvalidJob, match=r"'names'.*str \(at \[1\]\) is not valid UTF-8"):
        ingest.send("ok", names=["ok", name])
    with pytest.raises(shardq.InvalidJob, match=r"'names'.*set \(at \[1\]\['x'\]\) is not a msgpack type"):
        ingest.send("ok", names=[1, {"x": {2}}])
    job = fresh.queue.job(ingest.send(os.fsencode(name)))  # as bytes, as the error says
    assert msgpack.unpackb(job["body"])["a"] == [os.fsencode(name)]


# ---------------------------------------------------------------------------- 8: ids
def test_ids_out_of_range_are_told_as_what_they_are(fresh, capsys):
    for job_id in (2**63, 2**64):
        with pytest.raises(shardq.InvalidJob, match=r"job_id must be an integer in \[0, 2\*\*63 - 1\], got "):
            fresh.status(job_id)
        with pytest.raises(shardq.InvalidJob, match=r"\[0, 2\*\*63 - 1\]"):
            fresh.result(job_id, timeout=0)
    with pytest.raises(shardq.InvalidJob, match="job_id must be"):
        fresh.status(-1)
    for wf_id in ("", "w" * 200, 7):
        with pytest.raises(shardq.InvalidJob, match=r"^a workflow id must be a string of 1\.\.125 bytes"):
            Workflow.load(fresh, wf_id)
        with pytest.raises(shardq.InvalidJob, match="workflow id"):
            describe(fresh.queue, wf_id)
    capsys.readouterr()
    assert main(["workflow", "show", "", "--data-dir", fresh.target]) != exits.OK
    err = capsys.readouterr().err
    assert "workflow id" in err and "barrier id" not in err


# ---------------------------------------------------------------------------- 3: @app.periodic
def test_periodic_refuses_a_task_that_needs_an_argument_at_registration():
    app = shardq.App("var/none")

    with pytest.raises(shardq.InvalidConfig, match=r"report is called with no arguments.*'day'"):
        @app.periodic(every_s=60)
        @app.task(queue="default")
        def report(ctx, day: str) -> None: ...

    with pytest.raises(shardq.InvalidConfig, match=r"rollup is called with no arguments.*'day'"):
        @app.periodic(every_s=60)
        def rollup(ctx, day: str) -> None: ...

    assert app.schedules == [] and not any(name.endswith("rollup") for name in app.tasks)

    @app.periodic(every_s=60)
    def nightly(ctx, day: str = "today", *more: str) -> None: ...

    assert [s.task for s in app.schedules] == [nightly.name]


def test_periodic_stacked_on_a_task_is_told_apart_from_its_misuses():
    """Found by a walkthrough: @app.task above @app.periodic raised AttributeError ('Task'
    object has no attribute '__qualname__') at import; a queue given to @app.periodic over
    @app.task was dropped without a word (the ticks went to the task's queue); a task whose
    key is a function was scheduled with no key (its ticks out of per-key order)."""
    app = shardq.App("var/none")

    with pytest.raises(shardq.InvalidConfig, match=r"put @app.periodic\(...\) above @app.task"):
        @app.task(queue="default")
        @app.periodic(every_s=60)
        def upside_down(ctx) -> None: ...

    with pytest.raises(shardq.InvalidConfig, match="the ticks go to the task's queue"):
        @app.periodic(every_s=60, queue="q_periodic")
        @app.task(queue="q_task")
        def two_queues(ctx) -> None: ...

    @app.periodic(every_s=60, queue="q_task")  # the same queue twice: as asked
    @app.task(queue="q_task")
    def one_queue(ctx) -> None: ...

    @app.periodic(every_s=60)
    @app.task(queue="keyed", key=lambda: "tenant-1")
    def keyed(ctx) -> None: ...

    by_task = {s.task: s for s in app.schedules}
    assert by_task[one_queue.name].queue == "q_task"
    assert (by_task[keyed.name].queue, by_task[keyed.name].key) == ("keyed", "tenant-1")


# ---------------------------------------------------------------------------- 9: retries at the largest
def test_retries_at_its_largest_fits_the_largest_max_deliveries():
    top = RETRIES_MAX + 1
    assert load_config({"queues": {"big": {"max_deliveries": top}}}).queue("big").max_deliveries == top
    with pytest.raises(shardq.InvalidConfig, match="max_deliveries"):
        load_config({"queues": {"big": {"max_deliveries": top + 1}}})  # so no retries past RETRIES_MAX can run
    app = shardq.App("var/none", config={"queues": {"big": {"max_deliveries": top}}})

    def f(ctx): ...

    t = app.task(queue="big", retries=RETRIES_MAX, name="t.big")(f)
    assert t.retries == RETRIES_MAX
    assert check_retries({t.name: t}, lambda queue: {"max_deliveries": top}) == []  # the worker agrees
    with pytest.raises(shardq.InvalidConfig, match=f"retries must be None or an int in \\[0, {RETRIES_MAX}\\]"):
        app.task(queue="big", retries=RETRIES_MAX + 1, name="t.bigger")(f)


# ---------------------------------------------------------------------------- result(timeout) with the service down
def test_result_with_a_timeout_ends_by_it_when_the_service_is_down():
    """``result(timeout=1)`` with every shard gone took the client's ``retry_s`` (15 s) and
    then raised ShardUnavailable: each look now tries a shard that is down only until the
    caller's deadline (app.result, its asyncio form and a workflow's result)."""
    import time

    from support.service import Service
    with Service(shards=2) as svc:
        app = shardq.App(svc.data_dir)

        @app.task(keep_result=60, name="paths_end.kept")
        def kept(ctx, x: int = 0) -> int:
            return x + 1

        job = kept.send()
        wf = chain(kept.s(), kept.s()).send()
        svc.kill_all()

        async def look_async():
            try:
                return await app.result_async(job, timeout=1)
            finally:
                await app.aclose()

        for look in (lambda: app.result(job, timeout=1), lambda: wf.result(timeout=1),
                     lambda: asyncio.run(look_async())):
            started = time.monotonic()
            with pytest.raises((TimeoutError, shardq.ShardUnavailable)):
                look()
            assert time.monotonic() - started < 8, "the look waited out the client's retry_s (15 s)"
        app.close()


# ---------------------------------------------------------------------------- an event loop per call
def test_send_async_from_a_new_loop_each_call_holds_no_connection_of_the_loops_gone():
    """``asyncio.run(task.send_async(...))`` per call (Flask runs each async view so): the app
    kept each ended loop's asyncio client, a connection per shard, until the shards'
    ``max_connections`` turned every client of the service away (found: 300 requests, 611
    fds). A new loop's client now ends those of loops that have closed."""
    from support.service import Service
    with Service(shards=2) as svc:
        app = shardq.App(svc.data_dir)

        @app.task(name="paths_end.per_loop")
        def per_loop(ctx, n: int) -> None:
            return None

        def clients() -> int:
            return sum(s["clients"] for s in app.queue.stats()["shards"])

        fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
        asyncio.run(per_loop.send_async(0))
        before, fds_before = clients(), fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for n in range(1, 41):
                asyncio.run(per_loop.send_async(n))
            gc.collect()
        # the ended loops' connections are closed, and said so: no 'unclosed transport' (2 a call)
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
        assert len(app._aio) == 1  # the last loop's, until the next call or close()
        assert clients() <= before + 2, (before, clients())  # (was: 2 more a call, 80 here)
        assert fds() <= fds_before + 4, (fds_before, fds())
        assert app.queue.stats()["queues"]["default"]["ready"] == 41
        app.close()
