"""A SIGTERM that reaches a long-running command while it is still starting (importing its
handler, connecting, opening its store) is a clean stop, exit 0, as one while it runs is:
a service manager that stops a worker it has just started must not see it killed."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from shardq.cli import common
from support.service import REPO, short_tmpdir, wait_until


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_sigterm_while_the_worker_imports_its_handler_exits_0(tmp):
    fifo = os.path.join(tmp, "never-written")
    os.mkfifo(fifo)
    marker = os.path.join(tmp, "importing")
    with open(os.path.join(tmp, "slow_handler.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').close()\n"
                f"open({fifo!r}).read()  # blocks: nobody writes the fifo\n"
                "def handle(ctx):\n    pass\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "shardq.cli", "worker", "slow_handler:handle",
                          "--connect", os.path.join(tmp, "no-service")],
                         cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        wait_until(lambda: os.path.exists(marker), 30, 0.01, "the handler's import started")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err.decode()
    assert b"shardq worker: SIGTERM while starting: stopped" in err


def test_the_handlers_of_the_caller_come_back_after_the_command():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert common.stoppable_while_starting("t", lambda: os.kill(os.getpid(), signal.SIGINT) or 5) == 0
    assert common.stoppable_while_starting("t", lambda: 5) == 5
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
