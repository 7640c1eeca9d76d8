"""A client that begins a frame and never sends the rest is dropped after
``conn.FRAME_COMPLETE_S``: found at the shards' sockets, a half-sent frame held its bytes
(up to 64 MiB each) for as long as its client kept the connection open. A frame sent in
pieces within the time is served; the bytes after a whole frame begin the next one's
time. In process, through socketpairs, on the real ``ShardServer``."""
from __future__ import annotations

import logging

import pytest
from support.shard_loop import add_client, framed, iterate, replied

from shardq.shard import process


@pytest.fixture
def loop(tmp_path):
    from bench.probes.shard_path import Loop
    lp = Loop(str(tmp_path), preload=0)
    yield lp
    lp.close()


def test_a_client_that_leaves_a_frame_unfinished_is_dropped_and_the_loop_wakes_for_it(loop, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "shardq.shard")
    sock, conn = add_client(loop)
    whole = framed([[1, "ping", []]])
    sock.sendall(whole[:10])
    iterate(loop)
    assert conn in loop.server.conns and conn.begun_at > 0
    # idle, the loop waits no longer than the frame's time (it would have blocked for ever)
    assert 0 < loop.server._timeout() <= process.FRAME_COMPLETE_S
    monkeypatch.setattr(process, "FRAME_COMPLETE_S", 0.0)  # its time has come
    iterate(loop)
    assert conn not in loop.server.conns and conn not in loop.server._begun
    assert "did not send the rest within 0 s" in caplog.text
    sock.setblocking(False)
    assert sock.recv(1) == b""  # closed on the client


def test_a_frame_sent_in_pieces_in_time_is_served_and_its_time_ends_with_it(loop):
    sock, conn = add_client(loop)
    first, second = framed([[1, "ping", []]]), framed([[2, "ping", []]])  # 13 bytes each
    sock.sendall(first[:10])
    iterate(loop)
    begun = conn.begun_at
    sock.sendall(first[10:] + second[:7])  # the rest, and the start of the next frame
    iterate(loop)
    assert conn in loop.server.conns and conn.begun_at > begun  # the next frame's own time
    sock.sendall(second[7:])
    iterate(loop)
    assert conn.begun_at == 0.0 and conn not in loop.server._begun
    assert loop.server._timeout() is None  # nothing to wake for: idle for good
    assert replied(sock) == [1, 2]
