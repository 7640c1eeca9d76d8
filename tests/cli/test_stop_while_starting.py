"""A SIGTERM that reaches a long-running command while it is still starting (connecting,
opening its store: once its code is loaded and it handles SIGTERM) is a clean stop, exit 0,
as one while it runs is: a service manager that stops a worker it has just started must not
see it killed."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from shardq.cli import common
from support.doc_runner import catches_sigterm
from support.service import REPO, short_tmpdir, wait_until


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_sigterm_while_the_worker_connects_exits_0(tmp):
    """The worker's idempotency store is a PostgreSQL address that accepts the connection
    and never answers: the worker is stuck opening it when SIGTERM comes."""
    with open(os.path.join(tmp, "h.py"), "w") as f:
        f.write("def handle(ctx):\n    pass\n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    url = f"postgresql://u@127.0.0.1:{silent.getsockname()[1]}/db?connect_timeout=60"
    p = subprocess.Popen([sys.executable, "-m", "shardq.cli", "worker", "h:handle", "--idempotency", url,
                          "--connect", os.path.join(tmp, "no-service")],
                         cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        conn = None
        def connected():
            nonlocal conn
            silent.settimeout(0.05)
            try:
                conn, _ = silent.accept()
            except OSError:
                return False
            return True
        wait_until(connected, 30, 0.01, "the worker connecting to the store")
        wait_until(lambda: catches_sigterm(p.pid), 30, 0.01, "the worker stoppable")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        silent.close()
    assert p.returncode == 0, err.decode()
    assert b"shardq worker: SIGTERM while starting: stopped" in err


def test_a_worker_whose_handler_cannot_load_exits_2_before_it_handles_sigterm(tmp):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "shardq.cli", "worker", "nosuch_module:handle",
                        "--connect", os.path.join(tmp, "no-service")],
                       cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"UsageError: cannot load" in r.stderr


def test_the_handlers_of_the_caller_come_back_after_the_command():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert common.stoppable_while_starting("t", lambda: os.kill(os.getpid(), signal.SIGINT) or 5) == 0
    assert common.stoppable_while_starting("t", lambda: 5) == 5
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
