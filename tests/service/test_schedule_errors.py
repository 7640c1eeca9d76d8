"""A schedule that cannot fire, and a schedule that fails: a cron expression that matches no
date (``0 0 30 2 *``, 30 February) passed the config's checks, ``shardq schedules`` died of
croniter's CroniterBadDateError and ``shardq serve``'s scheduler failed on every wake
(``event=scheduler-error``) firing nothing, not even the config's other schedules. Now such
an expression is refused when the config is read, and one schedule's error, whatever it is,
stops that schedule alone."""
from __future__ import annotations

import logging
import os

import pytest

from shardq import config
from shardq.cli.main import main as shardq_main
from shardq.clock import FakeClock
from shardq.errors import InvalidConfig
from shardq.schedules import Schedule, iso
from shardq.service.scheduler import Scheduler, load_state, state_path

from support.service import Service, short_tmpdir, wait_until

T0 = 1_800_000_000.0  # a multiple of 60


@pytest.mark.parametrize("cron", ["0 0 30 2 *", "0 0 31 4 *", "15 3 31 2,4,6,9,11 *", "* * 30,31 2 *"])
def test_a_cron_that_matches_no_date_is_refused_when_the_config_is_read(cron, tmp_path, capsys):
    raw = {"schedules": {"never": {"cron": cron, "body": "feb30"},
                         "often": {"every_s": 2, "body": "tick"}}}
    with pytest.raises(InvalidConfig, match=r"^schedules\.never\.cron: .* matches no date"):
        config.parse(raw)
    with pytest.raises(InvalidConfig, match=r"schedule 'never'\.cron: .* matches no date"):
        Schedule.create("never", queue="q", body=b"x", cron=cron)     # an @app.periodic one
    toml = tmp_path / "shardq.toml"
    toml.write_text(f'[schedules.never]\ncron = "{cron}"\nbody = "feb30"\n')
    assert shardq_main(["schedules", "--config", str(toml), "--data-dir", str(tmp_path)]) == 5
    err = capsys.readouterr().err
    assert "schedules.never.cron" in err and "matches no date" in err and "Traceback" not in err


@pytest.mark.parametrize("cron", ["0 0 29 2 *", "0 0 30 2 1", "0 0 31 */2 *", "0 0 28 2 *"])
def test_a_cron_that_matches_some_date_however_rare_is_accepted(cron):
    """29 February (leap years), a day of the week beside 30 February (either one, as in
    cron: every Monday of February), the 31st of the odd months."""
    sc = config.parse({"schedules": {"rare": {"cron": cron, "body": "x"}}}).schedules["rare"]
    assert sc.cron == cron
    s = Schedule.create("rare", queue="q", body=b"x", cron=cron)
    assert s.last_at_or_before(T0) < T0 < s.next_after(T0)


class FailingSchedule(Schedule):
    """A schedule whose ticks cannot be worked out at run time (the config now refuses the
    cron expression that did this, so it is made to fail here)."""

    def last_at_or_before(self, t: float) -> float:
        raise RuntimeError("no tick for you")

    def next_after(self, t: float) -> float:
        raise RuntimeError("no tick for you")


def failing(name: str = "broken") -> Schedule:
    ok = Schedule.create(name, queue="default", body=b"never", every_s=60)
    return FailingSchedule(**{f: getattr(ok, f) for f in ok.__dataclass_fields__})


class FakeQueue:
    def __init__(self):
        self.jobs: list[str] = []
        self.fail_for: str | None = None

    def enqueue(self, body, key=None, queue="default", dedup_id=None, **_):
        if self.fail_for is not None and dedup_id.startswith(self.fail_for + ":"):
            raise TypeError("not a queue's refusal")
        self.jobs.append(dedup_id)
        return len(self.jobs)


def test_a_schedule_that_fails_stops_itself_alone(tmp_path, caplog):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    often = Schedule.create("often", queue="default", body=b"tick", every_s=2)
    sch = Scheduler([failing("broken"), often], q, str(tmp_path), clock)
    caplog.set_level(logging.INFO, logger="shardq.scheduler")
    assert sch.run_once() == []
    clock.set(T0 + 2.5)
    assert [(n, t) for n, t, _ in sch.run_once()] == [("often", T0 + 2)]
    assert sch.next_wake_s(clock.now()) == pytest.approx(1.0)   # often's next tick is T0 + 4; at most 1 s
    assert sch.next_wake_s(T0 + 3.75) == pytest.approx(0.25)    # often's tick, the broken one aside
    clock.set(T0 + 4.1)
    assert [(n, t) for n, t, _ in sch.run_once()] == [("often", T0 + 4)]
    assert load_state(state_path(str(tmp_path))).fired == {"often": T0 + 4}
    errors = [r for r in caplog.records if "event=schedule-error" in r.getMessage()]
    assert len(errors) == 3 == sch.errors                       # one a try, each naming the schedule
    assert all("schedule=broken error=RuntimeError: no tick for you" in r.getMessage() for r in errors)
    assert [bool(r.exc_info) for r in errors] == [True, False, False]  # the traceback once


def test_an_unexpected_error_from_the_enqueue_stops_that_schedule_alone(tmp_path, caplog):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    a = Schedule.create("a", queue="default", body=b"a", every_s=2)
    b = Schedule.create("b", queue="default", body=b"b", every_s=2)
    sch = Scheduler([a, b], q, str(tmp_path), clock)
    sch.run_once()
    q.fail_for = "a"
    clock.set(T0 + 2.5)
    assert [n for n, _, _ in sch.run_once()] == ["b"]
    assert "event=schedule-error schedule=a error=TypeError" in caplog.text
    q.fail_for = None
    assert [n for n, _, _ in sch.run_once()] == ["a"]           # not recorded: fired on the next wake
    assert q.jobs == [f"b:{iso(T0 + 2)}", f"a:{iso(T0 + 2)}"]


def test_the_scheduler_thread_fires_the_other_schedules(tmp_path):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    often = Schedule.create("often", queue="default", body=b"tick", every_s=2)
    sch = Scheduler([failing(), often], q, str(tmp_path), clock).start()
    try:
        for n in range(1, 4):
            clock.set(T0 + 2 * n + 0.5)
            sch.poke()
            wait_until(lambda: len(q.jobs) == n, 10, what=f"tick {n} of often")
        assert sch._thread is not None and sch._thread.is_alive()
    finally:
        sch.stop()
    assert sch._thread is not None and not sch._thread.is_alive()


BROKEN_MODULE = """
import shardq
from shardq.schedules import Schedule

app = shardq.App("unused")


class Broken(Schedule):
    def last_at_or_before(self, t):
        raise RuntimeError("broken at run time")

    def next_after(self, t):
        raise RuntimeError("broken at run time")


@app.periodic(every_s=1, name="broken")
@app.task
def never(ctx):
    pass


s = app.schedules[0]
app.schedules[0] = Broken(**{f: getattr(s, f) for f in s.__dataclass_fields__})
"""


def test_serve_fires_the_other_schedules_beside_a_failing_one(monkeypatch):
    """The finding as a user met it: ``shardq serve`` with a schedule that fails on every
    wake beside ``every_s = 1``; the latter fires (before: not once) and the log names the
    failing one."""
    mod_dir = short_tmpdir("sqmod")
    name = f"broken_sched_{os.getpid()}"
    with open(os.path.join(mod_dir, f"{name}.py"), "w") as f:
        f.write(BROKEN_MODULE)
    monkeypatch.setenv("PYTHONPATH", mod_dir)
    cfg = {"service": {"schedule_modules": [name]},
           "schedules": {"often": {"every_s": 1, "body": "tick"}}}
    with Service(shards=1, config=cfg) as svc, svc.connect() as q:
        wait_until(lambda: q.stats()["queues"].get("default", {}).get("ready", 0) >= 2, 20,
                   what="two ticks of the every_s = 1 schedule")
        wait_until(lambda: "event=schedule-error schedule=broken" in svc.tail(200), 10,
                   what="the failing schedule in the log")
        assert "event=scheduler-error" not in svc.tail(400)
        assert svc.proc is not None and svc.proc.poll() is None


def test_a_stuck_shard_holds_back_only_its_own_schedule_and_not_the_stop():
    """A shard stopped (SIGSTOP, a hung disk): the scheduler's enqueue to it waited the
    router's 15 s retry and 30 s request timeout, so the schedule on the healthy shard
    missed every tick meanwhile (nine in 20 s, then fired an old tick as if on time), and
    SIGTERM took 20 s (the scheduler's join on a blocked enqueue) against the 15 s
    docs/operations.md promises. The scheduler's client gives up on a shard within 2 s."""
    import signal
    import time

    from shardq.client.routing import shard_for_key
    keys = {shard_for_key(k, 2): k for k in (f"k{i}" for i in range(40))}
    cfg = {"service": {"health_timeout": 60}, "http": {"listen": ""},
           "schedules": {"on0": {"every_s": 1, "body": "t", "key": keys[0], "queue": "ticks"},
                         "on1": {"every_s": 1, "body": "t", "key": keys[1], "queue": "ticks"}}}
    with Service(shards=2, config=cfg) as svc:
        wait_until(lambda: "schedule=on1" in svc.tail(200), 20, what="a first tick on shard 1")
        stuck = svc.shard_pids()[0]
        os.kill(stuck, signal.SIGSTOP)
        try:
            fired = lambda: svc.tail(10_000).count("event=schedule-fired schedule=on1")  # noqa: E731
            before = fired()
            wait_until(lambda: fired() - before >= 2, 10,  # (was none for 15 s and more)
                       what="two ticks of the healthy shard's schedule while shard 0 is stopped")
            sent = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            svc.proc.wait(30)
            assert time.monotonic() - sent < 15, svc.tail(60)
        finally:
            try:
                os.kill(stuck, signal.SIGCONT)
            except ProcessLookupError:
                pass
