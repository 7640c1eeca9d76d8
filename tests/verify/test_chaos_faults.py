"""Crash points with real processes: SIGKILL a shard in the middle of batched enqueues and of
compactions, pause one past its health timeout, flip a bit in an old segment or a checkpoint.

Each test says what was acknowledged to a client and checks that exactly that survived.
(Dropping unfsynced writes, as a power cut does, needs a VM or a fault-injecting file
system; docs/reliability.md says what stands in for it.)
"""
from __future__ import annotations

import os
import re
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections import defaultdict

import pytest
from support.service import REPO, Service, wait_until

from shardq.datadir import DataDir
from shardq.errors import ShardqError
from shardq.wal import repair as wal_repair
from shardq.wal.format import HEADER, MAGIC_BYTES

ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, check=False)


def restarted(svc: Service, index: int, old_pid: int) -> int:
    """Wait for the supervisor to bring shard ``index`` back; its new pid."""
    def new_pid():
        try:
            with svc.connect(retry_s=0.5, request_timeout_s=2) as q:
                pids = q.ping()
            return pids[index] if pids[index] != old_pid else None
        except ShardqError:
            return None
    return wait_until(new_pid, timeout=30, what=f"shard {index} to restart")


def drain(q, queue: str) -> list:
    """Lease and ack everything in ``queue``; the leases, in delivery order."""
    out = []
    while True:
        leases = q.dequeue_many(queue, max_jobs=10_000, visibility=600)
        if not leases:
            return out
        assert q.ack_many(leases) == [None] * len(leases)
        out += leases


# ---------------------------------------------------------------- kill during batched enqueue
def test_sigkill_of_shards_during_batched_enqueue_loses_no_acknowledged_job():
    keys = [f"k{i}" for i in range(64)]
    stop = threading.Event()
    acked: dict[bytes, int] = {}      # body -> id, from enqueues that returned
    unknown: set[bytes] = set()       # bodies of enqueues that raised (outcome unknown)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def produce(t: int, q) -> None:
        rng = random.Random(t)
        mine = keys[t::2]
        try:
            for b in range(10_000):
                if stop.is_set():
                    return
                batch = [{"body": f"{t}-{b}-{i}".encode(), "key": rng.choice(mine)} for i in range(200)]
                try:
                    ids = q.enqueue_many(batch)
                except ShardqError:
                    with lock:
                        unknown.update(j["body"] for j in batch)
                    continue
                with lock:
                    acked.update((j["body"], i) for j, i in zip(batch, ids))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    with Service(shards=2, config={"service": {"restart_backoff_max": 0.5}}) as svc:
        routers = [svc.connect(retry_s=20, request_timeout_s=20) for _ in range(2)]
        threads = [threading.Thread(target=produce, args=(t, routers[t])) for t in range(2)]
        for th in threads:
            th.start()
        try:
            for n, shard in enumerate([0, 1, 0, 1, 0]):
                wait_until(lambda n=n: len(acked) >= 3000 * (n + 1), timeout=60, what="enqueue progress")
                pid = svc.shard_pids()[shard]
                os.kill(pid, signal.SIGKILL)      # mid-stream: batches are in flight on both shards
                restarted(svc, shard, pid)
        finally:
            stop.set()
            for th in threads:
                th.join(60)
        assert not errors, errors
        with svc.connect() as q:
            leases = drain(q, "default")
        for r in routers:
            conns = [*r.lanes, *(r._io.conns if r._io else [])]  # its lanes and its I/O thread's connections
            assert sum(c.connects for c in conns) > 2, "the kills never reached this producer"
            r.close()
        assert "shard-exit" in svc.tail(2000)

    bodies = [l.body for l in leases]
    assert len(bodies) == len(set(bodies)), "a retried batch was enqueued twice"
    missing = set(acked) - set(bodies)
    assert not missing, f"{len(missing)} acknowledged jobs lost, e.g. {sorted(missing)[:5]}"
    assert set(bodies) <= set(acked) | unknown, "delivered jobs that were never enqueued"
    assert all(acked[l.body] == l.job_id for l in leases if l.body in acked), "a retry answered other ids"
    per_key = defaultdict(list)
    for l in leases:
        _, b, i = map(int, l.body.decode().split("-"))
        per_key[l.key].append((b, i))
    for key, seqs in per_key.items():
        assert seqs == sorted(seqs), f"key {key}: delivered out of enqueue order"


# ---------------------------------------------------------------- kill during compaction
def _compaction_in_progress(files: list[str]) -> str | None:
    """What the directory shows of a compaction under way, or None."""
    if any(f.endswith(".ckpt.tmp") for f in files):
        return "writing checkpoint"
    ckpts = sorted(f for f in files if f.endswith(".ckpt"))
    if len(ckpts) > 1 or (ckpts and any(f.endswith(".wal") and f < ckpts[-1].replace(".ckpt", ".wal")
                                        for f in files)):
        return "deleting replaced files"
    return None


def test_sigkill_during_compaction_replays_consistently():
    cfg = {"limits": {"segment_bytes": 4096, "compact_min_bytes": 4096},
           "service": {"restart_backoff_max": 0.5}}
    keep = {f"keep-{i:05d}-{'x' * 150}".encode() for i in range(6000)}  # ~1 MB live: checkpoints take a while
    with Service(shards=1, config=cfg) as svc:
        shard_dir = DataDir(svc.data_dir).shard_dir(0)
        with svc.connect() as q:
            q.enqueue_many([{"body": b, "key": f"keep-{i % 50}"} for i, b in enumerate(sorted(keep))], queue="keep")
        stop = threading.Event()
        enq, acked, unknown, errors = set(), set(), set(), []

        def churn() -> None:
            q = svc.connect(retry_s=20, request_timeout_s=20)
            n = 0
            try:
                while not stop.is_set():
                    batch = [{"body": f"churn-{n}-{i}-{'y' * 200}".encode()} for i in range(300)]
                    n += 1
                    try:
                        ids = q.enqueue_many(batch, queue="churn")
                        enq.update(ids)
                        leases = q.dequeue_many("churn", max_jobs=300, visibility=600)
                        res = q.ack_many(leases)
                        acked.update(l.job_id for l, e in zip(leases, res) if e is None)
                    except ShardqError:
                        unknown.update(b["body"] for b in batch)
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)
            finally:
                q.close()

        th = threading.Thread(target=churn)
        th.start()
        kills: list[str] = []
        try:
            pid = svc.shard_pids()[0]
            while len(kills) < 12 and sum(k != "between compactions" for k in kills) < 4:
                # Stop the shard the moment a compaction shows on disk, check, then kill it.
                def caught():
                    return _compaction_in_progress(os.listdir(shard_dir))
                try:
                    wait_until(caught, timeout=3, interval=0.0005, what="a compaction")
                except AssertionError:
                    pass  # none seen: kill wherever the shard is
                os.kill(pid, signal.SIGSTOP)
                kills.append(_compaction_in_progress(os.listdir(shard_dir)) or "between compactions")
                os.kill(pid, signal.SIGKILL)
                pid = restarted(svc, 0, pid)
        finally:
            stop.set()
            th.join(60)
        assert not errors, errors
        assert sum(k != "between compactions" for k in kills) >= 1, kills

        with svc.connect() as q:
            st1 = q.stats()["queues"]
        log_text = svc.tail(100_000)
        svc.stop()
        reports = [r for r in wal_repair.check(shard_dir)]
        assert all(r.status == "ok" for r in reports), reports
        svc2 = Service(data_dir=svc.data_dir, shards=1, config=cfg, log_path=svc.log_path).start()
        try:
            with svc2.connect() as q:
                assert q.stats()["queues"] == st1, "a clean restart changed the state"
                kept = [l.body for l in drain(q, "keep")]
                remaining = {l.job_id for l in drain(q, "churn")}
        finally:
            svc2.stop()
            svc2.log.close()
    assert "compacted" in log_text
    assert sorted(kept) == sorted(keep), "a checkpointed job was lost or duplicated"
    assert not (acked & remaining), "an acknowledged ack was undone by replay"
    assert enq <= acked | remaining, f"{len(enq - acked - remaining)} acknowledged enqueues lost"


# ---------------------------------------------------------------- pause past the health timeout
def test_shard_paused_past_health_timeout_is_killed_and_restarted_without_loss():
    cfg = {"service": {"health_timeout": 1.0, "restart_backoff_max": 0.5}}
    with Service(shards=2, config=cfg) as svc, svc.connect(retry_s=30, request_timeout_s=30) as q:
        ids = q.enqueue_many([{"body": f"p{i}".encode(), "key": f"k{i % 10}"} for i in range(500)])
        held = q.dequeue_many(max_jobs=3, visibility=600)
        pid = svc.shard_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            restarted(svc, 0, pid)  # the supervisor found it hung, killed it and started another
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert "event=shard-hung shard=0" in svc.tail(200)
        assert q.ack_many(held) == [None] * 3  # leases survive the restart with their tokens
        got = [l.job_id for l in held] + [l.job_id for l in drain(q, "default")]
        assert sorted(got) == sorted(ids)


# ---------------------------------------------------------------- bit flips
#: A record of one enqueue_many of 10 jobs holds more than this; an epoch or a sync mark less.
BATCH_RECORD_BYTES_MIN = 150


def _records(path: str) -> list[int]:
    """Offsets of the records of a log file."""
    with open(path, "rb") as f:
        data = f.read()
    off, out = MAGIC_BYTES, []
    while off + HEADER.size <= len(data):
        length = HEADER.unpack_from(data, off)[1]
        if length == 0:
            break
        out.append(off)
        off += HEADER.size + length
    return out


def _batch_records(path: str) -> list[int]:
    """Offsets of the records of a log file that hold a batch of jobs (longer than the
    start's epoch and a sync mark, whose number before a batch depends on timing)."""
    with open(path, "rb") as f:
        data = f.read()
    return [off for off in _records(path) if HEADER.unpack_from(data, off)[1] > BATCH_RECORD_BYTES_MIN]


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _restart(svc: Service) -> None:
    svc.log.close()
    svc.start(timeout=30)


def _snapshot(directory: str) -> dict:
    return {n: pathlib.Path(directory, n).read_bytes() for n in sorted(os.listdir(directory))
            if n.endswith((".wal", ".ckpt"))}


def test_bit_flip_in_an_old_segment_refuses_start_then_check_and_repair():
    cfg = {"limits": {"segment_bytes": 4096, "compact_min_bytes": 2**40}}
    svc = Service(shards=1, config=cfg).start()
    dd = DataDir(svc.data_dir)
    shard_dir = dd.shard_dir(0)
    try:
        with svc.connect() as q:
            ids = [q.enqueue_many([{"body": f"job-{b}-{i}".encode(), "key": "acct"} for i in range(10)])
                   for b in range(60)]  # one record per call, many 4 KiB segments
        svc.stop()
        segments = sorted(n for n in os.listdir(shard_dir) if n.endswith(".wal"))
        assert len(segments) >= 3
        oldest = os.path.join(shard_dir, segments[0])
        bad = _batch_records(oldest)[1]  # the second batch's record: one batch before it, more after
        _flip(oldest, bad + HEADER.size + 5)

        with pytest.raises(AssertionError, match="exited"):
            _restart(svc)   # the service refuses to come up
        log_text = svc.tail(200)
        assert f"path={oldest} offset={bad}" in log_text, log_text
        assert "event=shard-failed" in log_text

        r = cli("wal", "check", "--data-dir", svc.data_dir)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"corrupt {oldest}" in r.stdout and f"at offset {bad}: bytes {bad}.." in r.stdout, r.stdout

        before = _snapshot(shard_dir)
        r = cli("wal", "repair", shard_dir)
        assert r.returncode == 2 and "--force" in r.stderr, r.stdout + r.stderr
        assert _snapshot(shard_dir) == before, "repair without --force changed files"

        r = cli("wal", "repair", shard_dir, "--force")
        assert r.returncode == 0, r.stdout + r.stderr
        # The damaged record held one batch: only its 10 jobs are lost, and named; every
        # record after it, in this segment and the later ones, is salvaged.
        assert f"{oldest}: bytes {bad}.." in r.stdout, r.stdout
        hit = [k for k, batch in enumerate(ids) if
               f"jobs not recovered (enqueued in the damaged bytes): 10 ({', '.join(map(str, batch))})" in r.stdout]
        assert len(hit) == 1, r.stdout
        assert cli("wal", "check", "--data-dir", svc.data_dir).returncode == 0

        _restart(svc)
        with svc.connect() as q:
            survivors = [l.job_id for l in drain(q, "default")]
            assert survivors == [j for k, batch in enumerate(ids) if k != hit[0] for j in batch]
            new = q.enqueue(b"after repair", key="acct")
        svc.stop()
        _restart(svc)  # repair -> append -> reread
        with svc.connect() as q:
            assert [l.job_id for l in drain(q, "default")] == [new]
    finally:
        svc.stop()
        svc.log.close()
        shutil.rmtree(os.path.dirname(svc.data_dir), ignore_errors=True)


def test_bit_flip_in_a_checkpoint_refuses_start_and_repair_salvages_the_rest():
    cfg = {"limits": {"segment_bytes": 4096, "compact_min_bytes": 4096}}
    svc = Service(shards=1, config=cfg).start()
    shard_dir = DataDir(svc.data_dir).shard_dir(0)
    try:
        with svc.connect() as q:
            live = dict(zip(q.enqueue_many([{"body": f"live-{i}".encode()} for i in range(200)], queue="live"),
                            (f"live-{i}".encode() for i in range(200))))
            for _b in range(40):  # churn until a checkpoint exists
                q.enqueue_many([{"body": b"c" * 100} for _ in range(20)], queue="churn")
                assert q.ack_many(q.dequeue_many("churn", max_jobs=100)) == [None] * 20
        svc.stop()
        ckpts = [n for n in os.listdir(shard_dir) if n.endswith(".ckpt")]
        assert len(ckpts) == 1, os.listdir(shard_dir)
        ckpt = os.path.join(shard_dir, ckpts[0])
        bad = _records(ckpt)[1]
        _flip(ckpt, bad + HEADER.size + 3)

        with pytest.raises(AssertionError, match="exited"):
            _restart(svc)
        assert f"path={ckpt} offset={bad}" in svc.tail(200)
        r = cli("wal", "check", "--data-dir", svc.data_dir)
        assert r.returncode == 1 and f"corrupt {ckpt}" in r.stdout, r.stdout
        r = cli("wal", "repair", shard_dir, "--force")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{ckpt}: bytes {bad}.." in r.stdout and "jobs not recovered" in r.stdout, r.stdout
        _restart(svc)
        with svc.connect() as q:
            got = {l.job_id: l.body for l in drain(q, "live")}
        # Every job outside the damaged record is back, byte for byte; the ones named as not
        # recovered are not.
        line = r.stdout.split("jobs not recovered (enqueued in the damaged bytes): ")[1].split("\n")[0]
        named = set(map(int, re.findall(r"\d+", line.split("(", 1)[1]))) if "(" in line else set()
        assert set(got) <= set(live) and not set(got) & named, r.stdout
        assert all(got[j] == live[j] for j in got)
        assert len(got) + len(named & set(live)) >= 199, r.stdout
    finally:
        svc.stop()
        svc.log.close()
        shutil.rmtree(os.path.dirname(svc.data_dir), ignore_errors=True)
