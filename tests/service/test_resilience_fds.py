"""Issue 9, item 3: running out of file descriptors is survivable.

A shard under ``ulimit -n 64`` (set with prlimit on the running process) is flooded with
authenticated connections until accept() and the handshake fail with EMFILE. Once the
flood ends, new clients must connect again, to the same process: before the fix the
acceptor thread returned on the first EMFILE (and the handshake leaked a descriptor when
its ``os.dup`` failed), so the shard accepted nobody ever again while still answering its
old connections and the supervisor's pings.
"""
from __future__ import annotations

import os
import resource
import threading

import shardq
from support.service import Service, wait_until
from shardq.datadir import DataDir
from shardq.protocol.sockio import connect_unix

FDS = 64
FLOOD = 120  # well past FDS: the shard runs out while some are still connecting


def open_fds(pid: int) -> int:
    import os
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_shard_out_of_descriptors_accepts_again_once_the_flood_ends():
    with Service(shards=1) as svc:
        pid = svc.shard_pids()[0]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (FDS, FDS))
        dd = DataDir(svc.data_dir)
        sock, key = dd.socket_path(0), dd.authkey()
        conns, lock = [], threading.Lock()

        def connect():
            try:
                c = connect_unix(sock, key, timeout=3)
            except (OSError, EOFError, Exception):  # noqa: BLE001 - any failure to connect is expected here
                return  # refused, reset or timed out while the shard was out of descriptors
            with lock:
                conns.append(c)

        threads = [threading.Thread(target=connect) for _ in range(FLOOD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        try:
            # At the limit (a few below it: a failed accept or dup leaves the last ones unused).
            assert open_fds(pid) >= FDS - 8, "the flood did not exhaust the shard's descriptors"
        finally:
            for c in conns:
                c.close()
        # The flood is over: a new client connects, to the very same process, and is served.
        with svc.connect(retry_s=10) as q:
            assert q.ping() == [pid]
            jid = q.enqueue(b"after the flood")
            lease = q.dequeue()
            assert lease.job_id == jid
            q.ack(lease)
        log = svc.tail(400)
        assert "Too many open files" in log, "the shard must say why new clients waited"
        assert log.count("Too many open files") <= 4, "the warning must be rate-limited"
        assert "accepting connections again" in log
        assert "Traceback" not in log
        wait_until(lambda: open_fds(pid) < FDS // 2, 10, 0.05, "the flood's descriptors to be freed")
        with shardq.connect(svc.data_dir, retry_s=5) as q:
            assert q.ping() == [pid]


def _flood(sock: str, key: bytes, n: int) -> list:
    conns, lock = [], threading.Lock()

    def connect():
        try:
            c = connect_unix(sock, key, timeout=3)
        except (OSError, EOFError, Exception):  # noqa: BLE001 - any failure to connect is expected here
            return
        with lock:
            conns.append(c)

    threads = [threading.Thread(target=connect) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return conns


def _stats_with_no_descriptor_free(q, pid: int) -> dict | None:
    """Whatever the flood left free, none now: the shard's limit set to its lowest free
    descriptor, so the next one it opens is over it; then ``stats``. Its answer if it found
    none free, else None: a descriptor freed between the look and the request (the flood's
    last handshakes end on their own timeouts, a connection the shard could not keep is
    closed) lets the listing through, and the caller tries again."""
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = min(set(range(FDS + 1)) - used)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, FDS))
    shard = q.stats()["shards"][0]
    return None if shard["available"] else shard


def test_a_request_that_fails_for_want_of_descriptors_is_answered_and_the_shard_serves_on():
    """Issue 44, item 13: ``stats`` lists the log directory (``wal_disk_bytes``); out of
    descriptors that fails with EMFILE, which ended the shard (exit 1, a restart). The
    request is answered with an error instead, and the same process serves the next."""
    with Service(shards=1) as svc:
        pid = svc.shard_pids()[0]
        dd = DataDir(svc.data_dir)
        with svc.connect(retry_s=10) as q:
            assert q.stats()["shards"][0]["pid"] == pid  # connected before the flood
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (FDS, FDS))
            conns = _flood(dd.socket_path(0), dd.authkey(), FLOOD)
            try:
                shard = wait_until(lambda: _stats_with_no_descriptor_free(q, pid), 10, 0.05,
                                   "a stats request that finds no descriptor free")
                assert shard["available"] is False
                assert "Too many open files" in shard["error"] and "stats" in shard["error"]
            finally:
                for c in conns:
                    c.close()
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (FDS, FDS))
            assert q.ping() == [pid], "the shard must not have exited"
            shard = q.stats()["shards"][0]
            assert shard["available"] and shard["pid"] == pid and shard["wal_disk_bytes"] > 0
            jid = q.enqueue(b"served on")
            lease = q.dequeue()
            assert lease.job_id == jid
            q.ack(lease)
        assert "stats failed, answered with an error" in svc.tail(400)


def test_a_flood_that_evicts_handshakes_first_still_says_descriptors_ran_out(caplog):
    """Each kind of the acceptor's trouble is rate-limited on its own. They shared one
    10 s limit: a flood whose silent connections evicted a handshake first (under load)
    kept "Too many open files" out of the log, and the operator never learnt why new
    clients waited (test_a_shard_out_of_descriptors_accepts_again_once_the_flood_ends)."""
    import socket

    from shardq.clock import FakeClock
    from shardq.shard.acceptor import Acceptor, ConnectionSlots

    listener, other = socket.socketpair()
    silent, peer = socket.socketpair()
    try:
        acc = Acceptor(listener, b"key", lambda fc: None, clock=FakeClock(),
                       slots={"client": ConnectionSlots(1), "service": ConnectionSlots(1)})
        acc._pending[1] = (0.0, silent.fileno())  # a handshake that never speaks
        with caplog.at_level("WARNING", logger="shardq.shard"):
            assert acc._evict_oldest()
            acc._back_off("accept failed: Too many open files")  # the same instant on its clock
            acc._turn_away(_Sink(), "client", 1)
            for _ in range(3):  # each again within its 10 s: counted, not logged
                acc._pending[1] = (0.0, silent.fileno())
                acc._evict_oldest()
                acc._back_off("accept failed: Too many open files")
        text = caplog.text
        assert text.count("handshakes were waiting") == 1
        assert text.count("Too many open files") == 1
        assert text.count("turned a client away") == 1
    finally:
        for s in (listener, other, silent, peer):
            s.close()


class _Sink:
    """A handshake's connection that takes what it is sent."""

    def send_bytes(self, data):
        pass
