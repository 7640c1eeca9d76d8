"""Latency figures.

* L: enqueue latency at a fixed offered rate (500 and 5,000 jobs/s). Open-loop pacing: job
  ``i`` is due at ``start + i / rate``; the producer sleeps until then (never spins, so it
  leaves the CPU to the server) and times each call. Two numbers per call: ``call_ms``, the
  call alone, and ``latency_ms``, from the moment the job was due until the call returned,
  which keeps the queueing delay a slow call causes to the jobs behind it (coordinated
  omission). ``achieved_per_s`` shows whether the producer kept up with the offered rate.
* W: idle consumer wake-up. A consumer (its own process; a thread for in-process queues) is
  blocked in a waiting dequeue; the producer enqueues one job at ``t0``; the latency is until
  the consumer holds it (before its ack). Between samples the producer waits for the ack and
  a further 10 ms, so the consumer is blocked again. Before the samples, the CPU% of the
  idle consumer and of the peer's server processes is read over ``idle_s``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import psutil

from .jobs import check
from .peers.base import Adapter, Client, ClientSpec, Item, connect

WAKE_WAIT_S = 5.0    # the consumer's dequeue wait; a sample never comes near it
GAP_S = 0.01         # after an ack, before the next sample
SETTLE_S = 0.3       # after the consumer says it is ready, before measuring anything
STOP_BODY = b"stop"  # enqueued last: the consumer acks it and exits


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank) of ``seconds``, in milliseconds."""
    if not seconds:
        return {"p50": float("nan"), "p99": float("nan")}
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] * 1e3

    return {"p50": rank(0.50), "p99": rank(0.99)}


CDF_POINTS_MAX = 500  # order statistics kept per run for a latency CDF (bench.plot's latency.png)


def cdf_us(seconds: list[float]) -> list[float]:
    """``seconds`` sorted, in microseconds, thinned to at most CDF_POINTS_MAX evenly spaced
    order statistics (the fastest and the slowest always among them): enough to draw the
    distribution and its tail, small enough for a JSON kept beside the figures."""
    ordered = sorted(seconds)
    n = len(ordered)
    if n > CDF_POINTS_MAX:
        ordered = [ordered[round(i * (n - 1) / (CDF_POINTS_MAX - 1))] for i in range(CDF_POINTS_MAX)]
    return [round(x * 1e6, 1) for x in ordered]


def paced_enqueue(client: Client, items: list[Item], rate_per_s: float,
                  time_cap_s: float) -> dict[str, Any]:
    """Figure L at ``rate_per_s``; stops early once ``time_cap_s`` has passed."""
    interval = 1.0 / rate_per_s
    calls: list[float] = []
    latencies: list[float] = []
    start = end = time.monotonic()
    for i, (body, key) in enumerate(items):
        due = start + i * interval
        ahead = due - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        called = time.monotonic()
        client.enqueue(body, key)
        end = time.monotonic()
        calls.append(end - called)
        latencies.append(end - due)
        if end - start > time_cap_s:
            break
    return {"offered_per_s": rate_per_s, "samples": len(calls),
            "achieved_per_s": len(calls) / (end - start) if end > start else 0.0,
            "call_ms": percentiles_ms(calls), "latency_ms": percentiles_ms(latencies),
            "latency_cdf_us": cdf_us(latencies)}


def wake_consumer(client: Client, conn) -> None:
    """Consumer of figure W: report (time it got the job, body) after each ack."""
    conn.send(("ready", None))
    while True:
        handle = client.dequeue(WAKE_WAIT_S)
        got_at = time.monotonic()
        if handle is None:
            continue
        body = client.body_of(handle)
        client.ack(handle)
        if body == STOP_BODY:
            return
        conn.send(("got", (got_at, body)))


def _consumer_process(spec: ClientSpec, conn) -> None:
    try:
        client = connect(spec)
        try:
            wake_consumer(client, conn)
        finally:
            client.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _consumer_thread(client: Client, conn) -> None:
    try:
        wake_consumer(client, conn)
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        conn.send(("error", f"{type(e).__name__}: {e}"))


def recv_from_consumer(conn, timeout_s: float) -> Any:
    """The next (status, value) a consumer process sent: its value, or the consumer's error raised."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the consumer sent nothing within {timeout_s} s")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(f"consumer failed: {value}")
    return value


def idle_cpu_percent(consumer_pid: int, server_pids: list[int], idle_s: float) -> dict:
    """CPU% (100 = one core) of the consumer and, summed, of the servers over ``idle_s``."""
    consumer = psutil.Process(consumer_pid)
    servers = [psutil.Process(pid) for pid in server_pids]
    for p in [consumer, *servers]:
        p.cpu_percent(None)
    time.sleep(idle_s)
    return {"consumer": consumer.cpu_percent(None),
            "server": sum(p.cpu_percent(None) for p in servers) if servers else None}


def wake_up(adapter: Adapter, items: list[Item], idle_s: float,
            timeout_s: float) -> dict[str, Any]:
    """Figure W: one sample per item."""
    spec = adapter.client_spec()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    if spec is not None:
        worker = ctx.Process(target=_consumer_process, args=(spec, child_conn), daemon=True)
        worker.start()
        consumer_pid = worker.pid
    else:
        worker = threading.Thread(target=_consumer_thread, args=(adapter, child_conn),
                                  daemon=True)
        worker.start()
        consumer_pid = os.getpid()
    try:
        recv_from_consumer(conn, timeout_s)  # ready
        time.sleep(SETTLE_S)
        cpu = idle_cpu_percent(consumer_pid, adapter.server_pids(), idle_s)
        waits, delivered = [], []
        for body, key in items:
            sent_at = time.monotonic()
            adapter.enqueue(body, key)
            got_at, got = recv_from_consumer(conn, timeout_s)
            waits.append(got_at - sent_at)
            delivered.append(got)
            time.sleep(GAP_S)
        adapter.enqueue(STOP_BODY, "stop")
        worker.join(timeout_s)
        while conn.poll(0):  # deliveries beyond one per job
            status, value = conn.recv()
            if status == "got":
                delivered.append(value[1])
    finally:
        if spec is not None and worker.is_alive():
            worker.kill()
            worker.join()
    delivery = check((body for body, _key in items), delivered)
    return {"mode": "process" if spec is not None else "thread", "samples": len(waits),
            "wake_ms": percentiles_ms(waits), "wake_cdf_us": cdf_us(waits), "idle_cpu_percent": cpu,
            "delivery": delivery.to_dict()}
