"""Busy-polling for a lone caller's reply (shardq/busypoll.py): when it polls without
sleeping, when it stops, what it refuses, and that the router's solo path uses it (and
serve's own routers do not). Nothing here times a call: speed is the benchmarks' business."""
from __future__ import annotations

import os
import shutil
import socket
import time

import pytest

import shardq
from shardq import busypoll
from shardq.busypoll import BUSY_POLL_US_DEFAULT, BUSY_POLL_US_MAX, BusyPoll
from shardq.clock import FakeClock
from shardq.client.router import Router
from shardq.errors import InvalidConfig

from support.service import short_tmpdir


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 2)


def test_it_polls_while_replies_come_within_the_budget_and_stops_when_they_do_not(two_cpus):
    busy = BusyPoll(300)
    assert busy.wanted()  # no reply seen yet: try
    for _ in range(8):
        busy.note(0.000_100)
    assert busy.wanted()
    for _ in range(16):
        busy.note(0.005)  # a slow disk: 5 ms per reply
    assert not busy.wanted()
    for _ in range(32):
        busy.note(0.000_100)  # faster again: it polls again
    assert busy.wanted()


def test_it_stops_when_callers_keep_finding_the_connection_in_use(two_cpus):
    busy = BusyPoll(300)
    for _ in range(8):
        busy.note_shared()
    assert not busy.wanted()
    for _ in range(16):
        busy.note(0.000_100)  # lone calls again
    assert busy.wanted()


def test_off_with_a_zero_budget_and_with_one_usable_cpu(monkeypatch):
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 2)
    assert not BusyPoll(0).wanted()
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 1)
    assert not BusyPoll(BUSY_POLL_US_DEFAULT).wanted()


def test_the_usable_cpus_are_this_processs_affinity():
    assert busypoll.usable_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", [-1, BUSY_POLL_US_MAX + 1, 1.5, "300", None, True])
def test_a_budget_that_is_not_an_int_in_range_is_refused(bad):
    with pytest.raises(InvalidConfig, match="busy_poll_us"):
        BusyPoll(bad)
    BusyPoll(BUSY_POLL_US_MAX)  # the maximum itself is accepted


def test_spin_returns_at_once_when_the_reply_is_there(two_cpus):
    a, b = socket.socketpair()
    try:
        import select
        poller = select.poll()
        poller.register(a.fileno(), select.POLLIN)
        b.send(b"x")
        assert BusyPoll(BUSY_POLL_US_MAX).spin(poller.poll, {}) == [(a.fileno(), select.POLLIN)]
    finally:
        a.close()
        b.close()


class Never:
    """A poll that never finds anything ready; ``calls`` holds the timeouts it was given
    (``tick``: how far each call moves ``clock``)."""

    def __init__(self, clock: FakeClock | None = None, tick: float = 0.0):
        self.calls: list[float] = []
        self.clock, self.tick = clock, tick

    def __call__(self, timeout: float) -> list:
        self.calls.append(timeout)
        if self.clock is not None:
            self.clock.advance(self.tick)  # each poll takes this long on that clock
        return []


def test_spin_gives_up_after_its_budget(two_cpus):
    never = Never()
    busy = BusyPoll(2000)
    started = time.monotonic()
    assert busy.spin(never, {}) == []
    assert time.monotonic() - started >= 0.002  # the whole budget was spent polling
    assert never.calls and set(never.calls) == {0}  # never a sleeping poll


def test_spin_times_its_budget_by_the_clock_it_is_given(two_cpus):
    clock = FakeClock()
    never = Never(clock, 0.001)  # each poll takes 1 ms of this clock's time
    assert BusyPoll(2000, clock).spin(never, {}) == []
    assert len(never.calls) == 2  # at 1 ms still within the 2 ms budget, at 2 ms spent


def test_spin_stops_when_another_thread_waits_on_the_connection(two_cpus):
    never = Never()
    assert BusyPoll(BUSY_POLL_US_MAX).spin(never, {7: object()}) == []
    assert never.calls == [0]  # one look, then the caller sleeps as the general path's do


def test_spin_if_wanted_polls_only_when_wanted_and_spins_on_after_a_first_look(two_cpus):
    never = Never()
    busy = BusyPoll(2000)
    started = time.monotonic()
    assert busy.spin_if_wanted(never) == []
    assert time.monotonic() - started >= 0.002 and set(never.calls) == {0}  # the spin ran its budget
    assert busy.spin_if_wanted(lambda timeout: [(3, 1)]) == [(3, 1)]  # the first look found it
    for _ in range(16):
        busy.note(1.0)  # waits far over the budget: not wanted
    never.calls.clear()
    assert not busy.wanted() and busy.spin_if_wanted(never) == [] and never.calls == []  # not even a look


@pytest.fixture
def service():
    root = short_tmpdir()
    try:
        with shardq.open(os.path.join(root, "data"), shards=1) as q:
            yield q
    finally:
        shutil.rmtree(root, ignore_errors=True)


def counting_spins(monkeypatch):
    """What each wait that polled found: a router's spin, a shard loop's spin_if_wanted
    when wanted (one entry, whether its first poll found the request or its spin did)."""
    spins = []
    real, real_if_wanted = BusyPoll.spin, BusyPoll.spin_if_wanted
    inside = []

    def spin(self, poll, others=(), limit_s=None):
        got = real(self, poll, others, limit_s)
        if not inside:
            spins.append(got)
        return got

    def spin_if_wanted(self, poll, limit_s=None):
        polled = self.wanted()
        inside.append(True)
        try:
            got = real_if_wanted(self, poll, limit_s)
        finally:
            inside.pop()
        if polled:
            spins.append(got)
        return got

    monkeypatch.setattr(BusyPoll, "spin", spin)
    monkeypatch.setattr(BusyPoll, "spin_if_wanted", spin_if_wanted)
    return spins


def test_a_lone_callers_calls_poll_for_their_replies(service, two_cpus, monkeypatch):
    spins = counting_spins(monkeypatch)
    with Router(service.data_dir) as q:
        q.ping()  # connected before counting
        q.queue_config("default")  # and the queue's placement known (asked before a first enqueue)
        spins.clear()
        jid = q.enqueue(b"polled", key="k")
        lease = q.dequeue()
        assert (lease.job_id, lease.body) == (jid, b"polled")
        q.ack(lease)
        assert len(spins) == 3  # enqueue, dequeue, ack: each polled for its reply


def test_no_polling_with_a_zero_budget_nor_in_serves_own_routers(service, two_cpus, monkeypatch):
    spins = counting_spins(monkeypatch)
    for router in (Router(service.data_dir, busy_poll_us=0), Router(service.data_dir, _role="service")):
        with router as q:
            jid = q.enqueue(b"slept", key="k")
            lease = q.dequeue()
            assert lease.job_id == jid
            q.ack(lease)
    assert spins == []


def test_the_router_refuses_a_bad_budget(service):
    with pytest.raises(InvalidConfig, match="busy_poll_us"):
        Router(service.data_dir, busy_poll_us=-5)


def shard_loop(tmp_path, service=None):
    from bench.probes.shard_path import Loop
    return Loop(str(tmp_path), preload=0, service=service)


def test_a_shards_loop_polls_for_the_next_request_before_it_sleeps(tmp_path, two_cpus, monkeypatch):
    spins = counting_spins(monkeypatch)
    loop = shard_loop(tmp_path)
    try:
        for _ in range(3):
            loop.enqueue()  # the request is written, then one iteration serves it
        assert loop.failures == 0
        assert len(spins) == 3 and all(spins)  # each found its request by polling, no sleep
        for _ in range(16):
            loop.server._busy.note(1.0)  # requests that came seconds apart: polling stops
        spins.clear()
        loop.enqueue()
        assert loop.failures == 0 and spins == []
    finally:
        loop.close()


def test_a_shard_configured_with_zero_never_polls(tmp_path, two_cpus, monkeypatch):
    spins = counting_spins(monkeypatch)
    loop = shard_loop(tmp_path, {"busy_poll_us": 0})
    try:
        for _ in range(3):
            loop.enqueue()
        assert loop.failures == 0 and spins == []
    finally:
        loop.close()
