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


def start(argv: Sequence[str], port: int, log_path: str) -> subprocess.Popen:
    """Start ``argv`` and wait until it accepts connections on 127.0.0.1:``port``."""
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                preexec_fn=_die_with_parent)
    finally:
        log.close()
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


def install_peers(peers: Sequence[str]) -> None:
    """Run setup_peers.sh for ``peers`` (idempotent); its output goes to stderr."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup_peers.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", script, *peers], env=env, stdout=sys.stderr, check=False)
