"""A shard's client connections at their limit (``limits.max_connections``).

Past the limit a client is turned away at the end of its handshake with
:class:`~shardq.TooManyConnections`, before it sends anything, and the clients the shard
holds are served as before; a slot freed by a client that leaves admits the next one.
Tested with a small limit, and at the default of 4,096 connections on one shard, which
also checks that a shard started under a soft descriptor limit of 1,024 raises its own.
"""
from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import time

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.datadir import DataDir
from shardq.protocol import wire
from shardq.protocol.sockio import connect_unix

from support.service import Service


def admitted(dd: DataDir, deadline_s: float = 10.0):
    """A raw connection to shard 0. The readiness check of ``Service.start`` may still hold
    its slot for a moment after it closed (the shard frees it when it reads the EOF)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return connect_unix(dd.socket_path(0), dd.authkey())
        except shardq.TooManyConnections:
            if time.monotonic() > end:
                raise
            time.sleep(0.01)  # backoff before the next try, not synchronisation


def aio_enqueue(data_dir: str, retry_s: float) -> None:
    """One enqueue through the asyncio client (bounded to 30 s: a hang fails the test)."""
    async def main():
        q = await shardq.aio.connect(data_dir, retry_s=retry_s)
        try:
            await q.enqueue(b"never sent")
        finally:
            await q.close()
    asyncio.run(asyncio.wait_for(main(), 30))


def ping_all(conns: list) -> list:
    """Send a ping on every connection first, then read every reply: all are served."""
    for i, c in enumerate(conns):
        c.send_bytes(msgpack.packb([[i + 1, "ping", []]]))
    pids = []
    for i, c in enumerate(conns):
        assert c.poll(10), f"connection {i} got no reply"
        [[rid, status, payload]] = msgpack.unpackb(c.recv_bytes(), raw=False)
        assert (rid, status) == (i + 1, wire.OK)
        pids.append(payload)
    return pids


#: A client that connects, says so, and blocks in a dequeue until it is killed.
KILLED_CLIENT = """
import sys, shardq
q = shardq.connect(sys.argv[1], retry_s=10)
q.ping()
print("connected", flush=True)
q.dequeue(wait=60)
"""


def test_past_max_connections_a_client_is_turned_away_and_a_freed_slot_admits_the_next():
    cfg = {"limits": {"max_connections": 4}, "http": {"listen": ""}}
    with Service(shards=1, config=cfg) as svc:
        dd = DataDir(svc.data_dir)
        held = [admitted(dd) for _ in range(4)]
        try:
            assert len(set(ping_all(held))) == 1
            # One more: the raw handshake says why, and nothing was sent on it.
            with pytest.raises(shardq.TooManyConnections, match=r"limit of 4 client connections"):
                connect_unix(dd.socket_path(0), dd.authkey())
            # A router tries again until its retry_s runs out, then raises the same type.
            with shardq.connect(svc.data_dir, retry_s=0.5) as q:
                with pytest.raises(shardq.TooManyConnections, match="limits.max_connections") as e:
                    q.enqueue(b"never sent")
            assert isinstance(e.value, shardq.ShardUnavailable)
            # The asyncio client likewise.
            with pytest.raises(shardq.TooManyConnections):
                aio_enqueue(svc.data_dir, retry_s=0.5)
            # The clients it holds were served throughout.
            assert len(set(ping_all(held))) == 1
            # One leaves: the next router gets in (the shard frees the slot on the EOF).
            held.pop().close()
            with shardq.connect(svc.data_dir, retry_s=10) as q:
                jid = q.enqueue(b"after a slot freed")
                lease = q.dequeue()
                assert lease.job_id == jid, "a turned-away client's enqueue reached the shard"
                q.ack(lease)
                assert q.dequeue() is None
                shard = q.stats()["shards"][0]
                assert (shard["clients"], shard["clients_max"]) == (4, 4)
                assert shard["clients_turned_away"] >= 3  # the raw client, the router, the asyncio client
            # No slot leaks: one slot serves one client after another, whether it closes
            # or is SIGKILLed mid-call (the shard frees the slot on the EOF either way).
            for i in range(20):
                if i % 2:
                    with shardq.connect(svc.data_dir, retry_s=10) as q:
                        assert q.ping()
                else:
                    killed = subprocess.Popen(
                        [sys.executable, "-c", KILLED_CLIENT, svc.data_dir], stdout=subprocess.PIPE,
                        stdin=subprocess.DEVNULL)
                    assert killed.stdout.readline() == b"connected\n"
                    killed.kill()
                    killed.wait(10)
            assert len(set(ping_all(held))) == 1
        finally:
            for c in held:
                c.close()
        log = svc.tail(200)
        assert "turned a client away" in log and "limits.max_connections" in log
        assert log.count("turned a client away") <= 2, "the warning is rate-limited"
        assert "Traceback" not in log


def test_a_shard_full_of_clients_is_still_health_checked_and_seen_by_metrics():
    """The supervisor's health pings do not use the clients' socket, and the HTTP listener
    connects as the service, apart from the clients' limit: a full shard is neither killed
    as hung nor missing from /metrics. (Before, the health ping's connection was closed
    like any other past the limit, and after health_timeout the supervisor killed a shard
    that was only full.)"""
    import urllib.request
    cfg = {"limits": {"max_connections": 2}, "service": {"health_timeout": 1}}
    with Service(shards=1, config=cfg) as svc:
        dd = DataDir(svc.data_dir)
        pid = svc.shard_pids()[0]
        held = [admitted(dd) for _ in range(2)]
        try:
            with pytest.raises(shardq.TooManyConnections):
                connect_unix(dd.socket_path(0), dd.authkey())
            # Full for several health timeouts: the same process serves throughout.
            end = time.monotonic() + 4
            while time.monotonic() < end:
                assert ping_all(held) == [pid, pid]
                time.sleep(0.1)  # pacing the pings over the window, not synchronisation
            with urllib.request.urlopen(svc.http_url() + "/metrics", timeout=10) as r:
                text = r.read().decode()
            assert 'shardq_shard_up{shard="0"} 1' in text
            assert 'shardq_shard_clients{shard="0"} 2' in text
            assert 'shardq_shard_restarts_total{shard="0"} 0' in text
        finally:
            for c in held:
                c.close()
        assert "killing" not in svc.tail(200).lower()


def test_a_flood_of_silent_connections_neither_kills_a_healthy_shard_nor_keeps_newcomers_out():
    """Connections that never authenticate: 40 more every half second, for four health
    timeouts. The supervisor's health pings do not use the socket (they go over the shard's
    stdin pipe), so the shard keeps its process. And they do not keep a newcomer out: when
    all 32 handshakes are taken, the oldest is dropped to make room, so each newcomer is
    admitted at once. (Before, a newcomer was refused until a silent one's 5 s handshake
    timeout ran out: a new client's first ping took 4.8 s.)"""
    import socket
    cfg = {"service": {"health_timeout": 1}, "http": {"listen": ""}}
    with Service(shards=1, config=cfg) as svc:
        path = DataDir(svc.data_dir).socket_path(0)
        held = admitted(DataDir(svc.data_dir))  # a client already in is served throughout
        pid = ping_all([held])[0]
        dd = DataDir(svc.data_dir)
        silent, waits = [], []
        try:
            end = time.monotonic() + 4
            while time.monotonic() < end:
                for _ in range(40):
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(0.05)
                    try:
                        s.connect(path)
                        silent.append(s)
                    except OSError:
                        s.close()
                t0 = time.monotonic()
                connect_unix(path, dd.authkey(), timeout=1.0).close()  # a newcomer meanwhile
                waits.append(time.monotonic() - t0)
                assert ping_all([held]) == [pid]
                time.sleep(0.5)  # pacing the flood, not synchronisation
            assert len(silent) > 32, "the flood never filled the handshakes: it tested nothing"
            assert max(waits) < 1.0, waits
        finally:
            for s in silent:
                s.close()
            held.close()
        with svc.connect(retry_s=10) as q:
            assert q.ping() == [pid]
        tail = svc.tail(5000)
        assert "shard-hung" not in tail, [l for l in tail.splitlines() if "hung" in l or "kill" in l]
        assert "dropped the oldest to let a new client in" in tail


DEFAULT = limits.CONNECTIONS_MAX_DEFAULT


def test_a_shard_holds_the_default_4096_connections_at_once_and_turns_away_the_next():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = DEFAULT + 256  # this test's own sockets, beside the files pytest holds
    if hard != resource.RLIM_INFINITY and hard < need + limits.SHARD_FDS_BESIDES_CLIENTS:
        try:  # root may raise the hard limit (CI runs as root)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, need + limits.SHARD_FDS_BESIDES_CLIENTS))
        except (ValueError, OSError):
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors this test needs")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The service starts under a soft limit of 1,024 (a common default): the shard must
    # raise its own to fit its connection limit.
    svc = Service(shards=1, config={"http": {"listen": ""}})
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))
    try:
        svc.__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    held = []
    try:
        pid = svc.shard_pids()[0]
        shard_soft = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
        assert shard_soft >= DEFAULT + limits.SHARD_FDS_BESIDES_CLIENTS
        dd = DataDir(svc.data_dir)
        for _ in range(DEFAULT):
            held.append(admitted(dd))
        assert set(ping_all(held)) == {pid}
        with pytest.raises(shardq.TooManyConnections, match=f"limit of {DEFAULT} client connections"):
            connect_unix(dd.socket_path(0), dd.authkey())
        held.pop().close()
        with shardq.connect(svc.data_dir, retry_s=10) as q:
            assert q.ping() == [pid]
            assert q.stats()["shards"][0]["clients"] == DEFAULT
    finally:
        for c in held:
            c.close()
        svc.__exit__(None, None, None)


def test_a_shard_under_a_low_hard_descriptor_limit_takes_what_it_can_and_says_so():
    """In a child process (the limit is per process): soft 512, hard 1,000."""
    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (512, 1000))\n"
        "from shardq.shard.process import room_for_descriptors\n"
        "print(room_for_descriptors(4096), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1000", "1000"]
    assert "RLIMIT_NOFILE allows 1000 descriptors, below the 4160" in out.stderr
    assert "raise LimitNOFILE" in out.stderr


def test_a_shard_of_another_wire_version_is_named_at_once_not_retried_until_retry_s():
    """The verdict names the wire version; a router or asyncio client of another version
    raises ProtocolError at its first call instead of retrying and calling it unavailable."""
    from multiprocessing.connection import Listener
    import threading
    from support.service import short_tmpdir
    dd = DataDir(short_tmpdir())
    dd.init(1)
    listener = Listener(dd.socket_path(0), "AF_UNIX", authkey=dd.authkey())
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - closed at the end
                return
            conn.recv_bytes()  # the client's hello
            conn.send_bytes(b"#SHARDQ-ADMITTED wire=999")
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(shardq.ProtocolError, match=r"shard 0: the shard speaks wire=999, this client wire=1"):
            connect_unix_and_route(dd.path)
        with pytest.raises(shardq.ProtocolError, match="wire=999"):
            aio_enqueue(dd.path, retry_s=60)
    finally:
        stop.set()
        import socket
        with socket.socket(socket.AF_UNIX) as wake:  # accept() is not woken by close(); this is
            wake.connect(dd.socket_path(0))
        t.join(10)
        listener.close()
        assert not t.is_alive()


def connect_unix_and_route(path: str) -> None:
    with shardq.connect(path, retry_s=60) as q:  # far longer than the test may take
        q.enqueue(b"x")


def test_the_service_pool_at_its_maximum_is_apart_from_the_clients():
    """serve's own connections (HTTP listener, schedules) hold up to 16 slots of their own:
    at that count one more is turned away, while clients still get in, and a shard full of
    clients still admits the service."""
    from shardq.shard.acceptor import SERVICE_CONNECTIONS_MAX
    cfg = {"limits": {"max_connections": 1}, "http": {"listen": ""}}
    with Service(shards=1, config=cfg) as svc:
        dd = DataDir(svc.data_dir)
        path, key = dd.socket_path(0), dd.authkey()
        client = admitted(dd)  # the one client slot
        service = [connect_unix(path, key, role="service") for _ in range(SERVICE_CONNECTIONS_MAX)]
        try:
            with pytest.raises(shardq.TooManyConnections, match=f"its {SERVICE_CONNECTIONS_MAX} service"):
                connect_unix(path, key, role="service")
            with pytest.raises(shardq.TooManyConnections, match="limit of 1 client"):
                connect_unix(path, key)
            assert len(set(ping_all([client] + service))) == 1
            service.pop().close()
            end = time.monotonic() + 10
            while True:  # the freed service slot comes back once the shard reads the EOF
                try:
                    service.append(connect_unix(path, key, role="service"))
                    break
                except shardq.TooManyConnections:
                    assert time.monotonic() < end, "a freed service slot never came back"
                    time.sleep(0.01)  # backoff before the next try, not synchronisation
            [shard] = [sh for sh in svc_stats(service[-1])]
            assert (shard["clients"], shard["service_connections"]) == (1, SERVICE_CONNECTIONS_MAX)
        finally:
            for c in [client] + service:
                c.close()


def svc_stats(conn) -> list:
    """The shard's stats through a raw connection."""
    conn.send_bytes(msgpack.packb([[99, "stats", []]]))
    assert conn.poll(10)
    [[rid, status, payload]] = msgpack.unpackb(conn.recv_bytes(), raw=False)
    assert (rid, status) == (99, wire.OK)
    return [payload]
