"""The SQS listener loop's selector (shardq/service/spin_selector.py): it busy-polls only
under the policy its caller gives for the wait, never for a wait of 0 and never past the
wait's timeout, notes each wait it was asked to poll for, and gives the event loop what a
plain selector would; and which waits the SQS listener polls for (shardq/sqs_api/server.py).
Nothing here times a call."""
from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from shardq import busypoll
from shardq.busypoll import BusyPoll
from shardq.config import SqsApiConfig
from shardq.service.spin_selector import SpinSelector


@pytest.fixture(autouse=True)
def two_cpus(monkeypatch):
    monkeypatch.setattr(busypoll, "usable_cpus", lambda: 2)


class Recording(BusyPoll):
    """A policy that records the spins asked of it and the waits noted."""

    def __init__(self, budget_us: int = 300):
        super().__init__(budget_us)
        self.spins: list[float | None] = []
        self.noted: list[float] = []

    def spin(self, poll, others=(), limit_s=None):
        self.spins.append(limit_s)
        return super().spin(poll, others, limit_s)

    def note(self, took_s: float) -> None:
        self.noted.append(took_s)
        super().note(took_s)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_it_polls_under_the_policy_and_returns_what_is_ready(pair):
    a, b = pair
    busy = Recording()
    sel = SpinSelector(lambda: busy)
    sel.register(a, 1)  # EVENT_READ
    b.send(b"x")
    ready = sel.select(5.0)
    assert [(key.fileobj, events) for key, events in ready] == [(a, 1)]
    assert busy.spins == [5.0] and len(busy.noted) == 1  # polled, the wait noted
    sel.close()


def test_a_spin_never_outlasts_the_waits_timeout_and_nothing_ready_is_nothing(pair):
    a, _ = pair
    busy = Recording(busypoll.BUSY_POLL_US_MAX)
    sel = SpinSelector(lambda: busy)
    sel.register(a, 1)
    assert sel.select(0.001) == []
    assert busy.spins == [0.001] and len(busy.noted) == 1
    sel.close()


def test_no_policy_a_zero_wait_or_a_policy_that_is_off_does_not_poll(pair):
    a, b = pair
    busy, asked = Recording(), []
    sel = SpinSelector(lambda: asked.append(1) or None)
    sel.register(a, 1)
    assert sel.select(0.001) == [] and asked == [1]  # asked, slept
    sel.policy = lambda: busy
    assert sel.select(0) == [] and busy.spins == [] and busy.noted == []  # a wait of 0: never asked
    for _ in range(16):
        busy.note(0.005)  # the waits took longer than the budget: it turns itself off
    busy.noted.clear()
    b.send(b"x")
    assert len(sel.select(1.0)) == 1 and busy.spins == [] and len(busy.noted) == 1  # slept, still noted
    sel.close()


def test_an_event_loop_runs_on_it_as_on_the_default_one():
    busy = Recording()
    loop = asyncio.SelectorEventLoop(SpinSelector(lambda: busy))
    try:
        async def work() -> int:
            await asyncio.sleep(0.001)
            return await asyncio.get_running_loop().run_in_executor(None, lambda: 7)
        assert loop.run_until_complete(work()) == 7
    finally:
        loop.close()
    assert busy.spins  # its waits were polled for


def test_the_sqs_listener_polls_for_a_lone_requests_reply_and_for_the_next_request_after_an_answer(tmp_path):
    from shardq.sqs_api.server import SqsService
    sqs = SqsService(tmp_path, SqsApiConfig(listen="127.0.0.1:0"))
    assert sqs._poll_policy() is None  # not listening yet
    sqs.listener = SimpleNamespace(answering=1, responses=0)  # type: ignore[assignment]
    assert sqs._poll_policy() is sqs.busy_reply  # one request: its reply from a shard comes soon
    sqs.listener = SimpleNamespace(answering=0, responses=1)  # type: ignore[assignment]
    assert sqs._poll_policy() is sqs.busy_next  # answered: a lone client's next request comes soon
    assert sqs._poll_policy() is None  # once per answer: an idle listener sleeps
    assert sqs.busy_reply.wanted() and sqs.busy_next.wanted()
    for _ in range(4):
        sqs.listener = SimpleNamespace(answering=2, responses=1)  # type: ignore[assignment]
        assert sqs._poll_policy() is None  # load: polling would take the CPU the shards and clients need
    # clients taking turns leave one request answered now and then: not alone, so no polling
    assert not sqs.busy_reply.wanted() and not sqs.busy_next.wanted()
    for _ in range(16):
        sqs.busy_reply.note(0.000_100)  # lone requests again, their replies quick: it polls again
    assert sqs.busy_reply.wanted()
