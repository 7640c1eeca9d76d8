"""The SQS listener's own work a request, counted: Python function calls and the CPU of its
loop's thread per SendMessage, ReceiveMessage of 10 and DeleteMessageBatch of 10 (issue 46).

    python -m bench.probes.sqs_listener_path [--requests 300] [--top 0] [--json PATH]

A real ``shardq serve`` (``--shards 2``, as ``bench.sqs_api`` starts it) holds the shards; the
listener measured runs in this process (:class:`shardq.sqs_api.server.SqsService` on its own
loop's thread, over the same data dir, busy-polling off so that the counts do not depend on
timing), answering raw JSON 1.0 requests sent one at a time from the main thread over a
keep-alive connection (``bench.sqs_api``'s client). Each action runs twice: once timed
(``time.thread_time`` of the loop's thread: the listener's CPU, HTTP and send syscalls
included), once under ``cProfile`` on that thread alone, whose call count (every Python
function and builtin called, ``total_calls``) does not depend on the machine, nor does the
count of the event loop's turns a request (``_run_once``). ``--top N`` prints the N functions
called most a request of each action. A third run of lone SendMessages times the loop
thread's two stretches of each: request read -> shard write, shard reply read -> response
write (p50 and p99; ``recv`` and ``send`` noted as they return).

Counts are per request, averaged over ``--requests``; receives and deletes each take
``--requests`` batches of 10 messages, sent before them (``SendMessageBatch``, not counted).
No figure is checked: it is a probe, for pairs of trees (old and new, on the same machine). Exit
status 1 if a receive got less than 10 messages or a delete failed (then the usual path was not
what ran)."""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import statistics
import sys
import threading
import time
from typing import Any

from shardq.config import SqsApiConfig
from shardq.sqs_api.server import SqsService

from .. import sqs_api as bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(path: str, line: int, name: str) -> str:
    """``shardq/sqs_api/messages.py:250:_receive`` (a repository's file), else the file's name."""
    where = os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path.rsplit("/", 1)[-1]
    return f"{where}:{line}:{name}"


def _on_loop(sqs: SqsService, fn: Any) -> Any:
    """``fn()``'s value, called on the listener's loop thread."""
    async def run() -> Any:
        return fn()
    assert sqs.loop_thread is not None
    return sqs.loop_thread.call(run(), 30)


def _measure(sqs: SqsService, requests: list[tuple[str, bytes]], client: Any, profile: bool,
             top: int) -> dict[str, Any]:
    prof = cProfile.Profile() if profile else None
    cpu0 = _on_loop(sqs, time.thread_time)
    if prof is not None:
        _on_loop(sqs, prof.enable)
    for action, body in requests:
        client.call(action, body)
    if prof is not None:
        _on_loop(sqs, prof.disable)
    cpu = _on_loop(sqs, time.thread_time) - cpu0
    out: dict[str, Any] = {"cpu_us": round(cpu * 1e6 / len(requests), 1)}
    if prof is not None:
        st = pstats.Stats(prof)
        out["calls"] = round(st.total_calls / len(requests), 1)  # type: ignore[attr-defined]
        turns = sum(v[1] for (f, _, name), v in st.stats.items()  # type: ignore[attr-defined]
                    if name == "_run_once" and f.endswith("base_events.py"))
        out["loop_turns"] = round(turns / len(requests), 2)  # the event loop's iterations
        if top:
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][1])[:top]  # type: ignore[attr-defined]
            out["top"] = [(_where(f, line, name), round(v[1] / len(requests), 2)) for (f, line, name), v in rows]
    return out


def _segments(sqs: SqsService, requests: list[tuple[str, bytes]], client: Any) -> dict[str, float]:
    """p50 and p99 of the loop thread's two stretches of a lone request, in microseconds:
    from the request's read (``recv`` on a TCP socket) to the first write to a shard (``send``
    on a unix socket), and from the shard's reply's read to the response's write. The
    sockets' ``recv`` and ``send`` are wrapped to note the time, on the loop's thread only."""
    loop_thread = sqs.loop_thread._thread.ident  # type: ignore[union-attr]
    events: list[tuple[int, str]] = []
    recv, send = socket.socket.recv, socket.socket.send

    def noting(op: str, fn: Any) -> Any:
        def wrapped(sock: socket.socket, *a: Any) -> Any:
            out = fn(sock, *a)
            if threading.get_ident() == loop_thread:
                events.append((time.perf_counter_ns(), op + ("u" if sock.family == socket.AF_UNIX else "t")))
            return out
        return wrapped
    socket.socket.recv, socket.socket.send = noting("r", recv), noting("s", send)  # type: ignore[method-assign]
    try:
        for action, body in requests:
            client.call(action, body)
    finally:
        socket.socket.recv, socket.socket.send = recv, send  # type: ignore[method-assign]
    to_shard, to_client = [], []
    read_at = None
    for at, op in events:
        if op in ("rt", "ru"):
            read_at = at
        elif read_at is not None:
            (to_shard if op == "su" else to_client).append((at - read_at) / 1000)
            read_at = None

    def pct(xs: list[float], q: int) -> float:
        return round(statistics.quantiles(xs, n=100)[q - 1], 1) if len(xs) > 1 else 0.0
    return {"to_shard_p50_us": pct(to_shard, 50), "to_shard_p99_us": pct(to_shard, 99),
            "to_client_p50_us": pct(to_client, 50), "to_client_p99_us": pct(to_client, 99)}


class _Keeping:
    """A client that keeps each receive's receipt handles, for the deletes after."""

    def __init__(self, c: Any):
        self.c = c
        self.handles: list[list[str]] = []

    def call(self, action: str, body: bytes) -> dict:
        got: dict = self.c.call(action, body)
        self.handles.append([m["ReceiptHandle"] for m in got.get("Messages", [])])
        return got


class _Deleting:
    """A client that counts the entries its delete batches did not delete."""

    def __init__(self, c: Any):
        self.c = c
        self.failed = 0

    def call(self, action: str, body: bytes) -> dict:
        got: dict = self.c.call(action, body)
        self.failed += len(got.get("Failed", []))
        return got


def run(n: int, top: int) -> dict[str, Any]:
    svc = bench.ShardqService(2)
    sqs = SqsService(svc.data_dir, SqsApiConfig(listen="127.0.0.1:0"), busy_poll_us=0).start()
    try:
        url = sqs.url.rstrip("/")
        qurl = bench._queue_url(url)
        c = bench.SqsClient(url)
        results: dict[str, Any] = {}
        ok = True
        for profile in (False, True):
            sends = [("SendMessage", json.dumps({"QueueUrl": qurl, "MessageBody": b}).encode())
                     for b in bench._bodies(n, f"lone{profile}")]
            results.setdefault("SendMessage", {}).update(_measure(sqs, sends, c, profile, top))
            if not profile:
                sends = [("SendMessage", json.dumps({"QueueUrl": qurl, "MessageBody": b}).encode())
                         for b in bench._bodies(n, "stretches")]
                results["SendMessage"].update(_segments(sqs, sends, c))
            bodies = bench._bodies(n * bench.BATCH, f"batch{profile}")
            for lo in range(0, len(bodies), bench.BATCH):
                c.call("SendMessageBatch", json.dumps({"QueueUrl": qurl, "Entries": [
                    {"Id": str(i), "MessageBody": b} for i, b in enumerate(bodies[lo:lo + bench.BATCH])]}).encode())
            receive = json.dumps({"QueueUrl": qurl, "MaxNumberOfMessages": bench.BATCH, "WaitTimeSeconds": 0}).encode()
            keeping = _Keeping(c)
            results.setdefault("ReceiveMessage", {}).update(
                _measure(sqs, [("ReceiveMessage", receive)] * n, keeping, profile, top))
            handles = keeping.handles
            deletes = [("DeleteMessageBatch", json.dumps({"QueueUrl": qurl, "Entries": [
                {"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(batch)]}).encode())
                for batch in handles if batch]
            deleting = _Deleting(c)
            results.setdefault("DeleteMessageBatch", {}).update(_measure(sqs, deletes, deleting, profile, top))
            # every receive got a full batch and every handle deleted its message: the path measured is the usual one
            ok = ok and all(len(b) == bench.BATCH for b in handles) and len(deletes) == n and not deleting.failed
        c.close()
        return {"requests": n, "ok": ok, "actions": results}
    finally:
        sqs.stop()
        svc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.sqs_listener_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = run(a.requests, a.top)
    for action, r in res["actions"].items():
        print(f"{action:<20} calls {r['calls']:>8.1f}  loop turns {r['loop_turns']:>5.2f}  "
              f"listener CPU {r['cpu_us']:>7.1f} us a request")
        if "to_shard_p50_us" in r:
            print(f"    request read -> shard write p50/p99 {r['to_shard_p50_us']}/{r['to_shard_p99_us']} us, "
                  f"reply read -> response write {r['to_client_p50_us']}/{r['to_client_p99_us']} us")
        for name, count in r.get("top", []):
            print(f"    {count:>7.2f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
