"""Issue 9, item 3: a full disk is survivable, on a real (tmpfs) file system of 8 MiB.

The data dir is a fresh tmpfs mount, so the shard starts with far less free space than one
preallocated segment (64 MiB by default) and fills it for real: partial writes, ENOSPC from
write(), a torn record to cut at the next start with no room to keep a copy of it.
Checked: the shard starts anyway (no preallocation, said in the log); an enqueue that finds
the disk full fails with a typed ``ShardUnavailable``; the log and ``stats`` say "disk
full"; nothing acknowledged is lost; and once space is freed the shard serves again without
anyone restarting ``shardq serve`` (before the fix: five exits in 60 s marked the shard
failed for good, and a partial ``.torn-*`` copy left by the full disk made every later start
fail on the existing name).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

import shardq
from shardq.wal.fileio import Files
from support.service import REPO, Service, short_tmpdir, wait_until

BODY = 64 * 1024
TMPFS = "8m"


@pytest.fixture
def small_fs():
    """A tmpfs of 8 MiB mounted on a short path; unmounted afterwards whatever happens."""
    mnt = short_tmpdir("fs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS},mode=0700", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, leave: int) -> str:
    """A file taking all but ``leave`` bytes of the file system."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb") as f:
        f.write(b"\xff" * max(free_bytes(path) - leave, 0))
    return filler


def stats_json(data_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "shardq.cli", "stats", "--json", "--data-dir", data_dir],
                       capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    return json.loads(r.stdout)


def test_a_full_disk_fails_enqueues_loses_nothing_acknowledged_and_heals_when_space_is_freed(small_fs):
    data = os.path.join(small_fs, "data")
    log_path = os.path.join(short_tmpdir(), "serve.log")  # the log must not be on the full disk
    cfg = {"service": {"restart_backoff_max": 1}}  # segments of 64 MiB: more than the whole disk
    with Service(data_dir=data, shards=1, config=cfg, log_path=log_path) as svc:
        assert "no space to preallocate 67108864 bytes" in svc.tail(100)  # and it started all the same
        serve_pid = svc.proc.pid
        filler = fill(small_fs, leave=2 * 1024 * 1024)
        acked: dict[int, bytes] = {}
        with svc.connect(retry_s=3, request_timeout_s=5) as q:
            error = None
            for i in range(200):
                body = i.to_bytes(4, "big") * (BODY // 4)
                try:
                    acked[q.enqueue(body, key=f"k{i % 3}")] = body
                except shardq.ShardqError as e:
                    error = e
                    break
            assert isinstance(error, shardq.ShardUnavailable), repr(error)
            assert 10 <= len(acked) < 200, len(acked)
        log = svc.tail(400)
        assert "event=shard-exit shard=0" in log and "reason=disk-full" in log, log[-3000:]
        assert "No space left on device" in log
        assert "event=shard-failed" not in log  # a full disk is never given up on
        st = stats_json(data)["shards"][0]
        assert "disk full" in (st.get("reason") or st.get("last_exit") or ""), st
        assert st["last_exit"].startswith("code=4") and "No space left on device" in st["last_exit"], st

        os.unlink(filler)  # space again: the shard must serve again by itself
        with svc.connect(retry_s=5) as q:
            after = wait_until(lambda: _try_enqueue(q, b"after"), 30, 0.2, "an enqueue to succeed again")
            got = {}
            while (leases := q.dequeue_many(max_jobs=100)):
                for lease in leases:
                    got[lease.job_id] = lease.body
                q.ack_many(leases)
        assert svc.proc.pid == serve_pid and svc.proc.poll() is None  # nobody restarted serve
        missing = [jid for jid in acked if got.get(jid) != acked[jid]]
        assert not missing, f"{len(missing)} acknowledged jobs lost or changed"
        assert got[after] == b"after"
        assert set(got) - set(acked) - {after} <= {max(acked) + 1}  # at most the refused one, if a retry made it
        shard_dir = os.path.join(data, "shard-0")
        for name in os.listdir(shard_dir):  # no partial copy of a torn tail left behind
            if ".torn-" in name:
                assert os.path.getsize(os.path.join(shard_dir, name)) > 0, name


def _try_enqueue(q, body):
    try:
        return q.enqueue(body)
    except shardq.ShardUnavailable:
        return None


class _FullDisk(Files):
    """A disk that takes reads and gives no space to any write (ENOSPC)."""

    def write(self, fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_restart_that_finds_the_disk_full_exits_4_and_says_so(tmp_path, monkeypatch, capsys, caplog):
    """A shard restarted on a full disk replays, then cannot write its start's own record
    (the new token epoch): LogFailed, which escaped main() as an uncaught exception (exit 1,
    a traceback) where a failed log write exits 4. The supervisor then showed
    ``code=1: disk full`` as the last exit (the full-disk test above, under load, when
    the restart came before it read ``stats``). In this process: the exit code and the
    supervisor's line are the claim, and no process is needed for either."""
    from shardq.config import parse
    from shardq.datadir import DataDir
    from shardq.shard import process, report
    from shardq.shard.durable import DurableShard

    data = str(tmp_path / "d")
    dd = DataDir(data)
    dd.init(1)
    first = DurableShard(dd.shard_dir(0), 0, parse({}))  # its first run: a log to replay
    first.open(0.0)
    first.close()
    monkeypatch.setattr(report, "files_from_env", _FullDisk)
    code = process.main(["--data-dir", data, "--index", "0"])
    out = capsys.readouterr()
    assert code == process.EXIT_LOG_FAILED == 4, out.err[-3000:]
    failed = [json.loads(line.removeprefix("failed ")) for line in out.out.splitlines() if line.startswith("failed ")]
    assert failed == [{"kind": "disk_full", "path": os.path.join(data, "shard-0", "0000000000000001.wal"),
                       "detail": "No space left on device (ENOSPC)"}]
    assert "cannot start: write to " in caplog.text  # said, not raised (before: LogFailed escaped main)
