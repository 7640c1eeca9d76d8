"""Real-process service fixtures for tests: start ``shardq serve`` in a short temp dir,
wait until every shard answers, and clean up every process by PID afterwards."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

import shardq

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def short_tmpdir(prefix: str = "sq") -> str:
    """A temp dir short enough for unix socket paths (pytest's tmp_path can be too long)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def parked_long_poll(q, queue: str, wait: float, max_jobs: int = 100):
    """A thread whose ``q.dequeue_many(queue, max_jobs, wait=wait)`` (its leases, or the ShardqError
    it raised) lands in the list returned beside it; returned once its wait is written to
    every shard (the router's I/O thread carries a wait over several shards)."""
    import threading

    out: list = []

    def poll() -> None:
        try:
            out.append(q.dequeue_many(queue, max_jobs, wait=wait))
        except shardq.ShardqError as e:
            out.append(e)

    t = threading.Thread(target=poll)
    t.start()
    wait_until(lambda: q._io and all(c.chan.pending for c in q._io.conns), 5, what="the long poll at every shard")
    return t, out


def poll_until(predicate, deadline: float, interval: float = 0.01):
    """Poll ``predicate`` until it returns a truthy value (returned) or the monotonic
    ``deadline`` passes (its last value is returned). The one sleeping poll of the tests:
    every wait on another process's progress goes through here or :func:`wait_until`."""
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.01, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (AssertionError)."""
    value = poll_until(predicate, time.monotonic() + timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return value


class Service:
    """``shardq serve`` as a child process. Use as a context manager."""

    def __init__(self, data_dir: str | None = None, shards: int = 2, config: dict | None = None,
                 log_path: str | None = None, wait_for: list[int] | None = None):
        self.data_dir = data_dir or os.path.join(short_tmpdir(), "data")
        self.shards = shards
        self.wait_for = wait_for  # the shards start() waits for (None: all; a test may expect one down)
        self.config = dict(config or {})
        # Metrics and console on a free port unless the test says otherwise: services of
        # parallel tests must not fight over the default port (see http_url()).
        self.config.setdefault("http", {"listen": "127.0.0.1:0"})
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path or self.data_dir.rstrip("/") + ".log"
        self._owns_dir = data_dir is None

    def start(self, timeout: float = 30.0) -> Service:
        # Again here: a test may have replaced self.config before a restart.
        self.config.setdefault("http", {"listen": "127.0.0.1:0"})
        cfg_path = self.data_dir.rstrip("/") + ".toml"
        with open(cfg_path, "w") as f:
            f.write(_to_toml(self.config))
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardq.cli", "serve", "--config", cfg_path, "--data-dir", self.data_dir,
             "--shards", str(self.shards)], stdout=self.log, stderr=subprocess.STDOUT, env=env,
            stdin=subprocess.DEVNULL)
        try:
            wait_until(self._all_ready, timeout, 0.02, "all shards ready")
        except BaseException:
            self.stop()  # __exit__ will not run when __enter__ raises: clean up by PID here
            self.log.close()
            raise
        return self

    def _all_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"shardq serve exited with {self.proc.returncode}: {self.tail()}")
        try:
            # retry_s short: a shard not listening yet fails this poll at once (the next is 20 ms
            # later) instead of waiting out the router's back-off between connects
            with shardq.connect(self.data_dir, retry_s=0.01, request_timeout_s=2) as q:
                if self.wait_for is None:
                    q.ping()
                    return True
                shards = q.stats()["shards"]
                return all(shards[i]["available"] for i in self.wait_for)
        except Exception:  # noqa: BLE001 - not ready yet, whatever the reason
            return False

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def shard_pids(self) -> list[int]:
        """PIDs of the shard processes, by shard index (via the ping op)."""
        with shardq.connect(self.data_dir, retry_s=5) as q:
            return q.ping()

    def all_pids(self) -> list[int]:
        if self.proc is None:
            return []
        try:
            parent = psutil.Process(self.proc.pid)
            return [self.proc.pid] + [c.pid for c in parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_all(self) -> None:
        """SIGKILL the supervisor and every shard (a power cut, as far as processes go)."""
        pids = self.all_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            self.proc.wait(10)
        for pid in pids:
            _wait_gone(pid)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill_all()
            return self.proc.returncode if self.proc else None
        pids = self.all_pids()
        self.proc.send_signal(signal.SIGTERM)
        rc = wait_exit(self.proc, 20)
        for pid in pids:  # clean up by PID whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(pid)
        return rc

    def http_url(self) -> str:
        """Where the HTTP listener is (``run/http.json``, written once it listens)."""
        path = os.path.join(self.data_dir, "run", "http.json")

        def current():  # a file left by a killed predecessor names another pid
            try:
                with open(path) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                return None
            return info["url"] if info["pid"] == self.proc.pid else None
        return wait_until(current, 20, 0.02, "the HTTP listener's address file")

    def connect(self, **kw):
        return shardq.connect(self.data_dir, **kw)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        self.log.close()
        if self._owns_dir:
            shutil.rmtree(os.path.dirname(self.data_dir), ignore_errors=True)


def run_worker(svc: Service, cwd: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``shardq worker *args --data-dir <svc's>`` run to its end in ``cwd``, this checkout
    importable; its output captured as text."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq", "worker", *args, "--data-dir", svc.data_dir],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def reset_queues(q, names) -> None:
    """Leave ``names`` empty and running (between tests sharing one service): resume, ack
    whatever can be leased, purge the dead letters."""
    for name in names:
        q.resume(name)
        while True:
            leases = q.dequeue_many(name, max_jobs=1000)
            if not leases:
                break
            q.ack_many(leases)
        q.purge_dead_letters(name)


def restarted(svc: Service, shard: int, old_pid: int) -> int:
    """Wait until shard ``shard`` answers with a pid other than ``old_pid``; return it."""
    def new_pid():
        try:
            with shardq.connect(svc.data_dir, retry_s=0.5, request_timeout_s=2) as q:
                pid = q.ping()[shard]
        except shardq.ShardUnavailable:
            return None
        return pid if pid != old_pid else None
    return wait_until(new_pid, 20, 0.02, f"shard {shard} to come back")


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    """``proc``'s exit status once it exits, or None past ``timeout`` (it runs on). Woken by
    the exit itself (a pidfd polled), not by ``Popen.wait``'s sleeps of up to 50 ms."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # reaped already, or no pidfds here
        fd = None
    if fd is not None:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(int(timeout * 1000))
        finally:
            os.close(fd)
    try:
        return proc.wait(0 if fd is not None else timeout)
    except subprocess.TimeoutExpired:
        return None


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    poll_until(lambda: _gone(pid), time.monotonic() + timeout)


def _to_toml(cfg: dict) -> str:
    lines = []
    for section, body in cfg.items():
        if section in ("queues", "schedules"):
            for qname, q in body.items():
                lines.append(f"[{section}.{json.dumps(qname)}]")
                lines += [f"{k} = {json.dumps(v)}" for k, v in q.items()]
        else:
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"
