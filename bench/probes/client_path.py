"""What the threaded client's own Python costs on the lone paths, counted, not timed.

    python -m bench.probes.client_path [--calls 200] [--busy-poll-us 0] [--json PATH]
    python -m bench.probes.client_path --quick            # 20 calls: checks that it runs

One shard (``shardq.open``), one router, one calling thread; per call of each shape, the
Python calls (``sys.setprofile`` "call" events in the calling thread: a generator resumed
counts as a call) and the bytecodes (``sys.settrace`` opcode events, as
:mod:`bench.probes.shard_path` counts the shard's) the client executes, in three parts:
up to its request's write, from the write to the read of its reply (the last read, for a
call that makes several requests), and after that read until the call returns. Counts do
not depend on the machine's load; ``--busy-poll-us 0`` (the default here) keeps the lone
call from polling for its reply, whose poll count depends on timing.

* ``enqueue``: one job (100-byte body, a key): figure L's call, the producer's part of W;
* ``dequeue_wait``: ``dequeue(wait=5)`` after a lease (a lease round, then the waiting
  dequeue), answered by a job another client enqueues 3 ms later: the consumer's part of W;
* ``ack``: the ack of one of those leases.

Exit status 0 when every wait got its job; 1 otherwise. docs/performance.md, "Figures L and W".
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import shardq
from shardq.client import connection
from shardq.client.router import Router
from shardq.protocol import wire

BODY = b"x" * 100
PRODUCER_DELAY_S = 0.003
PARTS = ("to the write", "to the reply", "after it")


class Counts:
    """Calls and bytecodes of one call, by part (:data:`PARTS`)."""

    def __init__(self) -> None:
        self.write, self.read = connection._write_frame.__code__, wire.read_frames.__code__
        self.reset()

    def reset(self) -> None:
        self.part = 0
        self.calls = [0, 0, 0]
        self.ops = [0, 0, 0]

    def _enter(self, code: Any, counts: list[int]) -> None:
        if code is self.write and self.part == 0:
            self.part = 1
        elif code is self.read:  # a later read: what came after the earlier one was still before the reply
            counts[1] += counts[2]
            counts[2] = 0
            self.part = 2

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self._enter(frame.f_code, self.calls)
            self.calls[self.part] += 1

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        self._enter(frame.f_code, self.ops)

        def opcode(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                self.ops[self.part] += 1
            return opcode
        return opcode


def measure(fn: Callable[[], object], calls: int, setup: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """``fn`` ``calls`` times under the profiler, then ``calls`` times traced."""
    c = Counts()
    calls_sum, ops_sum = [0, 0, 0], [0, 0, 0]
    for hook, sums in ((sys.setprofile, calls_sum), (sys.settrace, ops_sum)):
        for _ in range(calls):
            setup()
            c.reset()
            hook(c.profile if hook is sys.setprofile else c.trace)
            try:
                fn()
            finally:
                hook(None)
            got = c.calls if hook is sys.setprofile else c.ops
            for i in range(3):
                sums[i] += got[i]
    return {"calls": sum(calls_sum) / calls, "calls_by_part": [n / calls for n in calls_sum],
            "bytecodes": sum(ops_sum) / calls, "bytecodes_by_part": [n / calls for n in ops_sum]}


def run(data_dir: str, calls: int, busy_poll_us: int) -> tuple[dict[str, Any], bool]:
    results: dict[str, Any] = {}
    with shardq.open(data_dir, shards=1, busy_poll_us=busy_poll_us) as q, Router(data_dir) as producer:
        def produce_soon() -> None:
            def later() -> None:
                time.sleep(PRODUCER_DELAY_S)  # the consumer is waiting by then (a pause, not synchronisation)
                producer.enqueue(BODY)
            threading.Thread(target=later).start()

        for _ in range(20):  # warm: connections, the queue's config, the consumer's last lease
            q.enqueue(BODY, key="k")
            if (lease := q.dequeue(wait=1)) is not None:
                q.ack(lease)
        results["enqueue"] = measure(lambda: q.enqueue(BODY, key="k"), calls)
        while (lease := q.dequeue()) is not None:
            q.ack(lease)
        leases: list[Any] = []
        results["dequeue_wait"] = measure(lambda: leases.append(q.dequeue(wait=5)), calls, produce_soon)
        ok = all(lease is not None for lease in leases)
        held = iter([lease for lease in leases if lease is not None])  # one each for the profiled and traced acks
        if ok:
            results["ack"] = measure(lambda: q.ack(next(held)), calls)
    return results, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.client_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--busy-poll-us", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 calls")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    calls = 20 if a.quick else a.calls
    tmp = tempfile.mkdtemp(prefix="sq-client-path-")
    try:
        results, ok = run(tmp, calls, a.busy_poll_us)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in results.items():
        parts = " / ".join(f"{n:.1f}" for n in r["calls_by_part"])
        ops = " / ".join(f"{n:.0f}" for n in r["bytecodes_by_part"])
        print(f"{name:13s} {r['calls']:6.1f} calls ({parts}), {r['bytecodes']:6.0f} bytecodes ({ops})")
    print("parts: " + " / ".join(PARTS))
    if not ok:
        print("a wait got no job")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "calls": calls,
                       "busy_poll_us": a.busy_poll_us, "results": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
