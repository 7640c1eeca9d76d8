"""What the shard's own Python costs per request, without the scheduler in the way.

    python -m bench.probes.shard_path [--calls 2000] [--repeats 15] [--dir DIR] [--json PATH]
    python -m bench.probes.shard_path --quick            # 200 calls, 3 repeats: checks that it runs

One process drives the real shard loop (``ShardServer.iterate`` with its committer, its
log in ``--dir``, its reply writes) through a socketpair, one request at a time: write a
request frame, run one iteration, read the reply. No process sleeps or wakes, so what is
left is the CPU a lone request costs in the loop, hot in the caches. Two shapes:

* ``enqueue``: one job (100-byte body, a key) with a router session, as figure A sends it;
* ``batch``: 100 such jobs in one request with a session, as figure B's ``enqueue_many`` sends
  them (microseconds and bytecodes per request: divide by 100 for a job's);
* ``lease+ack``: a ``dequeue`` of one job then its ``ack`` (figure C), default
  ``lease_sync = "batched"``;
* ``wake``: figure W's iteration: a second client waits in ``dequeue_wait``, and one job's
  enqueue is served with the waiter's lease in its iteration (only that iteration is timed
  and traced; the waiter's ack and its next ``dequeue_wait`` come before each call, untimed).

Reported per request shape: microseconds per call (the minimum over ``--repeats`` rounds of
``--calls`` calls: the least disturbed round of this machine), and the Python bytecodes
executed per call, in total and for the functions that execute most (``sys.settrace``
opcode events, so exact and independent of the machine's load).

The same work costs two to four times as much between two real processes, because each
wake-up finds the caches cold: docs/performance.md, "Where a single call's time goes".
Exit status 0 when every reply was OK; 1 otherwise. No timing is ever checked.
"""
from __future__ import annotations

import argparse
import collections
import io
import json
import os
import select
import shutil
import socket
import struct
import sys
import tempfile
import time

import msgpack

from shardq.config import parse as parse_config
from shardq.shard.committer import Committer
from shardq.shard.conn import FrameConn
from shardq.shard.durable import DurableShard
from shardq.shard.process import ShardServer, tune_gc, untune_gc
from shardq.shard.report import ReportingFiles, SupervisorPipe

BODY = b"x" * 100
WAKE_QUEUE = "woken"  # shape "wake": empty until each call's enqueue
CLIENT_ID = 77
BATCH = 100  # shape "batch": figure B's request
_LEN = struct.Struct("!i")
TOP_FUNCTIONS = 12


class Loop:
    """A shard server and a client end of a socketpair, in this process and thread."""

    def __init__(self, directory: str, preload: int, service: dict | None = None):
        config = parse_config({"queues": {"default": {"visibility_timeout": 30}}, "service": service or {}})
        pipe = SupervisorPipe(io.StringIO(), interval_s=3600)
        self.shard = DurableShard(os.path.join(directory, "shard-0"), 0, config, files=ReportingFiles(pipe))
        self.shard.open()
        tune_gc()
        self.server = srv = ShardServer(self.shard, os.path.join(directory, "unused.sock"), b"unused")
        srv.committer = Committer(self.shard.log, 4)
        state = self.shard.state
        for start in range(0, preload, 5000):  # jobs for lease+ack, durable before the loop runs
            state.enqueue_many([[BODY, f"p{i}", "default", 0, 0, None]
                                for i in range(start, min(start + 5000, preload))], time.time())
            self.shard.commit()
        srv.committer.durable_seq = state.next_seq - 1
        srv._poller.register(srv._wake_r, select.EPOLLIN)
        ours, theirs = socket.socketpair()
        self._sock = ours
        self.fd = ours.fileno()
        conn = FrameConn(theirs.detach())
        srv.conns.add(conn)
        srv._by_fd[conn.fd] = conn
        srv._poller.register(conn.fd, select.EPOLLIN)
        waiter, theirs = socket.socketpair()  # the consumer of shape "wake"
        self._waiter = waiter
        conn = FrameConn(theirs.detach())
        srv.conns.add(conn)
        srv._by_fd[conn.fd] = conn
        srv._poller.register(conn.fd, select.EPOLLIN)
        self.rid = 0
        self.failures = 0
        self._held: list | None = None  # the waiter's lease, acked before its next wait
        self._batch_items = [[BODY, f"k{i % 1000}", "default", 0, 0, None] for i in range(BATCH)]

    def call(self, op: str, args: list):
        self.rid += 1
        req = msgpack.packb([[self.rid, op, args]])
        os.write(self.fd, _LEN.pack(len(req)) + req)
        self.server.iterate()
        data = os.read(self.fd, 1 << 16)
        ((rid, status, result),) = msgpack.unpackb(data[_LEN.size:], raw=False)
        if rid != self.rid or status != 0:
            self.failures += 1
        return result

    def enqueue(self, queue: str = "default") -> None:
        self.call("enqueue", [[[BODY, f"k{self.rid % 1000}", queue, 0, 0, None]],
                              [CLIENT_ID, self.rid + 1, self.rid + 1]])

    def batch(self) -> None:
        self.call("enqueue", [self._batch_items, [CLIENT_ID, self.rid + 1, self.rid + 1]])

    def lease_ack(self) -> None:
        lease = self.call("dequeue", ["default", None, 1])
        if lease:
            self.call("ack", [[[lease[0][0], lease[0][4]]]])
        else:
            self.failures += 1

    def _waiter_call(self, op: str, args: list) -> None:
        self.rid += 1
        req = msgpack.packb([[self.rid, op, args]])
        self._waiter.send(_LEN.pack(len(req)) + req)

    def park(self) -> None:
        """The waiter acks what it holds and waits again (untimed: before each "wake")."""
        if self._held is not None:
            self._waiter_call("ack", [[self._held]])
            self.server.iterate()
            self._reply(self._waiter)
        self._waiter_call("dequeue_wait", [WAKE_QUEUE, None, 1, 5.0])
        self.server.iterate()

    def wake(self) -> None:
        """An enqueue whose iteration leases the job to the parked waiter."""
        self.enqueue(WAKE_QUEUE)
        lease = self._reply(self._waiter)
        if lease:
            self._held = [lease[0][0], lease[0][4]]
        else:
            self.failures += 1
            self._held = None

    def _reply(self, sock: socket.socket):
        data = sock.recv(1 << 16)
        ((rid, status, result),) = msgpack.unpackb(data[_LEN.size:], raw=False)
        if status != 0:
            self.failures += 1
        return result

    def close(self) -> None:
        self.server.committer.stop()
        self.server._poller.close()
        self._sock.close()
        self._waiter.close()
        self.shard.close()
        untune_gc()


def _nothing() -> None:
    pass


def _timed(fn, calls: int, repeats: int, setup=_nothing) -> float:
    best = float("inf")
    clock = time.perf_counter
    for _ in range(repeats):
        took = 0.0
        for _ in range(calls):
            setup()
            t0 = clock()
            fn()
            took += clock() - t0
        best = min(best, took)
    return best / calls * 1e6


def _bytecodes(fn, calls: int, setup=_nothing) -> tuple[float, list]:
    """Bytecodes executed per call of ``fn``, in total and per function (most first)."""
    counts: collections.Counter = collections.Counter()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # the repo

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        code = frame.f_code
        where = (code.co_filename.replace(root, ""), code.co_name)

        def opcode(frame, event, arg):
            if event == "opcode":
                counts[where] += 1
            return opcode
        return opcode

    for _ in range(calls):
        setup()
        sys.settrace(tracer)
        try:
            fn()
        finally:
            sys.settrace(None)
    this = os.path.relpath(__file__, root)
    counts = collections.Counter({k: v for k, v in counts.items() if k[0] != this})  # not the driver
    top = [[f"{path}:{name}", n / calls] for (path, name), n in counts.most_common(TOP_FUNCTIONS)]
    return sum(counts.values()) / calls, top


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.shard_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dir", default=None, help="where the log goes (default: the system's temporary directory)")
    p.add_argument("--quick", action="store_true", help="200 calls, 3 repeats")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.calls, a.repeats = 200, 3
    warm = 200
    traced = min(a.calls, 200)
    tmp = tempfile.mkdtemp(prefix="sq-path-", dir=a.dir)
    results, failures = {}, 0
    try:
        preload = warm + a.calls * a.repeats + traced
        loop = Loop(tmp, preload)
        try:
            for name, fn, setup in (("enqueue", loop.enqueue, _nothing), ("lease+ack", loop.lease_ack, _nothing),
                                    ("wake", loop.wake, loop.park), ("batch", loop.batch, _nothing)):
                calls = a.calls if name != "batch" else max(1, a.calls // 10)  # its jobs pile up
                for _ in range(warm if name != "batch" else 20):
                    setup()
                    fn()
                us = _timed(fn, calls, a.repeats, setup)
                per_call, top = _bytecodes(fn, min(calls, traced), setup)
                results[name] = {"calls": calls, "us_per_call": us, "bytecodes_per_call": per_call, "top": top}
        finally:
            failures = loop.failures
            loop.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in results.items():
        print(f"{name:10s} {r['us_per_call']:7.1f} us per call (best of {a.repeats} x {r['calls']}), "
              f"{r['bytecodes_per_call']:6.0f} bytecodes per call")
        for where, n in r["top"]:
            print(f"    {n:7.1f}  {where}")
    ok = failures == 0
    if not ok:
        print(f"{failures} replies were not OK")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "calls": a.calls,
                       "repeats": a.repeats, "dir": a.dir, "results": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
