"""Single-client throughput figures, generic over adapters (one set-up adapter each call).

* A   enqueue, 1 producer, one call per job
* B   enqueue, 1 producer, batches of 100 (``enqueue_many``)
* B-threads  enqueue from 16 threads sharing one adapter, one call per job
* C   drain, 1 consumer, lease + ack per job
* C2  drain, 1 consumer, lease 100 + ack 100

A and B fill the queue that C and C2 then drain, so each drain checks the jobs its producer
figure enqueued. Every figure returns a dict; throughput is ``jobs_per_s``.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .jobs import BATCH_JOBS, batches, check, split
from .peers.base import Client, Item

DRAIN_WAIT_S = 0.5   # how long one dequeue waits while draining
THREADS_B = 16


def _rate(jobs: int, seconds: float) -> dict[str, Any]:
    return {"jobs": jobs, "seconds": seconds, "jobs_per_s": jobs / seconds if seconds > 0 else 0.0}


def enqueue_single(client: Client, items: list[Item]) -> dict[str, Any]:
    """Figure A."""
    start = time.monotonic()
    for body, key in items:
        client.enqueue(body, key)
    return _rate(len(items), time.monotonic() - start)


def enqueue_batched(client: Client, items: list[Item]) -> dict[str, Any]:
    """Figure B."""
    chunks = batches(items)
    start = time.monotonic()
    for chunk in chunks:
        client.enqueue_many(chunk)
    return _rate(len(items), time.monotonic() - start)


def enqueue_threads(client: Client, items: list[Item], threads: int = THREADS_B,
                    batch: bool = False) -> dict[str, Any]:
    """Figure B-threads (and figure S): ``threads`` producers sharing ``client``."""
    shares = split(items, threads)
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def produce(share: list[Item]) -> None:
        barrier.wait()
        try:
            enqueue_all(client, share, batch)
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            errors.append(e)

    workers = [threading.Thread(target=produce, args=(s,), daemon=True) for s in shares]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.monotonic()
    for w in workers:
        w.join()
    seconds = time.monotonic() - start
    if errors:
        raise errors[0]
    return dict(_rate(len(items), seconds), threads=threads)


def take_leftovers(client: Client, limit: int) -> list[bytes]:
    """Untimed, after a drain: whatever the queue still hands out (duplicates or strays)."""
    bodies = []
    while len(bodies) < limit:
        handle = client.dequeue(0.0)
        if handle is None:
            break
        bodies.append(client.body_of(handle))
        client.ack(handle)
    return bodies


def enqueue_all(client: Client, items: list[Item], batch: bool) -> None:
    """Enqueue ``items`` one call per job, or in batches of BATCH_JOBS."""
    if batch:
        for chunk in batches(items):
            client.enqueue_many(chunk)
    else:
        for body, key in items:
            client.enqueue(body, key)


def drain_step(client: Client, batch: bool, delivered: list[bytes]) -> bool:
    """Lease (one job, or a batch), note the bodies, ack. True if anything came."""
    if batch:
        handles = client.dequeue_many(BATCH_JOBS, DRAIN_WAIT_S)
        if handles:
            delivered.extend(client.body_of(h) for h in handles)
            client.ack_many(handles)
        return bool(handles)
    handle = client.dequeue(DRAIN_WAIT_S)
    if handle is None:
        return False
    delivered.append(client.body_of(handle))
    client.ack(handle)
    return True


def drain(client: Client, items: list[Item], batch: bool, stall_s: float) -> dict[str, Any]:
    """Figures C (``batch=False``) and C2: lease and ack until every job came back, or no job
    came for ``stall_s``. Timed from the first dequeue to the last ack."""
    want = len(items)
    delivered: list[bytes] = []
    start = last_ack = time.monotonic()
    while len(delivered) < want:
        got = drain_step(client, batch, delivered)
        now = time.monotonic()
        if got:
            last_ack = now
        elif now - last_ack > stall_s:
            break
    timed = len(delivered)
    delivered.extend(take_leftovers(client, limit=want))
    delivery = check((body for body, _key in items), delivered)
    return dict(_rate(timed, last_ack - start), delivery=delivery.to_dict())
