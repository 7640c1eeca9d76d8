"""The supervisor's decisions as a step function: no I/O, no clock, no processes.

:class:`Supervision` holds what the supervisor knows of each shard (a :class:`Shard`) and
is driven by one call, ``check(now, events) -> actions``: ``events`` are what happened
since the last call (a report line, a process exit, a stop, a SIGHUP), ``now`` is the
monotonic time the caller read from its clock, and the actions say what to do (spawn,
ping, kill, log, tell the service manager, reload). The thread that runs the processes
(:mod:`.supervisor`) gathers the events, calls :meth:`Supervision.check` and carries the
actions out; it decides nothing.

A shard's status is a :class:`ShardState`, and every change goes through
:meth:`Shard.move`, which refuses one that :data:`TRANSITIONS` does not allow
(:class:`~shardq.errors.InvariantViolation`: a bug here, not an operating error). An event
that no longer fits the status (a ``ready`` line from a process just killed as hung) is
dropped, not acted on.

The policy, in the supervisor's words (:mod:`.supervisor` for the whole story):

* a starting shard that reports nothing for ``start_timeout_s`` is hung; one reporting
  replay progress is waited for however long its replay takes;
* a ready shard is pinged every ``health_timeout_s / 4``; one that leaves a ping
  unanswered *and* reports no progress for ``health_timeout_s`` is hung: killed, then
  restarted when its exit is seen;
* the first exit restarts at once; each further exit before the shard has served for
  :data:`STABLE_RUN_S` (or ``restart_backoff_max_s`` if less) waits twice as long as the
  one before, from :data:`RESTART_BACKOFF_S_FIRST` up to ``restart_backoff_max_s``;
* a shard whose log is corrupt stays down (``failed``): restarting cannot repair a log;
* once stopping, nothing is spawned, pinged or killed, and an exit is a clean stop.
"""
from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import InvariantViolation

START_TIMEOUT_S = 60.0          # a starting shard that reports nothing for this long is hung
RESTART_BACKOFF_S_FIRST = 0.5   # the delay before the second restart in a row; doubles after
STABLE_RUN_S = 10.0             # ready this long (or restart_backoff_max if less): failures reset
EXIT_LOG_FAILED = 4             # shardq.shard.process's exit code for a failed log write


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal={signal.Signals(-code).name}"
        except ValueError:
            return f"signal={-code}"
    return f"code={code}"


class ShardState(StrEnum):
    """A shard slot's status, as published (``shardq stats``, the metrics' label)."""
    STOPPED = "stopped"        # no process, none wanted (before start, after stop)
    STARTING = "starting"      # spawned; replaying its log until it says "ready"
    READY = "ready"            # listening; pinged
    RESTARTING = "restarting"  # exited (restart_at set) or killed as hung (its exit awaited)
    FAILED = "failed"          # left down: a corrupt log


S = ShardState
#: every change of status the supervisor may make, checked in one place (:meth:`Shard.move`)
TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    S.STOPPED: frozenset({S.STARTING}),                            # spawned
    S.STARTING: frozenset({S.READY, S.RESTARTING, S.FAILED, S.STOPPED}),
    S.READY: frozenset({S.RESTARTING, S.FAILED, S.STOPPED}),       # exited, hung, corrupt, stopped
    # killed as hung, then its exit schedules the restart (RESTARTING again), or shows a corrupt log
    S.RESTARTING: frozenset({S.STARTING, S.RESTARTING, S.FAILED, S.STOPPED}),
    S.FAILED: frozenset({S.STOPPED}),
}


def allowed(old: ShardState, new: ShardState) -> bool:
    return new in TRANSITIONS[old]


@dataclass(eq=False)
class Shard:
    """What the supervisor knows of one shard slot; changed only by :class:`Supervision`."""
    index: int
    status: ShardState = ShardState.STOPPED
    pid: int | None = None             # the current process (the caller sets it as it spawns)
    restarts: int = 0
    failures: int = 0                  # exits in a row without a long enough run: the backoff step
    last_exit: str | None = None
    reason: str | None = None          # why it is not ready (kept while it starts again)
    reason_kind: str | None = None     # disk_full corrupt_log hung log_failed io_error exit
    restart_at: float | None = None    # while restarting; None while a killed process's exit is awaited
    ready_since: float | None = None
    last_heard: float = 0.0            # spawn, or the last line it sent
    busy: str | None = None            # the phase of its progress lines, until a ping answers
    busy_since: float = 0.0
    busy_logged: bool = False
    corrupt: dict[str, Any] | None = None  # what this run reported before exiting
    failed: dict[str, Any] | None = None
    hung: str | None = None            # why this run was killed as hung
    ready_info: dict[str, float] = field(default_factory=dict)
    depth: tuple[int, int] | None = None  # (jobs held, ready) from its last pong
    workflows_running: int = 0         # running workflow records, from its last pong
    ping_sent: float | None = None
    next_ping: float = 0.0

    def move(self, to: ShardState) -> None:
        """The one place a status changes; a change :data:`TRANSITIONS` refuses is a bug."""
        if not allowed(self.status, to):
            raise InvariantViolation(f"shard {self.index}: {self.status} -> {to} is not a transition")
        self.status = to


# ---------------------------------------------------------------------- events
# Events and actions are frozen records, equal when their class and fields are.
@dataclass(frozen=True)
class OfShard:
    """An event or an action about one shard."""
    shard: int


@dataclass(frozen=True)
class Bare:
    """An event or an action about the whole service."""


@dataclass(frozen=True)
class Progress(OfShard):
    phase: str


@dataclass(frozen=True)
class Ready(OfShard):
    pid: str
    records: int
    seconds: str  # the replay's, as the shard wrote them (logged as they are)
    jobs: int

    @property
    def replay_s(self) -> float:
        return float(self.seconds)


@dataclass(frozen=True)
class Pong(OfShard):
    depth: tuple[int, int] | None = None
    workflows_running: int = 0


@dataclass(frozen=True)
class Corrupt(OfShard):
    info: dict[str, Any]


@dataclass(frozen=True)
class Failed(OfShard):
    info: dict[str, Any]


@dataclass(frozen=True)
class Exited(OfShard):
    code: int


@dataclass(frozen=True)
class Stopped(OfShard):
    """stop() ended the shard's process (its exit code), or it had none (None)."""
    code: int | None


class Reloaded(OfShard):
    """The shard took the reloaded settings."""


class Heard(OfShard):
    """A line that says nothing more than that the shard lives."""


class HangUp(Bare):
    """SIGHUP: read the config file again."""


Event = Progress | Ready | Pong | Reloaded | Corrupt | Failed | Heard | Exited | Stopped | HangUp


def parse_line(shard: int, line: str) -> Event:
    """A report line (:mod:`shardq.shard.report`) as an event; ValueError, KeyError or
    TypeError for one that does not parse (the caller logs it)."""
    word, _, rest = line.partition(" ")
    if word == "progress":
        return Progress(shard, rest.split(" ", 1)[0])
    if word == "ready":
        pid, records, seconds, jobs = rest.split()
        float(seconds)  # ValueError now, not when it is read
        return Ready(shard, pid, int(records), seconds, int(jobs))
    if word == "pong":
        if not rest:
            return Pong(shard)
        held, ready, *more = rest.split()
        return Pong(shard, (int(held), int(ready)), int(more[0]) if more else 0)
    if word == "reloaded":
        return Reloaded(shard)
    if word in ("corrupt", "failed"):
        info = json.loads(rest)
        if not isinstance(info, dict):
            raise TypeError(f"{word}: not an object")
        return Corrupt(shard, info) if word == "corrupt" else Failed(shard, info)
    return Heard(shard)


# ---------------------------------------------------------------------- actions
class Spawn(OfShard):
    """Start the shard's process (its status is already STARTING)."""


class Ping(OfShard):
    """A health ping on the shard's stdin."""


class Kill(OfShard):
    """SIGKILL the shard's process: it is hung."""


@dataclass(frozen=True)
class Log:
    """``supervisor event=<name> key=value ...``, the fields in their order."""
    name: str
    level: int
    fields: tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class Notify:
    """Lines for the service manager, sent as they are."""
    lines: tuple[str, ...]


@dataclass(frozen=True)
class NotifyStatus:
    """``STATUS=<head><rest>``, paced by the notifier; with ``ready``, now and with ``READY=1``."""
    head: str
    rest: str
    ready: bool = False


class Watchdog(Bare):
    """``WATCHDOG=1`` if due: the service is healthy."""


class Reload(Bare):
    """Read the config file again and apply it."""


class Publish(Bare):
    """A status changed: publish every shard's status, wake whoever waits for one."""


Action = Spawn | Ping | Kill | Log | Notify | NotifyStatus | Watchdog | Reload | Publish


def _log(name: str, level: int = logging.INFO, **fields: object) -> Log:
    return Log(name, level, tuple(fields.items()))


@dataclass
class Policy:
    """The settings the decisions depend on (``[service]``, and start()'s timeout)."""
    health_timeout_s: float = 10.0
    restart_backoff_max_s: float = 60.0
    start_timeout_s: float = START_TIMEOUT_S

    @property
    def ping_interval_s(self) -> float:
        return self.health_timeout_s / 4


class Supervision:
    """The decisions about ``shards``; see the module's docstring.

    ``notify``: a service manager listens (``serve`` under systemd), so :meth:`check`
    also says what to tell it.
    """

    def __init__(self, shards: Iterable[Shard], policy: Policy | None = None, *, notify: bool = False):
        self.shards = list(shards)
        self.policy = policy or Policy()
        self.notify = notify
        self.stopping = False
        self.announced = False         # READY=1 sent: from now on the watchdog runs
        self._extended_at = float("-inf")

    # ------------------------------------------------------------------ the step
    def check(self, now: float, events: Iterable[Event] = ()) -> list[Action]:
        """Act on ``events`` in their order, then on what ``now`` makes due: spawns,
        restarts, pings, kills of hung shards, and what to tell the service manager."""
        out: list[Action] = []
        before = [sh.status for sh in self.shards]
        for ev in events:
            self._on_event(ev, now, out)
        if not self.stopping:
            for sh in self.shards:
                if sh.status is S.STOPPED or (sh.status is S.RESTARTING and sh.restart_at is not None
                                               and now >= sh.restart_at):
                    self._spawn(sh, now, out)
            self._health(now, out)
            if self.notify:
                self._tell_manager(now, out)
        if any(sh.status is not b for sh, b in zip(self.shards, before)) and Publish() not in out:
            out.append(Publish())
        return out

    def stop(self) -> list[Action]:
        """The service stops: from now on nothing is spawned, pinged or killed, and an exit is
        a clean stop. Says so to the service manager, once."""
        if self.stopping:
            return []
        self.stopping = True
        if not self.notify:
            return []
        return [Notify(("STOPPING=1", "STATUS=stopping: shards finish their commits and checkpoint"))]

    def next_wake(self, now: float, longest: float) -> float:
        """Seconds (at most ``longest``) until :meth:`check` has something to do unasked."""
        if self.stopping:
            return longest
        wait = min(longest, self.policy.ping_interval_s)  # health checks as fine-grained as the pings
        for sh in self.shards:
            if sh.status is S.STOPPED:
                return 0.0
            if sh.status is S.RESTARTING and sh.restart_at is not None:
                wait = min(wait, max(sh.restart_at - now, 0.0))
        return wait

    def settled(self) -> bool:
        """Every shard ready, failed, or failing again and again: what start() waits for."""
        return all(sh.status in (S.READY, S.FAILED) or sh.failures >= 2 for sh in self.shards)

    # ------------------------------------------------------------------ events
    def _on_event(self, ev: Event, now: float, out: list[Action]) -> None:
        if isinstance(ev, HangUp):
            if not self.stopping:
                self._reload(now, out)
            return
        sh = self.shards[ev.shard]
        if isinstance(ev, Exited):
            self._on_exit(sh, ev.code, now, out)
            return
        if isinstance(ev, Stopped):
            sh.ping_sent = None
            if ev.code is not None and sh.status in (S.STARTING, S.READY):
                out.append(_log("shard-stopped", shard=sh.index, exit=_describe_exit(ev.code)))
            if sh.status is not S.STOPPED:
                sh.move(S.STOPPED)
            return
        sh.last_heard = now
        if isinstance(ev, Progress):
            if sh.busy != ev.phase:
                sh.busy, sh.busy_since, sh.busy_logged = ev.phase, now, False
            elif not sh.busy_logged and now - sh.busy_since > self.policy.health_timeout_s:
                sh.busy_logged = True  # once per phase: it is why pings go unanswered
                if ev.phase == "disk":  # the operator's problem: a disk this slow delays every commit
                    out.append(_log("shard-busy", logging.WARNING, shard=sh.index, pid=sh.pid, phase=ev.phase,
                                    for_s=f"{now - sh.busy_since:.1f}",
                                    note='"waiting for a slow disk, not hung"'))
                else:
                    out.append(_log("shard-busy", shard=sh.index, pid=sh.pid, phase=ev.phase,
                                    for_s=f"{now - sh.busy_since:.1f}", note='"working, not hung"'))
        elif isinstance(ev, Ready):
            if not allowed(sh.status, S.READY):
                return  # killed as hung, or stopping: its exit is what counts now
            sh.ready_info = {"records": ev.records, "replay_s": ev.replay_s, "jobs": ev.jobs}
            sh.next_ping = now + self.policy.ping_interval_s
            sh.ping_sent = None
            sh.busy = None
            sh.ready_since = now
            sh.reason = sh.reason_kind = None
            out.append(_log("shard-ready", shard=sh.index, pid=ev.pid, replay_records=ev.records,
                            replay_s=ev.seconds, jobs=ev.jobs))
            sh.move(S.READY)
        elif isinstance(ev, Pong):
            sh.ping_sent = None
            sh.busy = None
            sh.next_ping = now + self.policy.ping_interval_s
            if ev.depth is not None:
                sh.depth = ev.depth
                sh.workflows_running = ev.workflows_running
        elif isinstance(ev, Reloaded):
            out.append(_log("shard-reloaded", shard=sh.index, pid=sh.pid))
        elif isinstance(ev, Corrupt):
            sh.corrupt = ev.info
        elif isinstance(ev, Failed):
            sh.failed = ev.info

    def _why(self, sh: Shard, code: int) -> tuple[str, str]:
        """(kind, words) for why the process that just exited did so."""
        if sh.corrupt:
            c = sh.corrupt
            return "corrupt_log", f"corrupt log {c['path']} at offset {c['offset']}: {c['reason']}"
        if sh.failed and sh.failed.get("kind") == "disk_full":
            where = f" ({sh.failed['path']})" if sh.failed.get("path") else ""
            return "disk_full", f"disk full: {sh.failed.get('detail')}{where}"
        if sh.failed:
            return "io_error", f"cannot open its log: {sh.failed.get('detail')}"
        if sh.hung:
            return "hung", f"hung: {sh.hung}"
        if code == EXIT_LOG_FAILED:
            return "log_failed", "a log write failed (exit code 4); the shard's log says why"
        if code < 0:
            return "exit", f"killed by {_describe_exit(code).removeprefix('signal=')}"
        return "exit", f"exited with code {code}"

    def _on_exit(self, sh: Shard, code: int, now: float, out: list[Action]) -> None:
        sh.ping_sent = None
        if self.stopping:
            if sh.status is not S.STOPPED:
                sh.move(S.STOPPED)
            return
        sh.reason_kind, sh.reason = kind, reason = self._why(sh, code)
        sh.last_exit = _describe_exit(code)
        if kind != "exit":
            sh.last_exit += f": {reason}"  # kept once it is ready again (reason is then cleared)
        if sh.corrupt:
            c = sh.corrupt
            out.append(_log("shard-exit", logging.WARNING, shard=sh.index, pid=sh.pid,
                            exit=f"{_describe_exit(code)} reason=corrupt-log path={c['path']} offset={c['offset']}"))
            out.append(_log("shard-failed", logging.ERROR, shard=sh.index, reason=json.dumps(reason),
                            note='"not restarted: check the log with shardq wal check"'))
            sh.move(S.FAILED)
            return
        cap = self.policy.restart_backoff_max_s
        if sh.ready_since is not None and now - sh.ready_since >= min(STABLE_RUN_S, cap):
            sh.failures = 0  # it ran long enough: this is a new failure, not a crash loop
        sh.failures += 1
        sh.ready_since = None
        delay = 0.0 if sh.failures == 1 else min(RESTART_BACKOFF_S_FIRST * 2 ** (sh.failures - 2), cap)
        extra = {} if kind == "exit" else {"reason": kind.replace("_", "-"), "detail": json.dumps(reason)}
        out.append(_log("shard-exit", logging.WARNING, shard=sh.index, pid=sh.pid, exit=_describe_exit(code),
                        **extra))
        sh.restarts += 1
        sh.restart_at = now + delay
        if delay:
            out.append(_log("shard-restart", logging.WARNING, shard=sh.index, restarts=sh.restarts,
                            in_s=f"{delay:g}", failures_in_a_row=sh.failures, reason=json.dumps(reason)))
        else:
            out.append(_log("shard-restart", shard=sh.index, restarts=sh.restarts))
        sh.move(S.RESTARTING)
        if not delay:
            self._spawn(sh, now, out)

    def _spawn(self, sh: Shard, now: float, out: list[Action]) -> None:
        sh.corrupt = sh.failed = sh.hung = sh.busy = sh.restart_at = sh.depth = None
        sh.pid = None
        sh.last_heard = now
        sh.move(S.STARTING)
        out.append(Spawn(sh.index))

    # ------------------------------------------------------------------ health
    def _kill_hung(self, sh: Shard, why: str, out: list[Action], **fields: object) -> None:
        out.append(_log("shard-hung", logging.WARNING, shard=sh.index, pid=sh.pid, **fields))
        out.append(Kill(sh.index))  # the exit it causes drives the restart
        sh.hung = why
        sh.ping_sent = None
        sh.restart_at = None
        sh.move(S.RESTARTING)

    def _health(self, now: float, out: list[Action]) -> None:
        timeout = self.policy.health_timeout_s
        for sh in self.shards:
            if sh.status is S.STARTING:
                if now - sh.last_heard > self.policy.start_timeout_s:
                    self._kill_hung(sh, f"no progress for {now - sh.last_heard:.0f} s while starting", out,
                                    silent_s=f"{now - sh.last_heard:.1f}", phase="starting")
                continue
            if sh.status is not S.READY:
                continue
            if sh.ping_sent is not None:  # answered by a "pong" line
                if now - max(sh.ping_sent, sh.last_heard) > timeout:
                    self._kill_hung(sh, f"no answer to a health ping for {now - sh.ping_sent:.1f} s", out,
                                    unanswered_s=f"{now - sh.ping_sent:.1f}")
                continue
            if now >= sh.next_ping:
                out.append(Ping(sh.index))
                sh.ping_sent = now

    def shard_healthy(self, sh: Shard, now: float) -> bool:
        """Ready and either answering its pings or reporting progress (a compaction, a slow
        disk): nothing unanswered for more than two ping intervals."""
        if sh.status is not S.READY:
            return False
        return sh.ping_sent is None or now - max(sh.ping_sent, sh.last_heard) <= 2 * self.policy.ping_interval_s

    def healthy(self, now: float) -> bool:
        """What ``WATCHDOG=1`` vouches for: every shard is healthy (:meth:`shard_healthy`),
        except one left down for a corrupt log, or down because its disk is full: restarting
        the service can neither repair a log nor free space, and would take the others down
        with it (the full disk's shard is restarted with backoff all the while, and serves
        once there is room)."""
        states = [self.shard_healthy(sh, now) or sh.status is S.FAILED
                  or (sh.status is not S.READY and sh.reason_kind == "disk_full") for sh in self.shards]
        return bool(states) and all(states) and any(sh.status is S.READY for sh in self.shards)

    # ------------------------------------------------------------------ service manager
    def status_text(self, now: float) -> tuple[str, str]:
        """``STATUS=`` in two parts: the shards (sent as soon as it changes) and the queue
        depth (sent at most every notify.STATUS_INTERVAL_S)."""
        down = [sh for sh in self.shards if not self.shard_healthy(sh, now)]
        head = f"{len(self.shards) - len(down)}/{len(self.shards)} shards up"
        for sh in down:
            why = "not answering" if sh.status is S.READY else str(sh.status)
            if sh.reason_kind and sh.status is not S.READY:
                why += f" ({sh.reason_kind.replace('_', '-')})"
            head += f", shard {sh.index} {why}"
        known = [sh.depth for sh in self.shards if sh.depth is not None]
        if not known:
            return head, ""
        rest = f"; queue depth {sum(d[1] for d in known)} ready, {sum(d[0] for d in known)} jobs held"
        return head, rest + ("" if len(known) == len(self.shards) else f" (in {len(known)} shards)")

    def announce(self, now: float) -> list[Action]:
        """``READY=1``, with the status: the service is up. From then on the watchdog runs."""
        if not self.notify or self.stopping:
            return []
        self.announced = True
        return [NotifyStatus(*self.status_text(now), ready=True)]

    def _tell_manager(self, now: float, out: list[Action]) -> None:
        """STATUS= (paced by the notifier), WATCHDOG=1 if healthy, and while shards start,
        EXTEND_TIMEOUT_USEC so a long replay (reported as progress) is not killed by the
        manager's start timeout; a silent shard is killed by ours."""
        head, rest = self.status_text(now)
        if not self.announced:
            head = "starting: " + head
            if now - self._extended_at >= self.policy.ping_interval_s:
                self._extended_at = now
                usec = int((self.policy.start_timeout_s + 2 * self.policy.ping_interval_s) * 1e6)
                out.append(Notify((f"EXTEND_TIMEOUT_USEC={usec}",)))
        out.append(NotifyStatus(head, rest))
        if self.announced and self.healthy(now):
            out.append(Watchdog())

    def _reload(self, now: float, out: list[Action]) -> None:
        if self.notify:
            out.append(Notify(("RELOADING=1", f"MONOTONIC_USEC={int(now * 1e6)}")))
        out.append(Reload())
        if self.notify:
            out.append(Notify(("READY=1",)))

    # ------------------------------------------------------------------ status
    def status_of(self, sh: Shard, now: float) -> dict[str, Any]:
        """A shard's row of ``run/supervisor.json`` and ``stats()`` (``restart_in_s`` while
        it waits to restart)."""
        out: dict[str, Any] = {"shard": sh.index, "status": str(sh.status), "restarts": sh.restarts,
                               "last_exit": sh.last_exit, "reason": sh.reason, "reason_kind": sh.reason_kind}
        if sh.status is S.RESTARTING and sh.restart_at is not None:
            out["restart_in_s"] = round(max(sh.restart_at - now, 0.0), 1)
        if sh.busy and sh.status is S.READY:
            out["busy"] = sh.busy
        return out
