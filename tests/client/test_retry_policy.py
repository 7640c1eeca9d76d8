"""The threaded connection across a broken connection (issue 9, item 6): per-shard order,
what a send cut short leaves ``sent``, timeouts and the races of its futures.

Which ops are sent again after a break is tested on both clients, in
test_client_drivers.py. A fake shard (the real handshake and framing, scripted replies)
makes the moment of the break exact.
"""
from __future__ import annotations

import threading

import msgpack
import pytest

import shardq
from shardq import limits
from shardq.client.connection import ConnectionLost, Future, ShardClient
from shardq.protocol import wire

from support.fake_shard import FakeShards


@pytest.fixture
def fake():
    made = []

    def make(*script):
        f = FakeShards(script=script)
        q = shardq.connect(f.dd.path, retry_s=5, request_timeout_s=5)
        made.append((f, q))
        return f, q

    yield make
    for f, q in made:
        q.close()  # first: a connection the fake serves ends when its client closes
        f.close()


def test_every_op_has_a_retry_policy():
    assert set(wire.RETRY) == wire.OPS
    # dequeue_wait is never re-sent either: a broken connection ends the wait, and the
    # router asks every shard again (tests/shard/test_waiting_lease.py)
    assert {op for op, p in wire.RETRY.items() if p == wire.UNKNOWN} == {"dequeue", "dequeue_wait", "nack", "bury",
                                                                        "redrive", "purge_dead", "purge_queue"}


def test_a_batch_cut_into_requests_reaches_the_shard_in_order_across_a_broken_connection(fake, monkeypatch):
    """A batch that one shard gets as several requests (here one over the job limit: two)
    keeps its order when the connection breaks between them. `shardq verify` with 16 MiB
    bodies found it broken: the second request, whose write found the connection gone, was
    sent at once on the new connection, and the first (written before the break) only after
    it, so a key's later job got the lower id and was delivered first."""
    f, q = fake("drop", ("serve", lambda op, args: list(range(len(args[0])))))
    submit = ShardClient.submit
    submits = []

    def submit_after_the_break(self, op, args, **kw):
        if op == "enqueue":  # not the queue's placement, asked before its first enqueue
            submits.append(op)
        if len(submits) == 2 and op == "enqueue":
            assert f.dropped.wait(10)  # the shard dropped the first request's connection
        return submit(self, op, args, **kw)

    monkeypatch.setattr(ShardClient, "submit", submit_after_the_break)
    n = limits.BATCH_JOBS_MAX + 1
    ids = q.enqueue_many([{"body": b"%d" % i, "key": "k"} for i in range(n)])
    assert len(ids) == n
    dropped, served = f.by_conn
    assert [len(args[0]) for _, _, args in dropped] == [limits.BATCH_JOBS_MAX]
    assert [len(args[0]) for _, _, args in served] == [limits.BATCH_JOBS_MAX, 1]  # in the batch's order
    assert served[0][2] == dropped[0][2]  # the first re-sent with its session: a shard would dedup it
    q.close()


def test_a_send_cut_short_leaves_sent_the_requests_of_frames_written_whole(monkeypatch):
    """One send of many requests can take several frames. A shard executes every whole
    frame it reads, so only the requests of the frame a failed write cut short, and of
    those after it, may be sent again; the others' outcome is unknown (a dequeue may have
    leased a job)."""
    import socket
    from multiprocessing.connection import Connection

    from shardq.client import connection
    a, b = socket.socketpair()
    client = ShardClient(0, "unused", b"k" * 32)
    conn = Connection(a.detach())
    client._conn = conn
    client.chan.connected()
    monkeypatch.setattr(limits, "FRAME_BYTES_MAX", 1000)  # two requests of 600 bytes: two frames
    write_frame = connection._write_frame
    frames = []

    def write_one_frame_then_break(fd, data):
        if frames:
            raise BrokenPipeError(32, "the shard went away")
        frames.append(data)
        write_frame(fd, data)

    monkeypatch.setattr(connection, "_write_frame", write_one_frame_then_break)
    client._flushing = True  # another thread is sending: both queue for one send
    first = client.submit("dequeue", ["q" * 600, None, 1])
    second = client.submit("dequeue", ["r" * 600, None, 1])
    first_req = first.req  # (a settled future lets go of its request)
    client._flushing = False
    client._flush()
    assert len(frames) == 1
    (rid, op, args), = msgpack.unpackb(Connection(b.detach()).recv_bytes(), raw=False)
    assert (rid, op, args[0]) == (first_req.rid, "dequeue", "q" * 600)
    assert isinstance(first.error, ConnectionLost) and first.error.sent  # the shard may have applied it
    assert isinstance(second.error, ConnectionLost) and not second.error.sent


def test_future_set_races_have_one_winner():
    for _ in range(200):
        fut = Future()
        barrier = threading.Barrier(8)
        errors = []

        def setter(i):
            barrier.wait()
            try:
                fut.set(i)
            except RuntimeError as e:  # a double release of the wait lock
                errors.append(e)

        threads = [threading.Thread(target=setter, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and fut.done and fut.wait(0) and fut.value in range(8)


def test_a_breaking_connection_and_the_reader_never_both_take_a_future():
    """_broken used to iterate the pending dict while the reader thread popped from it; both
    now go through the channel under the connection's lock: each request is settled once,
    by its reply or by the break."""
    import socket
    from multiprocessing.connection import Connection

    from shardq.client.channel import Request
    for _ in range(20):
        a, b = socket.socketpair()
        client = ShardClient(0, "unused", b"k" * 32)
        conn = Connection(a.detach())
        client._conn = conn
        client.chan.connected()
        futs = {}
        for rid in range(1, 2_001):
            fut = Future()
            req = Request("ping", [], [fut], 0.0)
            req.rid, req.sent = rid, True
            futs[rid] = fut
            client.chan.pending[rid] = req
        popped = []
        start = threading.Event()

        def reader():  # what _read_once does with each reply
            start.wait()
            for rid in range(1, 2_001):
                with client._lock:
                    done = client.chan.replies([[rid, wire.OK, "reply"]])
                popped.extend(rid for _, _, _ in done)
                client._settle(done)

        t = threading.Thread(target=reader)
        t.start()
        start.set()
        client._broken(conn)
        t.join()
        assert all(f.done for f in futs.values())
        lost = [r for r, f in futs.items() if isinstance(f.error, ConnectionLost)]
        replied = [r for r, f in futs.items() if f.value == "reply"]
        assert sorted(lost + replied) == list(range(1, 2_001)) and len(replied) == len(popped)
        assert all(futs[r].error.sent for r in lost)
        conn.close()
        b.close()


def test_a_request_submitted_while_the_socket_is_taken_is_read_once_it_is_free():
    """A request is submitted while another holds the read lock (a lone call reading its
    own reply, or the reader thread about to find nothing pending and leave): the reader
    thread, woken for it, waits for the lock and reads its reply; it is never left unread
    (CI once saw 'did not answer ack within 30 s' after a shard restart, when a caller met
    a reader that was going to sleep)."""
    import socket
    import time
    from multiprocessing.connection import Connection

    from support.service import poll_until
    a, b = socket.socketpair()
    client = ShardClient(0, "unused", b"k" * 32)
    conn = Connection(a.detach())
    client._conn = conn
    client.chan.connected()
    threading.Thread(target=client._read_loop, args=(conn,), daemon=True).start()
    server = Connection(b.detach())
    client._read_lock.acquire()  # another reader, reading for itself
    fut = client.submit("stats", [])
    (rid, _, _), = msgpack.unpackb(server.recv_bytes(), raw=False)
    server.send_bytes(msgpack.packb([[rid, wire.OK, "reply"]]))
    poll_until(lambda: client._reader_active, time.monotonic() + 5.0)  # the reader thread, woken for it
    assert not fut.wait(0.05)  # ... waits for the lock meanwhile
    client._read_lock.release()  # ... and leaves, having read nothing
    assert fut.wait(5) and fut.value == "reply"
    client.close()
    server.close()


def test_the_router_and_its_connections_read_time_from_the_clock_they_are_given():
    """Router and ShardClient take a Clock (shardq/clock.py) and read no time themselves:
    with a clock on which every reading is 100 s after the last, a request whose
    connection breaks finds its request timeout or its retry deadline (5 s each) passed
    and is not sent again (ShardUnavailable); on the real clock the same break is re-sent
    and answered."""
    from shardq.clock import Clock
    from shardq.client.router import Router

    class Leaping(Clock):
        t = 0.0

        def now(self) -> float:
            return 1e9

        def monotonic(self) -> float:
            self.t += 100.0
            return self.t

    for clock, outcome in ((Leaping(), shardq.ShardUnavailable), (None, [7])):
        f = FakeShards(script=["drop", ("serve", lambda op, args: 7)])
        q = Router(f.dd.path, retry_s=5, request_timeout_s=5, clock=clock)
        try:
            if outcome is shardq.ShardUnavailable:
                with pytest.raises(shardq.ShardUnavailable):
                    q.ping()
                assert f.dropped.wait(5)
                q.close()
                assert f.ops() == ["ping"]  # sent once
            else:
                assert q.ping() == outcome
                assert f.ops() == ["ping", "ping"]
        finally:
            q.close()
            f.close()


def test_a_request_queued_behind_another_threads_send_is_read_for():
    """A request waits in the outbox while another thread writes; the reader thread, asked
    to read for it, must not go back to sleep because nothing was written yet: the reply
    that comes once it is written is then read by nobody (seen with 200 threads enqueuing
    on one router: a caller waited out its 30 s request timeout)."""
    import socket
    import time
    from multiprocessing.connection import Connection

    from support.service import poll_until
    a, b = socket.socketpair()
    client = ShardClient(0, "unused", b"k" * 32)
    conn = Connection(a.detach())
    client._conn = conn
    client.chan.connected()
    threading.Thread(target=client._read_loop, args=(conn,), daemon=True).start()
    server = Connection(b.detach())
    client._flushing = True  # another thread is writing: ours waits in the outbox
    fut = client.submit("stats", [])  # its caller asks the reader thread to read
    poll_until(lambda: client._read_lock.locked(), time.monotonic() + 1.0)  # the reader, reading for it
    client._flushing = False
    client._flush()
    (rid, _, _), = msgpack.unpackb(server.recv_bytes(), raw=False)
    server.send_bytes(msgpack.packb([[rid, wire.OK, "reply"]]))
    assert fut.wait(5) and fut.value == "reply"
    client.close()
    server.close()
