"""The supervisor hears every line a shard writes (issue 30, part 4): lines that reach the
pipe together are each acted on, so a healthy shard is never killed as hung and a shard
that is ready is never waited for.

``SHARDQ_SOAK_S`` sets how long the real service is loaded (default 4 s, sixteen pings of
each shard at health_timeout = 1, as CI runs it: the stand-in tests are the ones that always
catch the lost line; the issue's figure is 30 s: ``SHARDQ_SOAK_S=30``).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import sys
import threading
import time

import pytest

from support.service import Service, alive, short_tmpdir, wait_until
from shardq.service.lines import LineSplitter
from shardq.service.supervisor import Supervisor
from shardq.shard.report import LINE_BYTES_MAX, fitted

SOAK_S = float(os.environ.get("SHARDQ_SOAK_S", "4"))


# ---------------------------------------------------------------------- splitting
@pytest.mark.parametrize("chunks, lines", [
    ([b"progress compact 9\npong\n"], [b"progress compact 9", b"pong"]),
    ([b"progress replay 3\nready 1 3 0.1 0\n"], [b"progress replay 3", b"ready 1 3 0.1 0"]),
    ([b"po", b"ng\n"], [b"pong"]),
    ([b"pong\npro", b"gress disk 1\n", b"\n"], [b"pong", b"progress disk 1", b""]),
    ([b"pong"], []),                                     # unfinished: held, not returned
    ([b"", b"a\n\nb\n"], [b"a", b"", b"b"]),
])
def test_every_complete_line_is_returned_in_order_however_the_bytes_arrive(chunks, lines):
    s = LineSplitter()
    got = []
    for c in chunks:
        got += s.feed(c)
    assert got == lines and s.dropped == 0


@pytest.mark.parametrize("chunks", [
    [b"x" * 11 + b"\npong\n"],                     # too long, whole in one read
    [b"x" * 6, b"x" * 5, b"x" * 7, b"\npong\n"],    # grows past the limit across reads
    [b"x" * 11, b"\npong\n"],                       # over it before its newline arrives
])
def test_a_line_over_the_limit_is_dropped_and_counted_and_the_next_one_is_read(chunks):
    s = LineSplitter(max_bytes=10)
    got = []
    for c in chunks:
        got += s.feed(c)
        assert s.unfinished() <= 10  # never more than the limit held
    assert got == [None, b"pong"] and s.dropped == 1


def test_a_line_at_the_limit_is_kept():
    s = LineSplitter(max_bytes=10)
    assert s.feed(b"x" * 9) == [] and s.feed(b"x\n") == [b"x" * 10] and s.dropped == 0


def test_the_longest_report_a_shard_writes_fits_the_limit():
    """The writer side of the contract: a corrupt/failed line with a huge reason is cut."""
    reason = "é\x00\"" * LINE_BYTES_MAX  # escapes make its JSON several times longer
    line = fitted("corrupt", {"path": "/p" * 2048, "offset": 2**63}, "reason", reason)
    assert len(line.encode()) <= LINE_BYTES_MAX
    word, _, rest = line.partition(" ")
    body = json.loads(rest)
    assert word == "corrupt" and body["offset"] == 2**63 and body["reason"].endswith(" [cut]")
    assert fitted("failed", {"kind": "disk_full", "path": None}, "detail", "no space") == \
        'failed {"kind": "disk_full", "path": null, "detail": "no space"}'


# ---------------------------------------------------------------------- stand-in shards
# A stand-in for `python -m shardq.shard.process`: it writes its report lines two at a
# time, in one write() each, and records every ping it answers (with its pid) in a file.
STAND_IN = r'''
import os, sys
mode, answered = sys.argv[1], sys.argv[2]
out = sys.stdout.fileno()
if mode == "joined-start":
    os.write(out, b"progress replay 10\nready %d 10 0.01 0\n" % os.getpid())
elif mode == "noisy":  # a line over the limit, then one that does not parse, then ready
    os.write(out, b"progress replay " + b"9" * 70000 + b"\ncorrupt {not json\n")
    os.write(out, b"ready %d 0 0.0 0\n" % os.getpid())
elif mode == "silent":  # replays for ever, saying nothing
    pass
else:
    os.write(out, b"ready %d 0 0.0 0\n" % os.getpid())
n = 0
while os.read(0, 1):  # a ping; EOF: the supervisor is gone
    n += 1
    os.write(out, b"progress compact %d\npong\n" % n)
    with open(answered, "a") as f:
        f.write(f"{os.getpid()}\n")
'''


@pytest.fixture
def stand_in():
    """``make(mode) -> (python, answered_path)``: an executable to pass as the supervisor's
    ``python``, which runs the stand-in whatever arguments it is given."""
    tmp = short_tmpdir()
    script = os.path.join(tmp, "stand_in.py")
    with open(script, "w") as f:
        f.write(STAND_IN)

    def make(mode: str):
        answered = os.path.join(tmp, f"{mode}.answered")
        python = os.path.join(tmp, f"python-{mode}")
        with open(python, "w") as f:
            f.write(f'#!/bin/sh\nexec {sys.executable} {script} {mode} {answered} "$@"\n')
        os.chmod(python, os.stat(python).st_mode | stat.S_IXUSR)
        return python, answered

    yield make
    shutil.rmtree(tmp, ignore_errors=True)


def answered_by(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(pid) for pid in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("background", [True, False], ids=["embedded", "foreground"])
def test_a_shard_writing_progress_and_pong_in_one_write_is_never_killed(stand_in, background):
    python, answered = stand_in("joined-pong")
    data = os.path.join(short_tmpdir(), "data")
    sup = Supervisor(data, {"service": {"health_timeout": 1}}, 1, python=python)
    pids = []
    try:
        sup.start(background=background, start_timeout=20)
        h = sup.handles[0]
        pids.append(h.proc.pid)

        def twelve_pings_or_a_kill():  # 3 s of pings every 0.25 s; a missed pong kills in 1 s
            if not background:
                sup._poll_once(0.05)
            return h.restarts or h.hung or len(answered_by(answered)) >= 12
        wait_until(twelve_pings_or_a_kill, 30, what="12 pings answered")
        assert h.restarts == 0 and h.hung is None, sup.process_stats(0)
        assert set(answered_by(answered)) == {pids[0]} and h.proc.pid == pids[0]
        assert h.status == "ready" and h.busy is None  # the pong after the progress line was seen
    finally:
        pids += [h.proc.pid for h in sup.handles if h.proc]
        sup.stop()
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("background", [True, False], ids=["embedded", "foreground"])
def test_a_shard_writing_replay_progress_and_ready_in_one_write_starts_at_once(stand_in, background):
    python, _ = stand_in("joined-start")
    data = os.path.join(short_tmpdir(), "data")
    sup = Supervisor(data, {"service": {"health_timeout": 1}}, 2, python=python)
    pids = []
    began = time.monotonic()
    try:
        sup.start(background=background, start_timeout=10)  # unheard, "ready" waits this twice
        took = time.monotonic() - began
        assert [h.status for h in sup.handles] == ["ready", "ready"]
        assert [h.ready_info["records"] for h in sup.handles] == [10, 10]
        assert all(h.restarts == 0 for h in sup.handles)
        assert took < 8, f"start() took {took:.1f} s"  # a stand-in starts in well under 1 s
    finally:
        pids += [h.proc.pid for h in sup.handles if h.proc]
        sup.stop()
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    assert not any(alive(p) for p in pids)


# ---------------------------------------------------------------------- a real service
def test_compacting_shards_under_load_are_never_restarted():
    """health_timeout = 1 (a ping every 0.25 s) and a short compaction every few dozen
    jobs (a small live state, the smallest compact_min_bytes): a ping that waits for a
    compaction is answered with a pong right after its progress line, often in the same
    read of the pipe. A buffered readline() lost such a pong and the shard was SIGKILLed as
    hung; that takes a race, so on a quiet host this test can pass without the fix: the
    stand-in tests above are the ones that always catch it."""
    cfg = {"service": {"health_timeout": 1},
           "limits": {"segment_bytes": 64 * 1024, "compact_min_bytes": 4096}}
    body = os.urandom(8192)
    stop = threading.Event()
    errors: list[BaseException] = []

    def load(svc, queue):
        try:
            with svc.connect(retry_s=5) as q:
                backlog = 0
                while not stop.is_set():
                    q.enqueue_many([{"body": body, "queue": queue}] * 32)
                    # Keep a few dozen jobs live: each compaction has a checkpoint to write,
                    # small enough that it is soon due again.
                    leases = q.dequeue_many(queue, max_jobs=64 if backlog > 30 else 16)
                    q.ack_many(leases)
                    backlog += 32 - len(leases)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            stop.set()

    with Service(shards=2, config=cfg) as svc:
        threads = [threading.Thread(target=load, args=(svc, f"q{i}")) for i in range(2)]
        for t in threads:
            t.start()
        try:
            stop.wait(SOAK_S)  # the load's duration; a failed call ends it early
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not errors, errors
        with svc.connect() as q:
            shards = q.stats()["shards"]
        assert [s["restarts"] for s in shards] == [0, 0], [(s["restarts"], s["last_exit"]) for s in shards]
        compactions = sum(s["compactions"] for s in shards)
        assert compactions >= SOAK_S / 2, f"only {compactions} compactions: the load did not exercise them"
        with open(svc.log_path, "rb") as f:
            log = f.read().decode(errors="replace")
        assert "event=shard-hung" not in log and "event=shard-exit" not in log, log[-3000:]


def test_a_line_too_long_or_malformed_is_logged_and_the_shard_still_starts(stand_in, monkeypatch):
    from shardq.service import supervisor
    python, _ = stand_in("noisy")
    data = os.path.join(short_tmpdir(), "data")
    sup = Supervisor(data, {"service": {"health_timeout": 1}}, 1, python=python)
    events: list[tuple[str, int, dict]] = []
    real_event = supervisor._event

    def event(name, level=logging.INFO, **fields):
        # Recorded here, not from a log handler: what the supervisor logs is the claim.
        events.append((name, level, fields))
        real_event(name, level, **fields)
    monkeypatch.setattr(supervisor, "_event", event)
    pids = []
    try:
        sup.start(background=True, start_timeout=10)
        h = sup.handles[0]
        pids.append(h.proc.pid)
        assert h.status == "ready" and sup._thread.is_alive() and h.corrupt is None
        assert h.lines.dropped == 1
        errors = {name: fields for name, level, fields in events if level == logging.ERROR}
        # In the order of the lines, all before the ready line that start() waited for.
        assert [name for name, level, _ in events if level == logging.ERROR] == \
            ["shard-line-too-long", "shard-bad-line"], events
        assert errors["shard-line-too-long"]["max_bytes"] == LINE_BYTES_MAX, events
        assert errors["shard-bad-line"]["line"] == '"corrupt {not json"', events
        assert errors["shard-bad-line"]["pid"] == pids[0]
    finally:
        sup.stop()
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("background", [True, False], ids=["embedded-stop", "foreground-sigterm"])
def test_a_stop_while_the_shards_start_ends_start_at_once_and_starts_nothing_more(stand_in, background):
    """serve's SIGTERM (or an embedding app's stop()) while the shards replay: start()
    returns at once, starts no scheduler, and every shard is stopped; it used to wait for
    every shard to be ready (here: for ever, as they never are)."""
    python, _ = stand_in("silent")
    data = os.path.join(short_tmpdir(), "data")
    cfg = {"schedules": {"x": {"every_s": 60, "body": "b", "queue": "cron"}}}
    sup = Supervisor(data, cfg, 2, python=python)
    pids: list[int] = []

    def stop_once_spawned():
        wait_until(lambda: len(sup.handles) == 2 and all(h.proc for h in sup.handles), 10, what="spawns")
        pids.extend(h.proc.pid for h in sup.handles)
        if background:
            sup.stop()
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # to the main thread, where start() waits
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stopper = threading.Thread(target=stop_once_spawned)
    try:
        if not background:
            sup.handle_signals()
        stopper.start()
        began = time.monotonic()
        assert sup.start(background=background, start_timeout=30) is sup
        took = time.monotonic() - began
        stopper.join(10)
        assert took < 10, f"start() took {took:.1f} s"
        assert sup.stopping and sup.scheduler is None and sup.workflow_watch is None
        assert [h.status for h in sup.handles] != ["ready", "ready"]
        assert sup.run() == 0  # stops at once
        assert all(h.status == "stopped" for h in sup.handles)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
        sup.stop()
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert not [t for t in threading.enumerate() if t.name == "shardq-scheduler"]
