"""The committer's reply path (issue 9, item 5): no descriptor-number limit, and a client
that does not read its replies never delays another client's.

Before: each send waited for a blocked socket with ``select()``, which raises ValueError
for descriptors of 1024 and more (the committer thread died and no reply left the shard
again), and which held every later reply back for up to a second per slow client.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import types

import pytest

from shardq.shard import committer as committer_mod
from shardq.shard.committer import Committer
from shardq.shard.conn import FrameConn

from support.service import wait_until


class NoLog:
    unsynced = False
    rotation_due = False

    def commit(self, payloads, sync=True):
        pass

    def sync(self):
        pass


def pair(high_fd: int):
    """(shard-side FrameConn at descriptor ``high_fd``, client-side socket)."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    os.dup2(a.fileno(), high_fd)
    a.close()
    return FrameConn(high_fd), b


def read_frame(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    (n,) = struct.unpack("!i", head)
    data = bytearray()
    while len(data) < n:
        data += sock.recv(min(1 << 20, n - len(data)))
    return bytes(data)


@pytest.fixture
def committer():
    c = Committer(NoLog(), exit_code=4)
    yield c
    c.stop()


def test_a_slow_reader_on_a_high_descriptor_delays_no_one(committer):
    slow, slow_peer = pair(1500)
    fast, fast_peer = pair(1501)
    big = os.urandom(2 << 20)
    committer.submit([], [(slow, big), (fast, b"quick reply")], [])
    assert read_frame(fast_peer, timeout=2.0) == b"quick reply"  # not held behind the slow one
    committer.submit([], [(fast, b"and another")], [])
    assert read_frame(fast_peer, timeout=2.0) == b"and another"
    got = []
    t = threading.Thread(target=lambda: got.append(read_frame(slow_peer, timeout=10.0)))
    t.start()  # the slow client starts reading: the backlog drains, in order
    committer.submit([], [(slow, b"after the big one")], [])
    t.join(15)
    assert got == [big] and read_frame(slow_peer, timeout=5.0) == b"after the big one"
    # Only the committer touches a connection's backlog (under its send lock); closing one
    # from here while its thread still finishes the flush that sent these bytes raced it
    # (CI once hung in the teardown: the thread died popping a deque this close emptied).
    committer.stop()
    for c, p in ((slow, slow_peer), (fast, fast_peer)):
        c.close()
        p.close()


def test_a_client_that_reads_nothing_is_dropped_and_a_close_waits_for_its_replies(committer, monkeypatch):
    monkeypatch.setattr(committer_mod, "SEND_TIMEOUT_S", 0.3)
    stuck, stuck_peer = pair(1502)
    committer.submit([], [(stuck, os.urandom(1 << 20))], [])
    wait_until(lambda: stuck.dead, 5.0, 0.01, "the stuck client to be dropped")
    # Shut down for both directions: the peer reads what it got, then EOF.
    stuck_peer.settimeout(5.0)
    while stuck_peer.recv(1 << 20):
        pass
    stuck.close()
    stuck_peer.close()
    # A close asked for while replies still wait happens only after they are sent.
    slow, slow_peer = pair(1503)
    payload = os.urandom(1 << 20)
    committer.submit([], [(slow, payload)], [slow])
    assert not slow.closed
    assert read_frame(slow_peer, timeout=5.0) == payload
    wait_until(lambda: slow.closed, 5.0, 0.01, "the close after the replies")
    slow_peer.close()


def test_an_unexpected_error_in_the_committer_thread_ends_the_process():
    """A bug in the thread used to end the thread alone: the shard lived on with nobody to
    send its replies until the supervisor's health check killed it."""
    import subprocess
    import sys
    code = """if True:
        import os, time
        from shardq.shard.committer import Committer
        class NoLog:
            unsynced = rotation_due = False
            def commit(self, payloads, sync=True): pass
            def sync(self): pass
        class Broken:
            closed = dead = False
            def send(self, frame): raise ValueError("a bug")
        c = Committer(NoLog(), exit_code=7)
        c.submit([], [(Broken(), b"x")], [])
        time.sleep(10)  # not reached: the thread ends the process
        os._exit(0)
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert "the committer thread failed" in proc.stderr and "ValueError: a bug" in proc.stderr


class SlowSyncLog:
    """A log whose fdatasync waits for ``release``: what the committer thread does while a
    disk is slow. Counts commits as SegmentWriter does (written, synced)."""

    def __init__(self):
        self.records: list[bytes] = []
        self.written = self.synced = 0
        self.rotation_due = False
        self.in_sync = threading.Event()
        self.release = threading.Event()

    @property
    def unsynced(self):
        return self.written != self.synced

    def commit(self, payloads, sync=True):
        self.records.extend(payloads)
        self.written += 1
        if sync:
            self.sync()

    def sync(self):
        target = self.written
        self.in_sync.set()
        assert self.release.wait(10)
        self.synced = target


def nothing_to_read(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


@pytest.fixture
def slow():
    """A committer on a :class:`SlowSyncLog`, and client sockets from ``slow.client()``;
    at the end the log is released, the committer stopped and every socket closed."""
    log_ = SlowSyncLog()
    c = Committer(log_, exit_code=4)
    send, made = c._send, []

    def client():
        made.append(pair(1600 + len(made)))
        return made[-1]

    yield types.SimpleNamespace(log=log_, c=c, client=client)
    log_.release.set()
    c._send = send
    c.stop()
    for conn, peer in made:
        conn.close()
        peer.close()


def asleep(c: Committer) -> bool:
    """The committer thread waits for work with nothing in hand."""
    return not c._busy and bool(c._work._waiters)


@pytest.mark.parametrize("rotation_due", [False, True])
def test_an_early_reply_does_not_wait_for_another_batchs_fsync(slow, rotation_due):
    log_, c = slow.log, slow.c
    a, a_peer = slow.client()
    b, b_peer = slow.client()
    # A's batch (an ack: a late reply) is written and waits in its fdatasync.
    c.submit([b"ack-of-job-1"], [(a, b"ack done")], [], sync=True, seq=1)
    assert log_.in_sync.wait(5)
    log_.rotation_due = rotation_due
    # B's lease (an early reply, written but not synced) comes meanwhile.
    c.submit([b"lease-of-job-2"], [], [], early=[(b, b"leased")], sync=False, seq=2)
    if rotation_due:  # the loop never starts a segment beside an fdatasync: it queues
        assert log_.records == [b"ack-of-job-1"] and nothing_to_read(b_peer)
    else:  # written, then answered, while A's fsync still runs; A's reply waits for it
        assert log_.records == [b"ack-of-job-1", b"lease-of-job-2"]
        assert read_frame(b_peer, timeout=5.0) == b"leased"
        assert nothing_to_read(a_peer) and c.durable_seq == 0
    log_.release.set()
    assert read_frame(a_peer, timeout=5.0) == b"ack done"
    if rotation_due:
        assert read_frame(b_peer, timeout=5.0) == b"leased"
    c.drain()
    assert log_.records == [b"ack-of-job-1", b"lease-of-job-2"]
    # B's record is written, not synced (a batched lease); the fdatasync that covered
    # A's either began before it was written or came before it: durable up to job 1.
    assert c.durable_seq == 1 and log_.unsynced and c.sync_due() is not None
    c.submit([], [(b, b"synced")], [], sync=True, seq=2)
    assert read_frame(b_peer, timeout=5.0) == b"synced"
    c.drain()  # the fdatasync's bookkeeping follows its replies
    assert c.durable_seq == 2 and not log_.unsynced and c.sync_due() is None


def test_a_reply_that_waits_for_an_fdatasync_leaves_before_its_bookkeeping(monkeypatch):
    """Between an fdatasync and the replies it covers there is nothing else: durable_seq,
    the sync deadline and the metrics are noted after the replies are written (a lease
    that could have gone early meanwhile waits for the next fsync: later, never wrong)."""
    log_ = SlowSyncLog()
    log_.release.set()
    c = Committer(log_, exit_code=4)
    conn, peer = pair(1700)
    readable_at_bookkeeping: list[bool] = []
    observe = c._observe  # the metrics: the last of the bookkeeping (durable_seq, sync_due before them)

    def noting(*args):
        try:
            readable_at_bookkeeping.append(bool(peer.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)))
        except BlockingIOError:
            readable_at_bookkeeping.append(False)
        assert c.durable_seq == 0 or readable_at_bookkeeping[-1]  # never durable before the reply left
        observe(*args)
    monkeypatch.setattr(c, "_observe", noting)
    try:
        c.submit([b"enqueue-of-job-1"], [(conn, b"enqueued")], [], inline=True, sync=True, seq=1)
        assert readable_at_bookkeeping == [True]  # inline: this thread did it all, in that order
        assert read_frame(peer, timeout=5.0) == b"enqueued"
        assert c.durable_seq == 1 and c.fsyncs == 1 and c.sync_due() is None
        assert c.commit_seconds.snapshot()["count"] == 1
    finally:
        c.stop()
        conn.close()
        peer.close()


def test_an_early_reply_left_to_a_slow_reader_is_flushed_though_the_thread_went_idle(slow):
    # The loop saw the thread busy and appended beside it; by the time its reply found the
    # socket full, the thread had finished and gone to sleep. Nothing else will be submitted:
    # the reply must still reach the client as it reads.
    log_, c = slow.log, slow.c
    a, a_peer = slow.client()
    b, b_peer = slow.client()
    send = c._send

    def send_once_the_thread_sleeps(sends):
        if threading.current_thread() is threading.main_thread():
            log_.release.set()
            wait_until(lambda: asleep(c), 5.0, 0.005, "the thread to sleep")
        send(sends)

    c._send = send_once_the_thread_sleeps
    c.submit([b"ack-of-job-1"], [(a, b"ack done")], [], sync=True, seq=1)
    assert log_.in_sync.wait(5)
    big = os.urandom(1 << 20)  # more than the socket takes at once
    c.submit([b"lease-of-job-2"], [], [], early=[(b, big)], sync=False, seq=2)
    assert read_frame(a_peer, timeout=5.0) == b"ack done"
    assert read_frame(b_peer, timeout=5.0) == big


def test_a_reply_left_behind_wakes_the_thread_though_another_backlog_was_there_when_it_began(slow):
    # Found by `shardq verify --body-bytes 65536` (a shard stopped delivering leases until it
    # was restarted): the loop, appending beside the thread's fdatasync, saw a slow reader's
    # backlog and so did not wake the thread; meanwhile the thread flushed that backlog and
    # went to sleep. The loop's own reply, left in the next backlog, then waited for ever, and
    # every later one with it (each found the backlog not empty and woke nobody).
    log_, c = slow.log, slow.c
    a, a_peer = slow.client()
    b, b_peer = slow.client()
    d, d_peer = slow.client()
    big_a, big_b = os.urandom(1 << 20), os.urandom(1 << 20)  # more than a socket takes at once
    send = c._send

    def send_once_the_backlog_is_flushed_and_the_thread_sleeps(sends):
        if threading.current_thread() is threading.main_thread():
            log_.release.set()  # the thread's fdatasync ends; it answers d, then flushes a
            assert read_frame(d_peer, timeout=5.0) == b"ack 2 done"
            assert read_frame(a_peer, timeout=5.0) == big_a
            wait_until(lambda: not c._backlog and asleep(c), 5.0, 0.005,
                       "the thread to flush the backlog and sleep")
        send(sends)

    log_.release.set()
    c.submit([b"ack-1"], [(a, big_a)], [], sync=True, seq=1)  # a: a slow reader's backlog
    wait_until(lambda: a in c._backlog and log_.synced == 1, 5.0, 0.005, "a's backlog")
    log_.release.clear()
    log_.in_sync.clear()
    c.submit([b"ack-2"], [(d, b"ack 2 done")], [], sync=True, seq=2)
    assert log_.in_sync.wait(5)  # the thread waits in its fdatasync
    c._send = send_once_the_backlog_is_flushed_and_the_thread_sleeps
    c.submit([b"lease-3"], [], [], early=[(b, big_b)], sync=False, seq=3)  # beside it
    assert read_frame(b_peer, timeout=5.0) == big_b


def test_records_synced_by_a_rotation_leave_no_sync_due(committer):
    """Batched leases are written unsynced; a rotation's seal fdatasyncs them. The synced
    batch the loop then submits finds nothing unsynced: sync_due must clear, or the loop,
    seeing it in the past, would submit synced batches with a zero timeout until the next
    synced write (an idle shard spinning)."""
    committer._write([b"lease"], 1, 1)  # NoLog: the record is "written"
    assert committer.sync_due() is not None
    assert committer._sync() is None  # the log says nothing is unsynced
    assert committer.sync_due() is None


def test_an_fdatasyncs_metrics_count_the_operations_of_every_write_it_covers():
    """commit_ops counts the log operations an fdatasync makes durable: those of the unsynced
    writes it covers (a batched lease's) with its own, as the caller counted them (``ops``),
    and commit_seconds one observation: as Histogram.observe would (the committer writes
    observe out for both, once per fdatasync)."""
    from shardq.shard.histogram import COMMIT_OPS_BUCKETS, Histogram
    c = Committer(NoLog(), exit_code=4)
    conn, peer = pair(1702)
    try:
        c.submit([b"lease"], [], [], inline=True, early=[(conn, b"leased")], sync=False, seq=1, ops=1)
        assert c.commit_ops.snapshot()["count"] == 0 and c.sync_due() is not None  # written, not synced
        c.submit([b"acks", b"more acks"], [(conn, b"acked")], [], inline=True, sync=True, seq=1, ops=22)
        expected = Histogram(COMMIT_OPS_BUCKETS)
        expected.observe(1 + 22)
        assert c.commit_ops.snapshot() == expected.snapshot()
        seconds = c.commit_seconds.snapshot()
        assert seconds["count"] == 1 and seconds["sum"] >= 0.0 and c.fsyncs == 1
        assert read_frame(peer, timeout=5.0) == b"leased" and read_frame(peer, timeout=5.0) == b"acked"
        c.submit([], [], [], inline=True, sync=True)  # nothing written since: no fdatasync, no metric
        assert c.commit_ops.snapshot() == expected.snapshot()
    finally:
        c.stop()
        conn.close()
        peer.close()


def test_write_mark_marks_only_synced_writes_and_says_when_none_is_pending(tmp_path):
    """write_mark tests the log's mark_wanted itself (the loop and the backup cut call it
    without testing first): a write not yet synced gets no mark (False: try again), a synced
    one gets one (True), and with none pending it writes nothing (True)."""
    from shardq.wal import Log
    log_ = Log(str(tmp_path), segment_bytes=1 << 20)
    for _ in log_.replay():
        pass
    c = Committer(log_, exit_code=4)
    try:
        assert c.write_mark() and not log_.mark_pending  # the replayed log's first mark (it vouches for the replay)
        c.submit([b"\x90"], [], [], inline=True, sync=False, seq=1)  # written, not synced
        written = log_.writer.written
        assert log_.mark_pending and not c.write_mark()  # not synced: no mark yet
        assert log_.writer.written == written
        log_.sync()
        assert c.write_mark() and log_.writer.written == written + 1 and not log_.mark_pending
        assert c.write_mark() and log_.writer.written == written + 1  # none pending: nothing written
    finally:
        c.stop()
        log_.close()
