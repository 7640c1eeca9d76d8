"""A log due for compaction on a disk without room for its checkpoint.

Compaction is an optimisation, never a condition to serve (docs/operations.md, "Disk
full"). Before, a shard whose log was due for compaction could not start on a full disk:
each start replayed, tried to compact, met ENOSPC writing the checkpoint and exited
(``cannot start: compaction of ... failed: [Errno 28]``), leaving one more segment behind
each time; its jobs could neither be leased nor acked, so no ack could free space either.
Now the shard starts from the log as it is, serves, says why it did not compact, removes
what the attempt created, and compacts once the file system has room.

The full disk is :class:`SmallDisk`: the log's file calls over a real directory with a
capacity, so a write that does not fit fails with ENOSPC after writing what fits, as a full
file system does (no mount needed).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

from shardq.clock import FakeClock
from shardq.errors import LogFailed
from shardq.shard import durable
from shardq.shard.durable import DurableShard, Engine
from shardq.wal import repair
from shardq.wal.fileio import Files
from shardq.wal.format import parse_name

KiB = 1024
BODY = 2 * KiB
JOBS = 40


class SmallDisk(Files):
    """A file system of ``capacity`` bytes for the log files under ``root`` (segments,
    checkpoints and their temporary files; a ``.torn-*`` copy, written past this object, is
    not counted). A write that would take more fails with ENOSPC once what fits is written; a preallocation
    that does not fit fails (and the log goes on without). With ``capacity_file``, the
    capacity is read from that file at each call, so that a test frees space in another
    process's disk. ``created`` lists every file created."""

    def __init__(self, root: str, capacity: int = 0, capacity_file: str | None = None):
        self.root = root
        self._capacity = capacity
        self.capacity_file = capacity_file
        self.created: list[str] = []

    @property
    def capacity(self) -> int:
        if self.capacity_file is not None:
            with open(self.capacity_file) as f:
                return int(f.read())
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = value

    def used(self) -> int:
        return sum(os.path.getsize(os.path.join(self.root, n)) for n in os.listdir(self.root)
                   if parse_name(n.removesuffix(".tmp")))

    def free(self, directory: str | None = None) -> int:
        return max(self.capacity - self.used(), 0)

    def create(self, path):
        self.created.append(os.path.basename(path))
        return super().create(path)

    def write(self, fd, data):
        grow = max(os.lseek(fd, 0, os.SEEK_CUR) + len(data) - os.fstat(fd).st_size, 0)
        room = self.free()
        if grow > room:
            fits = len(data) - (grow - room)
            if fits > 0:
                os.write(fd, bytes(data[:fits]))  # a full disk takes what fits, then says no
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(fd, data)

    def allocate(self, fd, size):
        if max(size - os.fstat(fd).st_size, 0) > self.free():
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().allocate(fd, size)


def log_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if parse_name(n.removesuffix(".tmp")))


def fill(directory: str, make_config) -> tuple[dict[int, bytes], int]:
    """A log of JOBS enqueues (and a few acks) never compacted: due at the next start with
    a low threshold. Returns the jobs left and the bytes the log files take."""
    config = make_config(segment_bytes=16 * KiB, compact_min_bytes=1 << 30)
    e = Engine(directory, config, clock=FakeClock())
    jobs = {e.enqueue(i.to_bytes(4, "big") * (BODY // 4), key=f"k{i % 4}"): i.to_bytes(4, "big") * (BODY // 4)
            for i in range(JOBS)}
    for lease in e.dequeue(max_jobs=3):
        e.ack(lease.job_id, lease.token)
        del jobs[lease.job_id]
    e.close()
    return jobs, sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def due_config(make_config):
    return make_config(segment_bytes=16 * KiB, compact_min_bytes=4 * KiB)


def all_jobs(directory: str, config) -> dict[int, bytes]:
    """Every job of the log, leased or not: replayed by a plain engine (no faults)."""
    e = Engine(directory, config, clock=FakeClock())
    try:
        return {j.id: j.body for j in e.state.jobs.values()}
    finally:
        e.close()


def test_a_start_due_for_compaction_on_a_full_disk_serves_from_the_log_and_compacts_once_there_is_room(
        tmp_path, make_config):
    directory = str(tmp_path / "shard")
    jobs, used = fill(directory, make_config)
    config = due_config(make_config)
    disk = SmallDisk(directory, capacity=used + 3 * KiB)  # room for small records, not for a checkpoint
    before = log_files(directory)
    clock = FakeClock()

    # Every start tries (the free space the shard sees says there is room), finds none, and
    # starts from the log as it is, leaving no file behind (before: LogFailed, and one more
    # segment each time).
    for _ in range(3):
        shard = DurableShard(directory, 0, config, files=disk, clock=clock)
        shard.open(clock.now())
        assert shard.compaction_deferred is not None and "No space left" in shard.compaction_deferred
        assert shard.compactions == 0
        assert log_files(directory) == before
        shard.close()
    assert any(n.endswith(".ckpt.tmp") for n in disk.created)  # it did try

    # It serves: reads, leases and acks (small records, which fit)
    shard = DurableShard(directory, 0, config, files=disk, clock=clock)
    shard.open(clock.now())
    assert shard.compaction_deferred is not None
    assert {j.id for j in shard.state.jobs.values()} == set(jobs)
    leases = shard.state.dequeue("default", clock.now(), None, 2)
    shard.commit()
    for lease in leases:
        shard.state.ack(lease.job_id, lease.token, clock.now())
        del jobs[lease.job_id]
    shard.commit()
    assert log_files(directory) == before
    # ... and an enqueue that does not fit fails as a full disk makes every write fail
    shard.state.enqueue(b"x" * 8 * KiB, clock.now())
    try:
        shard.commit()
        raise AssertionError("an enqueue larger than the free space was committed")
    except LogFailed as e:
        assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOSPC
    shard.close()

    # Space again: the shard compacts at its next look, not before
    shard = DurableShard(directory, 0, config, files=disk, clock=clock)
    shard.open(clock.now())
    assert shard.compaction_deferred is not None
    disk.capacity = used + 4 * 1024 * KiB
    lease, = shard.state.dequeue("default", clock.now(), None, 1)
    shard.commit()
    assert shard.compactions == 0  # the next look is not due yet
    clock.advance(durable.COMPACT_BACKOFF_MAX_S)
    shard.state.ack(lease.job_id, lease.token, clock.now())
    del jobs[lease.job_id]
    shard.commit()
    assert shard.compactions == 1 and shard.compaction_deferred is None
    names = log_files(directory)
    assert [n.rsplit(".", 1)[1] for n in names] == ["ckpt", "wal"], names
    shard.close()

    # Nothing acknowledged is lost, and the log is valid for `shardq wal check`
    got = all_jobs(directory, config)
    assert got == jobs
    assert [r.status for r in repair.check(directory)] == ["ok"] * len(log_files(directory))


def test_without_room_for_a_checkpoint_the_shard_does_not_try_and_looks_again_later(tmp_path, make_config):
    directory = str(tmp_path / "shard")
    jobs, used = fill(directory, make_config)
    config = due_config(make_config)
    disk = SmallDisk(directory, capacity=used + 3 * KiB)
    before = log_files(directory)
    clock = FakeClock()
    shard = DurableShard(directory, 0, config, files=disk, clock=clock, free_space=disk.free)
    shard.open(clock.now())
    assert shard.compaction_deferred is not None and "no room for a checkpoint" in shard.compaction_deferred
    assert not any(n.endswith(".ckpt.tmp") for n in disk.created)  # not even tried: the disk stays as it was
    assert log_files(directory) == before

    disk.capacity = used + 4 * 1024 * KiB
    leases = shard.state.dequeue("default", clock.now(), None, 1)
    shard.commit()
    assert shard.compactions == 0
    clock.advance(durable.COMPACT_LOOK_S)
    shard.state.ack(leases[0].job_id, leases[0].token, clock.now())
    del jobs[leases[0].job_id]
    shard.commit()
    assert shard.compactions == 1 and shard.compaction_deferred is None
    shard.close()
    assert all_jobs(directory, config) == jobs


# ---------------------------------------------------------------------------- the shard process
def _run_shard(data_dir: str, capacity_file: str, config: str) -> int:
    """The shard process (``python -m shardq.shard.process``) on a SmallDisk."""
    from shardq.datadir import DataDir
    from shardq.shard import process, report
    shard_dir = DataDir(data_dir).shard_dir(0)
    report.files_from_env = lambda: SmallDisk(shard_dir, capacity_file=capacity_file)
    durable.COMPACT_LOOK_S = 0.05  # looks again soon (the backoff starts there)
    return process.main(["--data-dir", data_dir, "--index", "0", "--config", config])


def test_the_shard_process_starts_and_serves_while_its_compaction_finds_no_space(tmp_path, make_config):
    """The process of a shard on a full disk, its log due: ready, serving, its stats saying
    why it did not compact, no ``failed`` line to the supervisor (it is not about to exit),
    and once there is room it compacts by itself."""
    import shardq
    from shardq.datadir import DataDir
    from support.service import REPO, short_tmpdir, wait_until
    top = short_tmpdir()
    data = os.path.join(top, "d")  # a short path: the shard's unix socket is in it
    dd = DataDir(data)
    dd.init(1)
    jobs, used = fill(dd.shard_dir(0), make_config)
    capacity_file = str(tmp_path / "capacity")
    with open(capacity_file, "w") as f:
        f.write(str(used + 3 * KiB))
    cfg = json.dumps({"limits": {"segment_bytes": 16 * KiB, "compact_min_bytes": 4 * KiB}})
    err_path = str(tmp_path / "shard.err")
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, __file__, data, capacity_file, cfg], cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: os.path.exists(dd.socket_path(0)) or proc.poll() is not None, 30, 0.02, "the shard")
        assert proc.poll() is None, open(err_path).read()[-3000:]
        q = shardq.connect(data, retry_s=20)
        try:
            st = q.stats()["shards"][0]
            assert st["available"] and "No space left" in (st["compaction_deferred"] or ""), st
            assert st["jobs"] == len(jobs) and st["compactions"] == 0
            # an attempt in the loop finds no space too (its look comes soon): put back, still serving
            # (each request is an iteration of the loop, which compacts when a look is due)
            wait_until(lambda: q.stats() and open(err_path).read().count("compaction put off") >= 2, 20, 0.05,
                       "a second attempt, in the loop")
            lease = q.dequeue_many(max_jobs=1)[0]
            q.ack(lease)
            del jobs[lease.job_id]
            with open(capacity_file, "w") as f:
                f.write(str(used + 4 * 1024 * KiB))
            wait_until(lambda: q.stats()["shards"][0]["compactions"] == 1, 20, 0.05, "a compaction")
            assert q.stats()["shards"][0]["compaction_deferred"] is None
        finally:
            q.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    try:
        log = open(err_path).read()
        assert proc.returncode == 0, log[-3000:]
        assert "ready" in out and "failed" not in out, out
        assert "cannot start" not in log and "compacted, no longer put off" in log, log[-3000:]
        assert all_jobs(dd.shard_dir(0), due_config(make_config)) == jobs
        assert all(r.status == "ok" for r in repair.check(dd.shard_dir(0)))
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_run_shard(*sys.argv[1:4]))
