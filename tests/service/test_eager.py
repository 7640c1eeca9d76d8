"""service/eager.py: a coroutine's first step runs at once, the rest as a task that behaves
as ``create_task``'s would (values, exceptions, cancellation)."""
from __future__ import annotations

import asyncio

import pytest

from shardq.service import eager


def test_a_coroutine_that_never_waits_ends_at_once_with_no_task():
    ran = []

    async def at_once():
        ran.append("ran")
        return 7

    async def main():
        task, value = eager.start(asyncio.get_running_loop(), at_once())
        assert (task, value, ran) == (None, 7, ["ran"])  # within start's call: no loop turn
    asyncio.run(main())


def test_the_first_step_runs_before_start_returns_the_rest_in_a_task():
    steps = []

    async def twice(fut):
        steps.append("first")
        got = await fut
        steps.append(f"then {got}")
        await asyncio.sleep(0)  # a bare yield passes through too
        return got * 2

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task, value = eager.start(asyncio.get_running_loop(), twice(fut))
        assert steps == ["first"] and value is None and not task.done()
        fut.set_result(21)
        assert await task == 42 and steps == ["first", "then 21"]
    asyncio.run(main())


def test_an_exception_after_the_first_wait_is_the_tasks():
    async def fails(fut):
        await fut
        raise ValueError("later")

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task, _ = eager.start(asyncio.get_running_loop(), fails(fut))
        fut.set_result(None)
        with pytest.raises(ValueError, match="later"):
            await task
    asyncio.run(main())


def test_a_cancellation_reaches_the_coroutine_where_it_waits():
    seen = []

    async def waits(fut):
        try:
            await fut
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0)  # it may still wait on its way out
            seen.append("cleaned up")
            raise

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task, _ = eager.start(asyncio.get_running_loop(), waits(fut))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled", "cleaned up"] and task.cancelled() and fut.cancelled()
    asyncio.run(main())


def test_a_cancellation_the_coroutine_swallows_lets_it_go_on():
    async def stubborn(fut):
        try:
            await fut
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
        return "kept on"

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task, _ = eager.start(asyncio.get_running_loop(), stubborn(fut))
        await asyncio.sleep(0)
        task.cancel()
        assert await task == "kept on"
    asyncio.run(main())
