"""Results and workflows in one process (App.embedded, 2 shards): keep_result, app.result
and app.status, chains, groups, chords (results in member order), a group after a step,
failure and redrive, cancel, progress, the asyncio API, and what is refused."""
from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest

import shardq
from shardq import chain, chord, group, limits
from shardq.tasks import body as taskbody
from shardq.client.effects import Send
from shardq.clock import FakeClock
from shardq.client.routing import shard_for_key
from shardq.tasks.workflow import Workflow, describe

from support.task_apps import drain, fresh_tasks
from support.service import wait_until


@pytest.fixture(scope="module")
def app():
    a = shardq.App.embedded(shards=2, config={"queue_defaults": {"max_deliveries": 2}})
    yield a
    a.close()


@pytest.fixture
def fresh(app):
    """The shared app with no tasks; its queues emptied after the test."""
    with fresh_tasks(app) as a:
        yield a


def test_a_kept_result_is_returned_and_its_status_says_succeeded(fresh):
    @fresh.task(keep_result=60)
    def square(ctx, x: int) -> dict:
        return {"x": x, "square": x * x, "raw": b"\x00\xff"}

    job_id = square.send(7)
    assert taskbody.decode_steps(fresh.queue.job(job_id)["body"])[3].keep_s == 60.0
    assert fresh.status(job_id)["state"] == "ready"
    drain(fresh)
    assert fresh.result(job_id, timeout=10) == {"x": 7, "square": 49, "raw": b"\x00\xff"}
    st = fresh.status(job_id)
    assert st["state"] == "succeeded" and st["result_bytes"] == len(msgpack.packb(
        {"x": 7, "square": 49, "raw": b"\x00\xff"}, use_bin_type=True))


def test_a_task_without_keep_result_has_no_result_and_a_plain_body(fresh):
    @fresh.task
    def plain(ctx):
        return 1

    job_id = plain.send()
    assert msgpack.unpackb(fresh.queue.job(job_id)["body"])["v"] == 1
    drain(fresh)
    with pytest.raises(shardq.NotFound, match="no result kept"):
        fresh.result(job_id, timeout=5)


def test_result_waits_until_timeout_for_a_job_nobody_runs(fresh):
    @fresh.task(keep_result=60, queue="nobody")
    def idle(ctx):
        return 1

    job_id = idle.send()
    with pytest.raises(TimeoutError):
        fresh.result(job_id, timeout=0.2)


def test_a_chain_passes_each_result_to_the_next_step(fresh):
    @fresh.task
    def fetch(ctx, url: str) -> bytes:
        return url.encode() + b"!"

    @fresh.task
    def parse(ctx, page: bytes, suffix: str) -> dict:
        return {"page": page, "len": len(page), "suffix": suffix}

    @fresh.task
    def store(ctx, doc: dict) -> str:
        return f"{doc['page'].decode()}:{doc['len']}{doc['suffix']}"

    wf = chain(fetch.s("https://example.org"), parse.s("?"), store.s()).send()
    assert isinstance(wf, shardq.Workflow)
    assert [r["state"] for r in wf.status()] == ["ready", "pending", "pending"]
    drain(fresh)
    assert wf.result(timeout=10) == "https://example.org!:20?"
    assert [r["state"] for r in wf.status()] == ["succeeded"] * 3


def test_a_chord_callback_gets_every_result_in_member_order_once(fresh):
    calls = []

    @fresh.task(key=lambda d, **_: f"doc-{d}")
    def score(ctx, d: int) -> int:
        return d * 10

    @fresh.task
    def summarize(ctx, results: list, label: str) -> dict:
        calls.append(list(results))
        return {"label": label, "results": results}

    members = 40
    wf = chord(group(score.s(d) for d in range(members)), summarize.s("total")).send()
    drain(fresh)
    assert wf.result(timeout=10) == {"label": "total", "results": [d * 10 for d in range(members)]}
    assert calls == [[d * 10 for d in range(members)]]
    q = fresh.queue
    sent: list[str] = []
    send = q._handlers[Send]  # every request of every Send effect
    q._handlers[Send] = lambda effect: sent.extend(op for _s, op, _a in effect.calls) or send(effect)
    try:
        rows = wf.status()
    finally:
        q._handlers[Send] = send
    assert len(rows) == members + 1 and all(r["state"] == "succeeded" for r in rows)
    assert "result" not in sent and "result_sizes" in sent  # a look reads sizes, no value
    values = q.results([r["job_id"] for r in rows])
    assert [r["result_bytes"] for r in rows] == [None if v.value is None else len(v.value) for v in values]
    assert rows[-1]["result_bytes"] is not None


def test_a_group_after_a_step_and_a_step_after_it(fresh):
    @fresh.task
    def base(ctx) -> int:
        return 5

    @fresh.task
    def add(ctx, x: int, y: int) -> int:
        return x + y

    @fresh.task
    def total(ctx, xs: list) -> int:
        return sum(xs) * 100 + len(xs)

    wf = chain(base.s(), group(add.s(1), add.s(2), chain(add.s(3), add.s(4))), total.s()).send()
    drain(fresh)
    assert wf.result(timeout=10) == (6 + 7 + 12) * 100 + 3


def test_a_workflow_that_ends_with_a_group_returns_the_members_results(fresh):
    @fresh.task
    def twice(ctx, x: int) -> int:
        return 2 * x

    wf = group(twice.s(1), twice.s(2), twice.s(3)).send()
    drain(fresh)
    assert wf.result(timeout=10) == [2, 4, 6]


def test_a_dead_member_fails_its_chord_and_a_redrive_resumes_it(fresh):
    gate = {"fail": True}
    ran = []

    @fresh.task
    def member(ctx, i: int) -> int:
        if i == 3 and gate["fail"]:
            raise shardq.Fail("member 3 is broken")
        return i

    @fresh.task
    def callback(ctx, xs: list) -> int:
        ran.append(xs)
        return sum(xs)

    wf = chord(group(member.s(i) for i in range(5)), callback.s()).send()
    drain(fresh)
    with pytest.raises(shardq.JobFailed, match="member 3 is broken") as err:
        wf.result(timeout=10)
    assert err.value.task == member.name and ran == []
    rows = {r["step"]: r for r in wf.status()}
    assert rows["0.0.3"]["state"] == "dead" and rows["0.1"]["state"] == "pending"
    assert rows["0.1"]["arrived"] == 4 and rows["0.1"]["total"] == 5
    gate["fail"] = False
    assert fresh.queue.redrive("default", [err.value.job_id]) == 1
    drain(fresh)
    assert wf.result(timeout=10) == 10 and ran == [[0, 1, 2, 3, 4]]


def test_a_chain_step_dead_before_its_barrier_saw_any_arrival_fails_the_result(fresh):
    """A chain step reports to a barrier of one member, which its shard knows only once
    something arrived: result() still watches the step, and raises its failure instead of
    waiting out its timeout."""
    @fresh.task
    def first(ctx) -> int:
        return 1

    @fresh.task
    def dies(ctx, x: int) -> int:
        raise shardq.Fail(f"step after {x} is broken")

    @fresh.task
    def last(ctx, x: int) -> int:
        return x

    wf = chain(first.s(), dies.s(), last.s()).send()
    drain(fresh)
    with pytest.raises(shardq.JobFailed, match="step 0.1 .* step after 1 is broken"):
        wf.result(timeout=10)


def test_cancel_stops_what_has_not_run(fresh):
    @fresh.task(queue="later")
    def first(ctx) -> int:
        return 1

    @fresh.task(queue="later")
    def second(ctx, x: int) -> int:
        return x + 1

    wf = chain(first.s(), second.s()).send()
    out = wf.cancel()
    assert out == {"barriers_cancelled": 1, "jobs": {"cancelled": 1}, "state": "cancelled"}
    assert [r["state"] for r in wf.status()] == ["cancelled", "cancelled"]
    assert drain(fresh, "later").leased == 0


def test_progress_is_visible_while_the_job_runs(fresh):
    started, release = threading.Event(), threading.Event()

    @fresh.task(keep_result=60)
    def slow(ctx) -> str:
        ctx.progress(0.5, "half way")
        started.set()
        release.wait(30)
        return "done"

    job_id = slow.send()
    worker = threading.Thread(target=drain, args=(fresh,))
    worker.start()
    try:
        assert started.wait(30)
        wait_until(lambda: fresh.status(job_id)["progress"] == 0.5, 10, 0.01, "progress recorded")
        st = fresh.status(job_id)
        assert st["state"] == "leased" and st["note"] == "half way"
    finally:
        release.set()
        worker.join(30)
    assert fresh.result(job_id, timeout=10) == "done"


def test_ctx_progress_refuses_a_fraction_outside_0_1(fresh):
    seen = []

    @fresh.task
    def bad(ctx):
        for value in (1.5, -0.1, True, "x%"):
            try:
                ctx.progress(value, "n") if not isinstance(value, str) else ctx.progress(0.2, value)
            except shardq.InvalidJob as exc:
                seen.append(str(exc))

    bad.send()
    drain(fresh)
    assert len(seen) == 3 and all("fraction" in s for s in seen)


def test_an_unencodable_or_too_large_return_value_fails_the_job_with_the_reason(fresh):
    @fresh.task(keep_result=60)
    def odd(ctx):
        return {1, 2}

    @fresh.task(keep_result=60)
    def huge(ctx, n: int):
        return b"x" * n

    # the largest value that fits, msgpack header included, and one byte more
    fits = limits.RESULT_BYTES_MAX - len(msgpack.packb(b"x" * limits.RESULT_BYTES_MAX)) + limits.RESULT_BYTES_MAX
    ids = [odd.send(), huge.send(fits), huge.send(fits + 1)]
    drain(fresh)
    assert len(fresh.result(ids[1], timeout=10)) == fits
    with pytest.raises(shardq.JobFailed, match="not a msgpack type"):
        fresh.result(ids[0], timeout=10)
    with pytest.raises(shardq.JobFailed, match="results are kept up to"):
        fresh.result(ids[2], timeout=10)


def test_the_asyncio_api(fresh):
    @fresh.task(keep_result=60)
    async def double(ctx, x: int) -> int:
        return 2 * x

    @fresh.task
    async def inc(ctx, x: int) -> int:
        return x + 1

    job_id = double.send(21)
    wf = chain(double.s(1), inc.s()).send()
    drain(fresh)

    async def main():
        try:
            return await fresh.result_async(job_id, timeout=10), await wf.result_async(timeout=10)
        finally:
            await fresh.aclose()

    assert asyncio.run(main()) == (42, 3)


def test_what_a_workflow_refuses_when_it_is_built(fresh):
    @fresh.task
    def t(ctx, x: int = 0) -> int:
        return x

    with pytest.raises(shardq.InvalidJob, match="at least one member"):
        chain(t.s(), group(), t.s()).send()
    for empty in (group(), group([]), chord(group(t.s(x) for x in []), t.s()), chain(group(), t.s())):
        with pytest.raises(shardq.InvalidJob, match="at least one member"):  # an empty group first too
            empty.send()
    with pytest.raises(shardq.InvalidJob, match="must end with a task"):
        group(chain(t.s(), group(t.s(), t.s()))).send()
    with pytest.raises(shardq.InvalidJob):
        chain(t.s(1, 2, 3)).send()  # the task's signature refuses the call before anything is sent
    with pytest.raises(shardq.InvalidJob, match="signatures"):
        chain(t.s(), "not a step")


def test_a_result_past_its_ttl_is_gone(fresh):
    @fresh.task(keep_result=0.3)
    def brief(ctx) -> int:
        return 1

    job_id = brief.send()
    drain(fresh)
    assert fresh.result(job_id, timeout=10) == 1
    wait_until(lambda: fresh.status(job_id)["state"] == "gone", 10, 0.02, "the result expired")
    with pytest.raises(shardq.NotFound):
        fresh.result(job_id, timeout=1)


def test_a_member_delivered_again_after_it_reported_is_counted_once(fresh):
    """The window a SIGKILL hits (reported, not acked), made deterministic: member 0 runs
    and reports but is never acked; member 1 finishes; member 0 comes back once its lease
    runs out and reports again, when one more arrival would complete the barrier. Only
    member 2 may complete it."""
    from shardq.consumer.handling import DONE, execute
    from shardq.tasks.dispatch import TaskHandler

    calls = []

    @fresh.task
    def member(ctx, i: int) -> int:
        return i * i

    @fresh.task
    def callback(ctx, xs: list) -> int:
        calls.append(xs)
        return len(xs)

    q = fresh.queue
    wf = chord(group(member.s(i) for i in range(3)), callback.s()).send()
    handler = TaskHandler(fresh.tasks)

    def index_of(lease):
        return taskbody.decode(lease.body)[1][0]

    def run(lease, ack=True):
        assert execute(handler, lease, None, client=q) == (DONE, None, None)
        if ack:
            q.ack(lease)

    leases = {index_of(lease): lease for lease in q.dequeue_many("default", max_jobs=3, visibility=0.3)}
    assert sorted(leases) == [0, 1, 2]
    run(leases[0], ack=False)            # reported; its worker "dies" before the ack
    run(leases[1])
    again: dict = {}

    def both_back():
        for lease in q.dequeue_many("default", max_jobs=3, visibility=30):
            again[index_of(lease)] = lease
        return len(again) == 2

    wait_until(both_back, 10, 0.05, "members 0 and 2 delivered again")
    assert again[0].attempt == 2
    run(again[0])                        # its second report changes nothing
    assert [r["state"] for r in wf.status()][-1] == "pending"
    run(again[2])                        # the last member: now the callback is enqueued
    drain(fresh)
    assert wf.result(timeout=10) == 3 and calls == [[0, 1, 4]]


def test_a_step_keeps_its_key_queue_delay_and_priority(fresh):
    @fresh.task(queue="wf-a")
    def first(ctx) -> str:
        return "user-9"

    @fresh.task(queue="wf-b", key=lambda who, **_: f"k-{who}")
    def second(ctx, who: str) -> str:
        return who

    wf = chain(first.s(), second.s().set(delay=3600, priority=7)).send()
    drain(fresh, "wf-a")
    wait_until(lambda: wf.status()[1]["job_id"] is not None, 10, 0.01, "the second step enqueued")
    info = fresh.queue.job(wf.status()[1]["job_id"])
    # the key function saw None in the input's place: the key is fixed when the workflow is sent
    assert (info["queue"], info["key"], info["state"], info["priority"]) == ("wf-b", "k-None", "delayed", 7)
    assert info["deadline"] > info["enqueued_at"] + 3000
    assert fresh.queue.cancel(info["job_id"]) == "cancelled"


def test_a_later_steps_priority_is_told_to_every_shard_when_the_workflow_is_sent(fresh):
    """A barrier's shard enqueues a later step; its priority used to be known to that shard
    alone, and a consumer whose lease round began at another shard took a job of priority 0
    from there first, with a priority 5 ready (docs/design.md, "Queue-wide priorities")."""
    key_of = {}
    for i in range(100):
        key_of.setdefault(shard_for_key(f"k{i}", 2), f"k{i}")

    @fresh.task(queue="wf-p-first")
    def first(ctx) -> int:
        return 1

    @fresh.task(queue="wf-p", key=lambda x, **_: key_of[1])
    def urgent(ctx, x: int) -> int:
        return x

    fresh.queue.enqueue(b"plain", key=key_of[0], queue="wf-p")  # priority 0, on shard 0
    wf = chain(first.s(), urgent.s().set(priority=5)).send()
    drain(fresh, "wf-p-first")
    job_of(wf, "0.1")  # the barrier on shard 1 enqueued it
    with shardq.connect(fresh.queue.data_dir) as consumer:  # never saw a priority; its round starts at shard 0
        lease = consumer.dequeue("wf-p")
        assert lease.key == key_of[1]  # the priority 5 first
        consumer.ack(lease)
    assert fresh.queue.dequeue("wf-p").key == key_of[0]


# ---------------------------------------------------------------------------- how workflows end
# Each way a step can end (docs/workflows.md, "How a workflow ends"), read by result() on both
# drivers: the threaded client (wf.result) and the asyncio one (wf.result_async).
DRIVERS = ["thread", "asyncio"]


def result_of(app, wf, driver: str, timeout: float | None = 5):
    if driver == "thread":
        return wf.result(timeout=timeout)

    async def main():
        try:
            return await wf.result_async(timeout=timeout)
        finally:
            await app.aclose()

    return asyncio.run(main())


def job_of(wf, path: str) -> int:
    return wait_until(lambda: {r["step"]: r["job_id"] for r in wf.status()}[path], 10, 0.01,
                      f"step {path} enqueued")


def record_state(app, wf) -> str:
    return app.queue.workflow(wf.id)["state"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_result_of_a_workflow_cancelled_before_its_last_step_is_enqueued_raises_at_once(fresh, driver):
    @fresh.task(queue="nobody")
    def first(ctx) -> int:
        return 1

    @fresh.task(queue="nobody")
    def second(ctx, x: int) -> int:
        return x + 1

    wf = chain(first.s(), second.s()).send()
    assert wf.cancel()["state"] == "cancelled"
    with pytest.raises(shardq.WorkflowCancelled, match=r"step 0\.1 .*not started.*wf\.cancel\(\)") as err:
        result_of(fresh, wf, driver)
    assert (err.value.workflow_id, err.value.step, err.value.task) == (wf.id, "0.1", second.name)
    assert record_state(fresh, wf) == "cancelled"


@pytest.mark.parametrize("driver", DRIVERS)
def test_result_of_a_workflow_cancelled_after_its_last_step_is_enqueued_or_leased_raises_at_once(fresh, driver):
    @fresh.task(queue="wf-end")
    def first(ctx) -> int:
        return 1

    @fresh.task(queue="wf-end")
    def last(ctx, x: int) -> int:
        return x + 1

    enqueued = chain(first.s(), last.s()).send()
    fresh.run_worker("wf-end", max_jobs=1, idle_wait_s=0.05, poll_s=0.01)
    job_of(enqueued, "0.1")  # the last step is enqueued, ready
    enqueued.cancel()
    with pytest.raises(shardq.WorkflowCancelled, match=r"step 0\.1 "):
        result_of(fresh, enqueued, driver)

    # The last step running when the workflow is cancelled: result() does not wait for it,
    # and says cancelled even once it stored its value.
    running = chain(last.s(5)).send()
    q = fresh.queue
    (lease,) = q.dequeue_many("wf-end", max_jobs=1)
    assert running.cancel()["jobs"] == {"cancelling": 1}
    with pytest.raises(shardq.WorkflowCancelled, match=rf"step 0\.0 .*job {lease.job_id}"):
        result_of(fresh, running, driver)
    q.put_result(lease, msgpack.packb(6), 60)
    with pytest.raises(shardq.Cancelled):
        q.ack(lease)
    with pytest.raises(shardq.WorkflowCancelled):
        result_of(fresh, running, driver)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_middle_step_cancelled_by_an_operator_cancels_its_workflow(fresh, driver):
    @fresh.task(queue="wf-end")
    def a(ctx) -> int:
        return 1

    @fresh.task(queue="wf-end")
    def b(ctx, x: int) -> int:
        return x + 1

    @fresh.task(queue="wf-end")
    def c(ctx, x: int) -> int:
        return x + 1

    wf = chain(a.s(), b.s(), c.s()).send()
    fresh.run_worker("wf-end", max_jobs=1, idle_wait_s=0.05, poll_s=0.01)
    middle = job_of(wf, "0.1")
    assert fresh.queue.cancel(middle) == "cancelled"  # what `shardq job cancel` does
    # the service's watcher records the end, whether or not anyone asks for the result
    wait_until(lambda: record_state(fresh, wf) != "running", 30, 0.05, "the watcher recording the end")
    record = fresh.queue.workflow(wf.id)
    assert record["state"] == "cancelled" and f"step 0.1 ({b.name}, job {middle})" in record["error"]
    assert record["expires_at"] is not None
    shown = describe(fresh.queue, wf.id)  # what `shardq workflow show` and the console show
    assert (shown["state"], shown["error"]) == ("cancelled", record["error"])
    assert shown["steps_by_state"] == {"succeeded": 1, "gone": 1, "pending": 1}
    with pytest.raises(shardq.WorkflowCancelled, match=rf"step 0\.1 \({b.name}, job {middle}\).*cancel") as err:
        result_of(fresh, wf, driver, timeout=None)
    assert err.value.job_id == middle

    # A chord's member cancelled: result() ends the record itself, at once.
    @fresh.task(queue="wf-end")
    def member(ctx, i: int) -> int:
        return i

    @fresh.task(queue="wf-end")
    def total(ctx, xs: list) -> int:
        return sum(xs)

    cw = chord(group(member.s(i) for i in range(4)), total.s()).send()
    gone = job_of(cw, "0.0.2")
    assert fresh.queue.cancel(gone) == "cancelled"
    drain(fresh, "wf-end")
    with pytest.raises(shardq.WorkflowCancelled, match=rf"step 0\.0\.2 \({member.name}, job {gone}\)"):
        result_of(fresh, cw, driver, timeout=None)
    assert record_state(fresh, cw) == "cancelled"


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_dead_step_then_purged_fails_its_workflow(fresh, driver):
    @fresh.task
    def first(ctx) -> int:
        return 1

    @fresh.task
    def dies(ctx, x: int) -> int:
        raise shardq.Fail(f"step after {x} is broken")

    @fresh.task
    def last(ctx, x: int) -> int:
        return x

    wf = chain(first.s(), dies.s(), last.s()).send()
    drain(fresh)
    wait_until(lambda: record_state(fresh, wf) == "failed", 30, 0.05, "the watcher recording the failure")
    assert fresh.queue.purge_dead_letters("default") == 1  # `shardq dead-letters purge`
    with pytest.raises(shardq.JobFailed, match=r"step 0\.1 .*step after 1 is broken") as err:
        result_of(fresh, wf, driver, timeout=None)
    assert (err.value.step, err.value.task) == ("0.1", dies.name)
    assert record_state(fresh, wf) == "failed"


def test_result_of_a_plain_job_times_out_naming_the_job(fresh):
    @fresh.task(keep_result=60, queue="nobody")
    def idle(ctx):
        return 1

    job_id = idle.send()
    with pytest.raises(TimeoutError) as err:
        fresh.result(job_id, timeout=0.05)
    assert f"job {job_id}" in str(err.value) and "workflow" not in str(err.value)
    assert "ready" in str(err.value)

    async def main():
        try:
            return await fresh.result_async(job_id, timeout=0.05)
        finally:
            await fresh.aclose()

    with pytest.raises(TimeoutError, match=f"^job {job_id} "):
        asyncio.run(main())


class Ticking(FakeClock):
    """Each monotonic reading is an hour after the last: any timeout has passed when next read."""

    def monotonic(self) -> float:
        return self.advance(3600.0)


def test_result_waits_are_timed_by_the_apps_clock(fresh):
    @fresh.task(keep_result=60, queue="nobody")
    def idle(ctx, *previous):
        return 1

    job_id = idle.send()
    wf = chain(idle.s(), idle.s()).send()
    with shardq.App(fresh.target, clock=Ticking()) as ticking:
        with pytest.raises(TimeoutError, match=f"^job {job_id} "):
            ticking.result(job_id, timeout=60)  # not 60 s of real time: the app's clock is past it at once
        with pytest.raises(TimeoutError, match=f"^workflow {wf.id} "):
            Workflow.load(ticking, wf.id).result(timeout=60)

        async def main():
            try:
                return await Workflow.load(ticking, wf.id).result_async(timeout=60)
            finally:
                await ticking.aclose()

        with pytest.raises(TimeoutError, match=f"^workflow {wf.id} "):
            asyncio.run(main())


def test_an_app_made_with_a_router_refuses_asyncio_calls_with_a_typed_error(fresh):
    # It has no data dir to connect an asyncio client to: this was a TypeError from deep
    # inside the data dir code.
    @fresh.task(keep_result=60, queue="nobody")
    def idle(ctx):
        return 1

    job_id = idle.send()
    borrowed = shardq.App(router=fresh.queue)

    async def main():
        return await borrowed.result_async(job_id, timeout=1)

    with pytest.raises(shardq.InvalidConfig, match="router="):
        asyncio.run(main())


def test_a_step_cancelled_while_it_runs_that_finishes_and_reports_lets_its_workflow_go_on(fresh):
    started, release = threading.Event(), threading.Event()

    @fresh.task(queue="wf-end")
    def slow(ctx) -> int:
        started.set()
        release.wait(30)
        return 1

    @fresh.task(queue="wf-end")
    def after(ctx, x: int) -> int:
        return x + 1

    wf = chain(slow.s(), after.s()).send()
    worker = threading.Thread(target=drain, args=(fresh, "wf-end"))
    worker.start()
    try:
        assert started.wait(30)
        assert fresh.queue.cancel(job_of(wf, "0.0")) == "cancelling"  # too late: it runs
    finally:
        release.set()
        worker.join(30)
    drain(fresh, "wf-end")
    assert wf.result(timeout=10) == 2
