"""``[sqs_api] processes`` > 1: the SQS listener as that many processes of ``serve``,
started and restarted here as the supervisor does its shards.

One process answers every SQS request on one event loop, under one interpreter lock; several share
the listening socket ``serve`` bound before any shard started (each inherits it; the kernel
gives each new connection to one of them), so the SQS path can use more than one CPU. Every
process reaches the shards through the public client API and shares what the SQS layer keeps
beside the messages (the queue catalog and the memos: on disk, under locks, docs/sqs-api.md),
so it does not matter which process answers a request.

Guarantees: ``start`` returns once every process serves (or raises, none left running). A
process that dies (a crash, SIGKILL) is started again, at once the first time and then after
a pause that doubles up to ``RESTART_PAUSE_S_MAX``; meanwhile the others answer, and a send
it had answered was fsynced before its answer, so nothing answered is lost. ``stop`` closes
each one's stdin (it finishes its requests and exits), then SIGKILLs what is left after the
grace time. The address file (``run/sqs-api.json``) lists the processes' pids."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from typing import Any

from ..busypoll import BUSY_POLL_US_DEFAULT
from ..clock import Clock, SystemClock
from ..config import SqsApiConfig, split_listen
from ..errors import ShardUnavailable
from ..service.http_listener import publish_address, unpublish_address
from .child import READY
from .server import ADDRESS_FILE

log = logging.getLogger("shardq.sqs_api")

START_TIMEOUT_S = 30.0      # a process that does not serve within this at start fails serve's start
RESTART_PAUSE_S_MAX = 5.0   # the longest pause before a process that keeps dying is started again
STOP_GRACE_S = 12.0         # a stopping process finishes its requests (2 s: server.STOP_GRACE_S) and its writes


@dataclasses.dataclass
class _Child:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    pause_s: float = 0.0       # before the next restart
    restarts: int = 0


class SqsProcesses:
    """``start(run_dir, sock)`` spawns ``cfg.processes`` children serving ``sock``; ``stop()``."""

    def __init__(self, data_dir: str, cfg: SqsApiConfig, *, python: str | None = None,
                 clock: Clock | None = None, busy_poll_us: int = BUSY_POLL_US_DEFAULT):
        self.data_dir, self.cfg = data_dir, cfg
        self.busy_poll_us = busy_poll_us  # each child's loop's (server.py)
        self._clock = clock or SystemClock()
        self.python = python or sys.executable
        self.host, self.port = split_listen(cfg.listen, "sqs_api.listen")
        self.children = [_Child(i) for i in range(cfg.processes)]
        self._sock: socket.socket | None = None
        self._run_dir: str | None = None
        self._address_file: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # spawns and the address file, against stop()
        self._monitor: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None]

    def start(self, run_dir: str | None, sock: socket.socket) -> SqsProcesses:
        self._sock, self._run_dir = sock, run_dir
        self.port = sock.getsockname()[1]
        try:
            with self._lock:
                for c in self.children:
                    self._spawn(c)
            deadline = self._clock.monotonic() + START_TIMEOUT_S
            for c in self.children:
                self._await_ready(c, deadline)
        except BaseException:
            self.stop()
            raise
        self._publish()
        # The monitor spawns the restarts: PR_SET_PDEATHSIG follows the spawning thread, which
        # must live as long as serve does (this one does; a start thread may not).
        self._monitor = threading.Thread(target=self._watch, name="shardq-sqs-processes", daemon=True)
        self._monitor.start()
        log.info("event=sqs-api-listening url=%s processes=%d pids=%s", self.url, len(self.children), self.pids())
        return self

    def _spawn(self, c: _Child) -> None:
        if self._sock is None:
            raise ShardUnavailable("the SQS listener's socket is gone")
        fd = self._sock.fileno()
        cmd = [self.python, "-m", "shardq.sqs_api.child", "--data-dir", self.data_dir, "--fd", str(fd),
               "--index", str(c.index), "--parent-pid", str(os.getpid()), "--busy-poll-us", str(self.busy_poll_us)]
        from ..service.supervisor import child_env
        try:
            c.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,),
                                      env=child_env(), start_new_session=True)
        except OSError as e:
            raise ShardUnavailable(f"cannot start SQS listener process {c.index}: {e}") from e
        if c.proc.stdin is None:
            raise ShardUnavailable(f"SQS listener process {c.index} has no stdin")
        # the [sqs_api] table, keys included: on a pipe, not on the command line
        c.proc.stdin.write(json.dumps(dataclasses.asdict(self.cfg)).encode() + b"\n")
        c.proc.stdin.flush()
        log.info("event=sqs-api-spawn index=%d pid=%d", c.index, c.proc.pid)

    def _await_ready(self, c: _Child, deadline: float) -> None:
        proc = c.proc
        if proc is None or proc.stdout is None:
            raise ShardUnavailable(f"SQS listener process {c.index} did not start")
        left = deadline - self._clock.monotonic()
        ready = select.select([proc.stdout], [], [], max(0.0, left))[0]
        line = proc.stdout.readline() if ready else b""
        if line != READY:
            raise ShardUnavailable(f"SQS listener process {c.index} (pid {proc.pid}) did not start within "
                                   f"{START_TIMEOUT_S:.0f} s (exit status {proc.poll()}): see serve's log")

    def _publish(self) -> None:
        if self._run_dir:
            self._address_file = publish_address(self._run_dir, ADDRESS_FILE, {
                "url": self.url, "pid": os.getpid(), "pids": self.pids(),
                "auth": "sigv4" if self.cfg.access_key_id else "open"})

    # ------------------------------------------------------------------ restarts
    def _watch(self) -> None:
        while not self._stopping.wait(0.05):
            for c in self.children:
                if c.proc is None or c.proc.poll() is None:
                    continue
                log.error("event=sqs-api-process-exited index=%d pid=%d status=%s restart_in_s=%.1f",
                          c.index, c.proc.pid, c.proc.returncode, c.pause_s)
                self._close_pipes(c.proc)
                if self._stopping.wait(c.pause_s):
                    return
                with self._lock:
                    if self._stopping.is_set():
                        return
                    try:
                        self._spawn(c)
                        self._await_ready(c, self._clock.monotonic() + START_TIMEOUT_S)
                    except ShardUnavailable as e:
                        log.error("event=sqs-api-restart-failed index=%d reason=%s", c.index, json.dumps(str(e)))
                        if c.proc is not None and c.proc.poll() is None:
                            c.proc.kill()  # hung on its way up: the next round starts another
                    c.restarts += 1
                    c.pause_s = min(RESTART_PAUSE_S_MAX, max(0.1, c.pause_s * 2))
                    self._publish()

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    # ------------------------------------------------------------------ stop
    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self._stopping.set()
        with self._lock:
            procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()  # its stdin's end: it stops serving and exits
                except OSError:
                    pass
        deadline = self._clock.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - self._clock.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self._close_pipes(proc)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(RESTART_PAUSE_S_MAX + 1)
        unpublish_address(self._address_file)
        self._address_file = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "pids": self.pids(), "restarts": sum(c.restarts for c in self.children)}
