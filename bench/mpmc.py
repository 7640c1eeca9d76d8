"""Figures D, D2 and M: many producers and consumers at once, end to end.

* D   2 producers + 2 consumers, one job per call
* D2  2 producers + 2 consumers, 100 jobs per call
* M   16 producers + 4 consumers, one job per call (many clients: what group commit is for)

Each producer enqueues its share of the jobs (one call per job, or batches of 100) while
each consumer leases and acks (one job per call, or 100) until the consumers together have
acked as many jobs as were enqueued. Timed from the first producer's start to
the last ack. Every delivered body is sent back and checked, so duplicate deliveries are
counted.

Clients are separate processes, each with its own connection (``connect(spec)``), so the
client's GIL is not the bottleneck; an adapter whose queue cannot be shared between
processes (no ``client_spec``) runs them as threads sharing the adapter instead. The result
says which (``mode``).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any
from collections.abc import Callable

from .jobs import check, split
from .peers.base import Adapter, Client, ClientSpec, Item, connect
from .workloads import drain_step, enqueue_all, take_leftovers

PRODUCERS = 2   # figures D, D2
CONSUMERS = 2
MANY_PRODUCERS = 16  # figure M
MANY_CONSUMERS = 4
START_TIMEOUT_S = 60.0  # for every client to connect


def produce(client: Client, items: list[Item], batch: bool, barrier) -> dict[str, Any]:
    barrier.wait(START_TIMEOUT_S)
    start = time.monotonic()
    enqueue_all(client, items, batch)
    return {"start": start, "end": time.monotonic()}


def consume(client: Client, batch: bool, target: int, acked, barrier,
            stall_s: float) -> dict[str, Any]:
    """Lease and ack until ``acked`` (shared by the consumers) reaches ``target``, or it has
    not moved for ``stall_s``; then take what the queue still hands out, untimed."""
    barrier.wait(START_TIMEOUT_S)
    delivered: list[bytes] = []
    acks: list[tuple[float, int]] = []  # (when, jobs acked): how the drain went, for phases()
    last_ack = time.monotonic()
    seen, seen_at = 0, last_ack
    while True:
        seen_now = acked.value
        now = time.monotonic()
        if seen_now >= target:
            break
        if seen_now != seen:
            seen, seen_at = seen_now, now
        elif now - seen_at > stall_s:
            break
        before = len(delivered)
        if drain_step(client, batch, delivered):
            last_ack = time.monotonic()
            acks.append((last_ack, len(delivered) - before))
            with acked.get_lock():
                acked.value += len(delivered) - before
    leftovers = take_leftovers(client, limit=target)
    return {"delivered": delivered + leftovers, "last_ack": last_ack, "acks": acks}


def _in_process(role: Callable, spec: ClientSpec, args: tuple, conn) -> None:
    """Entry point of a client process: connect, play ``role``, send the result back."""
    try:
        client = connect(spec)
        try:
            conn.send(("ok", role(client, *args)))
        finally:
            client.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        conn.send(("error", f"{type(e).__name__}: {e}"))


class _Counter:
    """The thread-mode stand-in for ``multiprocessing.Value``."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock


def _run_processes(spec: ClientSpec, roles: list[tuple[Callable, tuple]],
                   barrier, deadline_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for role, args in roles:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_in_process, args=(role, spec, args, child), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        barrier.wait(START_TIMEOUT_S)
        results = []
        for pipe in pipes:
            if not pipe.poll(deadline_s):
                raise TimeoutError(f"a client process gave no result within {deadline_s} s")
            status, value = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"client process failed: {value}")
            results.append(value)
        return results
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _run_threads(client: Client, roles: list[tuple[Callable, tuple]],
                 barrier, deadline_s: float) -> list[dict]:
    results: list[Any] = [None] * len(roles)

    def play(i: int, role: Callable, args: tuple) -> None:
        try:
            results[i] = ("ok", role(client, *args))
        except BaseException as e:  # noqa: BLE001 - reported as this role's result
            results[i] = ("error", f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=play, args=(i, r, a), daemon=True)
               for i, (r, a) in enumerate(roles)]
    for t in threads:
        t.start()
    barrier.wait(START_TIMEOUT_S)
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"a client thread gave no result within {deadline_s} s")
    for status, value in results:
        if status != "ok":
            raise RuntimeError(f"client thread failed: {value}")
    return [value for _status, value in results]


def run(adapter: Adapter, items: list[Item], batch: bool, stall_s: float,
        deadline_s: float, producers: int = PRODUCERS, consumers: int = CONSUMERS) -> dict[str, Any]:
    """Figure D (or D2); other producer/consumer counts for other figures (M in bench/plan.py and
    bench/probes/http_overhead.py)."""
    spec = adapter.client_spec()
    if spec is None and not adapter.thread_safe:
        raise RuntimeError(f"{adapter.name}: no client processes and not thread-safe")
    parties = producers + consumers + 1
    if spec is not None:
        ctx = mp.get_context("spawn")
        barrier, acked = ctx.Barrier(parties), ctx.Value("q", 0)
    else:
        barrier, acked = threading.Barrier(parties), _Counter()
    roles = [(produce, (share, batch, barrier)) for share in split(items, producers)]
    roles += [(consume, (batch, len(items), acked, barrier, stall_s))
              for _ in range(consumers)]
    if spec is not None:
        results = _run_processes(spec, roles, barrier, deadline_s)
    else:
        results = _run_threads(adapter, roles, barrier, deadline_s)
    produced, consumed = results[:producers], results[producers:]
    start = min(p["start"] for p in produced)
    end = max(c["last_ack"] for c in consumed)
    delivered = [body for c in consumed for body in c["delivered"]]
    delivery = check((body for body, _key in items), delivered)
    seconds = end - start
    return {"mode": "processes" if spec is not None else "threads",
            "producers": producers, "consumers": consumers, "jobs": len(items), "seconds": seconds,
            "jobs_per_s": len(items) / seconds if seconds > 0 else 0.0,
            **phases(start, max(p["end"] for p in produced), end, len(items),
                     [a for c in consumed for a in c["acks"]]),
            "duplicates": delivery.duplicates, "delivery": delivery.to_dict()}


def phases(start: float, produced: float, end: float, jobs: int,
           acks: list[tuple[float, int]]) -> dict[str, float]:
    """The run in two phases: while the producers run (their enqueue rate, and the jobs the
    consumers acked meanwhile), then the consumers alone (their drain rate), so a report
    says which side bounds the figure."""
    produce_s = produced - start
    acked = sum(n for when, n in acks if when <= produced)
    after_s = end - produced
    return {"produce_s": produce_s, "enqueue_per_s": jobs / produce_s if produce_s > 0 else 0.0,
            "acked_while_producing": acked,
            "drain_after_per_s": (jobs - acked) / after_s if after_s > 0 and jobs > acked else None}
