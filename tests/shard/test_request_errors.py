"""No request ends a shard (issue 44, item 13): an ``OSError`` of a handler's own I/O is
that request's error, answered as ``ShardUnavailable``; one that comes after the handler
changed the state is re-raised, as the state can no longer be trusted to match the log
(the process then exits and replays). In process, on the real ``ShardServer``; the same
with a real descriptor flood: tests/service/test_resilience_fds.py."""
from __future__ import annotations

import errno
import os

import pytest

from shardq.protocol import wire
from shardq.shard.durable import DurableShard
from shardq.shard.process import ShardServer


@pytest.fixture
def server(tmp_path, make_config):
    shard = DurableShard(str(tmp_path / "s"), 0, make_config())
    shard.open()
    srv = ShardServer(shard, str(tmp_path / "sock"), b"k" * 32)
    yield srv
    srv._poller.close()
    os.close(srv._wake_r)
    os.close(srv._wake_w)
    shard.close()


def test_an_oserror_in_a_handler_answers_that_request_and_the_next_is_served(server, monkeypatch):
    def emfile():
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(server.shard.log, "allocated_bytes", emfile)
    rid, status, payload = server._execute(None, 7, "stats", [], 1000.0, len(server.state._ops))
    assert (rid, status) == (7, wire.ERR)
    assert payload[0] == "ShardUnavailable" and "stats" in payload[1] and "Too many open files" in payload[1]
    assert server.state._ops == []  # nothing to log
    monkeypatch.undo()
    assert server._execute(None, 8, "stats", [], 1000.0, len(server.state._ops))[2]["wal_disk_bytes"] >= 0


def test_an_oserror_after_the_state_changed_is_not_swallowed(server):
    enqueue = server._handlers["enqueue"]

    def enqueue_then_fail(args, now, conn, rid):
        enqueue(args, now, conn, rid)
        raise OSError(errno.EIO, "after the state changed")
    server._handlers["enqueue"] = enqueue_then_fail
    with pytest.raises(OSError, match="after the state changed"):
        server._execute(None, 9, "enqueue", [[[b"x", None, "default", 0, 0, None]], None], 1000.0,
                        len(server.state._ops))


def test_a_client_that_leaves_its_replies_unread_is_dropped_not_read(server, caplog):
    """Found at the shards' sockets: a client that takes a trickle of its replies (a bare
    64 KiB read now and then) never met the send timeout, and the replies of what it went
    on asking grew the shard's memory ~100 MB/s. Past UNREAD_BYTES_MAX unread it is not
    read again but dropped; a client that reads its replies is read as ever."""
    import socket
    from shardq.shard.conn import UNREAD_BYTES_MAX, FrameConn
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        conn = FrameConn(ours.fileno())
        ping = wire.pack([[1, "ping", []]])
        theirs.sendall(len(ping).to_bytes(4, "big") + ping)
        conn.out_bytes = UNREAD_BYTES_MAX + 1  # replies the client has not taken
        batches: list = []
        server._read(conn, batches)
        assert batches == [] and "replies unread" in caplog.text
        conn.out_bytes = UNREAD_BYTES_MAX  # at the limit: read
        server._read(conn, batches)
        assert [reqs for _, reqs in batches] == [[[1, "ping", []]]]
    finally:
        ours.close()
        theirs.close()
