"""The supervisor: starts N shard processes, watches them, restarts the ones that die.

* A shard is ``python -m shardq.shard.process``, in a session of its own: a Ctrl-C meant
  for the terminal or the embedding app's process group does not reach it (the supervisor
  stops it), and ``PR_SET_PDEATHSIG`` still kills it with the supervisor, so a SIGKILLed
  service leaves no orphan writing to the log.
* A shard reports on its stdout pipe (:mod:`shardq.shard.report`): ``progress`` while it
  replays or compacts, ``ready`` once it listens, ``corrupt`` or ``failed`` (disk full)
  with the reason before it exits. EOF on that pipe means it exited. The supervisor reads
  the pipe's descriptor and splits the lines itself (:mod:`.lines`), so lines that arrive
  together (``progress`` then ``pong``) are each seen; a line over
  :data:`~shardq.shard.report.LINE_BYTES_MAX` is dropped and logged, never buffered.
* Health: the supervisor pings each ready shard every ``health_timeout / 4`` seconds, a
  byte on the shard's stdin pipe that its loop answers with a ``pong`` line (never through
  the clients' socket, which a crowd of clients or a flood of silent connections can make
  unreachable while the shard is fine); a shard that leaves a ping unanswered *and*
  reports no progress for ``health_timeout`` is hung, and is SIGKILLed and restarted. A
  compaction that outlasts the timeout is progress, not a hang; so is a write or fsync the
  disk takes that long to finish (logged at WARNING: restarting would not make the disk
  faster). A starting shard that reports
  nothing for ``start_timeout`` (60 s) is hung too; one that reports replay progress is
  waited for however long its replay takes.
* Restarts back off: the first exit restarts at once; each further exit before the shard
  has served for 10 s waits twice as long as the one before (0.5 s, 1 s, 2 s, ... up to
  ``restart_backoff_max``, 60 s by default). A shard is never
  given up on -- a full disk, for one, heals when space is freed -- except for a corrupt
  log: that shard stays down ("failed") until a person looks (``shardq wal check``).
* Why a shard is down (its last exit, "disk full", "corrupt log ... at offset N", "hung",
  "restarting in N s") is logged at WARNING or ERROR, kept per shard
  (:meth:`process_stats`) and published in ``run/supervisor.json`` for ``shardq stats`` in
  other processes (:mod:`shardq.protocol.status_file`).
* :meth:`start` returns once every shard is ready, failed, or failing repeatedly; the
  others serve meanwhile. It raises only if no shard could start, or if something it
  starts fails (a shard cannot be spawned, the schedules are refused); whatever it
  raises, it has first stopped everything it started: shards, threads, the data dir lock.
* Workflows: once the shards are up, a :class:`~.workflow_watch.WorkflowWatcher` thread
  records how each workflow ends, looking only at the shards whose last ``pong`` said they
  hold running workflow records.
* Periodic jobs: once the shards are up, a :class:`~.scheduler.Scheduler` thread fires
  the config's ``[schedules.*]`` and the ``@app.periodic`` schedules of the modules in
  ``service.schedule_modules``, through a router of its own.
* :meth:`stop`: SIGTERM to every shard (each finishes its iteration: fsync, replies, then
  writes a checkpoint if it logged enough: shardq/shard/process.py), then wait; anything
  still alive after :data:`STOP_GRACE_S` is SIGKILLed (its log is whole; the next start
  replays it).
* Reload (:meth:`reload`, SIGHUP under ``serve``): the queue settings of the new config
  go to every shard at once and the rest waits for a restart of ``serve``, each key
  logged (:mod:`.reload`).
* A service manager (``serve`` only, when ``NOTIFY_SOCKET`` is set; :mod:`.notify`):
  ``READY=1`` once :meth:`start` has returned and the HTTP listener is up, ``STATUS=``
  with the shards up and the queue depth, ``WATCHDOG=1`` while healthy
  (:meth:`healthy`), ``RELOADING=1``, ``STOPPING=1``.

Log lines (stderr) are ``supervisor event=<name> shard=<i> key=value ...`` for grep.

Every decision above (spawn, ping, kill, restart when, give up, what to tell the service
manager, reload) is made by :class:`~.supervision.Supervision`, which does no I/O and reads
no clock; this module is its shell: it spawns and reads the processes, turns what happens
into events, calls ``check(now, events)`` with the time of its :class:`~shardq.clock.Clock`,
and carries out the actions it gets back.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any
from multiprocessing.connection import wait as wait_ready

from ..clock import Clock, SystemClock
from ..config import Config, load as load_config
from ..datadir import DataDir
from ..errors import InvariantViolation, ShardUnavailable
from ..shard.report import PING, RELOAD, RELOAD_FILE
from .status import StatusBoard
from .lines import LineSplitter
from .notify import ENV_KEYS, Notifier
from .reload import plan as reload_plan
from .supervision import (START_TIMEOUT_S, Action, Event, Exited, HangUp, Heard, Kill, Log, Notify, NotifyStatus,
                          Ping, Policy, Publish, Reload, Shard, ShardState, Spawn, Supervision, Watchdog,
                          Stopped, parse_line)

if TYPE_CHECKING:
    from ..schedules import Schedule
    from .reload import Change
    from .scheduler import Scheduler
    from .workflow_watch import WorkflowWatcher

log = logging.getLogger("shardq.supervisor")

READ_BYTES = 64 * 1024          # one read of a shard's pipe: what a full pipe holds
#: how long stop() gives the shards to finish their iteration, their commits and their
#: checkpoint before it SIGKILLs them: with the HTTP listener's stop, ``serve`` exits
#: within STOP_GRACE_S + 5 s of SIGTERM (docs/operations.md, "Signals")
STOP_GRACE_S = 10.0


def _event(name: str, level: int = logging.INFO, /, **fields: object) -> None:
    log.log(level, "event=%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))


def child_env() -> dict[str, str]:
    """The environment for a child ``python -m shardq...``: it must import this same shardq,
    installed or not, so the directory holding the package goes first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}  # only serve speaks to systemd
    # (this file is <parent>/shardq/service/supervisor.py: not `import shardq`, the facade above every layer)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    return env


class ShardHandle(Shard):
    """One shard slot: what :class:`~.supervision.Supervision` knows of it, and its current
    process with the lines read from its stdout."""

    def __init__(self, index: int):
        super().__init__(index)
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines = LineSplitter()           # this run's stdout, split into report lines


class Supervisor:
    """Owns the shard processes of one data dir. ``start()`` then ``run()`` (foreground
    service) or ``start(background=True)`` (embedded: a monitor thread).

    The decisions are :class:`~.supervision.Supervision`'s; this class runs the processes,
    reads their pipes, and carries out what it is told. Time comes from ``clock`` (the
    system clock by default; the scheduler's too), read nowhere else."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None,
                 config: Config | dict[str, object] | str | None = None, shards: int | None = None, *,
                 python: str | None = None, stderr: int | IO[Any] | None = None,
                 clock: Clock | None = None, notifier: Notifier | None = None):
        self.config = load_config(config)
        self.dd = DataDir(data_dir or self.config.service.data_dir)
        # None ("service.shards = 0", the default): the data dir's own count, or for a new
        # one a shard per two CPUs (Config.resolved_shards), decided at start
        self.requested_shards = shards or self.config.service.shards or None
        self.python = python or sys.executable
        self.stderr = stderr
        self.handles: list[ShardHandle] = []
        self.stopping = False
        self.start_timeout = START_TIMEOUT_S
        self.grace_s = STOP_GRACE_S
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._signalled = False      # a stop signal came (handle_signals)
        self._signals_handled = False
        os.set_blocking(self._wake_r, False)
        self._changed = threading.Condition()
        self.board: StatusBoard | None = None
        self.clock = clock or SystemClock()  # tests pass a FakeClock
        self.scheduler: Scheduler | None = None
        self.workflow_watch: WorkflowWatcher | None = None  # service/workflow_watch.py
        self._monitor_error: BaseException | None = None
        #: the service manager's socket (``serve`` passes one when NOTIFY_SOCKET is set);
        #: an embedded supervisor says nothing: its app owns the protocol
        self.notifier = notifier if notifier is not None and notifier.enabled else None
        self.core = Supervision([])
        self._reload_from: Callable[[], Config] | None = None  # SIGHUP's config reader (handle_signals)
        self._reload_wanted = False
        self._serving = False        # run() polls: a SIGHUP is acted on

    def _policy(self) -> Policy:
        return Policy(self.config.service.health_timeout, self.config.service.restart_backoff_max,
                      self.start_timeout)

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, background: bool = False, start_timeout: float = START_TIMEOUT_S,
              before_shards: Callable[[], None] | None = None) -> Supervisor:
        """Create/check the data dir, start every shard, wait until each is ready, failed
        (corrupt log), or failing again and again (backing off between restarts).

        A shard that reports replay progress is waited for however long its replay takes;
        one silent for ``start_timeout`` seconds is killed as hung and restarted. Shards
        that are down are logged at ERROR and keep being restarted while the others serve.
        A stop meanwhile (a signal after :meth:`handle_signals`, :meth:`stop`) ends the
        wait at once. Raises ShardCountMismatch if the data dir has another N;
        ShardUnavailable, with every shard's reason, if no shard could start. ``before_shards``
        runs once the data dir is checked and locked, before any shard is spawned (``serve``
        binds its HTTP listener there: a port that is taken fails before anything starts);
        what it raises, start raises, having released the data dir.
        """
        n = self.dd.init(self.requested_shards or (self.dd.shards() if self.dd.exists() else
                                                   self.config.resolved_shards()))
        self.dd.authkey()  # refuse an unsafe key file here, clearly, not in N shard crashes
        self._lock_fd = self.dd.lock("supervisor.lock")
        self.stopping = self._signalled  # a signal during start: run() stops at once
        self._thread = None
        self._monitor_error = None
        self.start_timeout = start_timeout
        self.handles = [ShardHandle(i) for i in range(n)]
        self.core = Supervision(self.handles, self._policy(), notify=self.notifier is not None)
        try:
            self._write_config(self.config)  # (a disk that refuses it fails the start here, once)
            schedules = self._collect_schedules()  # a mistake in them fails before any shard starts
            if before_shards is not None:
                before_shards()
            self._start_shards(background)
            if not self.stopping:  # stopped while starting: start nothing more
                self._start_scheduler(schedules)
                self._start_workflow_watch()
        except BaseException:
            # Whatever failed (a spawn, the schedules, a Ctrl-C while waiting), nothing of
            # this start may outlive it: a shard left running, or the lock left held,
            # would make the next start() fail with DataDirLocked.
            self.stop()
            raise
        return self

    def _start_shards(self, background: bool) -> None:
        n = len(self.handles)
        try:
            self.board = StatusBoard(self.dd.run_dir, n)
        except OSError as e:
            log.warning("event=status-unpublished reason=%s", json.dumps(str(e)))
        _event("start", data_dir=self.dd.path, shards=n, pid=os.getpid())
        if background:
            # Shards are spawned by the monitor thread: PDEATHSIG follows the spawning thread.
            self._thread = threading.Thread(target=self._monitor, name="shardq-supervisor", daemon=True)
            self._thread.start()
            with self._changed:
                while not self._settled() and self._thread.is_alive() and self._monitor_error is None:
                    self._changed.wait(0.5)
            if self._monitor_error is not None:
                raise self._monitor_error
        else:
            while not self._settled():
                self._poll_once(0.5)
        if self.stopping:
            return  # stopped while starting: run() and stop() take it from here
        down = [h for h in self.handles if h.status is not ShardState.READY]
        if len(down) == n:
            raise ShardUnavailable("no shard could start: " + "; ".join(
                f"shard {h.index}: {h.reason or h.status}" for h in down))
        for h in down:
            _event("shard-down", logging.ERROR, shard=h.index, status=h.status, reason=json.dumps(h.reason),
                   note='"the other shards serve"')
        _event("ready", shards=n, down=len(down))

    def _settled(self) -> bool:
        return self.stopping or self.core.settled()

    def _collect_schedules(self) -> list[Schedule]:
        """The schedules to fire (:func:`~.scheduler.collect_schedules`: InvalidConfig for
        two of one name, or one on a queue not declared); none imports nothing."""
        if not (self.config.schedules or self.config.service.schedule_modules):
            return []
        from .scheduler import collect_schedules
        return collect_schedules(self.config)

    def _start_scheduler(self, schedules: list[Schedule]) -> None:
        if not schedules:
            return  # nothing to fire: start nothing
        from .scheduler import Scheduler
        from ..client.router import Router
        router = Router(self.dd.path, _role="service", retry_s=1.0, request_timeout_s=2.0)
        try:
            scheduler = Scheduler(schedules, router, self.dd.path, self.clock)  # refuses two of a name
            self.scheduler = scheduler.start()
        except BaseException:
            router.close()
            raise
        _event("scheduler-started", schedules=len(schedules))

    def _start_workflow_watch(self) -> None:
        from .workflow_watch import WorkflowWatcher
        self.workflow_watch = WorkflowWatcher(
            self.dd.path, lambda: [h.index for h in self.handles if h.workflows_running > 0]).start()

    def handle_signals(self, reload: Callable[[], Config] | None = None) -> None:
        """SIGTERM/SIGINT stop the service cleanly; a second one exits at once. ``serve``
        calls it before :meth:`start`, so a signal that comes while the shards or the HTTP
        listener start (clients may already be served) is a clean stop too, not the
        default action's death: :meth:`start` then returns and :meth:`run` stops at once.
        With ``reload`` (a function that reads the config file), SIGHUP reloads it
        (:meth:`reload`, from :meth:`run`'s loop; one that comes during :meth:`start` waits
        for it)."""
        def on_signal(signum: int, frame: object) -> None:
            if self._signalled:
                _event("killed", logging.WARNING, signal=signal.Signals(signum).name,
                       note='"second signal: shards SIGKILLed without waiting for their last iteration"')
                for h in self.handles:
                    if h.proc and h.proc.poll() is None:
                        h.proc.kill()
                os._exit(1)
            _event("stopping", signal=signal.Signals(signum).name)
            self._signalled = True
            self.stopping = True
            os.write(self._wake_w, b"x")

        def on_hangup(signum: int, frame: object) -> None:
            self._reload_wanted = True
            os.write(self._wake_w, b"x")

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if reload is not None:
            self._reload_from = reload
            signal.signal(signal.SIGHUP, on_hangup)
        self._signals_handled = True

    def run(self) -> int:
        """Foreground service: monitor until SIGTERM/SIGINT; a second signal exits at once."""
        if not self._signals_handled:
            self.handle_signals()
        self._serving = True
        try:
            while not self.stopping:
                self._poll_once(0.5)
        finally:
            self._serving = False
        self._execute(self.core.stop())
        self.stop()
        return 0

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every shard, wait for clean exits, SIGKILL what remains."""
        self.grace_s = grace_s
        if self.scheduler is not None:  # before the shards go: its last enqueue can finish
            self.scheduler.stop()
            self.scheduler.queue.close()
            self.scheduler = None
        if self.workflow_watch is not None:
            self.workflow_watch.stop()
            self.workflow_watch = None
        self.stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if (self._thread is not None and self._thread is not threading.current_thread()
                and self._thread.is_alive()):
            # The monitor thread spawned the shards and shuts them down: they are tied to
            # it by PDEATHSIG, so it must outlive them.
            self._thread.join(grace_s + 5)
        else:  # no monitor, or it has ended (then it shut down first) or never started
            self._shutdown(grace_s)

    def _shutdown(self, grace_s: float) -> None:
        self.core.stop()  # nothing more is spawned; run() told the service manager
        if self._lock_fd is None and all(h.status is ShardState.STOPPED for h in self.handles):
            return
        for h in self.handles:
            if h.proc and h.proc.poll() is None:
                h.proc.terminate()
        deadline = self.clock.monotonic() + grace_s
        ended: list[Event] = []
        for h in self.handles:
            if h.proc is not None:
                try:
                    h.proc.wait(max(deadline - self.clock.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    h.proc.kill()
                    h.proc.wait()
                self._close_pipes(h.proc)
            ended.append(Stopped(h.index, None if h.proc is None else h.proc.returncode))
        self._execute(self.core.check(self.clock.monotonic(), ended))
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        _event("stopped")

    # ------------------------------------------------------------------ processes
    def _write_config(self, config: Config) -> None:
        """Write ``config`` where every shard reads it, at its start and at a reload
        (``<data>/run/config.json``, 0600): whole or not at all (OSError: nothing written)."""
        path = os.path.join(self.dd.run_dir, RELOAD_FILE)
        with open(path + ".tmp", "w", opener=lambda f, fl: os.open(f, fl, 0o600)) as f:
            json.dump(config.to_dict(), f)
        os.replace(path + ".tmp", path)

    def _spawn(self, h: ShardHandle) -> None:
        # The config goes in a file (_write_config), not on the command line: one argument
        # holds at most 128 KiB on Linux (a config of ~850 declared queues failed to spawn),
        # and every local user can read a command line (schedule bodies).
        cmd = [self.python, "-m", "shardq.shard.process", "--data-dir", self.dd.path,
               "--index", str(h.index), "--config-file", os.path.join(self.dd.run_dir, RELOAD_FILE),
               "--parent-pid", str(os.getpid()), "--health-pipe"]
        try:
            h.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                      close_fds=True, env=child_env(), start_new_session=True)
        except OSError as e:  # no fork (EAGAIN, ENOMEM), no descriptors, no python
            raise ShardUnavailable(f"cannot start shard {h.index}: {e}") from e
        # Read without blocking, by the descriptor (_read_report): see shardq/service/lines.py.
        os.set_blocking(self._stdout(h.proc).fileno(), False)
        h.lines = LineSplitter()
        h.pid = h.proc.pid
        _event("spawn", shard=h.index, pid=h.proc.pid)

    @staticmethod
    def _stdout(proc: subprocess.Popen[bytes]) -> IO[bytes]:
        if proc.stdout is None:
            raise InvariantViolation("a shard's stdout is a pipe (_spawn)")
        return proc.stdout

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
        for pipe in (proc.stdout, proc.stdin):
            if pipe is not None:
                pipe.close()

    def _write(self, h: ShardHandle, byte: bytes) -> bool:
        """One byte on ``h``'s stdin; False if it has exited (its pipe is closed or broken)."""
        if h.proc is None or h.proc.stdin is None:
            return False
        try:
            os.write(h.proc.stdin.fileno(), byte)
            return True
        except (OSError, ValueError):  # ValueError: its pipe closed as it exited
            return False

    def _execute(self, actions: list[Action]) -> None:
        """Carry out what :class:`~.supervision.Supervision` decided, in its order."""
        now = self.clock.monotonic()
        for a in actions:
            if isinstance(a, Log):
                _event(a.name, a.level, **dict(a.fields))
            elif isinstance(a, Spawn):
                self._spawn(self.handles[a.shard])
            elif isinstance(a, Ping):
                self._write(self.handles[a.shard], PING)  # if it exited, its EOF drives the restart
            elif isinstance(a, Kill):
                proc = self.handles[a.shard].proc
                if proc is not None:
                    proc.kill()  # the stdout EOF then drives the restart
            elif isinstance(a, Publish):
                with self._changed:  # wake start() if it waits
                    self._changed.notify_all()
                self._publish()
            elif isinstance(a, Reload):
                self._reload_file()
            elif self.notifier is None:
                continue
            elif isinstance(a, NotifyStatus):
                extra = ("READY=1", f"MAINPID={os.getpid()}") if a.ready else ()
                self.notifier.status(a.head, a.rest, now, *extra, force=a.ready)
            elif isinstance(a, Notify):
                self.notifier.send(*a.lines)
            elif isinstance(a, Watchdog):
                self.notifier.watchdog(now)

    def _publish(self) -> None:
        now = self.clock.monotonic()
        if self.board is not None and not self.board.publish([self._status_of(h, now) for h in self.handles]):
            if not self.board.failed_once:
                self.board.failed_once = True
                log.warning("event=status-unpublished path=%s", self.board.path)

    def _monitor(self) -> None:
        try:
            while not self.stopping:
                self._poll_once(0.25)
        except BaseException as e:  # noqa: BLE001 - kept for start() and logged: why every shard stops
            # start() raises it if it still waits; later, the log is the only place to say
            # why every shard is about to be stopped.
            self._monitor_error = e
            _event("monitor-failed", logging.ERROR, error=json.dumps(f"{type(e).__name__}: {e}"),
                   note='"every shard is stopped"')
        finally:
            self._shutdown(self.grace_s)
            with self._changed:  # wake start() now, not at its next 0.5 s check
                self._changed.notify_all()

    def _poll_once(self, timeout: float) -> None:
        """Wait for a line, an exit, a signal or the next thing due; then one step of the
        decisions (:meth:`Supervision.check`), carried out."""
        timeout = self.core.next_wake(self.clock.monotonic(), timeout)
        if self.notifier is not None and (due_in := self.notifier.due_in(self.clock.monotonic())) is not None:
            timeout = min(timeout, due_in)  # a watchdog ping must not wait for a shard's line
        live = {self._stdout(h.proc).fileno(): h for h in self.handles
                if h.proc and h.proc.stdout and not h.proc.stdout.closed}
        events: list[Event] = []
        for r in wait_ready([self._wake_r, *live], timeout):
            h = live.get(r) if isinstance(r, int) else None
            if h is None:  # the wake-up pipe
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass
                continue
            events += self._read_report(h)
        if self._reload_wanted and self._serving and self._reload_from is not None:
            self._reload_wanted = False
            events.append(HangUp())
        if self.stopping:
            self._execute(self.core.stop())
        self._execute(self.core.check(self.clock.monotonic(), events))

    def _read_report(self, h: ShardHandle) -> list[Event]:
        """One read of ``h``'s stdout: an event for every line it completes, or for its exit
        (EOF). One read per wake-up, not a drain: bytes left in the pipe wake the next poll,
        so a chatty shard cannot hold the loop from the others."""
        proc = h.proc
        if proc is None:
            return []
        try:
            data = os.read(self._stdout(proc).fileno(), READ_BYTES)
        except BlockingIOError:
            return []
        if not data:
            if h.lines.unfinished():
                _event("shard-line-unfinished", logging.WARNING, shard=h.index, pid=proc.pid,
                       bytes=h.lines.unfinished(), note='"it exited in the middle of a line; ignored"')
            code = proc.wait()
            self._close_pipes(proc)
            return [Exited(h.index, code)]
        events: list[Event] = []
        for raw in h.lines.feed(data):
            if raw is None:  # logged in its place, before the lines after it
                _event("shard-line-too-long", logging.ERROR, shard=h.index, pid=proc.pid,
                       max_bytes=h.lines.max_bytes, note='"dropped, not kept"')
                continue
            line = raw.decode(errors="replace").strip()
            try:
                events.append(parse_line(h.index, line))
            except (ValueError, KeyError, TypeError) as e:  # the monitor must outlive a bad line
                _event("shard-bad-line", logging.ERROR, shard=h.index, pid=proc.pid,
                       line=json.dumps(line[:200]), error=json.dumps(str(e)))
                events.append(Heard(h.index))
        return events

    # ------------------------------------------------------------------ reload
    def _reload_file(self) -> None:
        """SIGHUP: read the config file again and :meth:`reload` it; a file that does not
        read or parse is logged and changes nothing."""
        if self._reload_from is None:
            return
        try:
            new = self._reload_from()
        except (OSError, ValueError) as e:  # InvalidConfig is a ValueError
            _event("reload-failed", logging.ERROR, error=json.dumps(str(e)), note='"nothing changed"')
        else:
            self.reload(new)

    def reload(self, new: Config | dict[str, object] | str) -> tuple[list[Change], list[Change]]:
        """Take the settings of ``new`` that can change while the service runs (the queue
        settings, ``restart_backoff_max``: :mod:`.reload`) and tell every running shard;
        log each key changed, applied or waiting for a restart. Returns the two lists of
        :class:`~.reload.Change`. A shard that is starting takes them as its loop begins;
        one spawned later reads them from the config file it is given (:meth:`_write_config`)."""
        p = reload_plan(self.config, load_config(new), shards=len(self.handles) or None)
        for c in p.applied:
            _event("reload-applied", key=c.key, old=json.dumps(c.old), new=json.dumps(c.new))
        for c in p.refused:  # (a restart would not take them either: serve would not start)
            _event("reload-refused", logging.ERROR, key=c.key, old=json.dumps(c.old), new=json.dumps(c.new),
                   why=json.dumps(c.why), note='"not applied: serve will not start with it"')
        for c in p.pending:
            _event("reload-needs-restart", logging.WARNING, key=c.key, old=json.dumps(c.old),
                   new=json.dumps(c.new), why=json.dumps(c.why), note='"not applied: takes effect when serve restarts"')
        told = 0
        if p.applied:
            try:
                self._write_config(p.config)
            except OSError as e:
                _event("reload-failed", logging.ERROR, error=json.dumps(f"cannot write {e.filename}: {e}"),
                       note='"nothing changed"')
                return [], p.restart
            self.config = p.config
            self.core.policy = self._policy()
            for h in self.handles:
                if h.proc is not None and h.proc.poll() is None and self._write(h, RELOAD):
                    told += 1  # one that exits meanwhile reads the new file when it starts again
        _event("reloaded", applied=len(p.applied), needs_restart=len(p.pending), shards_told=told,
               **({"not_applied": json.dumps(" ".join(c.key for c in p.restart))} if p.restart else {}),
               **({"refused": json.dumps(" ".join(c.key for c in p.refused))} if p.refused else {}))
        return p.applied, p.restart

    # ------------------------------------------------------------------ service manager
    def announce_ready(self) -> None:
        """``READY=1``: ``serve`` calls it once :meth:`start` has returned (every shard
        replayed and listening, or left down for a reason logged) and the HTTP listener
        is up. From then on the watchdog pings run."""
        if not self.stopping:
            self._execute(self.core.announce(self.clock.monotonic()))

    def healthy(self, now: float | None = None) -> bool:
        """What ``WATCHDOG=1`` vouches for (:meth:`Supervision.healthy`): every shard ready
        and answering its pings, left down for a corrupt log, or down for a full disk."""
        return self.core.healthy(self.clock.monotonic() if now is None else now)

    # ------------------------------------------------------------------ status
    def _status_of(self, h: ShardHandle, now: float) -> dict[str, Any]:
        out = self.core.status_of(h, now)
        if "restart_in_s" in out and self.board is not None:  # a reader in another process needs a wall-clock time
            out["restart_at"] = self.board.clock.now() + out["restart_in_s"]
        return out

    def process_stats(self, index: int) -> dict[str, Any]:
        """The supervisor's view of a shard (status, restarts, last exit, why it is down,
        when it restarts) and psutil figures of its process, for ``stats``."""
        import psutil
        h = self.handles[index]
        out = self._status_of(h, self.clock.monotonic())
        out.pop("restart_at", None)
        if h.proc is not None:
            try:
                p = psutil.Process(h.proc.pid)
                out.update(rss_bytes=p.memory_info().rss, cpu_percent=p.cpu_percent(None))
            except psutil.Error:
                pass
        return out
