""":class:`shardq.consumer.threads.JobThreads`, where the asyncio runner runs plain tasks:
daemon threads (a job abandoned in one never holds the exit: test_aioworker_grace_end.py),
reused while idle (a store's per-thread connection with them), each running ``on_exit`` as
it ends, and a shutdown that waits for no busy thread unless asked."""
from __future__ import annotations

import asyncio
import threading

import pytest

from shardq.consumer.threads import JobThreads


def test_idle_threads_are_reused_and_are_daemons():
    threads = JobThreads("t")
    try:
        first = threads.submit(threading.current_thread).result(10)
        second = threads.submit(threading.current_thread).result(10)
        assert first is second and first.daemon and first.name == "t-0"
    finally:
        threads.shutdown()


def test_a_busy_thread_gets_company_and_shutdown_does_not_wait_for_it():
    release, ended = threading.Event(), []
    threads = JobThreads("t", on_exit=lambda: ended.append(threading.current_thread().name))
    busy = threads.submit(release.wait)
    other = threads.submit(threading.current_thread).result(10)  # not queued behind the busy one
    assert other.name == "t-1"
    threads.shutdown(wait=False)
    other.join(10)
    assert ended == ["t-1"] and not busy.done()  # the idle one ended, the busy one runs on
    with pytest.raises(RuntimeError):
        threads.submit(print)
    release.set()
    assert busy.result(10) is True


def test_run_in_executor_gets_the_value_or_the_error():
    async def main() -> tuple[int, BaseException | None]:
        loop, threads = asyncio.get_running_loop(), JobThreads("t")
        try:
            value = await loop.run_in_executor(threads, sum, [1, 2])
            try:
                await loop.run_in_executor(threads, int, "x")
            except ValueError as exc:
                return value, exc
            return value, None
        finally:
            threads.shutdown()
    value, error = asyncio.run(main())
    assert value == 3 and isinstance(error, ValueError)
