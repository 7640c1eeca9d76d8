"""The retry policy of every op, and the clock the threaded router reads it by.

Which ops are sent again after a break, and in what order, is tested on both clients in
test_client_drivers.py. A fake shard (the real handshake and framing, scripted replies)
makes the moment of the break exact.
"""
from __future__ import annotations

import pytest

import shardq
from shardq.protocol import wire

from support.fake_shard import FakeShards


def test_every_op_has_a_retry_policy():
    assert set(wire.RETRY) == wire.OPS
    # dequeue_wait is never re-sent either: a broken connection ends the wait, and the
    # router asks every shard again (tests/shard/test_waiting_lease.py)
    assert {op for op, p in wire.RETRY.items() if p == wire.UNKNOWN} == {"dequeue", "dequeue_wait", "nack", "bury",
                                                                        "redrive", "purge_dead", "purge_queue"}


def test_the_router_and_its_connections_read_time_from_the_clock_they_are_given():
    """Router and its lanes take a Clock (shardq/clock.py) and read no time themselves:
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
