"""Tasks in one process (App.embedded): sending, the body format, refusing bad calls,
retries against the durable delivery count, Retry/Fail, unknown task names, ctx, typing."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import traceback

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.tasks.dispatch import TaskHandler
from shardq.tasks.runner import check_retries, plan

from support.task_apps import drain, fresh_tasks
from support.service import REPO


@pytest.fixture(scope="module")
def app():
    a = shardq.App.embedded(config={"queue_defaults": {"max_deliveries": 6}})
    yield a
    a.close()


@pytest.fixture
def fresh(app):
    """The shared app with no tasks; its queues emptied after the test."""
    with fresh_tasks(app) as a:
        yield a


def test_send_writes_the_documented_body_and_key(fresh):
    @fresh.task(queue="t-body", key=lambda user_id, **_: f"user-{user_id}", name="welcome")
    def welcome(ctx, user_id: int, template: str = "default"):
        pass

    jid = welcome.send(42, template="short")
    [lease] = fresh.queue.dequeue_many("t-body", max_jobs=10)
    assert lease.job_id == jid and lease.key == "user-42"
    assert msgpack.unpackb(lease.body) == {"t": "welcome", "a": [42], "k": {"template": "short"}, "v": 1}
    assert welcome(None, 1) is None  # calling the task runs the function inline


def test_default_name_is_module_and_qualname(fresh):
    @fresh.task
    def plain(ctx):
        pass

    assert plain.name == f"{__name__}.test_default_name_is_module_and_qualname.<locals>.plain"
    assert plain.queue == "default" and plain.key is None and plain.retries is None


@pytest.mark.parametrize("call, words", [
    (lambda t: t.send(object()), ["'user_id' (position 0)", "object is not a msgpack type"]),
    (lambda t: t.send(1, template={1, 2}), ["'template'", "set is not a msgpack type"]),
    (lambda t: t.send(2**64), ["'user_id'", "64-bit"]),
    (lambda t: t.send(1, 2, 3), ["too many positional arguments"]),
    (lambda t: t.send(), ["missing a required argument: 'user_id'"]),
    (lambda t: t.send(1, colour="red"), ["unexpected keyword argument 'colour'"]),
    (lambda t: t.send_many([((1,), {}), ((object(),), {})]), ["'user_id'"]),
    (lambda t: t.send_many([(1, {})]), ["(args, kwargs) pairs"]),
])
def test_bad_calls_are_refused_at_send_and_nothing_is_enqueued(fresh, call, words):
    @fresh.task(queue="t-bad")
    def welcome(ctx, user_id: int, template: str = "default"):
        pass

    with pytest.raises(shardq.InvalidJob) as err:
        call(welcome)
    for w in words:
        assert w in str(err.value)
    assert fresh.queue.stats()["queues"].get("t-bad", {}).get("ready", 0) == 0


def test_a_key_function_that_fails_or_returns_no_string_is_refused(fresh):
    @fresh.task(queue="t-key", key=lambda user_id: user_id)
    def numeric(ctx, user_id):
        pass

    @fresh.task(queue="t-key", key=lambda user_id: 1 / 0)
    def broken(ctx, user_id):
        pass

    with pytest.raises(shardq.InvalidJob, match="must return a str"):
        numeric.send(1)
    with pytest.raises(shardq.InvalidJob, match="ZeroDivisionError"):
        broken.send(1)


def test_body_size_limit_holds_at_its_maximum(fresh):
    @fresh.task(queue="t-size", name="s")
    def sized(ctx, blob: bytes):
        pass

    overhead = len(sized.job((b"",), {})["body"])
    # msgpack: the empty bin has a 2-byte header, a bin 32 a 5-byte one: 3 more.
    n = limits.BODY_BYTES_MAX_DEFAULT - overhead - 3
    assert len(sized.job((b"x" * n,), {})["body"]) == limits.BODY_BYTES_MAX_DEFAULT
    sized.send(b"x" * n)
    with pytest.raises(shardq.InvalidJob, match="body"):
        sized.send(b"x" * (n + 1))


def test_send_many_is_one_batch_and_splits_past_the_batch_limit(fresh):
    @fresh.task(queue="t-many", name="m")
    def many(ctx, i: int):
        pass

    ids = many.send_many([((i,), {}) for i in range(limits.BATCH_JOBS_MAX + 1)])
    assert len(set(ids)) == limits.BATCH_JOBS_MAX + 1
    assert fresh.queue.stats()["queues"]["t-many"]["ready"] == limits.BATCH_JOBS_MAX + 1


def test_send_with_delay_priority_and_dedup(fresh):
    @fresh.task(queue="t-with", name="w")
    def w(ctx, n: int):
        pass

    a = w.send_with(dedup_id="w-1")(1)
    assert w.send_with(dedup_id="w-1")(1) == a
    w.send_with(delay=3600)(2)
    hi = w.send_with(priority=9)(3)
    [first] = fresh.queue.dequeue_many("t-with", max_jobs=1)
    assert first.job_id == hi
    st = fresh.queue.stats()["queues"]["t-with"]
    assert st["delayed"] == 1


def test_retries_use_the_delivery_count_then_dead_letter_with_the_error(fresh):
    calls = []

    @fresh.task(queue="t-retry", retries=2, backoff=shardq.Exponential(0, 0), name="flaky")
    def flaky(ctx, n: int):
        calls.append(ctx.attempt)
        ctx.progress(f"step {ctx.attempt}")
        raise ValueError(f"boom {n}")

    jid = flaky.send(7)
    drain(fresh, "t-retry")
    assert calls == [1, 2, 3]  # the first delivery and 2 retries
    [dl] = fresh.queue.dead_letters("t-retry")
    assert dl.job_id == jid and dl.attempts == 3
    assert dl.error.startswith("ValueError: boom 7 (attempt 3; retries=2 used up)")
    assert "last progress: step 3" in dl.error


def test_retries_zero_dead_letters_on_the_first_failure(fresh):
    @fresh.task(queue="t-r0", retries=0, name="once")
    def once(ctx):
        raise RuntimeError("nope")

    once.send()
    drain(fresh, "t-r0")
    [dl] = fresh.queue.dead_letters("t-r0")
    assert dl.attempts == 1 and "retries=0 used up" in dl.error


def test_without_retries_the_queues_max_deliveries_decides(fresh, caplog):
    calls = []

    @fresh.task(queue="t-rq", backoff=shardq.Exponential(0, 0), name="q")
    def q(ctx):
        calls.append(ctx.attempt)
        raise ValueError("always")

    q.send()
    with caplog.at_level(logging.INFO, logger="shardq.worker"):
        drain(fresh, "t-rq")
    assert calls == [1, 2, 3, 4, 5, 6]  # max_deliveries = 6 in this app's config
    [dl] = fresh.queue.dead_letters("t-rq")
    assert dl.error.startswith("ValueError: always\nTraceback (most recent call last):")
    failures = [r for r in caplog.records if r.exc_info]
    assert [r.levelno for r in failures] == [logging.WARNING] * 5 + [logging.ERROR]
    assert "failed its last delivery (6 of 6)" in failures[-1].getMessage()


def test_retry_with_a_delay_and_fail_at_once(fresh):
    seen = []

    @fresh.task(queue="t-rf", retries=5, name="rf")
    def rf(ctx, what: str):
        seen.append((what, ctx.attempt))
        if what == "later":
            raise shardq.Retry(delay_s=3600)
        raise shardq.Fail("user 42 does not exist")

    later = rf.send("later")
    rf.send("fail")
    drain(fresh, "t-rf")
    assert sorted(seen) == [("fail", 1), ("later", 1)]
    st = fresh.queue.stats()["queues"]["t-rf"]
    assert st["delayed"] == 1 and st["dead"] == 1  # the retry waits its hour, not the backoff
    [dl] = fresh.queue.dead_letters("t-rf")
    assert dl.error == "user 42 does not exist" and dl.attempts == 1 and dl.job_id != later


def _fail_deep(n: int, depth: int = 0):
    if depth < n:
        _fail_deep(n, depth + 1)
    raise ValueError(f"deep {n}")


def test_a_failing_task_logs_its_traceback_once_per_attempt_and_keeps_it_in_the_dead_letter(fresh, caplog):
    # Issue 36: a task's failure logged one INFO line and no traceback, even at DEBUG.
    @fresh.task(queue="t-tb", retries=1, backoff=shardq.Exponential(0, 0), name="tb")
    def tb(ctx, n: int):
        _fail_deep(n)

    jid = tb.send(2)
    with caplog.at_level(logging.DEBUG, logger="shardq.worker"):
        drain(fresh, "t-tb")
    failures = [r for r in caplog.records if r.exc_info and f"job {jid} " in r.getMessage()]
    assert [(r.levelno, f"attempt {a} " in r.getMessage()) for r, a in zip(failures, (1, 2))] == \
        [(logging.WARNING, True), (logging.ERROR, True)]  # a retry, then failed for good
    assert "will retry" in failures[0].getMessage() and "failed for good" in failures[1].getMessage()
    for r in failures:
        assert r.exc_info[0] is ValueError
        assert "in _fail_deep" in "".join(traceback.format_exception(*r.exc_info))
    [dl] = fresh.queue.dead_letters("t-tb")
    first, rest = dl.error.split("\n", 1)
    assert first == "ValueError: deep 2 (attempt 2; retries=1 used up)"
    assert rest.startswith("Traceback (most recent call last):") and rest.endswith("ValueError: deep 2")
    assert rest.count("in _fail_deep") == 3


def _fail_chained(n: int):
    """A traceback of n + 1 chained exceptions, each with its own frames: far over the limit."""
    try:
        if n > 0:
            _fail_chained(n - 1)
    finally:
        raise ValueError(f"level {n}")


def test_a_task_traceback_in_the_error_text_keeps_its_innermost_frames_within_the_limit(fresh):
    @fresh.task(queue="t-tb-long", retries=0, name="tblong")
    def tblong(ctx, n: int):
        _fail_chained(n)

    tblong.send(30)
    drain(fresh, "t-tb-long")
    [dl] = fresh.queue.dead_letters("t-tb-long")
    assert len(dl.error.encode()) <= limits.ERROR_TEXT_BYTES_MAX
    first, cut_note, rest = dl.error.split("\n", 2)
    assert first == "ValueError: level 30 (attempt 1; retries=0 used up)"
    assert cut_note == "Traceback (innermost frames; the rest cut):"
    assert rest.endswith('raise ValueError(f"level {n}")\nValueError: level 30')


@pytest.mark.parametrize("text_bytes", [0, 100, limits.ERROR_TEXT_BYTES_MAX - 50, limits.ERROR_TEXT_BYTES_MAX])
def test_with_traceback_stays_within_the_error_text_limit_at_its_maximum(text_bytes):
    from shardq.consumer.handling import with_traceback
    try:
        _fail_chained(30)
    except ValueError as exc:
        err = exc
    text = "é" * (text_bytes // 2) + "x" * (text_bytes % 2)
    out = with_traceback(text, err)
    assert out.startswith(text) and len(out.encode()) <= limits.ERROR_TEXT_BYTES_MAX
    tb_lines = "".join(traceback.format_exception(err)).splitlines()
    kept = out[len(text):].splitlines()[2:]  # after the newline and the "cut" line
    assert kept == tb_lines[len(tb_lines) - len(kept):]  # whole lines, the last ones
    if text_bytes <= 100:
        assert out.endswith("ValueError: level 30")
    if text_bytes == limits.ERROR_TEXT_BYTES_MAX:
        assert out == text  # no room: the message is kept whole, the traceback left out


def test_a_retry_or_fail_raised_on_purpose_logs_no_traceback(fresh, caplog):
    @fresh.task(queue="t-purpose", name="purpose")
    def purpose(ctx, what: str):
        if what == "retry":
            raise shardq.Retry(delay_s=3600)
        raise shardq.Fail("no such user")

    purpose.send("retry")
    purpose.send("fail")
    with caplog.at_level(logging.INFO, logger="shardq.worker"):
        drain(fresh, "t-purpose")
    lines = {r.levelno: r for r in caplog.records if "retry requested" in r.getMessage()
             or "failed for good" in r.getMessage()}
    assert set(lines) == {logging.INFO, logging.ERROR}
    assert not any(r.exc_info for r in lines.values())
    [dl] = fresh.queue.dead_letters("t-purpose")
    assert dl.error == "no such user"


def test_unknown_task_names_and_foreign_bodies_are_dead_lettered_not_crash_looped(fresh):
    @fresh.task(queue="t-unknown", name="known")
    def known(ctx):
        pass

    q = fresh.queue
    q.enqueue(msgpack.packb({"t": "renamed.task", "a": [], "k": {}, "v": 1}), queue="t-unknown")
    q.enqueue(b"raw bytes, not msgpack \xc1", queue="t-unknown")
    q.enqueue(msgpack.packb({"t": "known", "a": [], "k": {}, "v": 3}), queue="t-unknown")
    q.enqueue(msgpack.packb({"t": "known", "a": "x", "k": {}, "v": 1}), queue="t-unknown")
    known.send()
    stats = drain(fresh, "t-unknown")
    assert stats.succeeded == 1 and stats.leased == 5  # each bad job delivered once
    errors = sorted(d.error for d in q.dead_letters("t-unknown"))
    assert all(d.attempts == 1 for d in q.dead_letters("t-unknown"))
    assert any("unknown task 'renamed.task'" in e and "knows 1 task(s): known" in e for e in errors)
    assert any("not msgpack" in e for e in errors)
    assert any("version 3" in e for e in errors)
    assert any("malformed task body" in e for e in errors)


def test_ctx_gives_job_id_key_attempt_db_extend_and_progress(fresh, caplog):
    seen = {}

    @fresh.task(queue="t-ctx", key="k1", name="c")
    def c(ctx):
        seen.update(job_id=ctx.job_id, key=ctx.key, attempt=ctx.attempt, db=ctx.db, queue=ctx.queue)
        seen["deadline"] = ctx.extend(600)
        ctx.progress("half way")

    jid = c.send()
    with caplog.at_level(logging.INFO, logger="shardq.worker"):
        drain(fresh, "t-ctx", heartbeat_fraction=0.5)
    assert seen["job_id"] == jid and seen["key"] == "k1" and seen["attempt"] == 1 and seen["queue"] == "t-ctx"
    assert seen["deadline"] > fresh.queue.queue_config("t-ctx")["visibility_timeout"] + 500 + seen["deadline"] - 600
    assert any("progress: half way" in r.getMessage() for r in caplog.records)


def test_ctx_extend_of_a_lost_lease_raises_lease_lost(fresh):
    out = []

    @fresh.task(queue="t-ext", name="e")
    def e(ctx):
        fresh.queue.nack(ctx.lease, delivered=False)  # someone else ends our lease
        try:
            ctx.extend(10)
        except shardq.LeaseLost as exc:
            out.append(exc)
            raise shardq.Fail("stop") from exc

    e.send()
    drain(fresh, "t-ext", max_jobs=1)
    assert len(out) == 1


def test_ctx_db_commits_the_effect_once_with_the_idempotency_store(fresh):
    from shardq.consumer.idempotency import MemoryStore
    store = MemoryStore()

    @fresh.task(queue="t-db", name="pay")
    def pay(ctx, amount: int):
        ctx.db[ctx.job_id] = amount

    ids = pay.send_many([((i,), {}) for i in range(20)])
    drain(fresh, "t-db", idempotency=store)
    assert store.data == {jid: i for i, jid in enumerate(ids)}


def test_retries_beyond_max_deliveries_are_reported(fresh):
    # The embedded app knows its service's config, so it refuses them at declaration
    # (test_task_retries_at_declaration.py); an app without the config declares them, and
    # the worker reports them at start.
    with pytest.raises(shardq.InvalidConfig, match="the most allowed is retries=5"):
        fresh.task(queue="t-warn", retries=10, name="greedy")(lambda ctx: None)
    unaware = shardq.App(router=fresh.queue)

    @unaware.task(queue="t-warn", retries=10, name="greedy")
    def greedy(ctx):
        pass

    [msg] = check_retries(unaware.tasks, fresh.queue.queue_config)
    assert "greedy" in msg and "max_deliveries=6" in msg and "at least 11" in msg
    assert "[queues.t-warn] max_deliveries = 11" in msg and "lower retries to 5" in msg


def test_retries_up_to_max_deliveries_minus_one_are_not_reported(fresh):
    @fresh.task(queue="t-nowarn", retries=5, name="fits")  # max_deliveries = 6 here
    def fits(ctx):
        pass

    assert check_retries(fresh.tasks, fresh.queue.queue_config) == []


@pytest.mark.parametrize("doc", ["README.md", "docs/tasks.md"])
def test_the_documented_tasks_retries_fit_the_default_max_deliveries(doc):
    # Issue 36: the README's task had retries=5, and the worker warned at start that the
    # default max_deliveries=5 would dead-letter it first.
    with open(os.path.join(REPO, doc)) as f:
        text = f.read()
    found = [int(n) for n in re.findall(r"@app\.task\([^)]*?retries=(\d+)", text, re.S)]
    assert found
    a = shardq.App("unused")  # never connects: only declaring
    for i, retries in enumerate(found):
        a.task(queue="q", retries=retries, name=f"t{i}")(lambda ctx: None)
    defaults = {"max_deliveries": limits.MAX_DELIVERIES_DEFAULT}
    assert check_retries(a.tasks, lambda q: defaults) == []


def test_plan_gives_async_queues_the_asyncio_worker(fresh):
    @fresh.task(queue="a")
    async def x(ctx):
        pass

    @fresh.task(queue="b")
    def y(ctx):
        pass

    assert plan(fresh.tasks, None) == {"a": "async", "b": "thread"}
    assert plan(fresh.tasks, ["b", "c"]) == {"b": "thread", "c": "thread"}


def test_an_async_task_on_a_thread_worker_runs_on_its_own_loop(fresh):
    from shardq.consumer.idempotency import MemoryStore
    store = MemoryStore()

    @fresh.task(queue="t-async-thread", name="aio")
    async def aio(ctx, n: int):
        await ctx.db.run(lambda db: db.__setitem__(ctx.job_id, n))

    jid = aio.send(5)
    drain(fresh, "t-async-thread", idempotency=store)
    assert store.data == {jid: 5}


def test_task_handler_pickles_as_module_names():
    import pickle
    h = TaskHandler.from_modules(["examples.tasks_app.tasks"])
    h2 = pickle.loads(pickle.dumps(h))
    assert set(h2.tasks) == set(h.tasks) and h2.tasks
    with pytest.raises(TypeError):
        pickle.dumps(TaskHandler({}))


def test_bad_declarations_are_refused(fresh):
    with pytest.raises(shardq.InvalidConfig, match="retries"):
        fresh.task(retries=-1)
    with pytest.raises(shardq.InvalidConfig, match="retries"):
        fresh.task(retries=1.5)
    with pytest.raises(shardq.InvalidConfig, match="queue name"):
        fresh.task(queue="")
    with pytest.raises(shardq.InvalidConfig, match="base_s"):
        shardq.Exponential(base_s=10, cap_s=1)
    with pytest.raises(shardq.InvalidConfig, match="ctx"):
        fresh.task(lambda: None)

    @fresh.task(name="dup")
    def one(ctx):
        pass

    with pytest.raises(shardq.InvalidConfig, match="two tasks"):
        @fresh.task(name="dup")
        def two(ctx):
            pass


TYPED = textwrap.dedent('''
    import shardq

    app = shardq.App("var/shardq")


    @app.task(queue="emails", retries=3)
    def send_welcome(ctx: object, user_id: int, template: str = "default") -> None:
        ...


    @app.task
    async def resize(ctx: object, path: str, width: int) -> int:
        return width


    async def produce() -> None:
        job: shardq.JobId = await resize.send_async("a.png", width=3)
        await resize.send_async("a.png", "wide")  # E: wrong type


    send_welcome.send(42, template="short")
    send_welcome.send_with(delay=60, dedup_id="w-42")(42)
    send_welcome.send("42")  # E: wrong type
    send_welcome.send(42, templat="x")  # E: unknown keyword
    send_welcome.send_with(priority=1)(42, "a", "b")  # E: too many arguments
''')


def test_send_keeps_the_signature_for_mypy(tmp_path):
    path = tmp_path / "typed_tasks.py"
    path.write_text(TYPED)
    expected = {i for i, line in enumerate(TYPED.splitlines(), 1) if "# E:" in line}
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--no-incremental", "--no-error-summary", "--hide-error-context", str(path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    errors = {int(line.split(":")[1]) for line in proc.stdout.splitlines()
              if line.startswith(str(path)) and ": error:" in line}
    assert errors == expected, proc.stdout + proc.stderr


def test_a_closed_app_refuses_every_call_with_closed_as_a_closed_client_does(tmp_path):
    """After close(), a send through the app raised nothing and connected again (App(dir)),
    or failed with NotADataDir, the embedded service's dir being gone (App.embedded())."""
    import asyncio

    from support.service import Service
    with Service(shards=1) as svc:
        for app in (shardq.App(svc.data_dir), shardq.App.embedded()):
            @app.task
            def ping(ctx, n: int) -> int:
                return n

            assert ping.send(1) > 0  # (connects)
            app.close()
            with pytest.raises(shardq.Closed, match="app is closed"):
                ping.send(2)
            with pytest.raises(shardq.Closed, match="app is closed"):
                app.queue  # noqa: B018 - the property is the call under test
            with pytest.raises(shardq.Closed, match="app is closed"):
                asyncio.run(ping.send_async(3))
            app.close()  # (again: nothing left to close)
        with shardq.connect(svc.data_dir) as q:
            assert len(q.dequeue_many(ping.queue, max_jobs=10)) == 1  # the first App's send; none after close
