"""Process hygiene and the files that guard access (issue 9 item 7, issue 15 item 6).

* Shards run in a session of their own: a Ctrl-C in the terminal of an app that embeds the
  service (``shardq.open``) reaches the app's process group, not the shards. Before the fix
  the shards got the SIGINT too, stopped, and the supervisor restarted them under the app.
  The app's ``close()`` still stops them; PDEATHSIG still kills them with a SIGKILLed
  supervisor (test_supervisor.py::test_supervisor_sigkill_takes_its_shards_with_it).
* The key file is opened with ``O_NOFOLLOW`` and checked with ``fstat``: a symlink, another
  owner, or group/other bits are refused with ``AuthError``.
* A socket directory that others can read (0755) is refused, as operations.md says; before,
  only write bits were checked (and ``serve`` chmod-ed it back silently).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

import shardq
from support.service import REPO, Service, alive, short_tmpdir

APP = r"""
import json, signal, sys, time
import shardq
# Python leaves SIGINT ignored when it starts ignored (a job started with & by a shell
# without job control): an app in a terminal has the handler that raises KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
q = shardq.open(sys.argv[1], shards=2)
try:
    print(json.dumps(q.ping()), flush=True)
    while True:  # until the Ctrl-C. Not signal.pause(): a SIGINT that came before it would be lost
        time.sleep(0.05)
except KeyboardInterrupt:
    print(json.dumps(q.ping()), flush=True)  # the same shard processes, still serving
    q.close()
    print("closed", flush=True)
"""


LINE_TIMEOUT_S = 60.0  # start-up, the Ctrl-C's handling and close() each take well under this


def test_ctrl_c_in_an_embedding_app_does_not_reach_its_shards_and_close_still_stops_them():
    tmp = short_tmpdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err = open(os.path.join(tmp, "app.log"), "w+b")
    # bufsize=0: readline reads no further than the line, so select() sees every line still unread
    app = subprocess.Popen([sys.executable, "-c", APP, os.path.join(tmp, "data")], stdout=subprocess.PIPE,
                           stderr=err, env=env, start_new_session=True, bufsize=0)  # its own group, as a shell's job
    app_log = lambda: (err.seek(0), err.read().decode(errors="replace")[-3000:])[1]  # noqa: E731 - a one-line local helper

    def line() -> bytes:  # the app's next line, or b"" if it says nothing for LINE_TIMEOUT_S
        ready, _, _ = select.select([app.stdout], [], [], LINE_TIMEOUT_S)
        return app.stdout.readline() if ready else b""

    pids: list[int] = []
    try:
        pids = json.loads(line() or b"null")
        assert pids and len(pids) == 2, app_log()
        os.killpg(app.pid, signal.SIGINT)  # what Ctrl-C in the app's terminal sends
        after = json.loads(line() or b"null")
        assert after == pids, f"the shards were stopped and restarted: {after} {app_log()}"
        assert line().strip() == b"closed"
        assert app.wait(30) == 0
        assert not any(alive(p) for p in pids), "close() left a shard running"
    finally:
        for pid in [app.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        app.wait(10)
        err.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def stopped_data_dir():
    """A data dir made by a real service, then stopped: the files are checked offline."""
    with Service(shards=1) as svc:
        svc.stop()
        yield svc.data_dir


def serve_rc(data_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--data-dir", data_dir, "--shards", "1"],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def test_a_symlinked_key_file_is_refused(stopped_data_dir):
    key = os.path.join(stopped_data_dir, "authkey")
    real = key + ".real"
    os.rename(key, real)
    os.symlink(real, key)  # mode 0600 behind it: only the link is wrong
    try:
        with pytest.raises(shardq.AuthError, match="symlink"):
            shardq.connect(stopped_data_dir)
        r = serve_rc(stopped_data_dir)
        assert r.returncode == 5 and "AuthError" in r.stderr and "symlink" in r.stderr, r.stderr[-2000:]
    finally:
        os.unlink(key)
        os.rename(real, key)


def test_a_key_file_of_another_user_is_refused(stopped_data_dir):
    key = os.path.join(stopped_data_dir, "authkey")
    try:
        os.chown(key, os.geteuid() + 4242, -1)
    except PermissionError:
        pytest.skip("chown needs root here: the owner check cannot be set up as this user")
    try:
        with pytest.raises(shardq.AuthError, match=f"owned by uid {os.geteuid() + 4242}"):
            shardq.connect(stopped_data_dir)
    finally:
        os.chown(key, os.geteuid(), -1)


def test_a_socket_dir_others_can_read_is_refused(stopped_data_dir):
    run = os.path.join(stopped_data_dir, "run")
    os.chmod(run, 0o755)
    try:
        with pytest.raises(shardq.AuthError, match="0755.*chmod 700"):
            shardq.connect(stopped_data_dir)
        r = serve_rc(stopped_data_dir)  # not silently chmod-ed back by serve either
        assert r.returncode == 5 and "socket dir" in r.stderr and "chmod 700" in r.stderr, r.stderr[-2000:]
        assert "event=spawn" not in r.stderr
    finally:
        os.chmod(run, 0o700)
    with Service(data_dir=stopped_data_dir, shards=1) as svc:  # and fine again once fixed
        assert len(svc.shard_pids()) == 1
