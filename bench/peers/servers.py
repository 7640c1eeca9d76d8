"""Peer server processes: find or install the binary, start it on 127.0.0.1, stop it by PID.

A started server gets SIGTERM when the harness dies (Linux ``PR_SET_PDEATHSIG``), so a
killed benchmark leaves no server behind.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from .base import SkipPeer

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def require_binary(name: str) -> str:
    """The path of ``name`` on PATH, or SkipPeer saying how to install it.

    run.py installs missing peers with setup_peers.sh before any adapter starts, so a binary
    still missing here means that install failed or was turned off (--no-install).
    """
    path = shutil.which(name)
    if path is None:
        raise SkipPeer(f"{name} not on PATH (bench/setup_peers.sh installs it with apt-get)")
    return path


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not glibc: the server is still stopped by teardown()


def spawn(argv: Sequence[str], log_path: str, env: dict[str, str] | None = None,
          cwd: str | None = None) -> subprocess.Popen:
    """Start ``argv`` with its output going to ``log_path``; it gets SIGTERM if we die."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, cwd=cwd, preexec_fn=_die_with_parent)
    finally:
        log.close()


def start(argv: Sequence[str], port: int, log_path: str) -> subprocess.Popen:
    """Start ``argv`` and wait until it accepts connections on 127.0.0.1:``port``."""
    proc = spawn(argv, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SkipPeer(f"{argv[0]} exited with {proc.returncode} at start; see {log_path}")
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.02)
    stop(proc)
    raise SkipPeer(f"{argv[0]} did not listen on {HOST}:{port} within {START_TIMEOUT_S} s")


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM the server by PID, SIGKILL it if it has not exited in STOP_TIMEOUT_S."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_tree(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop ``proc`` and the processes it started (a worker's pool, a forked job), each by
    PID: SIGTERM to ``proc`` so it shuts down its own way, then SIGKILL to whatever of the
    tree is still there after ``timeout_s``."""
    import psutil

    if proc is None:
        return
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    _gone, alive = psutil.wait_procs(tree, timeout=0 if proc.poll() is None else 1.0)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    if proc.poll() is None:
        proc.wait()


def install_peers(peers: Sequence[str]) -> None:
    """Run setup_peers.sh for ``peers`` (idempotent); its output goes to stderr."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup_peers.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", script, *peers], env=env, stdout=sys.stderr, check=False)


def pip_install_pinned(distributions: Sequence[str]) -> None:
    """pip-install ``distributions`` into the running Python at the versions pyproject.toml's
    bench extra pins (one place for the pins); its output goes to stderr."""
    import re
    import tomllib

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    by_name = {re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower(): req for req in extra}
    reqs = [by_name.get(d.lower(), d) for d in distributions]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs], stdout=sys.stderr,
                   check=False)
