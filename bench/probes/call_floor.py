"""What one durable call costs with the least Python can do, next to figure A's peers.

    python -m bench.probes.call_floor [--calls 3000] [--runs 3] [--peers shardq,beanstalkd] [--dir DIR]
                               [--op enqueue|lease-ack] [--cpus any|same|apart] [--gap-ms G]
                               [--json PATH]
    python -m bench.probes.call_floor --quick --peers shardq   # 300 calls, 1 run: checks that it runs

The floor is two processes and no framework: a client that packs a request with msgpack,
writes it with its length, and reads the reply; a server that waits in epoll, reads the
request, decodes it, writes it to a log file reserved up front (``posix_fallocate``, as
shardq's segments), fdatasyncs, and writes the reply. That is
what any design with a Python client and a Python server pays per call on this machine:
two context switches, the syscalls, two msgpack round trips and the fsync. Figure A's
single enqueue on bench.run's peers (their adapters and durable settings: shardq with 2
shards, beanstalkd ``-f 0``, ...) is measured in the same run, interleaved with the floor
(the order reversed every other run) on the same directory, so all meet the same disk and
the same load. What shardq spends above the floor is what its client and shard add
(validation, routing, futures, the state machine, the log format, replies ordered after
the fsync); docs/performance.md, "What a single call costs above the floor".

``--op lease-ack`` times figure C's call instead: a lease and its ack (the jobs enqueued
before the measurement). The floor's server then writes the lease to its log without an
fsync, as shardq's default ``lease_sync = "batched"`` does, and fsyncs the ack.

Reported per call: wall microseconds, and the CPU microseconds of the client and of the
servers (every process the peer runs; none for an in-process peer; the servers' from each
thread's schedstat, in nanoseconds, where /proc's user and system times count 10 ms ticks);
for the servers also that CPU split into user and system time in the proportion of those
ticks, and how often their threads blocked (voluntary
context switches of every thread: waits in epoll, in fdatasync, on a lock). ``--dir /dev/shm``
takes the fsync out of the picture. ``--cpus same`` pins the client and the servers to one
CPU, ``--cpus apart`` to two: the difference from the default shows what waking a process
on another CPU costs on this machine (docs/performance.md, "Where a single call's time
goes"). ``--gap-ms G`` pauses G milliseconds after each call, so every call starts from
an idle machine as in figures W and L@500 (the pause is not timed; CPU still is, and an
idle process uses none). Reported beside the mean: the median call (``us_p50``). Linux
only. Exit status 0 when every floor reply
matched its request and every peer call returned; 1 otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
from typing import NamedTuple

import msgpack
import psutil

from ..peers import PEERS, SkipPeer

BODY = b"x" * 100
_LEN = struct.Struct("!i")
WARM_UP_CALLS = 50    # before the measured calls, for the floor and every peer alike
LOG_BYTES = 64 << 20  # the floor's log, reserved up front (3,000 calls take about 0.4 MiB)


def _serve(sock: socket.socket, log_path: str) -> None:
    """The floor's server: one request at a time, logged and fdatasynced before its reply."""
    fd = sock.fileno()
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.posix_fallocate(log, 0, LOG_BYTES)  # as shardq's segments: no file size to journal per fsync
    os.fsync(log)
    end = 0
    scratch = bytearray(1 << 16)
    while True:
        ep.poll()
        # One read is one whole request: the client sends one ~150-byte frame and waits for
        # its reply, and a unix socket delivers a write that small in one piece.
        n = os.readv(fd, (scratch,))
        if not n:
            return
        requests = msgpack.unpackb(scratch[_LEN.size:n])
        record = msgpack.packb(requests)
        end += os.pwrite(log, record, end)
        if any(op != "lease" for _rid, op, _args in requests):
            os.fdatasync(log)  # a lease is written, not synced: shardq's batched lease
        reply = msgpack.packb([[rid, 0, [[rid, rid, BODY]] if op == "lease" else [rid]]
                               for rid, op, _args in requests])
        os.write(fd, _LEN.pack(len(reply)) + reply)


_ALL_CPUS = os.sched_getaffinity(0)  # where this process was allowed to run when it started
#: ``--cpus``: where the client and the servers may run (Linux CPU affinity; None = anywhere)
PLACEMENTS = {"any": None, "same": ({0}, {0}), "apart": ({0}, {1})}


def place(how: str, server_pids: list[int]) -> None:
    """Pin this process (the client) and ``server_pids`` as ``PLACEMENTS[how]`` says; with
    "any", let them run on every CPU again."""
    cpus = PLACEMENTS[how]
    client, server = cpus if cpus else (_ALL_CPUS, _ALL_CPUS)
    os.sched_setaffinity(0, client)
    for pid in server_pids:
        os.sched_setaffinity(pid, server)


def timed_calls(call, calls: int, gap_s: float) -> tuple[int, list[float]]:
    """Run ``call(i)`` for i in range(calls), pausing ``gap_s`` after each; the number that
    returned True and each call's seconds (the pauses left out)."""
    clock, pause = time.perf_counter, time.sleep
    ok, took = 0, []
    for i in range(calls):
        t = clock()
        ok += bool(call(i))
        took.append(clock() - t)
        if gap_s:
            pause(gap_s)
    return ok, took


class Usage(NamedTuple):
    """What ``server_usage`` reads from the servers' threads at one moment."""

    run_s: float     # seconds on a CPU, from each thread's schedstat (nanoseconds)
    user_s: float    # user and system seconds as /proc's stat counts them: in whole clock
    system_s: float  # ticks (10 ms), used only for how run_s splits
    blocks: int      # voluntary context switches


def server_usage(procs: list[psutil.Process]) -> Usage:
    """The CPU time and voluntary context switches of ``procs``, summed over every thread
    (psutil's switch count is the main thread's only). The CPU time is each thread's
    schedstat, in nanoseconds: /proc's user and system times count whole 10 ms ticks, and
    a server that spends 30 µs on each of 300 calls (the floor's, in ``--quick``) can see no
    tick at all. A thread that ends between two reads takes its time with it."""
    run = 0.0
    user = system = 0.0
    blocks = 0
    for proc in procs:
        t = proc.cpu_times()
        user += t.user
        system += t.system
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    run += int(f.read().split()[0]) / 1e9
                with open(f"/proc/{proc.pid}/task/{tid}/status") as f:
                    blocks += next(int(line.split()[1]) for line in f
                                   if line.startswith("voluntary_ctxt_switches"))
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended meanwhile
    return Usage(run, user, system, blocks)


def cpu_split(before: Usage, after: Usage) -> tuple[float, float]:
    """The servers' CPU seconds between two reads, split into user and system time in the
    proportion of the ticks counted meanwhile, as the kernel splits a process's precise run
    time; with no tick in between, in the proportion of all the ticks so far; with none at
    all, all user time (the kernel's rule)."""
    run = max(after.run_s - before.run_s, 0.0)
    user, system = after.user_s - before.user_s, after.system_s - before.system_s
    if user + system <= 0:
        user, system = after.user_s, after.system_s
    share = user / (user + system) if user + system > 0 else 1.0
    return run * share, run - run * share


def _result(calls: int, ok: bool, took: list[float], client_s: float, before: Usage, after: Usage) -> dict:
    user, system = cpu_split(before, after)
    return {"calls": calls, "ok": ok, "us_per_call": sum(took) / calls * 1e6,
            "us_p50": statistics.median(took) * 1e6,
            "client_cpu_us": client_s / calls * 1e6, "server_cpu_us": (user + system) / calls * 1e6,
            "server_user_us": user / calls * 1e6, "server_sys_us": system / calls * 1e6,
            "server_blocks": (after.blocks - before.blocks) / calls}


#: ``--op``: what one timed call is
OPS = ("enqueue", "lease-ack")


def floor_run(calls: int, directory: str, cpus: str = "any", gap_s: float = 0.0,
              op: str = "enqueue") -> dict:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the server
        ours.close()
        try:
            _serve(theirs, os.path.join(directory, "floor.log"))
        finally:
            os._exit(0)
    theirs.close()
    server = psutil.Process(pid)
    place(cpus, [pid])
    fd = ours.fileno()
    scratch = bytearray(1 << 16)

    def request(rid: int, name: str, args: list) -> list:
        data = msgpack.packb([[rid, name, args]])
        os.write(fd, _LEN.pack(len(data)) + data)
        n = os.readv(fd, (scratch,))
        return msgpack.unpackb(scratch[_LEN.size:n])[0]

    def enqueue(i: int) -> bool:
        return request(i, "enqueue", [[[BODY, f"k{i % 1000}", "default", 0, 0, None]], None])[0] == i

    def lease_ack(i: int) -> bool:
        job_id, token, body = request(i, "lease", ["default", 1, None])[2][0]
        return body == BODY and request(i, "ack", [[[job_id, token]], None])[0] == i

    call = lease_ack if op == "lease-ack" else enqueue

    for i in range(WARM_UP_CALLS):
        call(-1 - i)
    s0 = server_usage([server])
    c0 = time.process_time()
    matched, took = timed_calls(call, calls, gap_s)
    client = time.process_time() - c0
    s1 = server_usage([server])
    ours.close()
    os.waitpid(pid, 0)
    return _result(calls, matched == calls, took, client, s0, s1)


def _fill(adapter, items: list) -> None:
    """Enqueue ``items`` before the measurement, in batches where the peer has them."""
    if adapter.batch_mode:
        for start in range(0, len(items), 100):
            adapter.enqueue_many(items[start:start + 100])
    else:
        for body, key in items:
            adapter.enqueue(body, key)


def peer_run(name: str, calls: int, directory: str, cpus: str = "any", gap_s: float = 0.0,
             shardq_shards: int | None = None, op: str = "enqueue",
             shardq_busy_poll_us: int | None = None) -> dict:
    """Figure A's single enqueue, or figure C's lease and ack of one job (``op``), on one of
    bench.run's peers (its adapter, its settings; ``shardq_shards`` and
    ``shardq_busy_poll_us`` replace the shardq adapter's number of shards and the busy-poll
    budget of its router and shards). For "lease-ack" the jobs are enqueued before the
    measurement; a call is one ``dequeue`` and one ``ack``, and returns True when it leased
    a job with the body sent."""
    if name == "shardq" and (shardq_shards or shardq_busy_poll_us is not None):
        adapter = PEERS[name](shards=shardq_shards, busy_poll_us=shardq_busy_poll_us)
    else:
        adapter = PEERS[name]()
    adapter.setup(directory)  # SkipPeer when it cannot run here
    try:
        servers = [psutil.Process(pid) for pid in adapter.server_pids()]
        place(cpus, adapter.server_pids())
        if op == "lease-ack":
            _fill(adapter, [(BODY, f"k{i % 1000}") for i in range(WARM_UP_CALLS + calls)])

            def call(i: int) -> bool:
                handle = adapter.dequeue(1.0)
                if handle is None:
                    return False
                ok = adapter.body_of(handle) == BODY
                adapter.ack(handle)
                return ok
        else:
            def call(i: int) -> bool:
                adapter.enqueue(BODY, f"k{i % 1000}")
                return True
        for i in range(WARM_UP_CALLS):  # connect and warm up outside the measurement
            call(-1 - i)
        s0 = server_usage(servers)
        c0 = time.process_time()
        done, took = timed_calls(call, calls, gap_s)
        client = time.process_time() - c0
        s1 = server_usage(servers)
    finally:
        adapter.teardown()
    return {**_result(calls, done == calls, took, client, s0, s1), "servers": len(servers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.call_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the logs go (default: the system's temporary "
                                                "directory, as bench.run); keep it short, shardq's "
                                                "sockets live under it")
    p.add_argument("--peers", default="shardq,beanstalkd",
                   help="bench.run's peers measured beside the floor (default: shardq,beanstalkd)")
    p.add_argument("--cpus", choices=sorted(PLACEMENTS), default="any",
                   help="any: where the scheduler puts them (default); same: the client and the "
                        "servers pinned to CPU 0; apart: the client on CPU 0, the servers on CPU 1")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="pause this long after each call, so each starts from idle (default 0)")
    p.add_argument("--shardq-shards", type=int, default=None,
                   help="shards of the shardq peer (default: bench.run's adapter's)")
    p.add_argument("--op", choices=OPS, default="enqueue",
                   help="enqueue: figure A's call (default); lease-ack: figure C's lease and ack "
                        "of one job, the jobs enqueued first (the floor's lease is written, not "
                        "fsynced, as shardq's batched lease; its ack is fsynced)")
    p.add_argument("--shardq-busy-poll-us", type=int, default=None,
                   help="busy_poll_us of the shardq router and shards (default: theirs; 0: off)")
    p.add_argument("--quick", action="store_true", help="300 calls, 1 run")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.shardq_shards is not None and not 1 <= a.shardq_shards <= 64:
        p.error(f"--shardq-shards {a.shardq_shards} is outside 1..64")
    if not 0 <= a.gap_ms <= 1000:
        p.error(f"--gap-ms {a.gap_ms} is outside 0..1000")
    needed = set().union(*PLACEMENTS[a.cpus]) if PLACEMENTS[a.cpus] else set()
    if not needed <= _ALL_CPUS:
        p.error(f"--cpus {a.cpus} needs CPUs {sorted(needed)}; this process may use {sorted(_ALL_CPUS)}")
    if a.quick:
        a.calls, a.runs = 300, 1
    parent = a.dir or tempfile.gettempdir()
    names = ["floor"] + [n for n in a.peers.split(",") if n]
    results: dict[str, list[dict]] = {n: [] for n in names}
    skipped: dict[str, str] = {}
    for r in range(a.runs):
        order = names if r % 2 == 0 else names[::-1]  # ABBA: drift cancels
        for name in order:
            if name in skipped:
                continue
            tmp = tempfile.mkdtemp(prefix="sq-floor-", dir=parent)
            try:
                res = (floor_run(a.calls, tmp, a.cpus, a.gap_ms / 1e3, a.op) if name == "floor"
                       else peer_run(name, a.calls, tmp, a.cpus, a.gap_ms / 1e3, a.shardq_shards, a.op,
                                     a.shardq_busy_poll_us))
            except SkipPeer as e:
                skipped[name] = str(e)
                print(f"{name}: skipped: {e}", flush=True)
                continue
            finally:
                place("any", [])  # the next run starts unpinned
                shutil.rmtree(tmp, ignore_errors=True)
            results[name].append(res)
            print(f"run {r + 1}/{a.runs} {name:6s}: {res['us_per_call']:7.0f} us/call "
                  f"(median {res['us_p50']:.0f}), CPU client "
                  f"{res['client_cpu_us']:.0f} us, server {res['server_cpu_us']:.0f} us "
                  f"({res['server_user_us']:.0f} user, {res['server_sys_us']:.0f} system), "
                  f"server blocks {res['server_blocks']:.2f}", flush=True)
    keys = ("us_per_call", "us_p50", "client_cpu_us", "server_cpu_us", "server_user_us", "server_sys_us",
            "server_blocks")
    med = {name: {k: statistics.median(x[k] for x in rows) for k in keys}
           for name, rows in results.items() if rows}
    print(f"medians of {a.runs}, {a.calls} calls ({a.op}), logs in {parent}, CPUs: {a.cpus}, "
          f"gap: {a.gap_ms:g} ms (server blocks: voluntary context switches per call):")
    print(f"{'':8s} {'us/call':>8s} {'median':>7s} {'client CPU':>11s} {'server CPU':>11s} "
          f"{'user':>6s} {'system':>7s} {'blocks':>7s}")
    for name, m in med.items():
        print(f"{name:8s} {m['us_per_call']:8.0f} {m['us_p50']:7.0f} {m['client_cpu_us']:11.0f} "
              f"{m['server_cpu_us']:11.0f} {m['server_user_us']:6.0f} {m['server_sys_us']:7.0f} "
              f"{m['server_blocks']:7.2f}")
    floor_us = med["floor"]["us_per_call"]
    for name, m in med.items():
        if name != "floor":
            print(f"{name} above the floor: {m['us_per_call'] - floor_us:.0f} us per call "
                  f"(calls/s: {name} / floor = {floor_us / m['us_per_call']:.2f})")
    ok = all(x["ok"] for rows in results.values() for x in rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "calls": a.calls, "op": a.op,
                       "cpus": a.cpus,
                       "gap_ms": a.gap_ms, "shardq_shards": a.shardq_shards,
                       "shardq_busy_poll_us": a.shardq_busy_poll_us,
                       "runs": results,
                       "medians": med, "skipped": skipped, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
