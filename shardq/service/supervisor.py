"""The supervisor: starts N shard processes, watches them, restarts the ones that die.

* A shard is ``python -m shardq.shard.process``; it prints ``ready ...`` on its stdout pipe
  once it has replayed its log and listens. EOF on that pipe means it exited.
* Health: the supervisor pings each ready shard every ``health_timeout / 4`` seconds; a
  shard that leaves a ping unanswered for ``health_timeout`` is hung, and is SIGKILLed and
  restarted. A restarted shard replays its log while the other shards keep serving.
* Crash loops: after ``restart_limit`` exits within ``restart_window`` seconds the shard is
  left down and the reason is logged (e.g. the corrupt-log file and offset).
* Shards die with the supervisor (``PR_SET_PDEATHSIG``), so a SIGKILLed service leaves no
  orphan writing to the log.
* Periodic jobs: once every shard is ready, a :class:`~.scheduler.Scheduler` thread fires
  the config's ``[schedules.*]`` and the ``@app.periodic`` schedules of the modules in
  ``service.schedule_modules``, through a router of its own.
* :meth:`stop`: SIGTERM to every shard (each finishes its iteration: fsync, replies),
  then wait; anything still alive after the grace period is SIGKILLed.

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
from multiprocessing.connection import wait as wait_ready

from ..client.connection import ShardClient
from ..config import Config, load as load_config
from ..datadir import DataDir
from ..errors import ShardUnavailable

log = logging.getLogger("shardq.supervisor")


def _event(name: str, **fields) -> None:
    log.info("event=%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))


def child_env() -> dict[str, str]:
    """The environment for a child ``python -m shardq...``: it must import this same shardq,
    installed or not, so the directory holding the package goes first on PYTHONPATH."""
    import shardq
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(shardq.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal={signal.Signals(-code).name}"
        except ValueError:
            return f"signal={-code}"
    return f"code={code}"


class ShardHandle:
    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.status = "stopped"   # starting | ready | down | failed | stopped
        self.exits: deque[float] = deque()
        self.restarts = 0
        self.last_exit: str | None = None
        self.corrupt: dict | None = None
        self.ready_info: dict = {}
        self.ping_sent: float | None = None
        self.next_ping = 0.0
        self.health: ShardClient | None = None
        self.ready_event = threading.Event()
        self.ping_future = None


class Supervisor:
    """Owns the shard processes of one data dir. ``start()`` then ``run()`` (foreground
    service) or ``start(background=True)`` (embedded: a monitor thread)."""

    def __init__(self, data_dir=None, config: Config | dict | str | None = None, shards: int | None = None,
                 *, python: str | None = None, stderr=None, clock=None):
        self.config = load_config(config)
        self.dd = DataDir(data_dir or self.config.service.data_dir)
        self.requested_shards = shards or self.config.resolved_shards()
        self.python = python or sys.executable
        self.stderr = stderr
        self.handles: list[ShardHandle] = []
        self.stopping = False
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._spawn_requests: deque[ShardHandle] = deque()
        self.clock = clock  # the scheduler's (tests pass a FakeClock); None: the system clock
        self.scheduler = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, background: bool = False, ready_timeout: float = 60.0) -> "Supervisor":
        """Create/check the data dir, start every shard, wait until all are ready.

        Raises ShardCountMismatch if the data dir has another N; ShardUnavailable if a
        shard is not ready within ``ready_timeout`` (its last exit reason in the message).
        """
        n = self.dd.init(self.requested_shards)
        self.dd.authkey()  # refuse an unsafe key file here, clearly, not in N shard crashes
        self._lock_fd = self.dd.lock("supervisor.lock")
        self.handles = [ShardHandle(i) for i in range(n)]
        _event("start", data_dir=self.dd.path, shards=n, pid=os.getpid())
        if background:
            # Shards are spawned by the monitor thread: PDEATHSIG follows the spawning thread.
            self._spawn_requests.extend(self.handles)
            self._thread = threading.Thread(target=self._monitor, name="shardq-supervisor", daemon=True)
            self._thread.start()
        else:
            for h in self.handles:
                self._spawn(h)
        deadline = time.monotonic() + ready_timeout
        for h in self.handles:
            if not background:
                while h.status == "starting" and time.monotonic() < deadline:
                    self._poll_once(min(0.5, max(deadline - time.monotonic(), 0)))
            else:
                h.ready_event.wait(max(deadline - time.monotonic(), 0))
            if h.status != "ready":
                self.stop()
                why = f"corrupt log {h.corrupt}" if h.corrupt else (h.last_exit or "timed out")
                raise ShardUnavailable(f"shard {h.index} did not become ready: {why}")
        _event("ready", shards=n)
        self._start_scheduler()
        return self

    def _start_scheduler(self) -> None:
        if not (self.config.schedules or self.config.service.schedule_modules):
            return  # nothing to fire: import nothing, start nothing
        from .scheduler import Scheduler, collect_schedules
        try:
            schedules = collect_schedules(self.config)
        except BaseException:
            self.stop()
            raise
        if not schedules:
            return
        from ..client.router import Router
        self.scheduler = Scheduler(schedules, Router(self.dd.path), self.dd.path, self.clock).start()
        _event("scheduler-started", schedules=len(schedules))

    def run(self) -> int:
        """Foreground service: monitor until SIGTERM/SIGINT; a second signal exits at once."""
        def on_signal(signum, frame):
            if self.stopping:
                for h in self.handles:
                    if h.proc and h.proc.poll() is None:
                        h.proc.kill()
                os._exit(1)
            _event("stopping", signal=signal.Signals(signum).name)
            self.stopping = True
            os.write(self._wake_w, b"x")

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not self.stopping:
            self._poll_once(0.5)
        self.stop()
        return 0

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every shard, wait for clean exits, SIGKILL what remains."""
        self.grace_s = grace_s
        if self.scheduler is not None:  # before the shards go: its last enqueue can finish
            self.scheduler.stop()
            self.scheduler.queue.close()
            self.scheduler = None
        self.stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            # The monitor thread spawned the shards and shuts them down: they are tied to
            # it by PDEATHSIG, so it must outlive them.
            self._thread.join(grace_s + 5)
        else:
            self._shutdown(grace_s)

    def _shutdown(self, grace_s: float) -> None:
        if self._lock_fd is None and all(h.status == "stopped" for h in self.handles):
            return
        for h in self.handles:
            if h.health:
                h.health.close()
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
            if h.status != "stopped":
                _event("shard-stopped", shard=h.index, exit=_describe_exit(h.proc.returncode))
            h.status = "stopped"
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        _event("stopped")

    # ------------------------------------------------------------------ processes
    def _spawn(self, h: ShardHandle) -> None:
        cmd = [self.python, "-m", "shardq.shard.process", "--data-dir", self.dd.path,
               "--index", str(h.index), "--config", json.dumps(self.config.to_dict()),
               "--parent-pid", str(os.getpid())]
        h.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.stderr,
                                  close_fds=True, env=child_env())
        h.status = "starting"
        h.corrupt = None
        _event("spawn", shard=h.index, pid=h.proc.pid)

    def _monitor(self) -> None:
        try:
            while not self.stopping:
                while self._spawn_requests:
                    self._spawn(self._spawn_requests.popleft())
                self._poll_once(0.25)
        finally:
            self._shutdown(getattr(self, "grace_s", 10.0))

    def _poll_once(self, timeout: float) -> None:
        live = {h.proc.stdout: h for h in self.handles if h.proc and h.proc.stdout and not h.proc.stdout.closed}
        ready = wait_ready([self._wake_r, *live], timeout)
        for r in ready:
            if r == self._wake_r:
                try:
                    os.read(self._wake_r, 64)
                except BlockingIOError:
                    pass
                continue
            h = live[r]
            line = r.readline()
            if line:
                self._on_line(h, line.decode(errors="replace").strip())
            else:
                self._on_exit(h)
        if not self.stopping:
            self._health()

    def _on_line(self, h: ShardHandle, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "ready":
            pid, records, seconds, jobs = rest.split()
            h.status = "ready"
            h.ready_info = {"records": int(records), "replay_s": float(seconds), "jobs": int(jobs)}
            h.next_ping = time.monotonic() + self._ping_interval()
            h.ping_sent = None
            _event("shard-ready", shard=h.index, pid=pid, replay_records=records, replay_s=seconds, jobs=jobs)
            h.ready_event.set()
        elif word == "corrupt":
            h.corrupt = json.loads(rest)

    def _on_exit(self, h: ShardHandle) -> None:
        code = h.proc.wait()
        h.proc.stdout.close()
        if h.health:
            h.health.close()
            h.health = None
        if self.stopping:
            h.status = "stopped"
            return
        h.last_exit = _describe_exit(code)
        now = time.monotonic()
        h.exits.append(now)
        window = self.config.service.restart_window
        while h.exits and h.exits[0] < now - window:
            h.exits.popleft()
        reason = f" reason=corrupt-log path={h.corrupt['path']} offset={h.corrupt['offset']}" if h.corrupt else ""
        _event("shard-exit", shard=h.index, pid=h.proc.pid, exit=h.last_exit + reason)
        if h.corrupt or len(h.exits) >= self.config.service.restart_limit:
            h.status = "failed"
            why = (f"corrupt log {h.corrupt['path']} at offset {h.corrupt['offset']}: {h.corrupt['reason']}"
                   if h.corrupt else f"{len(h.exits)} exits within {window:.0f} s, last {h.last_exit}")
            _event("shard-failed", shard=h.index, reason=json.dumps(why))
            h.ready_event.set()
            return
        h.restarts += 1
        _event("shard-restart", shard=h.index, restarts=h.restarts)
        self._spawn(h)

    # ------------------------------------------------------------------ health
    def _ping_interval(self) -> float:
        return self.config.service.health_timeout / 4

    def _health(self) -> None:
        now = time.monotonic()
        for h in self.handles:
            if h.status != "ready" or h.proc is None:
                continue
            if h.ping_sent is not None:
                fut = h.ping_future
                if fut.done:
                    h.ping_sent = None
                    h.next_ping = now + self._ping_interval()
                elif now - h.ping_sent > self.config.service.health_timeout:
                    _event("shard-hung", shard=h.index, pid=h.proc.pid,
                           unanswered_s=f"{now - h.ping_sent:.1f}")
                    h.proc.kill()  # the stdout EOF then drives the restart
                    h.ping_sent = None
                    h.status = "down"
                continue
            if now >= h.next_ping:
                try:
                    if h.health is None:
                        h.health = ShardClient(h.index, self.dd.socket_path(h.index), self.dd.authkey())
                    h.health.ensure_connected(now + 1.0)
                    h.ping_future = h.health.submit("ping", [])
                    h.ping_sent = now
                except ShardUnavailable:
                    h.ping_sent = now  # unreachable counts as unanswered
                    from ..client.connection import Future
                    h.ping_future = Future()

    def process_stats(self, index: int) -> dict:
        """psutil figures of a shard process, for ``stats``."""
        import psutil
        h = self.handles[index]
        out = {"status": h.status, "restarts": h.restarts, "last_exit": h.last_exit}
        try:
            p = psutil.Process(h.proc.pid)
            out.update(rss_bytes=p.memory_info().rss, cpu_percent=p.cpu_percent(None))
        except (psutil.Error, AttributeError):
            pass
        return out
