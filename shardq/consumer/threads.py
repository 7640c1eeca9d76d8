"""The threads that run jobs, and why a job left running never holds the process's exit.

At the grace period's end a worker releases the leases of the jobs still running and
returns; a handler blocked in a thread cannot be stopped, so the thread is left to finish
on its own (its result is dropped: the lease is no longer the worker's). For ``run()`` to
return and the process to exit, nothing may wait for such a thread. Every thread that runs
a job is therefore started by :func:`job_thread`, a daemon thread that nothing joins once
its job was given up: the thread runner's runners (:mod:`.worker`, which joins them only
when no job was abandoned), the asyncio runner's plain tasks (:class:`JobThreads`) and its
transactions (:mod:`.aiotxn`).

Not ``asyncio.to_thread``: ``asyncio.run`` ends by joining the loop's default executor,
whatever is still running in it, and the interpreter's exit joins the threads of every
``ThreadPoolExecutor`` (``concurrent.futures`` registers that at import), so one abandoned
plain task kept a SIGTERMed ``shardq worker`` (and an app whose ``asyncio.run`` cancelled
``AsyncWorker.run_async``) up until the task returned, however long after its lease was
released.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


def job_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start ``target(*args)`` in a daemon thread: the interpreter's exit does not wait for
    it, so a job abandoned in it (the grace period ended) never holds the process up."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


class _Call(NamedTuple):
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]


class JobThreads(Executor):
    """An executor for ``loop.run_in_executor`` whose threads are :func:`job_thread`\\ s. A
    thread serves one call at a time and waits for the next while idle, so a store's
    per-thread connection is reused as in the loop's default executor; a call that finds no
    idle thread starts one (the worker's ``concurrency`` bounds how many run at once).
    :meth:`shutdown` ends the idle threads and lets the busy ones end as their calls return,
    waiting for none of them unless asked. ``on_exit`` runs in each thread as it ends (the
    store's :meth:`~.idempotency.IdempotencyStore.release_thread`)."""

    def __init__(self, name: str, on_exit: Callable[[], None] | None = None):
        self._name, self._on_exit = name, on_exit
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call that no submit() has claimed yet
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if kwargs:
            raise TypeError("JobThreads.submit takes positional arguments only")
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put(_Call(future, fn, args))
            if self._idle:
                self._idle -= 1
            else:
                self._threads.append(job_thread(self._serve, f"{self._name}-{len(self._threads)}"))
        return future

    def _serve(self) -> None:
        try:
            while (call := self._calls.get()) is not None:
                value: Any = None
                error: BaseException | None = None
                running = call.future.set_running_or_notify_cancel()
                if running:
                    try:
                        value = call.fn(*call.args)
                    except BaseException as exc:  # noqa: BLE001 - the caller's to see, not this thread's end
                        error = exc
                with self._lock:  # idle before the caller hears: its next call finds this thread
                    self._idle += 1
                if running and error is not None:
                    call.future.set_exception(error)
                elif running:
                    call.future.set_result(value)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; every thread ends once it is idle. ``wait``: join them (the
        asyncio runner never does: an abandoned job's thread runs on)."""
        with self._lock:
            self._shut = True
            threads = list(self._threads)
        if cancel_futures:
            self._cancel_waiting()
        for _ in threads:
            self._calls.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _cancel_waiting(self) -> None:
        """Cancel the calls no thread has taken (:meth:`shutdown`'s ``cancel_futures``)."""
        left: list[_Call | None] = []
        while True:
            try:
                left.append(self._calls.get_nowait())
            except queue.Empty:
                break
        for call in left:
            if call is not None:
                call.future.cancel()
