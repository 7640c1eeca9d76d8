"""A connection may park at most ``limits.PARKED_WAITS_MAX`` waiting dequeues and watches in
a shard at once; past it a wait is refused (QueueFull, nothing parked), and each answer,
expiry, withdrawal or drop gives its place back. Before, the waits of one connection had no
bound: every loop iteration scans them all (for the next deadline, for expiries), so a
client that parked waits without end slowed the shard for every client. In process, through
socketpairs, on the real ``ShardServer`` (the loop of ``bench/probes/shard_path.py``)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from support import shard_loop
from support.shard_loop import add_client, iterate, send_frame

from shardq import limits
from shardq.client.routing import job_item
from shardq.protocol import wire

MAX = limits.PARKED_WAITS_MAX


@pytest.fixture
def loop(tmp_path):
    from bench.probes.shard_path import Loop
    lp = Loop(str(tmp_path), preload=0)
    yield lp
    lp.close()


def replies(sock: socket.socket) -> dict[int, list]:
    """Every reply sent to ``sock`` so far, by request id: ``[status, payload]``."""
    return {r[0]: r[1:] for r in shard_loop.replies(sock)}


def parked(lp) -> int:
    srv = lp.server
    return sum(map(len, srv.lease_waiters.values())) + sum(map(len, srv.watchers.values()))


def test_a_connection_parks_its_maximum_of_waits_and_is_refused_one_more_until_one_ends(loop):
    client, conn = add_client(loop)
    # the maximum, dequeues and watches together, in one frame (a frame's most requests),
    # written by another thread: the socket holds less than the frame, and this one reads it
    frame = [[rid, "dequeue_wait", ["q", None, 1, 30.0]] if rid % 2 else [rid, "watch", ["q", 30.0]]
             for rid in range(MAX)]
    writer = threading.Thread(target=send_frame, args=(client, frame))
    writer.start()
    while parked(loop) < MAX:  # (served in slices, an iteration's time each)
        iterate(loop)
    writer.join()
    assert replies(client) == {} and conn.parked == MAX
    send_frame(client, [[MAX, "dequeue_wait", ["q", None, 1, 30.0]], [MAX + 1, "watch", ["q", 30.0]]])
    iterate(loop)
    got = replies(client)
    assert sorted(got) == [MAX, MAX + 1] and parked(loop) == MAX
    for status, payload in got.values():
        assert status == wire.ERR and payload[0] == "QueueFull" and "PARKED_WAITS_MAX" in payload[1], payload
    # another connection is not held back by this one's waits
    other, _ = add_client(loop)
    send_frame(other, [[1, "dequeue_wait", ["q", None, 1, 30.0]]])
    iterate(loop)
    assert replies(other) == {} and parked(loop) == MAX + 1
    # a withdrawn wait gives its place back
    send_frame(client, [[MAX + 2, "cancel_wait", [1]], [MAX + 3, "dequeue_wait", ["q", None, 1, 30.0]]])
    iterate(loop)
    assert replies(client) == {MAX + 2: [wire.OK, True]} and conn.parked == MAX
    # a job that comes is leased to the oldest waiting dequeue (the watches see none left
    # ready): its place comes back, and one more wait parks
    send_frame(other, [[2, "enqueue", [[job_item(b"job", None, "q", 0, 0, None)], None]]])
    while not replies(other):  # (the iteration that serves the enqueue answers the wait too)
        iterate(loop)
    assert list(replies(client)) == [3] and conn.parked == MAX - 1 == _entries(loop, conn)
    send_frame(client, [[MAX + 4, "watch", ["q", 30.0]]])
    iterate(loop)
    assert replies(client) == {} and conn.parked == MAX == _entries(loop, conn)


def _entries(lp, conn) -> int:
    """The waits of ``conn`` parked in the loop, counted one by one."""
    srv = lp.server
    return sum(w[0] is conn for ws in [*srv.lease_waiters.values(), *srv.watchers.values()] for w in ws)


def test_expired_and_dropped_waits_give_their_places_back(loop):
    client, conn = add_client(loop)
    send_frame(client, [[1, "dequeue_wait", ["q", None, 1, 0.01]], [2, "watch", ["q", 0.01]],
                        [3, "dequeue_wait", ["q", None, 1, 30.0]]])
    iterate(loop)
    assert conn.parked == 3
    deadline = time.monotonic() + 10
    while len(replies_so_far := replies(client)) < 2 and time.monotonic() < deadline:
        iterate(loop)  # (a polled deadline: the two short waits end within their 10 ms)
    assert replies_so_far == {1: [wire.OK, []], 2: [wire.OK, False]} and conn.parked == 1
    # a watch answered by a job that comes gives its place back
    send_frame(client, [[4, "watch", ["w", 30.0]], [5, "enqueue", [[job_item(b"job", None, "w", 0, 0, None)], None]]])
    got: dict[int, list] = {}
    while 5 not in got:
        iterate(loop)
        got.update(replies(client))
    assert got[4] == [wire.OK, True] and conn.parked == 1
    loop.server._drop(conn, None)
    assert parked(loop) == 0 and conn.parked == 0
