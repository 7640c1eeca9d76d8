"""shardq/loop_thread.py: an event loop on a thread of its own, and the blocking calls other
threads make into it (the router's I/O thread, serve's listeners)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from shardq.errors import Closed
from shardq.loop_thread import LoopThread


@pytest.fixture
def lt():
    lt = LoopThread("test-loop", owner="thing")
    yield lt
    lt.close()


def test_wait_returns_what_ran_on_the_loop_and_raises_its_error(lt):
    async def on_loop(x):
        assert threading.current_thread().name == "test-loop"
        if x < 0:
            raise ValueError("negative")
        await asyncio.sleep(0)
        return x * 2

    assert lt.wait(lambda: on_loop(21)) == 42
    with pytest.raises(ValueError, match="negative"):
        lt.wait(lambda: on_loop(-1))
    made = {}

    def a_future():
        made["fut"] = fut = lt.loop.create_future()
        lt.loop.call_soon(fut.set_result, "as it is")
        return fut

    assert lt.wait(a_future) == "as it is"


def test_an_interrupted_waiter_cancels_what_it_started_on_the_loop(lt):
    started, cancelled = threading.Event(), threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def interrupt():
        started.wait(10)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own SIGINT handler, whatever this process inherited (a background job starts
    # with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt).start()
        with pytest.raises(KeyboardInterrupt):
            lt.wait(forever)
    finally:
        signal.signal(signal.SIGINT, before)
    assert cancelled.wait(10)


def test_closing_ends_a_waiter_and_what_is_left_running_and_refuses_later_calls():
    lt = LoopThread("test-loop", owner="thing")
    started = threading.Event()
    out = []

    async def forever():
        started.set()
        await asyncio.sleep(3600)

    def waiter():
        try:
            out.append(lt.wait(forever, slice_s=0.05))
        except Closed as e:
            out.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    assert started.wait(10)
    lt.close()
    t.join(10)
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], Closed) and "thing is closed" in str(out[0])
    assert lt.loop.is_closed()
    with pytest.raises(Closed, match="thing is closed"):
        lt.wait(forever)


def test_a_call_started_while_closing_is_refused_not_left_to_hang(lt):
    lt.closing = True  # as close() sets it first: a task made now might never run
    with pytest.raises(Closed, match="thing is closed"):
        lt.wait(lambda: asyncio.sleep(0))
