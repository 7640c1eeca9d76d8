"""The machine's limits, measured in the same run as the queues, for scale.

* ``fsync_per_s``: write 100 bytes and ``os.fsync`` the file, in a loop, in the data tmp dir.
  A queue that fsyncs once per job before replying cannot enqueue faster from one producer.
* ``pipe_rtt_per_s``: ``multiprocessing.Pipe`` ping-pong of 100-byte messages with a child
  process (send_bytes / recv_bytes). One request and one reply per call, nothing else.
* ``pipe_pipelined_msgs_per_s``: the same, sending a window of 100 messages before reading
  the 100 echoes.
* ``pipe_batched_jobs_per_s``: 100 jobs of 100 bytes, msgpack-packed into one message; the
  child unpacks them and answers with 100 packed ids. Counted in jobs.

:func:`fsync_plus_rtt_per_s` combines the first two: the bound of figure A's target.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgpack

from .jobs import BATCH_JOBS, BODY_BYTES, make_items

WINDOW_MSGS = 100
_STOP = b""


def fsync_rate(tmpdir: str, duration_s: float) -> float:
    path = os.path.join(tmpdir, "fsync-probe")
    data = b"x" * BODY_BYTES
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        count = 0
        start = time.monotonic()
        end = start + duration_s
        while True:
            os.write(fd, data)
            os.fsync(fd)
            count += 1
            now = time.monotonic()
            if now >= end:
                return count / (now - start)
    finally:
        os.close(fd)
        os.unlink(path)


def _echo(conn) -> None:
    """Child: echo every message; a batch message gets one packed list of ids back."""
    while True:
        msg = conn.recv_bytes()
        if msg == _STOP:
            return
        if msg[:1] == b"B":
            jobs = msgpack.unpackb(msg[1:])
            conn.send_bytes(msgpack.packb(list(range(len(jobs)))))
        else:
            conn.send_bytes(msg)


def _timed(duration_s: float, step) -> float:
    """Call ``step()`` (which returns how many units it did) for ``duration_s``; units/s."""
    count = 0
    start = time.monotonic()
    end = start + duration_s
    while True:
        count += step()
        now = time.monotonic()
        if now >= end:
            return count / (now - start)


def pipe_rates(duration_s: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    msg = b"m" * BODY_BYTES
    jobs = [[key, body] for body, key in make_items("phys", BATCH_JOBS)]

    def ping() -> int:
        parent.send_bytes(msg)
        parent.recv_bytes()
        return 1

    def window() -> int:
        for _ in range(WINDOW_MSGS):
            parent.send_bytes(msg)
        for _ in range(WINDOW_MSGS):
            parent.recv_bytes()
        return WINDOW_MSGS

    def batched() -> int:  # packs every time, as a client would
        parent.send_bytes(b"B" + msgpack.packb(jobs))
        return len(msgpack.unpackb(parent.recv_bytes()))

    try:
        ping()  # the child is up
        return {
            "pipe_rtt_per_s": _timed(duration_s, ping),
            "pipe_pipelined_msgs_per_s": _timed(duration_s, window),
            "pipe_batched_jobs_per_s": _timed(duration_s, batched),
        }
    finally:
        parent.send_bytes(_STOP)
        proc.join(5)
        parent.close()


def fsync_plus_rtt_per_s(limits: dict[str, float]) -> float | None:
    """Calls/s of a call that costs one fsync plus one pipe round trip and nothing else: what
    one synchronous producer could reach if the queue added no work of its own."""
    if not limits.get("fsync_per_s") or not limits.get("pipe_rtt_per_s"):
        return None
    return 1.0 / (1.0 / limits["fsync_per_s"] + 1.0 / limits["pipe_rtt_per_s"])


def measure(tmpdir: str, duration_s: float) -> dict[str, float]:
    return {"fsync_per_s": fsync_rate(tmpdir, duration_s), **pipe_rates(duration_s)}
