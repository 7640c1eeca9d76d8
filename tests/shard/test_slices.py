"""One frame of many requests, or a crowd of clients, cannot hold a shard's loop for
seconds (found at the shards' sockets: a 57 MiB frame of small requests, or 60 requests
each with a 30 MiB reply, kept the loop from its health pings past ``health_timeout``,
and the supervisor restarted the shard). A frame announcing more than
``limits.FRAME_REQUESTS_MAX`` requests is refused before it is decoded, and both clients
cut their frames there; an iteration serves frames until it has worked ``SLICE_S`` (a
frame of more than ``SLICE_REQUESTS`` counts as several) and the next serves the rest
first, one slice of each connection in turn. In process, through socketpairs, on the
real ``ShardServer`` (the loop of ``bench/probes/shard_path.py``)."""
from __future__ import annotations

import os

import msgpack
import pytest
from support.shard_loop import add_client, iterate, replied, send_frame

from shardq import limits
from shardq.client.core import encode_frames
from shardq.errors import ProtocolError
from shardq.protocol import wire
from shardq.shard import process


@pytest.fixture
def loop(tmp_path):
    from bench.probes.shard_path import Loop
    lp = Loop(str(tmp_path), preload=0)
    yield lp
    lp.close()


def test_a_frame_of_many_requests_is_served_in_slices_in_order_with_other_clients_in_turn(loop, monkeypatch):
    monkeypatch.setattr(process, "SLICE_S", -1.0)  # every iteration has worked its time after one slice
    (a, _), (b, _) = add_client(loop), add_client(loop)
    n = 3 * process.SLICE_REQUESTS + 10
    send_frame(a, [[rid, "ping", []] for rid in range(n)])
    iterate(loop)
    assert replied(a) == list(range(process.SLICE_REQUESTS))  # one slice, not the whole frame
    send_frame(b, [[7, "ping", []]])
    iterate(loop)  # a's second slice, read before b's frame
    assert replied(b) == [] and replied(a) == list(range(process.SLICE_REQUESTS, 2 * process.SLICE_REQUESTS))
    iterate(loop)  # b's turn comes before a's third slice
    assert replied(b) == [7] and replied(a) == []
    iterate(loop)
    iterate(loop)
    assert replied(a) == list(range(2 * process.SLICE_REQUESTS, n)) and not loop.server._backlog


def test_many_frames_in_one_iteration_are_served_up_to_its_time_then_first_in_the_next(loop, monkeypatch):
    monkeypatch.setattr(process, "SLICE_S", -1.0)
    clients = [add_client(loop)[0] for _ in range(3)]
    for i, c in enumerate(clients):
        send_frame(c, [[i, "ping", []]])
    iterate(loop)
    got = [replied(c) for c in clients]
    assert sorted(map(len, got)) == [0, 0, 1]  # one frame served; the other two kept, not dropped
    iterate(loop)
    iterate(loop)
    assert sorted(got[i] + replied(c) for i, c in enumerate(clients)) == [[0], [1], [2]]


def test_at_the_default_slice_time_a_lone_frame_of_many_requests_is_served_whole(loop):
    a, _ = add_client(loop)
    send_frame(a, [[rid, "ping", []] for rid in range(2 * process.SLICE_REQUESTS)])
    iterate(loop)  # 512 pings take far less than SLICE_S
    assert replied(a) == list(range(2 * process.SLICE_REQUESTS))


def test_a_dropped_clients_kept_requests_are_not_served(loop, monkeypatch):
    monkeypatch.setattr(process, "SLICE_S", -1.0)
    a, _ = add_client(loop)
    send_frame(a, [[rid, "enqueue", [[[b"x", None, "default", 0, 0, None]], None]]
                   for rid in range(2 * process.SLICE_REQUESTS)])
    iterate(loop)
    served = loop.shard.state.stats()["default"]["ready"]
    assert served == process.SLICE_REQUESTS and loop.server._backlog
    conn = loop.server._backlog[0][0]
    loop.server._drop(conn, "test")
    iterate(loop)
    assert loop.shard.state.stats()["default"]["ready"] == served and not loop.server._backlog


def test_a_stopping_loop_serves_what_it_read_and_reads_nothing_more(loop, monkeypatch):
    monkeypatch.setattr(process, "SLICE_S", -1.0)
    (a, _), (b, _) = add_client(loop), add_client(loop)
    send_frame(a, [[rid, "ping", []] for rid in range(2 * process.SLICE_REQUESTS)])
    iterate(loop)
    loop.server.stopping = True
    send_frame(b, [[1, "ping", []]])
    iterate(loop)
    assert replied(a) == list(range(2 * process.SLICE_REQUESTS)) and replied(b) == []
    assert not loop.server._backlog


def test_a_frame_of_frame_requests_max_is_decoded_and_one_more_is_refused_unread():
    at = msgpack.packb([[rid, "ping", []] for rid in range(limits.FRAME_REQUESTS_MAX)])
    assert len(wire.decode_requests(at)) == limits.FRAME_REQUESTS_MAX
    assert len(wire.decode_requests(memoryview(bytearray(at)))) == limits.FRAME_REQUESTS_MAX
    over = msgpack.packb([[rid, "ping", []] for rid in range(limits.FRAME_REQUESTS_MAX + 1)])
    with pytest.raises(ProtocolError, match=f"{limits.FRAME_REQUESTS_MAX + 1} requests"):
        wire.decode_requests(over)
    # refused from its header: a frame of many millions would take seconds to decode
    header_only = b"\xdd" + (100_000_000).to_bytes(4, "big") + os.urandom(4 * limits.FRAME_REQUESTS_MAX)
    with pytest.raises(ProtocolError, match="100000000 requests"):
        wire.decode_requests(header_only)


def test_the_clients_cut_their_frames_at_frame_requests_max():
    requests = [[rid, "ping", []] for rid in range(2 * limits.FRAME_REQUESTS_MAX + 1)]
    frames = encode_frames(requests, lambda i, e: pytest.fail(f"refused {i}: {e}"))
    decoded = [wire.decode_requests(f) for f in frames]
    assert [len(d) for d in decoded] == [limits.FRAME_REQUESTS_MAX, limits.FRAME_REQUESTS_MAX, 1]
    assert [r for d in decoded for r in d] == requests


def test_health_pings_are_answered_between_the_slices_of_a_frame(loop, monkeypatch):
    monkeypatch.setattr(process, "SLICE_S", -1.0)
    srv = loop.server
    r, w = os.pipe()
    os.set_blocking(r, False)
    pings: list[bytes] = []
    srv._health_fd, srv._answer_health = r, pings.append
    srv._poller.register(r, 1)  # EPOLLIN
    try:
        a, _ = add_client(loop)
        send_frame(a, [[rid, "ping", []] for rid in range(3 * process.SLICE_REQUESTS)])
        iterate(loop)
        os.write(w, b"p")
        iterate(loop)
        assert pings == [b"p"] and srv._backlog  # answered with a slice of the frame still to serve
        iterate(loop)
        assert replied(a) == list(range(3 * process.SLICE_REQUESTS)) and not srv._backlog
    finally:
        srv._poller.unregister(r)
        os.close(r)
        os.close(w)
