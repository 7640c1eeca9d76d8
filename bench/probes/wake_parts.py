"""Where figure W's wake-up goes in shardq: the enqueue, the watch, the lease after it.

    python -m bench.probes.wake_parts [--samples 300] [--gap-ms 10] [--shards 2] [--json PATH]
    python -m bench.probes.wake_parts --quick          # 30 samples: checks that it runs
    python -m bench.probes.wake_parts --client aio     # the consumer uses the asyncio client

Figure W's setting (bench.run's shardq adapter and its shards; a consumer process blocked
in ``dequeue(wait=5)``; one job enqueued at ``t0``, then the ack and a pause, so every sample
starts from idle), with three times per sample, each from ``t0`` on the one
CLOCK_MONOTONIC every process shares:

* ``enqueue``: the producer's ``enqueue`` returned (the job is durable: fsynced);
* ``woke``: the consumer's router was told by a shard's ``watch`` that work is ready (the
  shard answers a watch as soon as the job is applied, before its fsync). Only where the
  wait goes through a watch: a queue with priorities, or shardq before its waiting
  dequeue (which the shard answers with the lease itself);
* ``got``: the consumer's ``dequeue`` returned the lease (figure W's sample).

Also timed, half before the consumer starts and half after it stopped: the same enqueue
with no consumer waiting (``enqueue alone``), to show what the consumer's wake-up, which
runs while the producer's call waits for its fsync, costs that call.

A shard hands out a job only once its enqueue is durable, so W is at least the enqueue
alone; ``got - enqueue alone`` is what the watch design adds around it (the consumer's
early wake-up slowing the producer's call, then the ``dequeue`` after the watch).
docs/performance.md, "Figures W and L@500". Exit status 0 when every job reached the
consumer exactly once; 1 otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time

from ..latency import recv_from_consumer
from ..peers.shardq_peer import QUEUE, ShardqAdapter

WAIT_S = 5.0        # the consumer's dequeue wait; a sample never comes near it
RECV_TIMEOUT_S = 30.0
ALONE_QUEUE = "wake-parts-alone"  # enqueues timed with no consumer waiting


def _time_the_watch(woke: list[float]) -> None:
    """Note in ``woke`` when a ``watch`` answers: the client engine's one watch, which both
    clients run (this process only)."""
    from shardq.client import engine

    watch = engine._watch

    def timed_watch(c, queue, timeout):
        shard = yield from watch(c, queue, timeout)
        woke.append(time.monotonic())
        return shard

    engine._watch = timed_watch


def _consumer(data_dir: str, conn) -> None:
    """Lease, ack and report (woke, got, body) for each job until the ``stop`` job."""
    import shardq

    woke: list[float] = []
    _time_the_watch(woke)
    try:
        with shardq.connect(data_dir) as q:
            conn.send(("ready", None))
            while True:
                woke.clear()
                lease = q.dequeue(QUEUE, wait=WAIT_S)
                got = time.monotonic()
                if lease is None:
                    continue
                q.ack(lease)
                if lease.body == b"stop":
                    return
                conn.send(("got", (woke[-1] if woke else None, got, lease.body)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _aio_consumer(data_dir: str, conn) -> None:
    """As :func:`_consumer`, with the asyncio client (``await q.dequeue(wait=...)``)."""
    import asyncio

    import shardq

    woke: list[float] = []
    _time_the_watch(woke)

    async def main():
        async with await shardq.aio.connect(data_dir) as q:
            conn.send(("ready", None))
            while True:
                woke.clear()
                lease = await q.dequeue(QUEUE, wait=WAIT_S)
                got = time.monotonic()
                if lease is None:
                    continue
                await q.ack(lease)
                if lease.body == b"stop":
                    return
                conn.send(("got", (woke[-1] if woke else None, got, lease.body)))
    try:
        asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        conn.send(("error", f"{type(e).__name__}: {e}"))


CONSUMERS = {"router": _consumer, "aio": _aio_consumer}


def percentiles_ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {f"p{p}": xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e3 for p in (50, 90, 99)}


def enqueue_alone(router, n: int, gap_s: float, tag: str) -> list[float]:
    """Seconds of ``n`` enqueues with ``gap_s`` after each, while no consumer waits (to
    another queue, so that the consumer started later does not take them)."""
    took = []
    for i in range(n):
        t0 = time.monotonic()
        router.enqueue(b"x", key=f"{tag}{i % 1000}", queue=ALONE_QUEUE)
        took.append(time.monotonic() - t0)
        time.sleep(gap_s)
    return took


def run(samples: int, gap_s: float, shards: int, directory: str, client: str = "router") -> dict:
    adapter = ShardqAdapter(shards=shards)
    adapter.setup(directory)
    alone = enqueue_alone(adapter.client._q, samples // 2, gap_s, "before")
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    consumer = ctx.Process(target=CONSUMERS[client], args=(adapter._data_dir, theirs), daemon=True)
    consumer.start()
    rows, bodies = [], []
    try:
        recv_from_consumer(ours, RECV_TIMEOUT_S)  # ready
        time.sleep(0.3)  # the consumer is blocked in its watch
        for i in range(samples):
            body = f"w{i}".encode()
            t0 = time.monotonic()
            adapter.enqueue(body, f"k{i % 1000}")
            enqueued = time.monotonic()
            woke, got, seen = recv_from_consumer(ours, RECV_TIMEOUT_S)
            bodies.append(seen)
            rows.append({"enqueue": enqueued - t0, "woke": None if woke is None else woke - t0,
                         "got": got - t0})
            time.sleep(gap_s)
        adapter.enqueue(b"stop", "stop")
        consumer.join(RECV_TIMEOUT_S)
        if not consumer.is_alive():
            alone += enqueue_alone(adapter.client._q, samples - samples // 2, gap_s, "after")
    finally:
        if consumer.is_alive():
            consumer.kill()
            consumer.join()
        adapter.teardown()
    once = sorted(bodies) == sorted(f"w{i}".encode() for i in range(samples))
    parts = {name: percentiles_ms([r[name] for r in rows if r[name] is not None])
             for name in ("enqueue", "woke", "got")}
    parts["got - enqueue"] = percentiles_ms([r["got"] - r["enqueue"] for r in rows])
    parts["enqueue alone"] = percentiles_ms(alone)
    return {"samples": samples, "gap_ms": gap_s * 1e3, "shards": shards, "client": client, "exactly_once": once,
            "woke_seen": sum(r["woke"] is not None for r in rows), "alone_samples": len(alone),
            "ms": parts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.wake_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=10.0, help="pause after each sample (default 10, as W)")
    p.add_argument("--shards", type=int, default=None, help="default: bench.run's shardq adapter's")
    p.add_argument("--dir", default=None, help="where the data dir goes (default: the system's temporary directory)")
    p.add_argument("--quick", action="store_true", help="30 samples")
    p.add_argument("--client", choices=sorted(CONSUMERS), default="router",
                   help="the consumer's client: the router (default) or the asyncio client")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.samples = 30
    tmp = tempfile.mkdtemp(prefix="sq-wake-", dir=a.dir)
    try:
        shards = a.shards if a.shards is not None else ShardqAdapter().shards
        res = run(a.samples, a.gap_ms / 1e3, shards, tmp, a.client)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{a.samples} samples, {res['shards']} shards, {a.gap_ms:g} ms apart, consumer on the "
          f"{a.client} client; ms from t0 (enqueue called):")
    print(f"{'':14s} {'p50':>7s} {'p90':>7s} {'p99':>7s}")
    for name, pct in res["ms"].items():
        print(f"{name:14s} " + " ".join(f"{pct.get(k, float('nan')):7.3f}" for k in ("p50", "p90", "p99")))
    print(f"every job reached the consumer once: {res['exactly_once']}; "
          f"samples woken by a watch: {res['woke_seen']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, **res}, f, indent=1)
    return 0 if res["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
