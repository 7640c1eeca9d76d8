"""The engine on disk: restarts, compaction, crashes and I/O errors.

Queue semantics are in test_state.py (run against the Engine there too); this file is about
what survives: reopening on the same directory, compaction under churn, a crash at every
step of a compaction, and a write/fsync/rename failure at every file-system call of a
workload.
"""
from __future__ import annotations

import errno
import os

import pytest

from support.faults import FAULTABLE, MUTATING, Crash, FaultyFiles, NoSyncFiles
from shardq.clock import FakeClock
from shardq.errors import Closed, LeaseLost, LogFailed
from shardq.shard.durable import Engine

KiB = 1024


def dir_bytes(path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def reopened(engine: Engine, config, clock, **kw) -> Engine:
    engine.close()
    return Engine(engine.shard.directory, config, clock=clock, **kw)


def settled_digest(engine: Engine, digest) -> dict:
    engine.stats()  # advance to the clock and commit what that derives (dead letters)
    return digest(engine.state)


# ---------------------------------------------------------------------------- restarts
def build_rich_state(e: Engine, clock: FakeClock) -> dict:
    """Keys with backlogs, priorities, delays, live leases, a nacked job with an error, a
    dead letter, dedup entries and a client session."""
    ctx = {"keys": {}}
    for n in range(3):
        for k in ("a", "b", "c", "d"):
            jid = e.enqueue(f"{k}{n}".encode(), key=k, priority=n, dedup_id=f"{k}-{n}")
            ctx["keys"].setdefault(k, []).append(jid)
    ctx["keyless"] = e.enqueue_many([(b"free", None, "default", 0, 7, None),
                                     (b"later", None, "default", 500, 0, None),
                                     (b"other-q", "a", "other", 0, 0, "x")], session=(42, 1, 1))
    ctx["delayed_key"] = e.enqueue(b"delayed-head", key="z", delay=100)
    ctx["behind_delayed"] = e.enqueue(b"behind", key="z")
    leases = e.dequeue(max_jobs=3, visibility=60)
    ctx["leases"] = leases
    # the first lease: nacked with an error and a delay
    e.nack(leases[0].job_id, leases[0].token, delay=30, error="transient")
    # the poison: keyless, dead after max_deliveries=2
    poison = e.enqueue(b"poison", priority=99)
    for _ in range(2):
        [lp] = e.dequeue(visibility=5)
        assert lp.job_id == poison
        e.nack(poison, lp.token, error="bad body")
    ctx["poison"] = poison
    clock.advance(1)
    ctx["live_leases"] = leases[1:]
    return ctx


def test_reopen_rebuilds_the_same_state_with_and_without_compaction(tmp_path, clock, make_config, digest):
    config = make_config(max_deliveries=2, dedup_window=1000)
    e = Engine(str(tmp_path), config, clock=clock)
    ctx = build_rich_state(e, clock)
    live = settled_digest(e, digest)
    assert [d.job_id for d in e.dead_letters()] == [ctx["poison"]]

    e = reopened(e, config, clock)
    assert settled_digest(e, digest) == live
    e.compact()
    e = reopened(e, config, clock)
    assert e.shard.replay_stats.checkpoint is not None
    assert settled_digest(e, digest) == live

    # Leases are still live with the same tokens; dedup and sessions still answer.
    for lease in ctx["live_leases"]:
        assert e.extend(lease.job_id, lease.token, 60) == clock.now() + 60
    assert e.enqueue(b"dup", key="b", dedup_id="b-2") == ctx["keys"]["b"][2]
    assert e.enqueue_many([(b"retry", None, "default", 0, 0, None)], session=(42, 1, 1)) == ctx["keyless"]
    [dl] = e.dead_letters()
    assert (dl.job_id, dl.attempts, dl.error) == (ctx["poison"], 2, "bad body")
    # Per-key order continues where it was: ack the live leases, drain, check each key.
    for lease in ctx["live_leases"]:
        e.ack(lease.job_id, lease.token)
    clock.advance(1000)
    seen: dict = {}
    while batch := e.dequeue(max_jobs=100):
        for lease in batch:
            seen.setdefault((lease.queue, lease.key), []).append(lease.job_id)
            e.ack(lease.job_id, lease.token)
    for k, jids in ctx["keys"].items():
        acked_before = [x.job_id for x in ctx["live_leases"] if x.key == k]
        assert [j for j in jids if j not in acked_before] == seen[("default", k)]
    assert seen[("default", "z")] == [ctx["delayed_key"], ctx["behind_delayed"]]
    e.close()


def test_a_restarted_shard_does_not_hand_out_a_live_lease(tmp_path, clock, make_config):
    config = make_config()
    e = Engine(str(tmp_path), config, clock=clock)
    jid = e.enqueue(b"x", key="k")
    e.enqueue(b"y", key="k")
    [lease] = e.dequeue(visibility=30)
    clock.advance(29)
    e = reopened(e, config, clock)
    assert e.dequeue(max_jobs=10) == []
    assert e.stats()["default"]["in_flight"] == 1
    clock.advance(1)
    [again] = e.dequeue()
    assert (again.job_id, again.attempt) == (jid, 2)
    assert again.token != lease.token
    with pytest.raises(LeaseLost):
        e.ack(jid, lease.token)
    e.close()


def test_the_lease_token_survives_a_restart(tmp_path, clock, make_config):
    config = make_config()
    e = Engine(str(tmp_path), config, clock=clock)
    jid = e.enqueue(b"x")
    [lease] = e.dequeue(visibility=30)
    e = reopened(e, config, clock)
    e.ack(jid, lease.token)
    e = reopened(e, config, clock)
    clock.advance(60)
    assert e.dequeue() == []
    e.close()


def test_a_poison_job_reaches_the_dlq_across_crash_restarts(tmp_path, clock, make_config):
    """The delivery count is durable before the job is handed out: a worker that takes the
    shard down with it on every delivery still moves the job to the DLQ."""
    config = make_config(max_deliveries=3)
    e = Engine(str(tmp_path), config, clock=clock)
    jid = e.enqueue(b"kills the shard", key="k")
    follower = e.enqueue(b"next", key="k")
    for attempt in (1, 2, 3):
        [lease] = e.dequeue(visibility=10)
        assert (lease.job_id, lease.attempt) == (jid, attempt)
        e = reopened(e, config, clock)  # "crash": no ack, no nack
        clock.advance(10)
    assert e.stats()["default"]["dead"] == 1
    [dl] = e.dead_letters()
    assert (dl.job_id, dl.attempts) == (jid, 3)
    assert [x.job_id for x in e.dequeue()] == [follower]
    e = reopened(e, config, clock)
    assert [d.job_id for d in e.dead_letters()] == [jid]
    e.close()


def test_engine_dead_letters_reflect_the_clock(tmp_path, clock, make_config):
    """Regression: ``Engine.dead_letters`` once skipped advancing to the clock, so a lease
    that expired on its last delivery was counted by stats() but not listed."""
    e = Engine(str(tmp_path), make_config(max_deliveries=1), clock=clock)
    jid = e.enqueue(b"x")
    e.dequeue(visibility=5)
    clock.advance(5)
    assert [d.job_id for d in e.dead_letters()] == [jid]
    e.close()


def test_engine_after_close_refuses_writes(tmp_path, clock):
    e = Engine(str(tmp_path), clock=clock)
    e.enqueue(b"x")
    e.close()
    with pytest.raises(Closed):
        e.enqueue(b"y")


# ---------------------------------------------------------------------------- compaction
def test_disk_use_stays_bounded_under_lease_release_churn(tmp_path, make_config, digest):
    """beanstalkd#622: release-with-delay churn must not grow the log without bound."""
    compact_min = 64 * KiB
    config = make_config(compact_min_bytes=compact_min, segment_bytes=16 * KiB, max_deliveries=10**6)
    clock = FakeClock()
    e = Engine(str(tmp_path), config, clock=clock, files=NoSyncFiles())
    live = [e.enqueue(b"b" * 200, key=f"k{i % 20}") for i in range(60)]
    peak = commits = 0
    for round_ in range(1500):
        for lease in e.dequeue(max_jobs=10, visibility=30):
            e.nack(lease.job_id, lease.token, delay=1 if round_ % 2 else 0)
            commits += 2
        if round_ % 5 == 0:  # enqueue/ack cycles around the same live set
            extra = e.enqueue(b"e" * 200, key="extra", priority=1000)
            [lx] = e.dequeue(max_jobs=1)
            assert lx.job_id == extra
            e.ack(extra, lx.token)
            commits += 3
        clock.advance(1)
        peak = max(peak, dir_bytes(tmp_path))
    assert e.shard.compactions >= 5
    assert peak < 3 * compact_min, f"peak disk use {peak} bytes"
    before = settled_digest(e, digest)
    e = reopened(e, config, clock, files=NoSyncFiles())
    records = e.shard.replay_stats.records
    assert records < commits / 10 and records < 2000, f"replayed {records} records for {len(live)} live jobs"
    assert settled_digest(e, digest) == before
    e.close()


def test_compaction_triggers_on_its_own_and_keeps_state(tmp_path, clock, make_config, digest):
    config = make_config(compact_min_bytes=4096, segment_bytes=4096)
    e = Engine(str(tmp_path), config, clock=clock)
    for i in range(40):
        jid = e.enqueue(b"x" * 100, key=f"k{i % 4}")
        if i % 2:
            [lease] = e.dequeue()
            e.ack(lease.job_id, lease.token)
    assert e.shard.compactions >= 1
    names = sorted(os.listdir(tmp_path))
    assert sum(n.endswith(".ckpt") for n in names) == 1, names
    before = settled_digest(e, digest)
    e = reopened(e, config, clock)
    assert settled_digest(e, digest) == before
    assert jid in e.state.jobs
    e.close()


def _compaction_setup(directory, config, clock, files):
    """Several segments, one earlier checkpoint, live leases, a dead letter, dedup."""
    e = Engine(directory, config, clock=clock, files=files)
    for i in range(12):
        e.enqueue(b"p" * 300, key=f"k{i % 3}", dedup_id=f"d{i}")
    leases = e.dequeue(max_jobs=2, visibility=100)
    e.compact()
    e.nack(leases[0].job_id, leases[0].token, error="x")
    for i in range(8):
        e.enqueue(b"q" * 300, priority=i % 3)
    [lp] = e.dequeue()
    e.nack(lp.job_id, lp.token, delay=20)
    return e


@pytest.mark.parametrize("error", [Crash, errno.EIO], ids=["crash", "EIO"])
def test_a_failure_at_any_step_of_compaction_loses_nothing(tmp_path, make_config, digest, error):
    config = make_config(segment_bytes=4096, compact_min_bytes=1 << 30, max_deliveries=2)

    # How many file-system calls does one compaction make here?
    probe = FaultyFiles(kinds=MUTATING)
    e = _compaction_setup(str(tmp_path / "probe"), config, FakeClock(), probe)
    start = probe.count
    e.compact()
    steps = probe.count - start
    kinds = [kind for kind, _ in probe.calls[-steps:]]
    e.close()
    assert {"create", "write", "fsync", "rename", "sync_dir", "unlink"} <= set(kinds)

    for n in range(1, steps + 1):
        clock = FakeClock()
        directory = str(tmp_path / f"crash{n}")
        files = FaultyFiles(kinds=MUTATING, error=error)
        e = _compaction_setup(directory, config, clock, files)
        before = settled_digest(e, digest)
        files.fail_at = files.count + n
        with pytest.raises(Crash if error is Crash else LogFailed):
            e.compact()
        assert files.failed[0] == kinds[n - 1]
        e.close()
        e = Engine(directory, config, clock=clock)
        assert settled_digest(e, digest) == before, f"after a failure at {kinds[n - 1]} (call {n})"
        # ...and the log works on from there.
        jid = e.enqueue(b"after", key="k0")
        e.compact()
        e = reopened(e, config, clock)
        assert jid in e.state.jobs
        e.close()


# ---------------------------------------------------------------------------- I/O errors
def _workload():
    """Steps (name, fn(engine, ctx, clock)) whose commits cross rotations (segment_bytes is
    4 KiB), automatic compactions (compact_min_bytes is 8 KiB) and an explicit one."""
    steps = []

    def add(name, fn):
        steps.append((name, fn))

    for i in range(14):
        add(f"enqueue{i}", lambda e, c, t, i=i: c.setdefault("ids", []).append(
            e.enqueue(bytes([65 + i]) * 600, key=f"k{i % 3}", priority=i % 2, dedup_id=f"d{i}")))
    add("dequeue", lambda e, c, t: c.__setitem__("leases", e.dequeue(max_jobs=3, visibility=30)))
    add("ack", lambda e, c, t: e.ack(c["leases"][0].job_id, c["leases"][0].token))
    add("nack", lambda e, c, t: e.nack(c["leases"][1].job_id, c["leases"][1].token, delay=5, error="e"))
    add("extend", lambda e, c, t: e.extend(c["leases"][2].job_id, c["leases"][2].token, 100))
    add("batch", lambda e, c, t: c.__setitem__("batch", e.enqueue_many(
        [(b"m" * 250, None, "default", 0, 3, None)] * 4, session=(9, 1, 1))))
    add("tick", lambda e, c, t: t.advance(10))
    add("dequeue2", lambda e, c, t: c.__setitem__("leases2", e.dequeue(max_jobs=4, visibility=10)))
    add("compact", lambda e, c, t: e.compact())
    for i in range(2):  # one engine call per step: a step either returned or did not
        add(f"ack2-{i}", lambda e, c, t, i=i: e.ack(c["leases2"][i].job_id, c["leases2"][i].token))
    for i in range(12):
        add(f"enqueue-late{i}", lambda e, c, t, i=i: e.enqueue(b"z" * 900, key=f"k{i % 2}"))
    add("tick2", lambda e, c, t: t.advance(20))
    add("dequeue3", lambda e, c, t: c.__setitem__("leases3", e.dequeue(max_jobs=20)))
    for i in range(3):
        add(f"nack3-{i}", lambda e, c, t, i=i: e.nack(c["leases3"][i].job_id, c["leases3"][i].token))
    return steps


def _is_tick(name):
    return name.startswith("tick")


def test_an_io_error_at_any_call_fails_loudly_and_loses_nothing_committed(tmp_path, make_config, digest, caplog):
    config = make_config(segment_bytes=4096, compact_min_bytes=8192, max_deliveries=3, dedup_window=1000)
    steps = _workload()

    # Reference: the state after each step of a healthy run, and how many calls it makes.
    counter = FaultyFiles()
    clock = FakeClock()
    e = Engine(str(tmp_path / "count"), config, clock=clock, files=counter)
    start, first_call, ctx = counter.count, len(counter.calls), {}
    for _, fn in steps:
        fn(e, ctx, clock)
    total = counter.count - start
    calls = counter.calls[first_call:]
    kinds = [k for k, _ in calls if k in FAULTABLE]
    new_segments = sum(k == "rename" and d.endswith(".wal") for k, d in calls)
    assert e.shard.compactions >= 2 and new_segments > e.shard.compactions, "no rotation outside compaction"
    assert {"create", "write", "datasync", "fsync", "rename", "sync_dir", "unlink"} <= set(kinds)
    e.close()
    clock = FakeClock()
    e = Engine(str(tmp_path / "ref"), config, clock=clock)
    expected, ctx = [settled_digest(e, digest)], {}
    for _, fn in steps:
        fn(e, ctx, clock)
        expected.append(settled_digest(e, digest))
    e.close()

    met, put_off = set(), 0
    for n in range(1, total + 1):
        err = (errno.ENOSPC, errno.EIO)[n // 2 % 2]  # so that each kind of call meets both
        met.add((kinds[n - 1], err))
        clock = FakeClock()
        directory = str(tmp_path / f"f{n}")
        files = FaultyFiles(error=err)
        e = Engine(directory, config, clock=clock, files=files)
        files.fail_at = files.count + n
        caplog.clear()
        ctx, done, failed_at = {}, 0, None
        for i, (_name, fn) in enumerate(steps):
            try:
                fn(e, ctx, clock)
            except LogFailed:
                failed_at = i
                break
            done += 1
        where = f"fault {errno.errorcode[err]} at call {n} ({kinds[n - 1]}), step {failed_at}"
        if failed_at is None:
            # A compaction that finds no space before its checkpoint is in place is put off,
            # not a failure: the log is put back as it was and the engine goes on
            # (DurableShard.compact; test_compaction_no_space.py).
            assert err == errno.ENOSPC and "compaction put off" in caplog.text, f"{where}: no step reported the failure"
            put_off += 1
            assert not [f for f in os.listdir(directory) if f.endswith(".tmp")], where
            assert settled_digest(e, digest) == expected[len(steps)], where
            e.close()
            e = Engine(directory, config, clock=clock)
            assert settled_digest(e, digest) == expected[len(steps)], where
            e.close()
            continue
        assert files.failed[0] == kinds[n - 1]
        # Every later write fails too, and the fsync is never retried.
        for call in (lambda: e.enqueue(b"later"), e.compact, lambda: e.shard.log.commit([b"\x90"])):
            with pytest.raises(LogFailed):
                call()
        assert files.syncs_after_failure() == [], where
        e.close()
        # Reopen healthy: everything whose call returned is there; the failed call may be.
        e = Engine(directory, config, clock=clock)
        got = settled_digest(e, digest)
        assert got in (expected[done], expected[done + 1]), where
        e.enqueue(b"works again")
        e.close()
    for kind in ("write", "datasync", "fsync", "rename", "sync_dir"):
        assert {(kind, errno.ENOSPC), (kind, errno.EIO)} <= met, kind
    assert put_off > 0  # some ENOSPC met a compaction
