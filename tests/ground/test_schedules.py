"""Periodic jobs: tick arithmetic (cron in a time zone, every_s), the firing plan (never
twice, no bursts, catch-up), the scheduler's record across restarts, and a real supervisor
restarted around a fake clock."""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import uuid
from zoneinfo import ZoneInfo

import msgpack
import pytest

import shardq
from shardq import config, limits
from shardq.cli.main import main as shardq_main
from shardq.clock import FakeClock, SystemClock
from shardq.errors import InvalidConfig, QueueFull
from shardq.service.scheduler import Scheduler, State, collect_schedules, load_state, state_path
from shardq.schedules import NAME_BYTES_MAX, Schedule, fixed_time, iso, plan
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
    # croniter's R picks another time at every look: fired ~17 times a night, each tick new
    ({"cron": "R 2 * * *"}, "random value"),
    ({"cron": "0 R(0-5) * * *"}, "random value"),
])
def test_bad_schedules_are_refused_by_name(kw, words):
    with pytest.raises(InvalidConfig, match=words):
        Schedule.create("bad", queue="q", body=b"x", **kw)


# ---------------------------------------------------------------------------- clock changes
# cronie's rules (cron(8), "Daylight Saving Time and other time changes"): a fixed-time
# expression (neither minute nor hour field starts with "*") fires once in a repeated hour,
# and at the change for a time the clocks skip; any other fires at every wall-clock time
# that happens. In Paris in 2026 the clocks go forward on 29 March at 01:00Z (02:00 CET
# becomes 03:00 CEST) and back on 25 October at 01:00Z (03:00 CEST becomes 02:00 CET).
PARIS = "Europe/Paris"


def cron_ticks(cron: str, tz: str, start: float, end: float) -> list[str]:
    s = Schedule.create("n", queue="q", body=b"x", cron=cron, timezone=tz)
    out, t = [], start
    while (t := s.next_after(t)) < end:
        out.append(iso(t))
    return out


@pytest.mark.parametrize("cron, start, end, ticks", [
    # back: 02:00-02:59 local is 00:00-00:59Z (CEST), then again 01:00-01:59Z (CET)
    ("30 2 * * *", utc(2026, 10, 24, 23), utc(2026, 10, 25, 3), ["2026-10-25T00:30:00Z"]),
    ("*/30 * * * *", utc(2026, 10, 24, 23, 50), utc(2026, 10, 25, 2, 10),
     ["2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z", "2026-10-25T01:30:00Z",
      "2026-10-25T02:00:00Z"]),
    # forward: 02:00-02:59 local never happens; 01:00Z is 03:00 CEST
    ("30 2 * * *", utc(2026, 3, 28, 23), utc(2026, 3, 29, 3), ["2026-03-29T01:00:00Z"]),
    ("0,30 2 * * *", utc(2026, 3, 28, 23), utc(2026, 3, 29, 3), ["2026-03-29T01:00:00Z"]),
    ("30 */2 * * *", utc(2026, 3, 28, 23), utc(2026, 3, 29, 3), ["2026-03-28T23:30:00Z", "2026-03-29T02:30:00Z"]),
])
def test_cron_across_the_clock_changes_follows_cronie(cron, start, end, ticks):
    assert cron_ticks(cron, PARIS, start, end) == ticks


@pytest.mark.parametrize("cron, ticks", [
    # a day-of-month field that starts with "*" makes the two day fields both-and (cronie's
    # DOM_STAR): odd days that are Mondays, Mondays (croniter's default was either-or: every
    # odd day and every Monday, every day)
    ("0 0 */2 * mon", ["2027-01-11T00:00:00Z", "2027-01-25T00:00:00Z", "2027-02-01T00:00:00Z"]),
    ("0 0 */1 * mon", ["2027-01-04T00:00:00Z", "2027-01-11T00:00:00Z", "2027-01-18T00:00:00Z"]),
    ("0 0 * * */3", ["2027-01-02T00:00:00Z", "2027-01-03T00:00:00Z", "2027-01-06T00:00:00Z"]),  # Sat, Sun, Wed
    # neither starts with "*": either-or, as cron
    ("0 0 1-2 * mon", ["2027-01-01T00:00:00Z", "2027-01-02T00:00:00Z", "2027-01-04T00:00:00Z"]),
])
def test_the_two_day_fields_combine_as_cronie_does(cron, ticks):
    assert cron_ticks(cron, "UTC", utc(2027, 1, 1) - 1, utc(2027, 3, 1))[:3] == ticks
    s = Schedule.create("n", queue="q", body=b"x", cron=cron)
    assert s.last_at_or_before(s.next_after(utc(2027, 1, 1)) + 30) == s.next_after(utc(2027, 1, 1))


def test_fixed_time_means_no_star_leading_the_minute_or_the_hour_field():
    assert [fixed_time(c) for c in ("30 2 * * *", "0 9,17 * * 1-5", "0-59 0-23 * * *")] == [True] * 3
    assert [fixed_time(c) for c in ("*/15 * * * *", "0 * * * *", "0 */2 * * *", "* 2 * * *")] == [False] * 4


def cronie_model(cron: str, tz: str, start: int, end: int) -> list[int]:
    """The ticks in [start, end) as cronie's loop finds them, a minute at a time on the wall
    clock: a matching wall time fires when it shows, except a fixed-time one shown before (the
    clocks went back); fixed-time ones that the clock skipped fire at the minute after the jump."""
    from croniter import croniter
    zone, fixed, shown, out = ZoneInfo(tz), fixed_time(cron), set(), []
    wall = dt.datetime.fromtimestamp(start - 60, zone).replace(tzinfo=None)
    for t in range(start, end, 60):
        prev, wall = wall, dt.datetime.fromtimestamp(t, zone).replace(tzinfo=None)
        skipped = [prev + dt.timedelta(minutes=m) for m in range(1, (wall - prev) // dt.timedelta(minutes=1))]
        due = croniter.match(cron, wall) and not (fixed and wall in shown)
        if due or (fixed and any(croniter.match(cron, w) for w in skipped)):
            out.append(t)
        shown.add(wall)
    return out


CHANGES = [  # (zone, a change in 2026, UTC)
    (PARIS, utc(2026, 3, 29, 1)), (PARIS, utc(2026, 10, 25, 1)),
    ("America/New_York", utc(2026, 3, 8, 7)), ("America/New_York", utc(2026, 11, 1, 6)),
    ("Australia/Lord_Howe", utc(2026, 4, 4, 15)), ("Australia/Lord_Howe", utc(2026, 10, 3, 15, 30)),  # 30 min
]


@pytest.mark.parametrize("tz, change", CHANGES, ids=[f"{z}-{iso(c)[:10]}" for z, c in CHANGES])
def test_next_and_last_tick_match_a_minute_by_minute_model_of_cronie(tz, change):
    start, end = int(change) - 4 * 3600, int(change) + 4 * 3600
    for cron in ("30 2 * * *", "0,30 2 * * *", "15 1-3 * * *", "*/20 * * * *", "15 */2 * * *", "* 2 * * *"):
        model = cronie_model(cron, tz, start - 4 * 3600, end)
        s = Schedule.create("n", queue="q", body=b"x", cron=cron, timezone=tz)
        assert cron_ticks(cron, tz, start, end) == [iso(t) for t in model if start < t < end], cron
        for now in range(start + 17, end, 300):
            before = [t for t in model if t <= now]
            if before:
                assert s.last_at_or_before(now) == before[-1], (cron, iso(now))


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
    assert load_state(state_path(datadir)) == State(last={"tick": T0 + 60}, fired={"tick": T0 + 60})
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
    assert load_state(state_path(datadir)) == State({}, {})


def run_every_30_s(sch: Scheduler, clock: FakeClock, start: float, end: float) -> None:
    t = start
    while t <= end:
        clock.set(t)
        sch.run_once()
        t += 30


NIGHTLY = Schedule.create("nightly", queue="q", body=b"x", cron="30 2 * * *", timezone=PARIS)


def test_a_nightly_job_runs_once_on_the_night_the_clocks_go_back(datadir):
    """As reported: 02:30 in Paris happens twice on 25 October 2026, and the job ran twice."""
    clock, q = FakeClock(utc(2026, 10, 24)), FakeQueue()
    run_every_30_s(Scheduler([NIGHTLY], q, datadir, clock), clock, utc(2026, 10, 24), utc(2026, 10, 26, 2))
    assert [j[3] for j in q.jobs] == ["nightly:2026-10-24T00:30:00Z", "nightly:2026-10-25T00:30:00Z",
                                      "nightly:2026-10-26T01:30:00Z"]


def test_a_nightly_job_the_clocks_skip_runs_at_the_change(datadir):
    clock, q = FakeClock(utc(2026, 3, 28)), FakeQueue()
    run_every_30_s(Scheduler([NIGHTLY], q, datadir, clock), clock, utc(2026, 3, 28), utc(2026, 3, 30, 2))
    assert [j[3] for j in q.jobs] == ["nightly:2026-03-28T01:30:00Z", "nightly:2026-03-29T01:00:00Z",
                                      "nightly:2026-03-30T00:30:00Z"]


def test_a_scheduler_killed_in_the_repeated_hour_fires_the_night_once(datadir):
    """kill -9 after the record, or between the enqueue and the record: the restarted
    scheduler, in the second pass of 02:30, adds no job (the record, else the dedup id)."""
    clock, q = FakeClock(utc(2026, 10, 24, 22)), FakeQueue()
    sch = Scheduler([NIGHTLY], q, datadir, clock)
    run_every_30_s(sch, clock, utc(2026, 10, 24, 22), utc(2026, 10, 25, 0, 29))
    with open(state_path(datadir), "rb") as f:
        unrecorded = f.read()                           # the record as it was before the fire
    run_every_30_s(sch, clock, utc(2026, 10, 25, 0, 29, 30), utc(2026, 10, 25, 1, 30, 30))
    assert [j[3] for j in q.jobs] == ["nightly:2026-10-25T00:30:00Z"]
    assert Scheduler([NIGHTLY], q, datadir, clock).run_once() == []    # killed after the record
    with open(state_path(datadir), "wb") as f:
        f.write(unrecorded)                             # killed before it
    again = Scheduler([NIGHTLY], q, datadir, clock)
    assert [t for _, t, _ in again.run_once()] == [utc(2026, 10, 25, 0, 30)]  # the same tick, deduplicated
    run_every_30_s(again, clock, utc(2026, 10, 25, 1, 31), utc(2026, 10, 25, 4))
    assert [j[3] for j in q.jobs] == ["nightly:2026-10-25T00:30:00Z"]


SCHEDULES_TOML = """
[schedules.minutely]
every_s = 60
body = "m"

[schedules.yearly]
cron = "0 0 1 1 *"
body = "y"

[schedules.no-catch-up]
every_s = 60
body = "n"
catch_up = false
"""


def test_shardq_schedules_shows_no_last_tick_for_a_schedule_never_fired(tmp_path, capsys):
    """``last`` is the last tick fired: not the scheduler's start (yearly) nor a tick skipped
    with catch_up = false (no-catch-up), in the table ("-") and in --json (null)."""
    cfg, data = tmp_path / "shardq.toml", tmp_path / "data"
    cfg.write_text(SCHEDULES_TOML)
    data.mkdir()
    schedules = collect_schedules(config.load(str(cfg)))
    clock, q = FakeClock(T0 + 1), FakeQueue()
    assert Scheduler(schedules, q, str(data), clock).run_once() == []   # serve starts
    clock.set(T0 + 90)                                                  # restarted after T0 + 60
    assert [n for n, _, _ in Scheduler(schedules, q, str(data), clock).run_once()] == ["minutely"]
    assert load_state(state_path(str(data))).fired == {"minutely": T0 + 60}
    args = ["schedules", "--config", str(cfg), "--data-dir", str(data)]
    assert shardq_main([*args, "--json"]) == 0
    rows = {r["name"]: r["last"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {"minutely": iso(T0 + 60), "yearly": None, "no-catch-up": None}
    assert shardq_main(args) == 0
    table = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert table == {"minutely": iso(T0 + 60), "yearly": "-", "no-catch-up": "-"}


# ---------------------------------------------------------------------------- config mistakes
def test_a_schedule_on_a_queue_not_declared_is_refused_when_the_config_is_read():
    """It was accepted, then every tick failed with UnknownQueue, once a second, forever."""
    raw = {"service": {"declare_queues": True}, "queues": {"default": {}, "reports": {}},
           "schedules": {"nightly": {"cron": "30 2 * * *", "body": "x", "queue": "report"}}}
    with pytest.raises(InvalidConfig, match=r"^schedules\.nightly\.queue: queue 'report' is not declared"):
        config.parse(raw)
    assert config.parse({**raw, "service": {}}).schedules["nightly"].queue == "report"  # any queue will do
    raw["schedules"]["nightly"]["queue"] = "reports"
    assert config.parse(raw).schedules["nightly"].queue == "reports"


PERIODIC_MODULE = """
import shardq
app = shardq.App("unused")

@app.periodic(every_s=60, name="x")
@app.task(queue={queue!r})
def tick(ctx):
    pass
"""


def periodic_module(tmp_path, monkeypatch, queue: str = "default") -> str:
    name = f"periodic_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(PERIODIC_MODULE.format(queue=queue))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_two_schedules_of_one_name_are_refused_as_a_config_error(tmp_path, monkeypatch, capsys):
    """The name is a schedule's dedup ids and its record: one of them would never fire. It
    was refused only by the Scheduler (ShardqError, once serve's shards had started), and
    ``shardq schedules`` listed both."""
    raw = {"schedules": {"x": {"every_s": 60, "body": "config"}},
           "service": {"schedule_modules": [periodic_module(tmp_path, monkeypatch)]}}
    words = r"two schedules are named 'x' \(\[schedules\.x\] and an @app\.periodic schedule\)"
    with pytest.raises(InvalidConfig, match=words):
        collect_schedules(config.parse(raw))
    raw["service"]["schedule_modules"].append(periodic_module(tmp_path, monkeypatch))
    del raw["schedules"]
    with pytest.raises(InvalidConfig, match=r"two schedules are named 'x' \(two @app\.periodic schedules\)"):
        collect_schedules(config.parse(raw))
    toml = tmp_path / "shardq.toml"
    toml.write_text(f"[service]\nschedule_modules = {json.dumps(raw['service']['schedule_modules'])}\n")
    assert shardq_main(["schedules", "--config", str(toml), "--data-dir", str(tmp_path)]) == 5
    assert "two schedules are named 'x'" in capsys.readouterr().err


def test_a_periodic_task_on_a_queue_not_declared_is_refused(tmp_path, monkeypatch):
    raw = {"service": {"declare_queues": True, "schedule_modules": [periodic_module(tmp_path, monkeypatch, "reports")]}}
    with pytest.raises(InvalidConfig, match="schedule 'x' sends to queue 'reports', which is not declared"):
        collect_schedules(config.parse(raw))
    raw["queues"] = {"reports": {}}
    assert [s.queue for s in collect_schedules(config.parse(raw))] == ["reports"]


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
            assert load_state(state_path(data)).last["every-minute"] == T0 + 3660
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
