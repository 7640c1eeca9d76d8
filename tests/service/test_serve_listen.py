"""Issue 44, items 9 and 14: where ``shardq serve``'s HTTP listener goes, and when a taken
port stops it.

``--http-listen ADDR`` (then ``SHARDQ_HTTP_LISTEN``, then ``[http] listen``) moves the
listener, ``""`` turns it off; the listener is bound before any shard starts, so a port that
is taken stops ``serve`` at once (exit 5), before its readiness line and ``READY=1``, naming
the port, the process that holds it and the flag. (The restored copy served beside the
running service: tests/backup/test_backup.py.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import psutil
import pytest

import shardq
from support.service import REPO, _to_toml, short_tmpdir, wait_until
from shardq.config import parse
from shardq.errors import InvalidConfig


@pytest.fixture
def taken():
    """A TCP port of 127.0.0.1 held (listening) by this test process."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def base():
    d = short_tmpdir("sql")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(base: str, listen: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    cfg = os.path.join(base, "shardq.toml")
    with open(cfg, "w") as f:
        f.write(_to_toml({"http": {"listen": listen}, "service": {"health_timeout": 2}}))
    full_env = {k: v for k, v in os.environ.items() if k not in ("SHARDQ_HTTP_LISTEN", "NOTIFY_SOCKET")}
    full_env.update(env or {}, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "shardq.cli", "serve", "--config", cfg, "--data-dir",
                             os.path.join(base, "data"), "--shards", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM ``serve``, wait, and SIGKILL by PID whatever of it is left; (exit code, stderr)."""
    try:
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pids = []
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return proc.returncode, err


def serving(base: str, proc: subprocess.Popen) -> int:
    def up():
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with shardq.connect(os.path.join(base, "data"), retry_s=0.2) as q:
                return q.ping()[0]
        except Exception:  # noqa: BLE001 - not up yet
            return None
    return wait_until(up, 30, 0.02, "serve to answer")


def listener_url(base: str) -> str | None:
    try:
        with open(os.path.join(base, "data", "run", "http.json")) as f:
            return json.load(f)["url"]
    except FileNotFoundError:
        return None


def test_a_taken_port_stops_serve_before_ready_naming_the_port_the_holder_and_the_flag(base, taken):
    notify_path = os.path.join(base, "notify")
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(notify_path)
    try:
        proc = serve(base, f"127.0.0.1:{taken}", env={"NOTIFY_SOCKET": notify_path})
        _, err = proc.communicate(timeout=60)
        manager.setblocking(False)
        said = []
        while True:
            try:
                said.append(manager.recv(65536).decode())
            except BlockingIOError:
                break
    finally:
        manager.close()
    assert proc.returncode == 5, err
    assert f"port {taken}" in err and f"pid {os.getpid()}" in err and "--http-listen" in err, err
    # at once: before any shard started, before the readiness line and READY=1
    assert "event=spawn" not in err and "event=ready" not in err, err
    assert not [m for m in said if "READY=1" in m], said
    assert not os.path.exists(os.path.join(base, "data", "run", "http.json"))


def test_http_listen_moves_the_listener_over_the_environment_and_the_config(base, taken):
    proc = serve(base, f"127.0.0.1:{taken}", "--http-listen", "127.0.0.1:0",
                 env={"SHARDQ_HTTP_LISTEN": f"127.0.0.1:{taken}"})
    try:
        serving(base, proc)
        url = wait_until(lambda: listener_url(base), 20, 0.02, "the listener's address file")
        assert url.startswith("http://127.0.0.1:") and f":{taken}/" not in url
        # a reload reads the file again, with the same override: no change to report
        with open(os.path.join(base, "shardq.toml"), "a") as f:
            f.write("\n[queues.fresh]\n")
        os.kill(proc.pid, signal.SIGHUP)
        config = os.path.join(base, "data", "run", "config.json")  # (written at start too: the new queue tells)
        wait_until(lambda: "fresh" in json.load(open(config))["queues"], 20, 0.02, "the reload")
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert f"metrics at {url}metrics" in err
    assert re.search(r"event=reloaded applied=\d+ needs_restart=0 ", err) and "http.listen" not in err, err


def test_an_empty_listen_address_in_the_environment_turns_the_listener_off(base, taken):
    proc = serve(base, f"127.0.0.1:{taken}", env={"SHARDQ_HTTP_LISTEN": ""})
    try:
        serving(base, proc)
        assert listener_url(base) is None
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert "shardq serving" in err and "metrics at" not in err and "event=http-listening" not in err


def test_the_listen_address_comes_from_the_flag_then_the_environment_then_the_config():
    from shardq.cli.serve import with_listen
    cfg = parse({"http": {"listen": "127.0.0.1:7781"}})
    assert with_listen(cfg, None, {}).http.listen == "127.0.0.1:7781"
    assert with_listen(cfg, None, {"SHARDQ_HTTP_LISTEN": "[::1]:0"}).http.listen == "[::1]:0"
    assert with_listen(cfg, None, {"SHARDQ_HTTP_LISTEN": ""}).http.listen == ""
    assert with_listen(cfg, "", {"SHARDQ_HTTP_LISTEN": "[::1]:0"}).http.listen == ""
    assert with_listen(cfg, "127.0.0.1:9", {"SHARDQ_HTTP_LISTEN": ""}).http.listen == "127.0.0.1:9"
    with pytest.raises(InvalidConfig, match="SHARDQ_HTTP_LISTEN"):
        with_listen(cfg, None, {"SHARDQ_HTTP_LISTEN": "7781"})


def test_a_malformed_http_listen_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--http-listen", "7781"],
                       capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 2 and "--http-listen" in r.stderr and "host:port" in r.stderr, r.stderr
