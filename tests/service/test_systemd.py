"""``shardq serve`` under a service manager: the sd_notify client against sockets the test
binds, a real ``serve`` talking to a fake notify socket (READY=1, STATUS=, WATCHDOG=1,
STOPPING=1), and the shipped unit file through ``systemd-analyze verify``."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time

import pytest

from support.service import REPO, Service, short_tmpdir
from shardq.service import notify
from shardq.service.notify import Notifier, watchdog_interval_s

UNIT = os.path.join(REPO, "config", "shardq.service")


class FakeManager:
    """A notify socket (a path, or an abstract name) and a thread that records every
    datagram with its arrival time, as systemd would receive them."""

    def __init__(self, abstract: bool = False):
        self.dir = short_tmpdir("sdn")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"shardq-test-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.address = os.path.join(self.dir, "notify")
            self.sock.bind(self.address)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.hook = None          # called with each message, in the receiving thread
        self._changed = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            if self.hook is not None:
                self.hook(fields)
            with self._changed:
                self.messages.append((time.monotonic(), fields))
                self._changed.notify_all()

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "a message"):
        """The index of the first message (from the start) that ``predicate`` accepts."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i, (_, m) in enumerate(self.messages):
                    if predicate(i, m):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; got {self.texts()[-20:]}")
                self._changed.wait(left)

    def texts(self) -> list[dict[str, str]]:
        with self._changed:
            return [m for _, m in self.messages]

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------- the client
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_send_reaches_a_path_or_an_abstract_socket(abstract):
    mgr = FakeManager(abstract)
    try:
        assert notify.send(mgr.address, "READY=1", "STATUS=2/2 shards up") is True
        mgr.wait_for(lambda i, m: m == {"READY": "1", "STATUS": "2/2 shards up"}, 5, "the datagram")
    finally:
        mgr.close()


@pytest.mark.parametrize("address", [None, "", "relative/path", "vsock:2:1234",
                                     "/nonexistent-dir/notify", "@shardq-test-nobody-listens"])
def test_send_without_a_listener_returns_false_and_never_raises(address):
    assert notify.send(address, "READY=1") is False


def test_send_to_a_full_socket_does_not_block():
    """A manager that does not read: the send fails at once (MSG_DONTWAIT), it never blocks the loop."""
    mgr_dir = short_tmpdir("sdn")
    path = os.path.join(mgr_dir, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    try:
        results = [notify.send(path, "STATUS=" + "x" * 4000) for _ in range(2000)]
        assert results[0] is True and results[-1] is False  # the queue filled, and then it said so
    finally:
        s.close()
        shutil.rmtree(mgr_dir, ignore_errors=True)


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"WATCHDOG_USEC": "4000000"}, 4.0),
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}, 4.0),
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),     # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_interval_from_the_environment(env, expected):
    assert watchdog_interval_s(env) == expected


def test_notifier_paces_status_and_watchdog():
    mgr = FakeManager()
    try:
        n = Notifier({"NOTIFY_SOCKET": mgr.address, "WATCHDOG_USEC": "2000000"})
        assert n.enabled and n.watchdog_s == 2.0 and n.due_in(100.0) == 0.0
        n.watchdog(100.0)
        n.watchdog(100.9)                        # before half the interval: nothing
        assert n.due_in(100.9) == pytest.approx(0.1)
        n.watchdog(101.0)
        n.status("2/2 shards up", "; queue depth 1 ready, 1 jobs held", 101.0)
        n.status("2/2 shards up", "; queue depth 2 ready, 2 jobs held", 101.5)   # a figure, too soon
        n.status("1/2 shards up, shard 1 restarting", "", 101.6)             # the shards: at once
        n.status("1/2 shards up, shard 1 restarting", "", 101.7)             # the same: nothing
        n.status("1/2 shards up, shard 1 restarting", "; queue depth 3 ready, 3 jobs held", 102.7)
        mgr.wait_for(lambda i, m: i == 4, 5, "five datagrams")
        assert n.sent == 5
        assert mgr.texts() == [{"WATCHDOG": "1"}, {"WATCHDOG": "1"},
                               {"STATUS": "2/2 shards up; queue depth 1 ready, 1 jobs held"},
                               {"STATUS": "1/2 shards up, shard 1 restarting"},
                               {"STATUS": "1/2 shards up, shard 1 restarting; queue depth 3 ready, 3 jobs held"}]
    finally:
        mgr.close()


def test_a_notifier_without_a_socket_sends_nothing():
    n = Notifier({"WATCHDOG_USEC": "1000000"})
    n.status("x", "", 0.0)
    n.watchdog(0.0)
    assert not n.enabled and n.watchdog_s is None and n.due_in(0.0) is None and n.sent == 0


# ---------------------------------------------------------------------- a real serve
HEALTH_TIMEOUT_S = 1.0      # pings every 0.25 s; a silent shard is killed after 1 s
WATCHDOG_S = 1.0
_DEPTH = re.compile(r"queue depth (\d+) ready, (\d+) jobs held")


def _headline(m: dict) -> str:
    return m.get("STATUS", "").split(";", 1)[0]


def test_serve_speaks_sd_notify(monkeypatch):
    """READY=1 only once every shard is ready; STATUS= with the shards up and the queue depth;
    WATCHDOG=1 every half interval while healthy, none while a shard is hung (SIGSTOP) until
    it is back; STOPPING=1 on SIGTERM, then a clean exit."""
    mgr = FakeManager()
    monkeypatch.setenv("NOTIFY_SOCKET", mgr.address)
    monkeypatch.setenv("WATCHDOG_USEC", str(int(WATCHDOG_S * 1e6)))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    svc = Service(shards=2, config={"service": {"health_timeout": HEALTH_TIMEOUT_S}})
    ready_seen_in_log: list[str] = []

    def at_ready(fields):
        # In the receiving thread, as READY=1 arrives: the supervisor logs each shard-ready
        # before it sends READY=1, so the log must already hold every one of them.
        if fields.get("READY") == "1" and not ready_seen_in_log:
            ready_seen_in_log.append(svc.tail(200))
    mgr.hook = at_ready
    try:
        with svc:
            ready = mgr.wait_for(lambda i, m: m.get("READY") == "1", 30, "READY=1")
            log_then = ready_seen_in_log[0]
            assert all(f"event=shard-ready shard={i} " in log_then for i in range(2)), log_then
            before = mgr.texts()[:ready]
            assert before and all(_headline(m).startswith("starting: ") for m in before if "STATUS" in m)
            assert not any("WATCHDOG" in m for m in before)
            assert _headline(mgr.texts()[ready]) == "2/2 shards up"

            # the queue depth: 30 jobs, then 10 of them leased
            with svc.connect() as q:
                q.enqueue_many([{"body": f"job {i}".encode(), "key": f"k{i}"} for i in range(30)])
                mgr.wait_for(lambda i, m: i > ready and _DEPTH.search(m.get("STATUS", ""))
                             and _DEPTH.search(m["STATUS"]).groups() == ("30", "30"), 20, "depth 30")
                leases = q.dequeue_many(max_jobs=10, visibility=60)
                assert len(leases) == 10
                mgr.wait_for(lambda i, m: i > ready and _DEPTH.search(m.get("STATUS", ""))
                             and _DEPTH.search(m["STATUS"]).groups() == ("20", "30"), 20, "depth 20 of 30")

            # watchdog pings while healthy, every half interval
            mgr.wait_for(lambda i, m: i > ready and sum("WATCHDOG" in x for _, x in mgr.messages[ready:]) >= 6,
                         20, "six watchdog pings")
            times = [t for t, m in mgr.messages[ready:] if "WATCHDOG" in m]
            assert statistics.median(b - a for a, b in zip(times, times[1:])) <= 0.75 * WATCHDOG_S

            # a hung shard: no watchdog from the moment it is seen down until it is back
            pid = svc.shard_pids()[1]
            mark = len(mgr.texts())
            os.kill(pid, signal.SIGSTOP)
            try:
                down = mgr.wait_for(lambda i, m: i >= mark and _headline(m).startswith("1/2 shards up, shard 1 "),
                                    20, "shard 1 seen down")
                back = mgr.wait_for(lambda i, m: i > down and _headline(m) == "2/2 shards up", 30,
                                    "shard 1 back")
            finally:
                try:
                    os.kill(pid, signal.SIGKILL)  # the supervisor killed it already; never leave it stopped
                except ProcessLookupError:
                    pass
            between = mgr.texts()[down:back]
            assert not any("WATCHDOG" in m for m in between), between
            mgr.wait_for(lambda i, m: i > back and "WATCHDOG" in m, 10, "the watchdog again")
            assert svc.shard_pids()[1] != pid

            # SIGTERM: STOPPING=1, then exit 0; nothing after
            svc.proc.send_signal(signal.SIGTERM)
            stopping = mgr.wait_for(lambda i, m: m.get("STOPPING") == "1", 20, "STOPPING=1")
            assert svc.proc.wait(20) == 0
            assert not any("WATCHDOG" in m or "READY" in m for m in mgr.texts()[stopping:])
    finally:
        mgr.close()


def test_serve_without_notify_socket_sends_nothing_and_shards_never_inherit_it(monkeypatch):
    """The shards get no NOTIFY_SOCKET (only serve may speak for the service), and an
    embedded supervisor sends nothing even when its app runs under systemd."""
    from shardq.service.supervisor import Supervisor, child_env
    mgr = FakeManager()
    monkeypatch.setenv("NOTIFY_SOCKET", mgr.address)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    try:
        assert not set(notify.ENV_KEYS) & set(child_env())
        data = os.path.join(short_tmpdir(), "data")
        sup = Supervisor(data, {}, 1).start(background=True)
        try:
            assert sup.notifier is None
            sup.reload({"queue_defaults": {"max_deliveries": 2}})
            mgr_sent = mgr.texts()
        finally:
            sup.stop()
        assert mgr_sent == []
    finally:
        mgr.close()


# ---------------------------------------------------------------------- the unit file
def _unit(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_unit_file_says_what_the_docs_say():
    u = _unit(open(UNIT).read())
    assert u["Type"] == ["notify"] and u["Restart"] == ["on-failure"] and u["KillMode"] == ["mixed"]
    assert u["ExecStart"] == ["/opt/shardq/.venv/bin/shardq serve --config /etc/shardq/shardq.toml"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert u["User"] == ["shardq"] and u["StateDirectory"] == ["shardq"]
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert u[key] == ["yes"], key
    assert u["ProtectSystem"] == ["strict"]
    # the stop bound it allows for is above the one serve keeps (docs/operations.md, "Signals")
    from shardq.service.supervisor import STOP_GRACE_S
    assert float(u["TimeoutStopSec"][0]) > STOP_GRACE_S + 5


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd)")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """The shipped unit, with ExecStart pointed at this checkout's shardq (verify requires an
    executable there), passes ``systemd-analyze verify`` with no complaint about it."""
    shardq_bin = os.path.join(REPO, ".venv", "bin", "shardq")
    if not os.access(shardq_bin, os.X_OK):
        pytest.skip(f"no executable {shardq_bin} to point ExecStart at")
    text = open(UNIT).read()
    assert text.count("/opt/shardq/.venv/bin/shardq") == 1
    unit = tmp_path / "shardq.service"
    unit.write_text(text.replace("/opt/shardq/.venv/bin/shardq", shardq_bin))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                       text=True, timeout=60)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "shardq.service" in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr
    # and verify does catch a broken unit here (so a pass above means something)
    unit.write_text(text.replace("/opt/shardq/.venv/bin/shardq", shardq_bin).replace("Type=notify", "Type=notifyy"))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert any("shardq.service" in line for line in (r.stdout + r.stderr).splitlines())
