"""The supervisor's decisions, state by state (shardq/service/supervision.py): no process,
no pipe, no sleep; time is a FakeClock moved by hand. The same claims against real shard
processes are in test_supervisor.py; these run in milliseconds."""
from __future__ import annotations

import itertools

import pytest

from shardq.clock import FakeClock
from shardq.errors import InvariantViolation
from shardq.service.supervision import (
    RESTART_BACKOFF_S_FIRST, STABLE_RUN_S, TRANSITIONS, Corrupt, Exited, Failed, HangUp, Heard, Kill, Log, Notify,
    NotifyStatus, Ping, Policy, Pong, Progress, Publish, Ready, Reload, Reloaded, Shard, ShardState, Spawn,
    Stopped, Supervision, Watchdog, parse_line)

S = ShardState
HEALTH_S = 4.0          # a ping every 1 s
START_S = 60.0


def supervision(n: int = 1, *, backoff_max: float = 60.0, notify: bool = False) -> tuple[Supervision, FakeClock]:
    return Supervision([Shard(i) for i in range(n)], Policy(HEALTH_S, backoff_max, START_S), notify=notify), \
        FakeClock(1000.0)


def logs(actions) -> list[str]:
    return [a.name for a in actions if isinstance(a, Log)]


def fields(actions, name: str) -> dict:
    return next(dict(a.fields) for a in actions if isinstance(a, Log) and a.name == name)


def ready(core: Supervision, clock: FakeClock, i: int = 0) -> list:
    return core.check(clock.monotonic(), [Ready(i, str(100 + i), 10, "0.010000", 3)])


def started(n: int = 1, **kw) -> tuple[Supervision, FakeClock]:
    core, clock = supervision(n, **kw)
    out = core.check(clock.monotonic())
    assert [a for a in out if isinstance(a, Spawn)] == [Spawn(i) for i in range(n)] and out[-1] == Publish()
    for i in range(n):
        ready(core, clock, i)
    assert all(sh.status is S.READY for sh in core.shards)
    return core, clock


# ---------------------------------------------------------------------- the transition table
@pytest.mark.parametrize("old, new", list(itertools.product(S, S)), ids=lambda s: s.value)
def test_each_transition_is_made_or_refused_as_the_table_says(old, new):
    sh = Shard(0, status=old)
    if new in TRANSITIONS[old]:
        sh.move(new)
        assert sh.status is new
    else:
        with pytest.raises(InvariantViolation, match=f"{old} -> {new}"):
            sh.move(new)
        assert sh.status is old


def test_the_table_names_every_state_and_a_failed_shard_only_stops():
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.FAILED] == {S.STOPPED}       # a corrupt log is never retried
    assert S.READY not in TRANSITIONS[S.STOPPED]      # only a spawn leaves STOPPED
    assert S.STARTING not in TRANSITIONS[S.READY]     # a ready shard's process exits first


def test_the_status_is_published_as_its_word():
    assert [str(s) for s in S] == ["stopped", "starting", "ready", "restarting", "failed"]
    assert S.READY == "ready" and f"{S.RESTARTING}" == "restarting"


# ---------------------------------------------------------------------- start
def test_the_first_step_spawns_every_shard_and_ready_lines_make_them_ready():
    core, clock = supervision(2)
    assert core.next_wake(clock.monotonic(), 0.5) == 0  # a spawn is due: no wait
    assert core.check(clock.monotonic()) == [Spawn(0), Spawn(1), Publish()]
    assert [sh.status for sh in core.shards] == [S.STARTING, S.STARTING] and not core.settled()
    out = ready(core, clock, 0)
    assert logs(out) == ["shard-ready"] and Publish() in out
    assert fields(out, "shard-ready") == {"shard": 0, "pid": "100", "replay_records": 10, "replay_s": "0.010000",
                                          "jobs": 3}
    assert core.shards[0].ready_info == {"records": 10, "replay_s": 0.01, "jobs": 3}
    assert not core.settled()
    ready(core, clock, 1)
    assert core.settled() and core.check(clock.monotonic()) == []  # nothing due yet


def test_a_silent_starting_shard_is_killed_as_hung_but_one_reporting_progress_is_waited_for():
    core, clock = supervision(2)
    core.check(clock.monotonic())
    out = []
    for _ in range(5):  # shard 0 replays for 5 start timeouts, reporting progress
        clock.advance(START_S - 1)
        out += core.check(clock.monotonic(), [Progress(0, "replay")])
    assert core.shards[0].status is S.STARTING and Kill(0) not in out
    assert Kill(1) in out and core.shards[1].status is S.RESTARTING  # silent all along
    assert fields(out, "shard-hung")["phase"] == "starting"
    out = core.check(clock.monotonic(), [Exited(1, -9)])
    assert core.shards[1].reason_kind == "hung" and "while starting" in core.shards[1].reason
    assert Spawn(1) in out  # its first exit: restarted at once


# ---------------------------------------------------------------------- crashes and backoff
def test_a_crash_restarts_at_once_then_after_a_backoff_that_doubles_up_to_the_cap():
    core, clock = started(backoff_max=2.0)
    out = core.check(clock.monotonic(), [Exited(0, -9)])
    assert out[-2:] == [Spawn(0), Publish()] and logs(out) == ["shard-exit", "shard-restart"]
    assert fields(out, "shard-exit") == {"shard": 0, "pid": None, "exit": "signal=SIGKILL"}
    assert core.shards[0].restarts == 1 and core.shards[0].reason == "killed by SIGKILL"
    delays = []
    for _ in range(4):  # it dies again at once, each time
        out = core.check(clock.monotonic(), [Exited(0, 1)])
        assert core.shards[0].status is S.RESTARTING and Spawn(0) not in out
        delay = core.shards[0].restart_at - clock.monotonic()
        delays.append(delay)
        assert core.next_wake(clock.monotonic(), 5.0) == min(delay, HEALTH_S / 4)  # or the health check's
        clock.advance(delay - 0.01)
        assert Spawn(0) not in core.check(clock.monotonic())  # not a moment early
        clock.advance(0.01)
        assert core.check(clock.monotonic()) == [Spawn(0), Publish()]
    assert delays == [RESTART_BACKOFF_S_FIRST, 1.0, 2.0, 2.0]
    assert core.shards[0].restarts == 5 and core.shards[0].failures == 5


def test_a_crash_loop_counts_as_settled_and_is_never_given_up_on():
    core, clock = supervision(1)
    core.check(clock.monotonic())
    for _ in range(20):
        core.check(clock.monotonic(), [Exited(0, 4)])
        if core.shards[0].status is S.RESTARTING:  # the first exit restarts at once
            clock.advance(core.shards[0].restart_at - clock.monotonic())
            core.check(clock.monotonic())
    sh = core.shards[0]
    assert sh.status is S.STARTING and sh.failures == 20 and core.settled()
    assert sh.reason_kind == "log_failed" and sh.last_exit.startswith("code=4: a log write failed")
    assert sh.restart_at is None


def test_a_shard_that_served_long_enough_starts_its_backoff_again():
    core, clock = started()
    core.check(clock.monotonic(), [Exited(0, 1)])       # failure 1: at once
    ready(core, clock)
    core.check(clock.monotonic(), [Exited(0, 1)])       # failure 2: after 0.5 s
    assert core.shards[0].failures == 2
    clock.advance(RESTART_BACKOFF_S_FIRST)
    core.check(clock.monotonic())
    ready(core, clock)
    clock.advance(STABLE_RUN_S)
    out = core.check(clock.monotonic(), [Exited(0, 1)])  # after a stable run: a new failure
    assert core.shards[0].failures == 1 and Spawn(0) in out


@pytest.mark.parametrize("report, kind, words", [
    (Failed(0, {"kind": "disk_full", "detail": "No space left", "path": "/d/1.wal"}), "disk_full",
     "disk full: No space left (/d/1.wal)"),
    (Failed(0, {"kind": "open", "detail": "File exists"}), "io_error", "cannot open its log: File exists"),
    (Heard(0), "exit", "exited with code 3"),
])
def test_why_a_shard_exited_is_kept_and_it_is_restarted(report, kind, words):
    core, clock = started()
    out = core.check(clock.monotonic(), [report, Exited(0, 3)])
    assert (core.shards[0].reason_kind, core.shards[0].reason) == (kind, words)
    assert Spawn(0) in out
    ready(core, clock)
    assert core.shards[0].reason is None and words in core.shards[0].last_exit or kind == "exit"


def test_a_corrupt_log_leaves_the_shard_failed_for_good():
    core, clock = started(2)
    c = {"path": "/d/shard-0/1.wal", "offset": 4096, "reason": "crc mismatch"}
    out = core.check(clock.monotonic(), [Corrupt(0, c), Exited(0, 3)])
    assert core.shards[0].status is S.FAILED and Spawn(0) not in out
    assert logs(out) == ["shard-exit", "shard-failed"]
    assert core.shards[0].reason == "corrupt log /d/shard-0/1.wal at offset 4096: crc mismatch"
    clock.advance(3600)
    assert all(not isinstance(a, (Spawn, Ping, Kill)) or a.shard != 0 for a in core.check(clock.monotonic()))
    assert core.settled() and core.healthy(clock.monotonic())  # a failed shard does not fail the watchdog
    assert core.status_text(clock.monotonic())[0] == "1/2 shards up, shard 0 failed (corrupt-log)"


def test_a_shard_down_for_a_full_disk_does_not_fail_the_watchdog():
    """systemd's restart of the whole service frees no space and takes the healthy shards
    down: with WatchdogSec=60 and the restart backoff's 60 s, a shard crash-looping on a
    full disk got serve restarted about every minute (a walkthrough saw no WATCHDOG=1 for
    45 s). It is restarted with backoff meanwhile, as before; any other exit still counts."""
    core, clock = started(2)
    full = Failed(0, {"kind": "disk_full", "detail": "No space left", "path": "/d/1.wal"})
    out = core.check(clock.monotonic(), [full, Exited(0, 4)])
    assert core.shards[0].status is not S.READY and Spawn(0) in out
    assert core.healthy(clock.monotonic())
    core.check(clock.monotonic(), [Exited(1, 3)])  # the other shard crashes: that is no disk
    assert not core.healthy(clock.monotonic())


# ---------------------------------------------------------------------- health
def test_a_ready_shard_is_pinged_and_a_pong_keeps_it():
    core, clock = started()
    clock.advance(HEALTH_S / 4 - 0.01)
    assert core.check(clock.monotonic()) == []
    clock.advance(0.01)
    assert core.check(clock.monotonic()) == [Ping(0)]
    clock.advance(0.5)
    assert core.check(clock.monotonic()) == []  # one ping in flight at a time
    core.check(clock.monotonic(), [Pong(0, (5, 2), 1)])
    assert (core.shards[0].depth, core.shards[0].workflows_running) == ((5, 2), 1)
    assert core.status_text(clock.monotonic()) == ("1/1 shards up", "; queue depth 2 ready, 5 jobs held")


def test_a_hung_shard_is_killed_after_missed_pings_and_restarted():
    core, clock = started()
    clock.advance(HEALTH_S / 4)
    assert core.check(clock.monotonic()) == [Ping(0)]
    clock.advance(HEALTH_S)
    assert not core.healthy(clock.monotonic())
    assert Kill(0) not in core.check(clock.monotonic())  # exactly the timeout: not yet
    clock.advance(0.01)
    out = core.check(clock.monotonic())
    assert out == [Log("shard-hung", 30, (("shard", 0), ("pid", None), ("unanswered_s", "4.0"))), Kill(0),
                   Publish()]
    sh = core.shards[0]
    assert sh.status is S.RESTARTING and sh.restart_at is None and core.next_wake(clock.monotonic(), 0.5) == 0.5
    assert Spawn(0) not in core.check(clock.monotonic() + 100)  # its exit is waited for
    assert core.check(clock.monotonic(), [Ready(0, "1", 0, "0.0", 0)]) == []  # a late line changes nothing
    out = core.check(clock.monotonic(), [Exited(0, -9)])
    assert Spawn(0) in out and sh.status is S.STARTING and sh.hung is None
    assert (sh.reason_kind, sh.restarts) == ("hung", 1) and "no answer to a health ping" in sh.reason
    assert fields(out, "shard-exit")["reason"] == "hung"


def test_progress_keeps_a_shard_that_answers_no_ping_and_a_long_phase_is_logged_once():
    core, clock = started()
    clock.advance(HEALTH_S / 4)
    core.check(clock.monotonic())  # a ping, not answered: the shard compacts
    said = []
    for _ in range(12):
        clock.advance(1.0)
        out = core.check(clock.monotonic(), [Progress(0, "compact")])
        assert Kill(0) not in out
        said += logs(out)
    assert said == ["shard-busy"] and core.status_of(core.shards[0], clock.monotonic())["busy"] == "compact"
    core.check(clock.monotonic(), [Pong(0)])
    assert core.shards[0].busy is None


def test_a_slow_disk_is_a_warning_not_a_hang():
    core, clock = started()
    out = []
    for _ in range(6):
        clock.advance(1.0)
        out += core.check(clock.monotonic(), [Progress(0, "disk")])
    busy = [a for a in out if isinstance(a, Log) and a.name == "shard-busy"]
    assert len(busy) == 1 and busy[0].level == 30 and "slow disk" in dict(busy[0].fields)["note"]


# ---------------------------------------------------------------------- stop
def test_a_stop_while_shards_start_spawns_pings_and_kills_nothing_more():
    core, clock = supervision(2)
    core.check(clock.monotonic())
    ready(core, clock, 0)
    assert core.stop() == [] and core.stop() == []
    clock.advance(10 * START_S)  # shard 1 silent far past its start timeout, shard 0 unpinged
    assert core.check(clock.monotonic()) == []
    out = core.check(clock.monotonic(), [Exited(1, 1)])  # an exit now is a stop, not a crash
    assert core.shards[1].status is S.STOPPED and logs(out) == [] and core.shards[1].restarts == 0
    out = core.check(clock.monotonic(), [Stopped(0, 0), Stopped(1, 1)])
    assert logs(out) == ["shard-stopped"] and fields(out, "shard-stopped") == {"shard": 0, "exit": "code=0"}
    assert [sh.status for sh in core.shards] == [S.STOPPED, S.STOPPED]
    assert core.check(clock.monotonic()) == []  # stopped shards are not spawned again


def test_a_stop_tells_the_service_manager_once_and_then_nothing():
    core, clock = started(notify=True)
    assert core.announce(clock.monotonic()) == [NotifyStatus("1/1 shards up", "", ready=True)]
    assert Watchdog() in core.check(clock.monotonic())
    assert core.stop() == [Notify(("STOPPING=1", "STATUS=stopping: shards finish their commits and checkpoint"))]
    assert core.stop() == [] and core.announce(clock.monotonic()) == []
    assert core.check(clock.monotonic() + 100, [HangUp()]) == []  # no watchdog, status or reload


# ---------------------------------------------------------------------- the service manager
def test_while_starting_the_manager_hears_starting_and_its_timeout_is_extended():
    core, clock = supervision(2, notify=True)
    out = core.check(clock.monotonic())
    usec = int((START_S + 2 * HEALTH_S / 4) * 1e6)
    assert Notify((f"EXTEND_TIMEOUT_USEC={usec}",)) in out
    assert NotifyStatus("starting: 0/2 shards up, shard 0 starting, shard 1 starting", "") in out
    assert Watchdog() not in out
    clock.advance(0.5)
    assert not any(isinstance(a, Notify) for a in core.check(clock.monotonic()))  # paced: a ping interval
    clock.advance(0.5)
    assert any(isinstance(a, Notify) for a in core.check(clock.monotonic()))


def test_a_sighup_reloads_between_reloading_and_ready():
    core, clock = started(notify=True)
    out = [a for a in core.check(clock.monotonic(), [HangUp()]) if isinstance(a, (Notify, Reload))]
    assert out == [Notify(("RELOADING=1", f"MONOTONIC_USEC={int(clock.monotonic() * 1e6)}")), Reload(),
                   Notify(("READY=1",))]
    quiet, clock = started()
    assert quiet.check(clock.monotonic(), [HangUp()]) == [Reload()]
    assert quiet.check(clock.monotonic(), [Reloaded(0)])[0].name == "shard-reloaded"


def test_the_published_status_says_when_a_restart_is_due():
    core, clock = started()
    core.check(clock.monotonic(), [Exited(0, 1)])
    core.check(clock.monotonic(), [Exited(0, 1)])
    clock.advance(0.2)
    row = core.status_of(core.shards[0], clock.monotonic())
    assert row == {"shard": 0, "status": "restarting", "restarts": 2, "last_exit": "code=1",
                   "reason": "exited with code 1", "reason_kind": "exit", "restart_in_s": 0.3}


# ---------------------------------------------------------------------- report lines
@pytest.mark.parametrize("line, event", [
    ("progress compact 9", Progress(2, "compact")),
    ("ready 4242 10 0.240013 7", Ready(2, "4242", 10, "0.240013", 7)),
    ("pong", Pong(2)),
    ("pong 5 2", Pong(2, (5, 2), 0)),
    ("pong 5 2 3", Pong(2, (5, 2), 3)),
    ("reloaded", Reloaded(2)),
    ('corrupt {"path": "p", "offset": 1, "reason": "r"}', Corrupt(2, {"path": "p", "offset": 1, "reason": "r"})),
    ('failed {"kind": "disk_full"}', Failed(2, {"kind": "disk_full"})),
    ("something new", Heard(2)),
    ("", Heard(2)),
])
def test_a_report_line_is_read_as_its_event(line, event):
    assert parse_line(2, line) == event


@pytest.mark.parametrize("line", ["ready 1 2 3", "ready x 1 0.1 nope", "ready 1 1 fast 0", "pong one 2",
                                  "corrupt {not json", "corrupt [1]"])
def test_a_malformed_report_line_raises_for_the_caller_to_log(line):
    with pytest.raises((ValueError, KeyError, TypeError)):
        parse_line(0, line)


# ---------------------------------------------------------------------- time, injected
CLOCK_READS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}


def test_no_module_of_the_service_reads_the_clock_but_through_a_clock():
    """shardq/clock.py is the one place time is read: the supervisor, its decisions and the
    HTTP side take a Clock (a FakeClock in tests)."""
    import ast
    import pathlib

    import shardq.service
    found = []
    for path in sorted(pathlib.Path(shardq.service.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in CLOCK_READS
                    and isinstance(node.value, ast.Name) and node.value.id == "time"):
                found.append(f"{path.name}:{node.lineno} time.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "time":
                found += [f"{path.name}:{node.lineno} from time import {a.name}" for a in node.names
                          if a.name in CLOCK_READS]
    assert found == []
