"""Where a lone call's and a wake-up's time goes, step by step (figures L and W).

    python -m bench.probes.tails [--calls 1000] [--samples 300] [--l-gap-ms 2] [--w-gap-ms 50] [--json PATH]
    python -m bench.probes.tails --quick            # 60 calls, 30 samples: checks that it runs

One shard (``shardq.open``'s service, figure L's and W's config), whose process is
:mod:`bench.probes.tails_shard`: the real shard, which notes when each step of each request
happens. This process and the consumer's note their own steps (the client's write of the
request, its read of the reply); every time is ``time.monotonic()``, the CLOCK_MONOTONIC
all processes share, so the steps of one call line up across the three processes.

* **L**: ``enqueue`` of one job (100-byte body, a key), ``--l-gap-ms`` after each reply (2 ms:
  figure L's 500/s; every call starts from idle). Split: the client up to its request's
  write; the write and the shard's wake-up (until its epoll reports it); read and decode;
  validation and the state; the loop until the log append; the append; the fdatasync;
  until the reply's write; the write and the client's wake-up (until it reads the reply);
  the client after it. Each write is noted just before it, on the writer's side.
* **W**: a consumer process waits in ``dequeue(wait=5)``; the producer enqueues one job, and
  ``--w-gap-ms`` after the consumer holds it (the ack untimed before the pause), the next.
  Split as L for the enqueue, then from the fdatasync to the lease's write to the consumer,
  its write and the consumer's wake-up, and the consumer until ``dequeue`` returns.
* **A** (first, untimed step by step): ``--calls`` enqueues back to back, for the CPU per call.

Per step: p50 and p99 in microseconds (each step's own percentiles: they do not add up to
the call's), each figure's five slowest samples step by step, and the threads each path
crosses (a hand-off from one thread to another is a wake-up, and a wait for the
interpreter's lock held by another, up to the 5 ms switch interval). Also the CPU per call of
A, L and W on both ends (each thread's schedstat; the client's calling thread), the shard
loop's iterations per call, and the shard's cyclic collections during the run. Exit status
0 when every job reached the consumer once; 1 otherwise. No timing is checked.
docs/performance.md, "Figures L and W: where a lone call's and a wake-up's time goes".
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

from .tails_shard import TRACE_ENV

QUEUE = "default"
CONFIG = {"queues": {QUEUE: {"visibility_timeout": 30}}}
BODY = b"x" * 100
WAIT_S = 5.0
RECV_TIMEOUT_S = 30.0


def trace_client(events: list[list[Any]]) -> None:
    """Note, in this process, when a request's frame is written and when a reply is read."""
    from shardq.client import connection
    from shardq.protocol import wire

    write, read = connection._write_frame, wire.read_frames
    clock, ident = time.monotonic, threading.get_ident

    def timed_write(fd: int, data: bytes) -> None:
        events.append(["sent", clock(), ident(), None])  # before the write: the shard may wake at once
        write(fd, data)

    def timed_read(fd: int, buf: bytearray, scratch: bytearray) -> Any:
        t = clock()
        out = read(fd, buf, scratch)
        if out:
            events.append(["got", t, ident(), None])
        return out
    connection._write_frame = timed_write
    wire.read_frames = timed_read


def _consumer(data_dir: str, pipe: Any) -> None:
    """Lease, then report (reply read, dequeue returned, threads) and ack, until ``stop``."""
    import shardq

    events: list[list[Any]] = []
    trace_client(events)
    try:
        with shardq.connect(data_dir) as q:
            pipe.send(("ready", None))
            while True:
                events.clear()
                lease = q.dequeue(QUEUE, wait=WAIT_S)
                done = time.monotonic()
                if lease is None:
                    continue
                got = [e for e in events if e[0] == "got"]
                pipe.send(("got", (got[-1][1] if got else None, done,
                                   got[-1][2] if got else None, threading.get_ident(), lease.body,
                                   time.thread_time())))
                q.ack(lease)
                if lease.body == b"stop":
                    return
    except BaseException as e:  # noqa: BLE001 - reported to the parent process through the pipe
        pipe.send(("error", f"{type(e).__name__}: {e}"))


def _recv(pipe: Any) -> Any:
    if not pipe.poll(RECV_TIMEOUT_S):
        raise TimeoutError("the consumer said nothing")
    kind, value = pipe.recv()
    if kind == "error":
        raise RuntimeError(value)
    return value


def pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    return {f"p{p}": round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e6, 1) for p in (50, 90, 99)}


def _in(evs: list[list[Any]], name: str, lo: float, hi: float) -> list[list[Any]]:
    return [e for e in evs if e[0] == name and lo <= e[1] <= hi]


def split(call: dict[str, Any], shard: list[list[Any]], fds: dict[str, int]) -> dict[str, Any] | None:
    """One call's steps from the events of the shard within its window (``t0`` to its
    reply's read), or None when the shard's events do not show one whole iteration."""
    lo, hi = call["sent"], call["got"]
    wakes = _in(shard, "wake", lo, hi)
    if not wakes:
        return None
    wake = wakes[0][1]
    end = hi if call.get("lease_got") is None else max(hi, call["lease_got"])
    window = [e for e in shard if wake <= e[1] <= end]
    window = window[:next((i for i, e in enumerate(window) if e[0] == "iter_end"), len(window))]  # one iteration
    first = {}
    for e in window:
        first.setdefault(e[0], e)
    sends = [e for e in window if e[0] == "send"]
    mine = [e for e in sends if e[3] == fds.get("producer")] or sends[:1]
    if not all(k in first for k in ("read_end", "exec", "exec_end", "write", "write_end", "sync",
                                    "sync_end")) or not mine:
        return None
    decode = first.get("decode")
    row = {
        "client to write": call["sent"] - call["t0"],
        "write + shard wake-up": wake - call["sent"],
        "read + decode": first["read_end"][1] - wake,
        "of which decode": decode[3] if decode else None,
        "validation + state": first["exec_end"][1] - first["exec"][1],
        "loop to the append": first["write"][1] - first["exec_end"][1],
        "log append": first["write_end"][1] - first["write"][1],
        "to the fdatasync": first["sync"][1] - first["write_end"][1],
        "fdatasync": first["sync_end"][1] - first["sync"][1],
        "to the reply's write": mine[0][1] - first["sync_end"][1],
        "write + client wake-up": call["got"] - mine[0][1],
        "client after it": call["done"] - call["got"],
        "call": call["done"] - call["t0"],
        "spun": wakes[0][3],
        "threads": {"read": first["read"][2], "write": first["write"][2], "sync": first["sync"][2],
                    "send": mine[0][2]},
    }
    if call.get("lease_got") is not None:
        others = [e for e in sends if e[3] != mine[0][3]]
        if others:
            row["fdatasync to the lease's write"] = others[0][1] - first["sync_end"][1]
            row["write + consumer wake-up"] = call["lease_got"] - others[0][1]
        row["consumer after it"] = call["lease_done"] - call["lease_got"]
        row["W: enqueue called to lease returned"] = call["lease_done"] - call["t0"]
        row["consumer hand-off"] = call["lease_thread"] != call["lease_caller"]
    return row


def summarize(rows: list[dict[str, Any]], main_thread: int) -> dict[str, Any]:
    keys = [k for k in rows[0] if k not in ("threads", "spun", "consumer hand-off")] if rows else []
    out: dict[str, Any] = {k: pct([r.get(k) for r in rows]) for k in keys}  # type: ignore[misc]
    on_loop = {step: sum(r["threads"][step] == main_thread for r in rows) for step in ("read", "write", "sync", "send")}
    out["steps on the loop thread (of samples)"] = on_loop
    out["shard thread hand-offs per call (mean)"] = round(sum(
        len({r["threads"][s] for s in ("read", "write", "sync", "send")}) - 1 for r in rows) / max(len(rows), 1), 2)
    out["wake-ups found by the busy poll"] = sum(r["spun"] for r in rows)
    if rows and "consumer hand-off" in rows[0]:
        out["consumer reads on another thread than its caller"] = sum(r["consumer hand-off"] for r in rows)
    out["samples"] = len(rows)
    return out


def run(calls: int, samples: int, l_gap_s: float, w_gap_s: float, directory: str) -> dict[str, Any]:
    import shardq
    from shardq.service.supervisor import Supervisor

    data = os.path.join(directory, "data")
    wrapper = os.path.join(directory, "shard-python")
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -m bench.probes.tails_shard \"$@\"\n")
    os.chmod(wrapper, stat.S_IRWXU)
    trace = os.path.join(directory, "trace")
    os.environ[TRACE_ENV] = trace
    try:
        sup = Supervisor(data, CONFIG, 1, python=wrapper).start(background=True)
    finally:
        del os.environ[TRACE_ENV]
    events: list[list[Any]] = []
    trace_client(events)
    l_calls: list[dict[str, Any]] = []
    w_calls: list[dict[str, Any]] = []
    once = False
    cpu: dict[str, Any] = {}
    try:
        q = shardq.connect(data)
        for i in range(50):  # warm up: connections, imports
            q.enqueue(BODY, key=f"w{i}", queue="warm")
        shard_proc = [psutil.Process(h.proc.pid) for h in sup.handles]
        cpu["A"] = _cpu_of(lambda: [q.enqueue(BODY, key=f"a{i % 1000}", queue="alone") for i in range(calls)],
                           shard_proc, calls)
        c0, s0 = time.thread_time(), _cpu_s(shard_proc)
        for i in range(calls):
            events.clear()
            t0 = time.monotonic()
            q.enqueue(BODY, key=f"k{i % 1000}", queue="alone")
            done = time.monotonic()
            l_calls.append(_client_call(events, t0, done))
            time.sleep(l_gap_s)
        cpu["L"] = {"client_us": round((time.thread_time() - c0) / calls * 1e6, 1),
                    "shard_us": round((_cpu_s(shard_proc) - s0) / calls * 1e6, 1)}
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        consumer = ctx.Process(target=_consumer, args=(data, theirs), daemon=True)
        consumer.start()
        bodies: list[bytes] = []
        consumer_cpus: list[float] = []
        try:
            _recv(ours)
            time.sleep(0.3)  # blocked in its dequeue
            c0, s0 = time.thread_time(), _cpu_s(shard_proc)
            for i in range(samples):
                body = b"w%d" % i
                events.clear()
                t0 = time.monotonic()
                q.enqueue(body, key=f"k{i % 1000}", queue=QUEUE)
                done = time.monotonic()
                lease_got, lease_done, lease_thread, lease_caller, seen, consumer_cpu = _recv(ours)
                consumer_cpus.append(consumer_cpu)
                bodies.append(seen)
                call = _client_call(events, t0, done)
                call.update(lease_got=lease_got, lease_done=lease_done, lease_thread=lease_thread,
                            lease_caller=lease_caller)
                w_calls.append(call)
                time.sleep(w_gap_s)
            cpu["W"] = {"producer_us": round((time.thread_time() - c0) / samples * 1e6, 1),
                        "shard_us": round((_cpu_s(shard_proc) - s0) / samples * 1e6, 1),
                        "consumer_us (lease + ack)": round(
                            (consumer_cpus[-1] - consumer_cpus[0]) / max(samples - 1, 1) * 1e6, 1)}
            q.enqueue(b"stop", key="stop", queue=QUEUE)
            _recv(ours)
            consumer.join(RECV_TIMEOUT_S)
        finally:
            if consumer.is_alive():
                consumer.kill()
                consumer.join()
        once = sorted(bodies) == sorted(b"w%d" % i for i in range(samples))
        q.close()
    finally:
        sup.stop()
    with open(f"{trace}.shard0") as f:
        got = json.load(f)
    shard, main_thread = got["events"], got["main_thread"]
    served_from = next(e[1] for e in shard if e[0] == "iter")  # not the start's own collect
    gcs = [e[3] for e in shard if e[0] == "gc" and e[1] >= served_from]
    result: dict[str, Any] = {
        "calls": calls, "samples": samples, "l_gap_ms": l_gap_s * 1e3, "w_gap_ms": w_gap_s * 1e3,
        "exactly_once": once, "cpu_per_call": cpu, "_shard_events": shard, "_w_calls": w_calls,
        "gc": {"collections by generation": {g: sum(1 for x in gcs if x[0] == g) for g in (0, 1, 2)},
               "longest collection, s": max((x[1] for x in gcs), default=0.0),
               "all collections, s": sum(x[1] for x in gcs)},
    }
    # the producer's connection: the one that every reply of figure L (no other client) went to
    l_sends = [e[3] for c in l_calls if c["sent"] and c["got"] for e in _in(shard, "send", c["sent"], c["got"])]
    fds = {"producer": max(set(l_sends), key=l_sends.count)} if l_sends else {}
    for name, calls_ in (("L", l_calls), ("W", w_calls)):
        result[name] = _figure(name, calls_, shard, fds, main_thread)
    return result


def _figure(name: str, calls: list[dict[str, Any]], shard: list[list[Any]], fds: dict[str, int],
            main_thread: int) -> dict[str, Any]:
    """One figure's steps (:func:`summarize`), its five slowest samples step by step, and the
    shard loop's iterations and CPU (its thread's, polls included) per call."""
    rows = [r for r in (split(c, shard, fds) for c in calls if c["sent"] and c["got"]) if r]
    out = summarize(rows, main_thread)
    whole = "call" if name == "L" else "W: enqueue called to lease returned"
    out["slowest samples, us"] = [{k: round(v * 1e6, 1) for k, v in r.items() if isinstance(v, float)}
                                  for r in sorted(rows, key=lambda r: r[whole])[-5:]]
    if len(calls) > 1:
        lo, hi, n = calls[0]["t0"], calls[-1]["t0"], len(calls) - 1
        its = [e for e in shard if e[0] in ("iter", "iter_end") and lo <= e[1] < hi]
        cpu = sum(b[3] - a[3] for a, b in zip(its, its[1:]) if a[0] == "iter" and b[0] == "iter_end")
        out["shard loop thread CPU per call, us"] = round(cpu / n * 1e6, 1)
        out["shard iterations per call"] = round(sum(1 for e in its if e[0] == "iter") / n, 2)
    return out


def _cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds of every thread of ``procs``, from schedstat (nanoseconds; /proc's user
    and system times count 10 ms ticks)."""
    total = 0
    for proc in procs:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except FileNotFoundError:
                pass  # a thread that ended takes its time with it
    return total / 1e9


def _cpu_of(work: Any, shard: list[psutil.Process], calls: int) -> dict[str, float]:
    """CPU microseconds per call of this thread and of the shard while ``work()`` runs."""
    c0, s0, w0 = time.thread_time(), _cpu_s(shard), time.monotonic()
    work()
    return {"wall_us": round((time.monotonic() - w0) / calls * 1e6, 1),
            "client_us": round((time.thread_time() - c0) / calls * 1e6, 1),
            "shard_us": round((_cpu_s(shard) - s0) / calls * 1e6, 1)}


def _client_call(events: list[list[Any]], t0: float, done: float) -> dict[str, Any]:
    sent = next((e[1] for e in events if e[0] == "sent"), None)
    got = next((e[1] for e in events if e[0] == "got"), None)
    return {"t0": t0, "sent": sent, "got": got, "done": done}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.tails", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="figure L's calls (default 1,000)")
    p.add_argument("--samples", type=int, default=300, help="figure W's samples (default 300)")
    p.add_argument("--l-gap-ms", type=float, default=2.0)
    p.add_argument("--w-gap-ms", type=float, default=50.0)
    p.add_argument("--dir", default=None, help="where the data dir goes (default: the system's temporary directory)")
    p.add_argument("--quick", action="store_true", help="60 calls and 30 samples")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.calls, a.samples = 60, 30
    tmp = tempfile.mkdtemp(prefix="sq-tails-", dir=a.dir)
    try:
        res = run(a.calls, a.samples, a.l_gap_ms / 1e3, a.w_gap_ms / 1e3, tmp)
        del res["_shard_events"], res["_w_calls"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for fig in ("L", "W"):
        r = res[fig]
        print(f"figure {fig}: {r['samples']} calls; microseconds")
        print(f"  {'':38s} {'p50':>8s} {'p90':>8s} {'p99':>8s}")
        for k, v in r.items():
            if isinstance(v, dict) and "p50" in v:
                print(f"  {k:38s} " + " ".join(f"{v[q]:8.1f}" for q in ("p50", "p90", "p99")))
        for k, v in r.items():
            if not (isinstance(v, dict) and "p50" in v) and k not in ("samples", "slowest samples, us"):
                print(f"  {k}: {v}")
    print(f"CPU per call, microseconds (A: back to back; L, W as above): {res['cpu_per_call']}")
    print(f"shard GC during the run: {res['gc']}")
    print(f"every job reached the consumer once: {res['exactly_once']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, **res}, f, indent=1)
    return 0 if res["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
