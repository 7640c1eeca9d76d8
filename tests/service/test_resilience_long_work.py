"""Issue 9, item 5 (last finding): a shard busy with long work is not taken for a hung one.

And a shard waiting for a slow disk is not either: a CI run filling a shard here got it
killed as hung (`health_timeout` 0.4 s) when another writer stalled one of its fsyncs.

Compaction runs on the shard's loop thread, so the supervisor's pings wait until it is done.
Before the fix, a compaction longer than ``health_timeout`` got the shard SIGKILLed as
hung; the restarted shard replayed, found the compaction still due, compacted again, and was
killed again, forever. Now the shard reports progress on its stdout pipe while it compacts
(and while it replays at start), and the supervisor counts progress as alive.

Sizes: 800,000 small jobs, about 56 MB of log, compact in about 2 s here and replay in
about as long; the health timeout is 0.4 s and the start timeout 1 s (the interpreter's own
start, before the first progress line, must fit in it), both shorter than the work.
"""
from __future__ import annotations

import os
import re
import shutil
import time

import shardq
from support.service import Service, short_tmpdir, wait_until
from shardq.service.supervisor import Supervisor
from shardq.wal.fileio import FAULT_SLOW_DISK_ENV

JOBS = 1_600_000
BATCH = 5_000
HEALTH_TIMEOUT_S = 0.4
CONFIG = {"service": {"health_timeout": HEALTH_TIMEOUT_S, "restart_backoff_max": 0.5},
          "limits": {"compact_min_bytes": 96 * 1024 * 1024},  # due at about 1,400,000 jobs
          "http": {"listen": ""}}


def test_a_compaction_longer_than_the_health_timeout_runs_once_and_a_long_replay_is_waited_for():
    data_dir = os.path.join(short_tmpdir(), "data")
    with Service(data_dir=data_dir, shards=1, config=CONFIG) as svc:
        with svc.connect(retry_s=30) as q:
            pid = q.ping()[0]
            for _ in range(JOBS // BATCH):
                q.enqueue_many([{"body": b"x" * 40} for _ in range(BATCH)])
            wait_until(lambda: q.stats()["shards"][0]["compactions"] >= 1, 60, 0.1, "a compaction")
            st = q.stats()["shards"][0]
            assert (st["pid"], st["compactions"], st["jobs"]) == (pid, 1, JOBS), (st, svc.tail(400)[-3000:])
        log = svc.tail(400)
        took = [float(s) for s in re.findall(r"compacted: checkpoint \d+ bytes in ([\d.]+) s", log)]
        # The supervisor says "busy" at the first progress line (one every health_timeout / 4)
        # more than health_timeout after the phase's first: a compaction must outlast both.
        assert took and took[0] > HEALTH_TIMEOUT_S * 1.5, f"the compaction was too quick to test anything: {took}"
        assert "event=shard-hung" not in log and "event=shard-exit" not in log, log[-3000:]
        assert re.search(r"event=shard-busy shard=0 pid=\d+ phase=compact", log), log[-3000:]
        svc.kill_all()  # the next start replays the checkpoint and the segment after it

    # A replay longer than the start timeout: progress keeps the starting shard alive.
    start_timeout = 1.0
    sup = Supervisor(data_dir, CONFIG, 1)
    try:
        sup.start(background=True, start_timeout=start_timeout)
        h = sup.handles[0]
        assert (h.status, h.restarts, h.last_exit) == ("ready", 0, None), (h.status, h.restarts, h.reason)
        assert h.ready_info["replay_s"] > start_timeout, h.ready_info
        with shardq.Router(sup.dd.path, supervisor=sup) as q:
            assert q.stats()["shards"][0]["jobs"] == JOBS
    finally:
        sup.stop()
        shutil.rmtree(os.path.dirname(data_dir), ignore_errors=True)


STALL_S = 1.5  # almost four health timeouts


def test_a_commit_waiting_for_a_slow_disk_is_not_taken_for_a_hang(monkeypatch, tmp_path):
    """The fsync stalls (the test hook sleeps in it, as a disk shared with a heavy writer
    makes it wait); the shard's ping replies wait behind the commit, but the shard reports
    that it waits for its disk, so it is not killed, and the operator is warned."""
    switch = tmp_path / "slow-disk"
    monkeypatch.setenv(FAULT_SLOW_DISK_ENV, str(switch))
    with Service(shards=1, config=CONFIG) as svc:
        with svc.connect(retry_s=30) as q:
            pid = q.ping()[0]
            q.enqueue(b"before")
            switch.write_text(str(STALL_S))
            try:
                t0 = time.monotonic()
                q.enqueue(b"during")  # waits for its fsync, which waits STALL_S first
                took = time.monotonic() - t0
            finally:
                switch.unlink()
            assert took >= STALL_S, f"the fsync was not stalled ({took:.2f} s): the test tests nothing"
            assert q.ping()[0] == pid
            assert [lease.body for lease in q.dequeue_many(max_jobs=2, visibility=30)] == [b"before", b"during"]
        log = svc.tail(200)
    assert "event=shard-hung" not in log and "event=shard-exit" not in log, log[-3000:]
    assert re.search(rf"WARNING event=shard-busy shard=0 pid={pid} phase=disk for_s=[\d.]+ "
                     rf'note="waiting for a slow disk, not hung"', log), log[-3000:]
