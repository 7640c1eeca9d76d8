"""The shard loop's part of a wake-up (figure W), in one process through socketpairs: a job
enqueued while a consumer waits in ``dequeue_wait`` is leased to it in the same iteration,
its lease written after the fsync that makes the job durable; and a loop whose last
iteration answered nobody (a parked wait) sleeps for its next request at once instead of
polling for it (shardq/shard/process.py, ``iterate``)."""
from __future__ import annotations

import socket
import struct

import msgpack
import pytest
from support.shard_loop import add_client

from shardq import busypoll
from shardq.busypoll import BusyPoll
from shardq.shard.conn import FrameConn
from shardq.wal.fileio import Files

_LEN = struct.Struct("!i")


@pytest.fixture
def loop(tmp_path, monkeypatch):
    from bench.probes.shard_path import Loop
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 2)  # a loop that may poll
    lp = Loop(str(tmp_path), preload=0)
    yield lp
    lp.close()


def second_client(lp) -> tuple[socket.socket, int]:
    """Another client connection on the loop's shard (the consumer): our end, and the
    shard's descriptor for it."""
    ours, conn = add_client(lp)
    return ours, conn.fd


def send(sock: socket.socket, rid: int, op: str, args: list) -> None:
    data = msgpack.packb([[rid, op, args]])
    sock.sendall(_LEN.pack(len(data)) + data)


def park_a_wait(lp, consumer: socket.socket, queue: str = "default") -> None:
    send(consumer, 1, "dequeue_wait", [queue, None, 1, 5.0])
    lp.server.iterate()
    assert sum(map(len, lp.server.lease_waiters.values())) == 1


def test_a_waiting_consumers_lease_leaves_in_the_iteration_of_the_enqueue_and_after_its_fsync(loop, monkeypatch):
    producer_fd = next(iter(loop.server._by_fd))  # the loop's own client
    consumer, consumer_fd = second_client(loop)
    park_a_wait(loop, consumer)
    order: list[object] = []
    # (a commit's fdatasync, whichever call makes it: alone, or after its write)
    real_send, real_sync, real_write_sync = FrameConn.send, Files.datasync, Files.write_sync

    def noting_send(self, frame):
        order.append(self.fd)
        return real_send(self, frame)

    def noting_sync(self, fd):
        order.append("fdatasync")
        return real_sync(self, fd)

    def noting_write_sync(self, fd, data):
        real_write_sync(self, fd, data)
        order.append("fdatasync")
    monkeypatch.setattr(FrameConn, "send", noting_send)
    monkeypatch.setattr(Files, "datasync", noting_sync)
    monkeypatch.setattr(Files, "write_sync", noting_write_sync)
    loop.enqueue()  # one iteration: the enqueue, the waiter's lease, one fsync, the replies
    assert loop.failures == 0
    assert order[0] == "fdatasync" and sorted(order[1:]) == sorted([consumer_fd, producer_fd])
    data = consumer.recv(1 << 16)
    ((rid, status, rows),) = msgpack.unpackb(data[_LEN.size:], raw=False)
    assert (rid, status, len(rows)) == (1, 0, 1)
    assert rows[0][2] == b"x" * 100  # the body the producer sent
    consumer.close()


def spins_counted(monkeypatch) -> list[object]:
    """What each of the loop's waits that polled found (spin_if_wanted, when wanted)."""
    spins: list[object] = []
    real = BusyPoll.spin_if_wanted

    def spin_if_wanted(self, poll, limit_s=None):
        polled = self.wanted()
        got = real(self, poll, limit_s)
        if polled:
            spins.append(got)
        return got
    monkeypatch.setattr(BusyPoll, "spin_if_wanted", spin_if_wanted)
    return spins


def test_after_an_iteration_that_answered_nobody_the_loop_sleeps_at_once(loop, monkeypatch):
    spins = spins_counted(monkeypatch)
    for _ in range(3):
        loop.enqueue()
    assert loop.failures == 0 and len(spins) == 3  # each answered: the next wait polled
    consumer, _ = second_client(loop)
    park_a_wait(loop, consumer, queue="empty")  # polled for (the last enqueue was answered)
    assert len(spins) == 4
    loop.enqueue()  # after the parked wait nobody was answered: no poll before this one
    assert loop.failures == 0 and len(spins) == 4
    loop.enqueue()  # answered again: the next wait polls
    assert len(spins) == 5
    consumer.close()


def test_a_reply_to_a_service_connection_does_not_arm_the_spin_and_one_to_a_client_does(loop, monkeypatch):
    """serve's own calls and the SQS listener's routers (role "service") never poll for
    their replies, so their next request comes late: the loop sleeps at once after
    answering only them (issue 46), and polls after answering a client."""
    spins = spins_counted(monkeypatch)
    producer = next(iter(loop.server._by_fd.values()))  # the connection loop.enqueue speaks on
    producer.role = "service"
    loop.enqueue()  # its wait follows the loop's start (answered): polled
    assert loop.failures == 0 and len(spins) == 1
    loop.enqueue()  # the last reply went to a service connection: no poll
    loop.enqueue()
    assert loop.failures == 0 and len(spins) == 1
    producer.role = "client"
    loop.enqueue()  # still after a reply to the service connection: no poll
    assert len(spins) == 1
    loop.enqueue()  # after a reply to a client: polled
    assert loop.failures == 0 and len(spins) == 2


def test_the_acceptor_gives_each_connection_the_role_its_hello_names(tmp_path):
    import threading

    from shardq.protocol.sockio import connect_unix
    from shardq.shard.acceptor import Acceptor
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    got: list[FrameConn] = []
    arrived = threading.Event()

    def deliver(fc: FrameConn) -> None:
        got.append(fc)
        arrived.set()
    Acceptor(listener, b"key", deliver).start()
    try:
        for role in ("service", "client"):
            arrived.clear()
            connect_unix(path, b"key", role=role).close()
            assert arrived.wait(10)
        assert [fc.role for fc in got] == ["service", "client"]
    finally:
        listener.close()
        for fc in got:
            fc.close()
