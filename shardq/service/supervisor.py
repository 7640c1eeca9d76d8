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
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait as wait_ready

from ..config import Config, load as load_config
from ..datadir import DataDir
from ..errors import ShardUnavailable
from ..shard.report import PING, RELOAD, RELOAD_FILE
from .status import StatusBoard
from .lines import LineSplitter
from .notify import ENV_KEYS, Notifier
from .reload import plan as reload_plan
from .supervision import (EXIT_LOG_FAILED, RESTART_BACKOFF_S_FIRST, STABLE_RUN_S, START_TIMEOUT_S,
                          _describe_exit)

log = logging.getLogger("shardq.supervisor")

READ_BYTES = 64 * 1024          # one read of a shard's pipe: what a full pipe holds
#: how long stop() gives the shards to finish their iteration, their commits and their
#: checkpoint before it SIGKILLs them: with the HTTP listener's stop, ``serve`` exits
#: within STOP_GRACE_S + 5 s of SIGTERM (docs/operations.md, "Signals")
STOP_GRACE_S = 10.0


def _event(name: str, level: int = logging.INFO, **fields) -> None:
    log.log(level, "event=%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))


def child_env() -> dict[str, str]:
    """The environment for a child ``python -m shardq...``: it must import this same shardq,
    installed or not, so the directory holding the package goes first on PYTHONPATH."""
    import shardq
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}  # only serve speaks to systemd
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(shardq.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    return env


class ShardHandle:
    """One shard slot: the current process, its status, and why it is not ready."""

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.status = "stopped"   # starting | ready | restarting | failed | stopped
        self.restarts = 0
        self.failures = 0         # exits in a row without a long enough run: the backoff step
        self.last_exit: str | None = None
        self.reason: str | None = None       # why it is not ready (kept while it starts again)
        self.reason_kind: str | None = None  # disk_full corrupt_log hung log_failed io_error exit
        self.restart_at: float | None = None  # monotonic, while restarting
        self.ready_since: float | None = None
        self.last_heard = 0.0                 # monotonic: spawn, or the last line it sent
        self.busy: str | None = None          # the phase of its progress lines, until a ping answers
        self.busy_since = 0.0
        self.busy_logged = False
        self.corrupt: dict | None = None      # what this run reported before exiting
        self.failed: dict | None = None
        self.hung: str | None = None          # why this run was killed as hung
        self.ready_info: dict = {}
        self.depth: tuple[int, int] | None = None  # (jobs held, ready) from its last pong
        self.workflows_running = 0            # running workflow records, from its last pong
        self.ping_sent: float | None = None
        self.next_ping = 0.0
        self.lines = LineSplitter()           # this run's stdout, split into report lines


class Supervisor:
    """Owns the shard processes of one data dir. ``start()`` then ``run()`` (foreground
    service) or ``start(background=True)`` (embedded: a monitor thread)."""

    def __init__(self, data_dir=None, config: Config | dict | str | None = None, shards: int | None = None,
                 *, python: str | None = None, stderr=None, clock=None, notifier: Notifier | None = None):
        self.config = load_config(config)
        self.dd = DataDir(data_dir or self.config.service.data_dir)
        self.requested_shards = shards or self.config.resolved_shards()
        self.python = python or sys.executable
        self.stderr = stderr
        self.handles: list[ShardHandle] = []
        self.stopping = False
        self.start_timeout = START_TIMEOUT_S
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._signalled = False      # a stop signal came (handle_signals)
        self._signals_handled = False
        os.set_blocking(self._wake_r, False)
        self._spawn_requests: deque[ShardHandle] = deque()
        self._changed = threading.Condition()
        self.board: StatusBoard | None = None
        self.clock = clock  # the scheduler's (tests pass a FakeClock); None: the system clock
        self.scheduler = None
        self.workflow_watch = None            # the workflow watcher (service/workflow_watch.py)
        self._monitor_error: BaseException | None = None
        #: the service manager's socket (``serve`` passes one when NOTIFY_SOCKET is set);
        #: an embedded supervisor says nothing: its app owns the protocol
        self.notifier = notifier if notifier is not None and notifier.enabled else None
        self._announced = False      # READY=1 sent: from now on the watchdog runs
        self._extended_at = float("-inf")
        self._reload_from: Callable[[], Config] | None = None  # SIGHUP's config reader (handle_signals)
        self._reload_wanted = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, background: bool = False, start_timeout: float = START_TIMEOUT_S,
              before_shards: Callable[[], None] | None = None) -> Supervisor:
        """Create/check the data dir, start every shard, wait until each is ready, failed
        (corrupt log), or failing again and again (backing off between restarts).

        A shard that reports replay progress is waited for however long its replay takes;
        one silent for ``start_timeout`` seconds is killed as hung and restarted. Shards
        that are down are logged at ERROR and keep being restarted while the others serve.
        Raises ShardCountMismatch if the data dir has another N; ShardUnavailable, with
        every shard's reason, if no shard could start. ``before_shards`` runs once the data
        dir is checked and locked, before any shard is spawned (``serve`` binds its HTTP
        listener there: a port that is taken fails before anything starts); what it
        raises, start raises, having released the data dir.
        """
        n = self.dd.init(self.requested_shards)
        self.dd.authkey()  # refuse an unsafe key file here, clearly, not in N shard crashes
        self._lock_fd = self.dd.lock("supervisor.lock")
        self.stopping = self._signalled  # a signal during start: run() stops at once
        self._thread = None
        self._monitor_error = None
        self._spawn_requests.clear()
        self.start_timeout = start_timeout
        self.handles = [ShardHandle(i) for i in range(n)]
        try:
            if before_shards is not None:
                before_shards()
            self._start_shards(background)
            self._start_scheduler()
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
            self._spawn_requests.extend(self.handles)
            self._thread = threading.Thread(target=self._monitor, name="shardq-supervisor", daemon=True)
            self._thread.start()
            with self._changed:
                while not self._settled() and self._thread.is_alive() and self._monitor_error is None:
                    self._changed.wait(0.5)
            if self._monitor_error is not None:
                raise self._monitor_error
        else:
            for h in self.handles:
                self._spawn(h)
            while not self._settled():
                self._poll_once(0.5)
        down = [h for h in self.handles if h.status != "ready"]
        if len(down) == n:
            raise ShardUnavailable("no shard could start: " + "; ".join(
                f"shard {h.index}: {h.reason or h.status}" for h in down))
        for h in down:
            _event("shard-down", logging.ERROR, shard=h.index, status=h.status, reason=json.dumps(h.reason),
                   note='"the other shards serve"')
        _event("ready", shards=n, down=len(down))

    def _settled(self) -> bool:
        return all(h.status in ("ready", "failed") or h.failures >= 2 for h in self.handles)

    def _start_scheduler(self) -> None:
        if not (self.config.schedules or self.config.service.schedule_modules):
            return  # nothing to fire: import nothing, start nothing
        from .scheduler import Scheduler, collect_schedules
        schedules = collect_schedules(self.config)  # start() stops the shards if this raises
        if not schedules:
            return
        from ..client.router import Router
        router = Router(self.dd.path, _role="service")
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
        default action's death: :meth:`run` then stops at once. With ``reload`` (a
        function that reads the config file), SIGHUP reloads it (:meth:`reload`, from
        :meth:`run`'s loop; one that comes during :meth:`start` waits for it)."""
        def on_signal(signum, frame):
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

        def on_hangup(signum, frame):
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
        while not self.stopping:
            self._poll_once(0.5)
            if self._reload_wanted and not self.stopping:
                self._reload_wanted = False
                self._reload_file()
        if self.notifier is not None:
            self.notifier.send("STOPPING=1", "STATUS=stopping: shards finish their commits and checkpoint")
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
        if self._lock_fd is None and all(h.status == "stopped" for h in self.handles):
            return
        for h in self.handles:
            if h.proc and h.proc.poll() is None:
                h.proc.terminate()
        deadline = time.monotonic() + grace_s
        for h in self.handles:
            if h.proc is None:
                continue
            try:
                h.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()
            if h.proc.stdout:
                h.proc.stdout.close()
            if h.proc.stdin:
                h.proc.stdin.close()
            if h.status not in ("stopped", "failed", "restarting"):
                _event("shard-stopped", shard=h.index, exit=_describe_exit(h.proc.returncode))
            h.status = "stopped"
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        _event("stopped")

    # ------------------------------------------------------------------ processes
    def _spawn(self, h: ShardHandle) -> None:
        cmd = [self.python, "-m", "shardq.shard.process", "--data-dir", self.dd.path,
               "--index", str(h.index), "--config", json.dumps(self.config.to_dict()),
               "--parent-pid", str(os.getpid()), "--health-pipe"]
        try:
            h.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                      close_fds=True, env=child_env(), start_new_session=True)
        except OSError as e:  # no fork (EAGAIN, ENOMEM), no descriptors, no python
            raise ShardUnavailable(f"cannot start shard {h.index}: {e}") from e
        # Read without blocking, by the descriptor (_read_report): see shardq/service/lines.py.
        os.set_blocking(h.proc.stdout.fileno(), False)
        h.lines = LineSplitter()
        h.corrupt = h.failed = h.hung = h.busy = h.restart_at = h.depth = None
        h.last_heard = time.monotonic()
        _event("spawn", shard=h.index, pid=h.proc.pid)
        self._set_status(h, "starting")

    def _set_status(self, h: ShardHandle, status: str) -> None:
        """Change a shard's status: wake start() if it waits, publish for `shardq stats`."""
        with self._changed:
            h.status = status
            self._changed.notify_all()
        self._publish()

    def _publish(self) -> None:
        if self.board is not None and not self.board.publish([self._status_of(h) for h in self.handles]):
            if not self.board.failed_once:
                self.board.failed_once = True
                log.warning("event=status-unpublished path=%s", self.board.path)

    def _monitor(self) -> None:
        try:
            while not self.stopping:
                while self._spawn_requests:
                    self._spawn(self._spawn_requests.popleft())
                self._poll_once(0.25)
        except BaseException as e:  # noqa: BLE001 - kept for start() and logged: why every shard stops
            # start() raises it if it still waits; later, the log is the only place to say
            # why every shard is about to be stopped.
            self._monitor_error = e
            _event("monitor-failed", logging.ERROR, error=json.dumps(f"{type(e).__name__}: {e}"),
                   note='"every shard is stopped"')
        finally:
            self._shutdown(getattr(self, "grace_s", STOP_GRACE_S))
            with self._changed:  # wake start() now, not at its next 0.5 s check
                self._changed.notify_all()

    def _poll_once(self, timeout: float) -> None:
        due = [h.restart_at for h in self.handles if h.status == "restarting" and h.restart_at is not None]
        if due:
            timeout = min(timeout, max(min(due) - time.monotonic(), 0.0))
        timeout = min(timeout, self._ping_interval())  # health checks as fine-grained as the pings
        if self.notifier is not None and (due_in := self.notifier.due_in(time.monotonic())) is not None:
            timeout = min(timeout, due_in)  # a watchdog ping must not wait for a shard's line
        live = {h.proc.stdout.fileno(): h for h in self.handles
                if h.proc and h.proc.stdout and not h.proc.stdout.closed}
        ready = wait_ready([self._wake_r, *live], timeout)
        for r in ready:
            if r == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass
                continue
            self._read_report(live[r])
        if not self.stopping:
            self._restart_due()
            self._health()
            if self.notifier is not None:
                self._tell_manager()

    def _read_report(self, h: ShardHandle) -> None:
        """One read of ``h``'s stdout: act on every line it completes, or on its exit (EOF).
        One read per wake-up, not a drain: bytes left in the pipe wake the next poll, so a
        chatty shard cannot hold the loop from the others."""
        try:
            data = os.read(h.proc.stdout.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        if not data:
            if h.lines.unfinished():
                _event("shard-line-unfinished", logging.WARNING, shard=h.index, pid=h.proc.pid,
                       bytes=h.lines.unfinished(), note='"it exited in the middle of a line; ignored"')
            self._on_exit(h)
            return
        for raw in h.lines.feed(data):
            if raw is None:  # logged in its place, before the lines after it
                _event("shard-line-too-long", logging.ERROR, shard=h.index, pid=h.proc.pid,
                       max_bytes=h.lines.max_bytes, note='"dropped, not kept"')
                continue
            line = raw.decode(errors="replace").strip()
            try:
                self._on_line(h, line)
            except (ValueError, KeyError, TypeError) as e:  # the monitor must outlive a bad line
                _event("shard-bad-line", logging.ERROR, shard=h.index, pid=h.proc.pid,
                       line=json.dumps(line[:200]), error=json.dumps(str(e)))

    def _on_line(self, h: ShardHandle, line: str) -> None:
        word, _, rest = line.partition(" ")
        now = time.monotonic()
        h.last_heard = now
        if word == "progress":
            phase = rest.split(" ", 1)[0]
            if h.busy != phase:
                h.busy, h.busy_since, h.busy_logged = phase, now, False
            elif not h.busy_logged and now - h.busy_since > self.config.service.health_timeout:
                h.busy_logged = True  # once per phase: it is why pings go unanswered
                if phase == "disk":  # the operator's problem: a disk this slow delays every commit
                    _event("shard-busy", logging.WARNING, shard=h.index, pid=h.proc.pid, phase=phase,
                           for_s=f"{now - h.busy_since:.1f}", note='"waiting for a slow disk, not hung"')
                else:
                    _event("shard-busy", shard=h.index, pid=h.proc.pid, phase=phase,
                           for_s=f"{now - h.busy_since:.1f}", note='"working, not hung"')
        elif word == "ready":
            pid, records, seconds, jobs = rest.split()
            h.ready_info = {"records": int(records), "replay_s": float(seconds), "jobs": int(jobs)}
            h.next_ping = now + self._ping_interval()
            h.ping_sent = None
            h.busy = None
            h.ready_since = now
            h.reason = h.reason_kind = None
            _event("shard-ready", shard=h.index, pid=pid, replay_records=records, replay_s=seconds, jobs=jobs)
            self._set_status(h, "ready")
        elif word == "pong":
            h.ping_sent = None
            h.busy = None
            h.next_ping = now + self._ping_interval()
            if rest:
                jobs, ready, *more = rest.split()
                h.depth = (int(jobs), int(ready))
                h.workflows_running = int(more[0]) if more else 0
        elif word == "reloaded":
            _event("shard-reloaded", shard=h.index, pid=h.proc.pid)
        elif word == "corrupt":
            h.corrupt = json.loads(rest)
        elif word == "failed":
            h.failed = json.loads(rest)

    def _why(self, h: ShardHandle, code: int) -> tuple[str, str]:
        """(kind, words) for why the process that just exited did so."""
        if h.corrupt:
            c = h.corrupt
            return "corrupt_log", f"corrupt log {c['path']} at offset {c['offset']}: {c['reason']}"
        if h.failed and h.failed.get("kind") == "disk_full":
            where = f" ({h.failed['path']})" if h.failed.get("path") else ""
            return "disk_full", f"disk full: {h.failed.get('detail')}{where}"
        if h.failed:
            return "io_error", f"cannot open its log: {h.failed.get('detail')}"
        if h.hung:
            return "hung", f"hung: {h.hung}"
        if code == EXIT_LOG_FAILED:
            return "log_failed", "a log write failed (exit code 4); the shard's log says why"
        if code < 0:
            return "exit", f"killed by {_describe_exit(code).removeprefix('signal=')}"
        return "exit", f"exited with code {code}"

    def _on_exit(self, h: ShardHandle) -> None:
        code = h.proc.wait()
        h.proc.stdout.close()
        if h.proc.stdin:
            h.proc.stdin.close()
        h.ping_sent = None
        if self.stopping:
            self._set_status(h, "stopped")
            return
        now = time.monotonic()
        h.reason_kind, h.reason = self._why(h, code)
        h.last_exit = _describe_exit(code)
        if h.reason_kind != "exit":
            h.last_exit += f": {h.reason}"  # kept once it is ready again (reason is then cleared)
        if h.corrupt:
            c = h.corrupt
            _event("shard-exit", logging.WARNING, shard=h.index, pid=h.proc.pid,
                   exit=f"{_describe_exit(code)} reason=corrupt-log path={c['path']} offset={c['offset']}")
            _event("shard-failed", logging.ERROR, shard=h.index, reason=json.dumps(h.reason),
                   note='"not restarted: check the log with shardq wal check"')
            self._set_status(h, "failed")
            return
        cap = self.config.service.restart_backoff_max
        if h.ready_since is not None and now - h.ready_since >= min(STABLE_RUN_S, cap):
            h.failures = 0  # it ran long enough: this is a new failure, not a crash loop
        h.failures += 1
        h.ready_since = None
        delay = 0.0 if h.failures == 1 else min(RESTART_BACKOFF_S_FIRST * 2 ** (h.failures - 2), cap)
        extra = {} if h.reason_kind == "exit" else {"reason": h.reason_kind.replace("_", "-"),
                                                     "detail": json.dumps(h.reason)}
        _event("shard-exit", logging.WARNING, shard=h.index, pid=h.proc.pid, exit=_describe_exit(code), **extra)
        h.restarts += 1
        h.restart_at = now + delay
        if delay:
            _event("shard-restart", logging.WARNING, shard=h.index, restarts=h.restarts, in_s=f"{delay:g}",
                   failures_in_a_row=h.failures, reason=json.dumps(h.reason))
        else:
            _event("shard-restart", shard=h.index, restarts=h.restarts)
        self._set_status(h, "restarting")
        if not delay:
            self._spawn(h)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for h in self.handles:
            if h.status == "restarting" and h.restart_at is not None and now >= h.restart_at:
                self._spawn(h)

    # ------------------------------------------------------------------ health
    def _ping_interval(self) -> float:
        return self.config.service.health_timeout / 4

    def _kill_hung(self, h: ShardHandle, why: str, **fields) -> None:
        _event("shard-hung", logging.WARNING, shard=h.index, pid=h.proc.pid, **fields)
        h.hung = why
        h.proc.kill()  # the stdout EOF then drives the restart
        h.ping_sent = None
        h.restart_at = None
        self._set_status(h, "restarting")

    def _health(self) -> None:
        now = time.monotonic()
        timeout = self.config.service.health_timeout
        for h in self.handles:
            if h.proc is None:
                continue
            if h.status == "starting":
                if now - h.last_heard > self.start_timeout:
                    self._kill_hung(h, f"no progress for {now - h.last_heard:.0f} s while starting",
                                    silent_s=f"{now - h.last_heard:.1f}", phase="starting")
                continue
            if h.status != "ready":
                continue
            if h.ping_sent is not None:  # answered by a "pong" line (_on_line)
                if now - max(h.ping_sent, h.last_heard) > timeout:
                    self._kill_hung(h, f"no answer to a health ping for {now - h.ping_sent:.1f} s",
                                    unanswered_s=f"{now - h.ping_sent:.1f}")
                continue
            if now >= h.next_ping:
                try:
                    os.write(h.proc.stdin.fileno(), PING)
                except OSError:
                    pass  # it exited: the EOF on its stdout drives the restart; unanswered meanwhile
                h.ping_sent = now

    # ------------------------------------------------------------------ reload
    def _reload_file(self) -> None:
        """SIGHUP: read the config file again and :meth:`reload` it; a file that does not
        read or parse is logged and changes nothing."""
        if self._reload_from is None:
            return
        if self.notifier is not None:
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            new = self._reload_from()
        except (OSError, ValueError) as e:  # InvalidConfig is a ValueError
            _event("reload-failed", logging.ERROR, error=json.dumps(str(e)), note='"nothing changed"')
        else:
            self.reload(new)
        if self.notifier is not None:
            self.notifier.send("READY=1")

    def reload(self, new: Config | dict | str) -> tuple[list, list]:
        """Take the settings of ``new`` that can change while the service runs (the queue
        settings, ``restart_backoff_max``: :mod:`.reload`) and tell every running shard;
        log each key changed, applied or waiting for a restart. Returns the two lists of
        :class:`~.reload.Change`. A shard that is starting takes them as its loop begins;
        one spawned later is given them on its command line."""
        p = reload_plan(self.config, load_config(new))
        for c in p.applied:
            _event("reload-applied", key=c.key, old=json.dumps(c.old), new=json.dumps(c.new))
        for c in p.restart:
            _event("reload-needs-restart", logging.WARNING, key=c.key, old=json.dumps(c.old),
                   new=json.dumps(c.new), why=json.dumps(c.why), note='"not applied: takes effect when serve restarts"')
        told = 0
        if p.applied:
            path = os.path.join(self.dd.run_dir, RELOAD_FILE)
            try:
                with open(path + ".tmp", "w", opener=lambda f, fl: os.open(f, fl, 0o600)) as f:
                    json.dump(p.config.to_dict(), f)
                os.replace(path + ".tmp", path)  # a shard reads it whole or not at all
            except OSError as e:
                _event("reload-failed", logging.ERROR, error=json.dumps(f"cannot write {path}: {e}"),
                       note='"nothing changed"')
                return [], p.restart
            self.config = p.config
            for h in self.handles:
                if h.proc is not None and h.proc.poll() is None:
                    try:
                        os.write(h.proc.stdin.fileno(), RELOAD)
                        told += 1
                    except (OSError, ValueError):  # ValueError: its pipe closed as it exited
                        pass  # its restart takes self.config from the command line
        _event("reloaded", applied=len(p.applied), needs_restart=len(p.restart), shards_told=told,
               **({"not_applied": json.dumps(" ".join(c.key for c in p.restart))} if p.restart else {}))
        return p.applied, p.restart

    # ------------------------------------------------------------------ service manager
    def announce_ready(self) -> None:
        """``READY=1``: ``serve`` calls it once :meth:`start` has returned (every shard
        replayed and listening, or left down for a reason logged) and the HTTP listener
        is up. From then on the watchdog pings run."""
        if self.notifier is None or self.stopping:
            return
        self._announced = True
        now = time.monotonic()
        self.notifier.status(*self._status_text(now), now, "READY=1", f"MAINPID={os.getpid()}", force=True)

    def _shard_healthy(self, h: ShardHandle, now: float) -> bool:
        """Ready and either answering its pings or reporting progress (a compaction, a slow
        disk): nothing unanswered for more than two ping intervals."""
        if h.status != "ready":
            return False
        return h.ping_sent is None or now - max(h.ping_sent, h.last_heard) <= 2 * self._ping_interval()

    def healthy(self, now: float | None = None) -> bool:
        """What ``WATCHDOG=1`` vouches for: the monitor loop runs (it sends them) and every
        shard is healthy (:meth:`_shard_healthy`), except one left down for a corrupt log:
        restarting the service cannot repair a log, and would take the others down with it."""
        now = time.monotonic() if now is None else now
        states = [self._shard_healthy(h, now) or h.status == "failed" for h in self.handles]
        return bool(states) and all(states) and any(h.status == "ready" for h in self.handles)

    def _status_text(self, now: float) -> tuple[str, str]:
        """``STATUS=`` in two parts: the shards (sent as soon as it changes) and the queue
        depth (sent at most every notify.STATUS_INTERVAL_S)."""
        down = [h for h in self.handles if not self._shard_healthy(h, now)]
        head = f"{len(self.handles) - len(down)}/{len(self.handles)} shards up"
        for h in down:
            why = "not answering" if h.status == "ready" else h.status
            if h.reason_kind and h.status != "ready":
                why += f" ({h.reason_kind.replace('_', '-')})"
            head += f", shard {h.index} {why}"
        known = [h.depth for h in self.handles if h.depth is not None]
        if not known:
            return head, ""
        rest = f"; queue depth {sum(d[1] for d in known)} ready, {sum(d[0] for d in known)} jobs held"
        return head, rest + ("" if len(known) == len(self.handles) else f" (in {len(known)} shards)")

    def _tell_manager(self) -> None:
        """After each poll: STATUS= if it changed, WATCHDOG=1 if due and healthy, and while
        shards start, EXTEND_TIMEOUT_USEC so a long replay (reported as progress) is not
        killed by the manager's start timeout; a silent shard is killed by ours."""
        n = self.notifier
        now = time.monotonic()
        head, rest = self._status_text(now)
        if not self._announced:
            head = "starting: " + head
            if now - self._extended_at >= self._ping_interval():
                self._extended_at = now
                n.send(f"EXTEND_TIMEOUT_USEC={int((self.start_timeout + 2 * self._ping_interval()) * 1e6)}")
        n.status(head, rest, now)
        if self._announced and self.healthy(now):
            n.watchdog(now)

    # ------------------------------------------------------------------ status
    def _status_of(self, h: ShardHandle) -> dict:
        out = {"shard": h.index, "status": h.status, "restarts": h.restarts, "last_exit": h.last_exit,
               "reason": h.reason, "reason_kind": h.reason_kind}
        if h.status == "restarting" and h.restart_at is not None:
            out["restart_in_s"] = round(max(h.restart_at - time.monotonic(), 0.0), 1)
            if self.board is not None:  # a reader in another process needs a wall-clock time
                out["restart_at"] = self.board.clock.now() + out["restart_in_s"]
        if h.busy and h.status == "ready":
            out["busy"] = h.busy
        return out

    def process_stats(self, index: int) -> dict:
        """The supervisor's view of a shard (status, restarts, last exit, why it is down,
        when it restarts) and psutil figures of its process, for ``stats``."""
        import psutil
        h = self.handles[index]
        out = self._status_of(h)
        out.pop("restart_at", None)
        try:
            p = psutil.Process(h.proc.pid)
            out.update(rss_bytes=p.memory_info().rss, cpu_percent=p.cpu_percent(None))
        except (psutil.Error, AttributeError):
            pass
        return out
