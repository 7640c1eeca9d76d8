"""A client of a data dir no service runs on fails at once, with what to do; one whose
service runs while a shard restarts keeps waiting. The check is the supervisor's lock,
probed without disturbing a supervisor that is taking it."""
from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import threading
import time

import pytest

import shardq
from shardq.datadir import DataDir
from shardq.errors import DataDirLocked, ServiceNotRunning
from support.service import Service, alive, restarted, short_tmpdir, wait_until


@pytest.fixture(scope="module")
def stopped():
    """The data dir of a service that ran and was stopped."""
    with Service(shards=2) as svc:
        svc.stop()
        yield svc.data_dir


def test_connect_to_a_stopped_service_fails_within_a_second(stopped):
    started = time.monotonic()
    with pytest.raises(ServiceNotRunning) as e:
        shardq.connect(stopped)
    assert time.monotonic() - started < 1.0
    assert str(e.value) == (f"no shardq service is running on {stopped}: "
                            f"start it with shardq serve --data-dir {stopped}")
    assert isinstance(e.value, shardq.ShardUnavailable)  # old handlers still catch it


def test_asyncio_connect_to_a_stopped_service_fails_within_a_second(stopped):
    started = time.monotonic()
    with pytest.raises(ServiceNotRunning, match="no shardq service is running"):
        asyncio.run(shardq.aio.connect(stopped))
    assert time.monotonic() - started < 1.0


def test_a_running_service_with_every_shard_down_is_waited_for():
    """The supervisor holds its lock while it restarts shards: a client created meanwhile
    is not told that no service runs, and its call lands once a shard is back."""
    with Service(shards=1) as svc:
        [pid] = svc.shard_pids()
        os.kill(svc.proc.pid, signal.SIGSTOP)  # it cannot restart the shard until SIGCONT
        try:
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not alive(pid), 10, 0.01, "the shard gone")
            with shardq.connect(svc.data_dir, retry_s=30) as q:
                result: list = []
                caller = threading.Thread(target=lambda: result.append(q.enqueue(b"after the restart")))
                caller.start()
                os.kill(svc.proc.pid, signal.SIGCONT)
                caller.join(30)
                assert not caller.is_alive() and len(result) == 1
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
        restarted(svc, 0, pid)


def test_a_probe_holding_the_lock_does_not_make_a_starting_supervisor_fail():
    dd = DataDir(os.path.join(short_tmpdir(), "data"))
    dd.init(1)
    path = os.path.join(dd.path, "supervisor.lock")
    probe = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # what a client's probe holds, briefly
    release = threading.Timer(0.05, os.close, [probe])
    release.start()
    fd = dd.lock("supervisor.lock")
    release.join()
    try:
        assert dd.service_running() is True
        with open(path) as f:
            assert f.read() == f"{os.getpid()}\n"
        with pytest.raises(DataDirLocked, match=rf"held by another running process \(pid {os.getpid()}\)"):
            DataDir(dd.path).lock("supervisor.lock")
    finally:
        os.close(fd)
    assert dd.service_running() is False


def test_a_data_dir_no_supervisor_ever_served_is_left_to_the_client():
    """No lock file: a data dir being created now, or shards run alone (tests): no verdict."""
    dd = DataDir(os.path.join(short_tmpdir(), "data"))
    dd.init(1)
    assert dd.service_running() is None
    started = time.monotonic()
    dd.require_service()
    assert time.monotonic() - started < 0.1


def test_a_file_as_the_data_dir_is_not_a_data_dir_for_both_clients(tmp_path):
    """shardq.connect('README.md') raised a raw NotADirectoryError from the data dir's
    metadata; both clients now say NotADataDir, naming the path."""
    a_file = tmp_path / "README.md"
    a_file.write_text("not a data dir")
    for path in (a_file, a_file / "below"):
        with pytest.raises(shardq.NotADataDir, match="is not a shardq data dir"):
            shardq.connect(str(path))
        with pytest.raises(shardq.NotADataDir, match="is not a shardq data dir"):
            asyncio.run(shardq.aio.connect(str(path)))
