"""Periodic jobs: tick arithmetic (cron in a time zone, every_s), the firing plan (never
twice, no bursts, catch-up), the scheduler's record across restarts, and a real supervisor
restarted around a fake clock."""
from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.clock import FakeClock, SystemClock
from shardq.errors import InvalidConfig, QueueFull
from shardq.service.scheduler import Scheduler, load_state, state_path
from shardq.schedules import NAME_BYTES_MAX, Schedule, iso, plan
from shardq.service.supervisor import Supervisor

from support.service import REPO, Service, short_tmpdir, wait_until


def utc(*a) -> float:
    return dt.datetime(*a, tzinfo=dt.UTC).timestamp()


def every(s, **kw) -> Schedule:
    return Schedule.create("tick", queue="default", body=b"x", every_s=s, **kw)


# ---------------------------------------------------------------------------- ticks
def test_every_s_ticks_are_multiples_of_the_period_since_the_epoch():
    s = every(60)
    t = utc(2026, 1, 1, 12, 0, 30)
    assert s.last_at_or_before(t) == utc(2026, 1, 1, 12, 0)
    assert s.next_after(t) == utc(2026, 1, 1, 12, 1)
    assert s.next_after(utc(2026, 1, 1, 12, 1)) == utc(2026, 1, 1, 12, 2)  # strictly after
    assert s.last_at_or_before(utc(2026, 1, 1, 12, 1)) == utc(2026, 1, 1, 12, 1)


def test_cron_is_evaluated_in_its_time_zone_across_daylight_saving():
    s = Schedule.create("nine", queue="q", body=b"x", cron="0 9 * * *", timezone="Europe/Paris")
    assert s.next_after(utc(2026, 1, 10)) == utc(2026, 1, 10, 8)     # CET = UTC+1
    assert s.next_after(utc(2026, 7, 10)) == utc(2026, 7, 10, 7)     # CEST = UTC+2
    # The spring-forward night (29 March 2026): 09:00 local is still one tick a day.
    assert s.next_after(utc(2026, 3, 29)) == utc(2026, 3, 29, 7)
    assert s.last_at_or_before(utc(2026, 3, 29, 7)) == utc(2026, 3, 29, 7)
    assert s.last_at_or_before(utc(2026, 3, 29, 6, 59)) == utc(2026, 3, 28, 8)


def test_dedup_id_names_the_tick_and_fits_the_limit_at_the_longest_name():
    s = Schedule.create("n" * NAME_BYTES_MAX, queue="q", body=b"x", every_s=60)
    did = s.dedup_id(utc(2026, 11, 30, 20, 5))
    assert did.endswith(":2026-11-30T20:05:00Z")
    assert len(did.encode()) == limits.DEDUP_ID_BYTES_MAX
    with pytest.raises(InvalidConfig, match="name"):
        Schedule.create("n" * (NAME_BYTES_MAX + 1), queue="q", body=b"x", every_s=60)


@pytest.mark.parametrize("kw, words", [
    ({"cron": "*/5 * * *"}, "5-field"),
    ({"cron": "61 * * * *"}, "5-field"),
    ({"every_s": 0.5}, "every_s"),
    ({"every_s": 60, "cron": "* * * * *"}, "exactly one"),
    ({}, "exactly one"),
    ({"every_s": 60, "timezone": "Nowhere/Town"}, "time zone"),
])
def test_bad_schedules_are_refused_by_name(kw, words):
    with pytest.raises(InvalidConfig, match=words):
        Schedule.create("bad", queue="q", body=b"x", **kw)


# ---------------------------------------------------------------------------- the plan
T0 = utc(2026, 1, 1, 12, 0)


def test_plan_fires_each_tick_once_in_order():
    s = every(60)
    tick, last = plan(s, None, T0 + 10, started_at=T0 + 5)
    assert tick is None                           # first sight: nothing before start is owed
    tick, last = plan(s, last, T0 + 60, T0 + 5)
    assert tick == T0 + 60
    assert plan(s, last, T0 + 61, T0 + 5) == (None, T0 + 60)  # not twice
    assert plan(s, last, T0 + 120.5, T0 + 5) == (T0 + 120, T0 + 120)


def test_a_clock_stepped_back_fires_nothing_until_it_passes_the_last_tick():
    s = every(60)
    last = T0 + 600
    for now in (T0 + 30, T0 + 300, T0 + 600, T0 + 659):
        assert plan(s, last, now, T0) == (None, last)
    assert plan(s, last, T0 + 660, T0) == (T0 + 660, T0 + 660)


def test_a_stall_or_a_jump_forward_fires_once_not_a_burst():
    s = every(60)
    assert plan(s, T0, T0 + 3600 + 5, T0) == (T0 + 3600, T0 + 3600)


@pytest.mark.parametrize("catch_up, fired", [(True, True), (False, False)])
def test_a_tick_missed_while_down_fires_once_on_start_unless_catch_up_is_false(catch_up, fired):
    s = every(60, catch_up=catch_up)
    restart = T0 + 600 + 7
    tick, last = plan(s, T0, restart, started_at=restart)
    assert tick == (T0 + 600 if fired else None) and last == T0 + 600
    assert plan(s, last, restart + 1, restart) == (None, T0 + 600)
    assert plan(s, last, T0 + 660, restart) == (T0 + 660, T0 + 660)  # on time again


# ---------------------------------------------------------------------------- the scheduler
class FakeQueue:
    """Records enqueues; dedup like the real queue (same dedup id -> first id)."""

    def __init__(self):
        self.jobs: list[tuple] = []
        self.ids: dict[str, int] = {}
        self.fail = False

    def enqueue(self, body, key=None, queue="default", dedup_id=None, **_):
        if self.fail:
            raise QueueFull("full")
        if dedup_id in self.ids:
            return self.ids[dedup_id]
        self.jobs.append((queue, key, body, dedup_id))
        self.ids[dedup_id] = len(self.jobs)
        return len(self.jobs)


@pytest.fixture
def datadir(tmp_path):
    return str(tmp_path)


def test_scheduler_records_the_last_tick_and_catches_up_once_after_a_restart(datadir):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    s = every(60)
    sch = Scheduler([s], q, datadir, clock)
    assert sch.run_once() == []
    clock.set(T0 + 61)
    assert [t for _, t, _ in sch.run_once()] == [T0 + 60]
    assert load_state(state_path(datadir)) == {"tick": T0 + 60}
    assert sch.next_wake_s(clock.now()) == pytest.approx(1.0)  # at most a second asleep
    # Down for ten minutes, then a new scheduler (a restarted supervisor).
    clock.set(T0 + 60 + 600 + 3)
    sch2 = Scheduler([s], q, datadir, clock)
    assert [t for _, t, _ in sch2.run_once()] == [T0 + 660]  # once, the latest missed tick
    assert sch2.run_once() == []
    assert [j[3] for j in q.jobs] == [f"tick:{iso(T0 + 60)}", f"tick:{iso(T0 + 660)}"]


def test_a_crash_between_enqueue_and_record_refires_the_same_dedup_id(datadir):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    s = every(60)
    Scheduler([s], q, datadir, clock).run_once()
    clock.set(T0 + 61)
    sch = Scheduler([s], q, datadir, clock)
    sch.started_at = T0 + 1
    [(_, _, first)] = sch.run_once()
    os.unlink(state_path(datadir))                     # the record was never written
    again = Scheduler([s], q, datadir, clock)          # restarted at the same moment
    again.last = {"tick": T0}
    [(_, _, second)] = again.run_once()
    assert second == first and len(q.jobs) == 1        # the queue's dedup: one job


def test_a_failed_enqueue_is_not_recorded_and_is_tried_again(datadir):
    clock, q = FakeClock(T0 + 1), FakeQueue()
    sch = Scheduler([every(60)], q, datadir, clock)
    sch.run_once()
    clock.set(T0 + 61)
    q.fail = True
    assert sch.run_once() == []
    q.fail = False
    assert [t for _, t, _ in sch.run_once()] == [T0 + 60]


def test_an_unreadable_record_is_treated_as_missing(datadir):
    with open(state_path(datadir), "w") as f:
        f.write("{not json")
    assert load_state(state_path(datadir)) == {}


# ---------------------------------------------------------------------------- real shards
def _count(q, queue):
    st = q.stats()["queues"].get(queue, {})
    return st.get("ready", 0) + st.get("delayed", 0)


class FakeWallClock(FakeClock):
    """Wall time moved by hand (the scheduler's), monotonic time real: the supervisor times
    its shards' health pings on it, and a jump of the fake clock is no hung shard."""
    monotonic = staticmethod(SystemClock.monotonic)


def test_supervisor_fires_across_a_restart_with_a_fake_clock():
    tmp = short_tmpdir()
    data = os.path.join(tmp, "data")
    cfg = {"schedules": {"every-minute": {"every_s": 60, "body": "hello", "queue": "cron"},
                         "no-catch-up": {"every_s": 60, "body": "skip", "queue": "cron2",
                                         "catch_up": False}}}
    clock = FakeWallClock(T0 + 1)
    sup = Supervisor(data, cfg, 1, clock=clock).start(background=True)
    try:
        with shardq.connect(data) as q:
            clock.set(T0 + 61)
            sup.scheduler.poke()
            wait_until(lambda: _count(q, "cron") == 1 and _count(q, "cron2") == 1, 10, what="first tick")
            clock.set(T0 + 90)
            sup.scheduler.poke()
            sup.scheduler.poke()
            assert wait_until(lambda: sup.scheduler.run_once() == [], 5)  # nothing new
        sup.stop()
        clock.set(T0 + 61 + 3600)                       # an hour down
        sup = Supervisor(data, cfg, 1, clock=clock).start(background=True)
        with shardq.connect(data) as q:
            wait_until(lambda: _count(q, "cron") == 2, 10, what="the catch-up tick")
            [lease] = q.dequeue_many("cron", max_jobs=10)[1:]
            assert lease.body == b"hello"
            assert _count(q, "cron2") == 1              # catch_up = false: skipped
            sup.stop()
            sup = Supervisor(data, cfg, 1, clock=clock).start(background=True)  # same moment
            assert sup.scheduler.run_once() == []
            assert load_state(state_path(data))["every-minute"] == T0 + 3660
    finally:
        sup.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_schedulers_firing_one_tick_make_one_job():
    tmp = short_tmpdir()
    try:
        with shardq.open(os.path.join(tmp, "data"), shards=2) as q:
            clock = FakeClock(T0 + 61)
            s = Schedule.create("dup", queue="d", key="k", body=b"x", every_s=60)
            a = Scheduler([s], q, tmp + "/a", clock)
            b = Scheduler([s], q, tmp + "/b", clock)
            os.makedirs(tmp + "/a"), os.makedirs(tmp + "/b")
            a.last, b.last = {"dup": T0}, {"dup": T0}
            [(_, _, ja)] = a.run_once()
            [(_, _, jb)] = b.run_once()
            assert ja == jb and _count(q, "d") == 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_shardq_serve_fires_config_and_app_schedules_and_lists_them():
    cfg = {"service": {"schedule_modules": ["examples.tasks_app.tasks"]},
           "schedules": {"beat": {"every_s": 1, "task": "examples.tasks_app.tasks.hourly_report",
                                  "queue": "beats"}}}
    with Service(shards=1, config=cfg) as svc:
        with svc.connect() as q:
            wait_until(lambda: _count(q, "beats") >= 2, 15, 0.05, "two beats")
            [lease] = q.dequeue_many("beats", max_jobs=1)
            assert msgpack.unpackb(lease.body) == {"t": "examples.tasks_app.tasks.hourly_report",
                                                   "a": [], "k": {}, "v": 1}
        out = subprocess.run([sys.executable, "-m", "shardq.cli", "schedules", "--config",
                              svc.data_dir.rstrip("/") + ".toml", "--data-dir", svc.data_dir],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["name", "when", "queue", "runs", "next", "last"]
        beat = next(line for line in lines if line.startswith("beat "))
        assert "every 1 s" in beat and "beats" in beat and beat.split()[-1].endswith("Z")
        assert any(line.startswith("examples.tasks_app.tasks.hourly_report ") for line in lines)
