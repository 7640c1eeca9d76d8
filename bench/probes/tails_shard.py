"""A shard process that notes when each step of each request happens (bench.probes.tails).

The supervisor runs it in place of ``python -m shardq.shard.process`` (its ``python``, a
one-line script that starts this module with the same arguments). It wraps, in this
process only, the points a request passes on its way through the shard, notes
``time.monotonic()`` (CLOCK_MONOTONIC, the clock every process shares) and the thread at
each, runs the shard's own ``main``, and on its way out writes what it noted to the file
named by :data:`TRACE_ENV` as JSON. Nothing of shardq is changed on disk.

Events, each ``[name, t, thread, extra]``:

* ``iter`` / ``iter_end``: ``ShardServer.iterate`` begins / returns (each ``_end`` event's
  extra: the thread's CPU seconds so far; ``iter``'s too);
* ``wake``: the loop's epoll reported a descriptor ready (extra: 1 if found by the busy
  poll, 0 after a sleep);
* ``read`` / ``read_end``: ``ShardServer._read`` (the read syscall and the decode);
* ``decode``: ``wire.decode_requests`` took extra seconds;
* ``exec`` / ``exec_end``: ``ShardServer._execute`` (validation and the state; extra: the op);
* ``submit`` / ``submit_end``: ``Committer.submit`` (extra: inline asked);
* ``write`` / ``write_end``: ``Files.write`` (the log append's write syscall, whichever path
  of the committer makes it: a lone commit writes and syncs in one call of the log, and in
  one ``Files.write_sync``, which this process makes as a ``write`` and a ``datasync``);
* ``sync`` / ``sync_end``: ``Files.datasync`` (the fdatasync);
* ``send``: one reply frame is about to be written to a client (extra: its descriptor);
* ``gc``: a cyclic collection ended (extra: [generation, seconds, objects collected]).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Any

TRACE_ENV = "SHARDQ_TAILS_TRACE"
EVENTS_MAX = 2_000_000   # a run of a few thousand calls notes some tens of thousands


def install(events: list[list[Any]]) -> None:
    """Wrap the shard's steps so that each notes an event in ``events``."""
    from shardq.protocol import wire
    from shardq.shard import committer as committer_mod
    from shardq.shard import conn as conn_mod
    from shardq.shard import process
    from shardq.wal import fileio

    clock, ident, note = time.monotonic, threading.get_ident, events.append

    def around(cls: Any, name: str, event: str, extra: Any = None) -> None:
        inner = getattr(cls, name)

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if len(events) < EVENTS_MAX:
                note([event, clock(), ident(), extra(args, kwargs) if extra else None])
            try:
                return inner(self, *args, **kwargs)
            finally:
                if len(events) < EVENTS_MAX:
                    note([event + "_end", clock(), ident(), time.thread_time()])
        setattr(cls, name, wrapped)

    around(process.ShardServer, "iterate", "iter", lambda a, k: time.thread_time())
    around(process.ShardServer, "_read", "read")
    around(process.ShardServer, "_execute", "exec", lambda a, k: a[2])
    around(committer_mod.Committer, "submit", "submit", lambda a, k: bool(k.get("inline")))
    around(fileio.Files, "write", "write")
    around(fileio.Files, "datasync", "sync")
    # A synced commit's one call (write_sync) made as its two, so each is noted apart.
    fileio.Files.write_sync = fileio.Files._write_then_datasync  # type: ignore[method-assign]

    decode = wire.decode_requests

    def timed_decode(data: Any) -> Any:
        t = clock()
        out = decode(data)
        note(["decode", t, ident(), clock() - t])
        return out
    wire.decode_requests = timed_decode

    send = conn_mod.FrameConn.send

    def timed_send(self: Any, frame: bytes) -> Any:
        note(["send", clock(), ident(), self.fd])  # before the write: the client may read at once
        return send(self, frame)
    conn_mod.FrameConn.send = timed_send  # type: ignore[method-assign]

    init = process.ShardServer.__init__

    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._poller = _NotingPoller(self._poller, events)
    process.ShardServer.__init__ = traced_init  # type: ignore[method-assign]

    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[info["generation"]] = clock()
        else:
            t0 = started.pop(info["generation"], clock())
            note(["gc", clock(), ident(), [info["generation"], clock() - t0, info["collected"]]])
    gc.callbacks.append(on_gc)


class _NotingPoller:
    """An epoll that notes when a wait reports something (the loop's wake-up)."""

    def __init__(self, inner: Any, events: list[list[Any]]):
        self._inner, self._events = inner, events

    def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        ready = self._inner.poll(timeout, maxevents)
        if ready:
            self._events.append(["wake", time.monotonic(), threading.get_ident(), int(timeout == 0)])
        return ready

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def main() -> int:
    argv = sys.argv[1:]
    if argv[:2] == ["-m", "shardq.shard.process"]:
        argv = argv[2:]
    events: list[list[Any]] = []
    install(events)
    from shardq.shard import process
    code = process.main(argv)
    path = os.environ.get(TRACE_ENV)
    if path:
        index = argv[argv.index("--index") + 1] if "--index" in argv else "0"
        with open(f"{path}.shard{index}", "w") as f:
            json.dump({"main_thread": threading.main_thread().ident, "events": events}, f)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
