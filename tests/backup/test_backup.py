"""``shardq backup`` and ``shardq restore`` against a real ``shardq serve`` (docs/backup.md).

Under load (producers enqueueing, a worker acking, compaction running all along): every
enqueue acknowledged before the backup began is in the restored copy, no enqueue sent
after a shard's cut is, no job whose ack was acknowledged before the backup began comes
back; ``serve`` starts on the restored dir and exactly those jobs dequeue. A damaged copy
(a flipped byte in a record, a missing or cut file, another key file, an edited manifest)
is refused with the file and offset named, and nothing is handed over.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

import shardq

from shardq.backup.logfiles import LogFile, WriteChain
from shardq.client.routing import job_shard
from shardq.config import Config
from shardq.shard.state import ShardState
from shardq.wal.format import HEADER, MAGIC_BYTES, parse_name

from support.service import REPO, Service, short_tmpdir, wait_until

# Small segments and compaction thresholds: segments rotate and checkpoints replace them
# all through the test, so a backup meets both (and files deleted after its cut).
CONFIG = {"http": {"listen": ""}, "queues": {"work": {"visibility_timeout": 1}, "keep": {}},
          "limits": {"segment_bytes": 65536, "compact_min_bytes": 131072}}
CUT = re.compile(r"^shard (\d+): cut at (\S+Z): (\d{16}\.wal) up to byte (\d+) \(write (\d+), jobs numbered up to "
                 r"(\d+)\); (\d+) files?, ", re.M)


def cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd or REPO)


def cut_times(stdout: str, shards: int) -> dict[int, float]:
    found = {int(m[1]): datetime.datetime.fromisoformat(m[2]).timestamp() for m in CUT.finditer(stdout)}
    assert sorted(found) == list(range(shards)), stdout
    return found


def live_jobs(data_dir: str, shards: int) -> dict[int, bytes]:
    """Job id -> body of every live job in a data dir, replayed offline (as serve would)."""
    jobs: dict[int, bytes] = {}
    for i in range(shards):
        d = os.path.join(data_dir, f"shard-{i}")
        state, chain = ShardState(i, Config()), WriteChain()
        names = sorted((p[0], p[1] == "wal", n) for n in os.listdir(d) if (p := parse_name(n)))
        for _, is_segment, name in names:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                state.replay(LogFile(path, f.read(), "wal" if is_segment else "ckpt", chain).records())
        jobs.update({jid: j.body for jid, j in state.jobs.items()})
    return jobs


@pytest.fixture
def tmp():
    path = short_tmpdir("sqbk")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_backup_under_load_holds_what_was_acknowledged_before_it_and_nothing_sent_after_its_cut(tmp):
    made: list[tuple[int, float, float]] = []       # (job id, enqueue sent, enqueue acknowledged)
    acked: dict[int, tuple[float, float]] = {}      # job id -> (ack sent, ack acknowledged)
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce(n: int, q) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.time()
            jid = q.enqueue(f"p{n}-{i}".encode(), key=f"k{i % 64}", queue=("work", "keep")[i % 2])
            made.append((jid, t0, time.time()))
            i += 1

    def work(q) -> None:
        while not stop.is_set():
            leases = q.dequeue_many("work", max_jobs=20, wait=0.05)
            t0 = time.time()
            outcomes = q.ack_many(leases) if leases else []
            t1 = time.time()
            for lease, error in zip(leases, outcomes):
                if error is None:
                    acked.setdefault(lease.job_id, (t0, t1))

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)

    dest, new = os.path.join(tmp, "backup"), os.path.join(tmp, "restored")
    with Service(data_dir=os.path.join(tmp, "data"), shards=2, config=CONFIG) as svc:
        routers = [svc.connect(retry_s=20) for _ in range(4)]
        threads = [threading.Thread(target=guarded, args=(produce, n, routers[n])) for n in range(3)]
        threads.append(threading.Thread(target=guarded, args=(work, routers[3])))
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(made) >= 2000 and len(acked) >= 400 or errors, 60, what="load before the backup")
            began = time.time()
            r = cli("backup", dest, "--data-dir", svc.data_dir)
            assert r.returncode == 0, r.stderr
            cuts = cut_times(r.stdout, 2)
            assert began < min(cuts.values())
            # the producers go on after the cuts: enqueues sent after them must not be in the copy
            wait_until(lambda: sum(t0 > max(cuts.values()) for _, t0, _ in made[-300:]) >= 200 or errors, 60,
                       what="enqueues after the cut")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            for q in routers:
                q.close()
        assert not errors, errors
        with svc.connect() as q:
            assert sum(s["compactions"] for s in q.stats()["shards"]) >= 2  # checkpoints, deleted segments
            original_id = q.service_id
        assert not [n for i in range(2) for n in os.listdir(os.path.join(svc.data_dir, f"shard-{i}"))
                    if n.startswith("backup-")]  # the staging dirs are gone

    r = cli("restore", dest, "--data-dir", new)
    assert r.returncode == 0, r.stderr
    assert f"beside the running service with: shardq serve --data-dir {new} --shards 2 " in r.stdout
    copy = live_jobs(new, 2)

    def shard_cut(jid: int) -> float:
        return cuts[job_shard(jid, 2)]

    must_have = [jid for jid, _, t1 in made if t1 < began and (jid not in acked or acked[jid][0] > shard_cut(jid))]
    must_not = [jid for jid, t0, _ in made if t0 > shard_cut(jid)]
    gone_before = [jid for jid, (_, t1) in acked.items() if t1 < began]
    assert len(must_have) > 500 and len(must_not) >= 200 and len(gone_before) > 200
    assert not [jid for jid in must_have if jid not in copy]
    assert not [jid for jid in must_not if jid in copy]
    assert not [jid for jid in gone_before if jid in copy]
    bodies = {jid: t for jid, t, _ in made}
    assert all(jid in bodies for jid in copy)  # nothing the producers did not make

    # serve starts on the restored dir, under a new service id, and every job in it dequeues
    with Service(data_dir=new, shards=2, config=CONFIG) as restored, restored.connect(retry_s=20) as q:
        assert q.service_id != original_id
        got: set[int] = set()

        def drain() -> bool:
            for queue in ("work", "keep"):
                leases = q.dequeue_many(queue, max_jobs=1000, wait=0.1)
                q.ack_many(leases)
                got.update(lease.job_id for lease in leases)
            return got >= set(copy)
        wait_until(drain, 30, what="every restored job to dequeue")
        assert got == set(copy)


@pytest.fixture(scope="module")
def backup_dir():
    """A finished backup of a service holding a few hundred jobs in two queues."""
    base = short_tmpdir("sqbkm")
    with Service(data_dir=os.path.join(base, "data"), shards=2, config=CONFIG) as svc, svc.connect() as q:
        q.enqueue_many([{"body": b"x" * (1 + i % 300), "key": f"k{i % 9}", "queue": "keep"} for i in range(600)])
        leases = q.dequeue_many("keep", max_jobs=50)  # one per key: 9
        assert len(leases) == 9 and q.ack_many(leases) == [None] * 9
        r = cli("backup", os.path.join(base, "backup"), "--data-dir", svc.data_dir)
        assert r.returncode == 0, r.stderr
    yield os.path.join(base, "backup")
    shutil.rmtree(base, ignore_errors=True)


def damaged(backup_dir: str, tmp: str, damage) -> tuple[subprocess.CompletedProcess, str]:
    copy = os.path.join(tmp, "copy")
    shutil.copytree(backup_dir, copy)
    damage(copy)
    new = os.path.join(tmp, "new")
    r = cli("restore", copy, "--data-dir", new)
    assert not os.path.exists(new) and not [n for n in os.listdir(tmp) if ".restoring-" in n]  # nothing handed over
    return r, copy


def newest_segment(copy: str, shard: int) -> str:
    d = os.path.join(copy, f"shard-{shard}")
    return os.path.join(d, max(n for n in os.listdir(d) if n.endswith(".wal")))


def record_starts(data: bytes) -> list[int]:
    offsets, off = [], MAGIC_BYTES
    while off + HEADER.size <= len(data):
        offsets.append(off)
        off += HEADER.size + HEADER.unpack_from(data, off)[1]
    return offsets


def test_restore_refuses_a_flipped_byte_in_a_record_naming_the_file_and_the_record(backup_dir, tmp):
    where = {}

    def flip(copy):
        path = newest_segment(copy, 1)
        data = bytearray(open(path, "rb").read())
        pos = len(data) // 2
        data[pos] ^= 0x01
        open(path, "wb").write(data)
        where.update(path=path, record=max(o for o in record_starts(bytes(data)) if o <= pos))

    r, _ = damaged(backup_dir, tmp, flip)
    assert r.returncode == 1, r.stderr
    assert f"error: CorruptLog: corrupt log {where['path']} at byte offset {where['record']}: " in r.stderr


def test_restore_refuses_a_missing_or_shortened_file(backup_dir, tmp):
    def remove(copy):
        os.unlink(newest_segment(copy, 0))
    r, copy = damaged(backup_dir, tmp, remove)
    assert r.returncode == 1
    missing = newest_segment(backup_dir, 0).replace(backup_dir, copy)
    assert f"corrupt log {missing} at byte offset 0: missing" in r.stderr
    shutil.rmtree(copy)

    def shorten(copy):
        path = newest_segment(copy, 1)
        os.truncate(path, os.path.getsize(path) - 10)
    r, copy = damaged(backup_dir, tmp, shorten)
    size = os.path.getsize(newest_segment(backup_dir, 1))
    assert r.returncode == 1
    assert f"at byte offset {size - 10}: holds {size - 10} bytes, the manifest says {size}" in r.stderr


def test_restore_refuses_another_key_file_and_an_edited_manifest(backup_dir, tmp):
    def other_key(copy):
        with open(os.path.join(copy, "authkey"), "w") as f:
            f.write("ab" * 32)
    r, copy = damaged(backup_dir, tmp, other_key)
    assert r.returncode == 1
    assert re.search(rf"corrupt log {re.escape(copy)}/authkey at byte offset 0: its sha256 is \w+, the manifest's "
                     r"\w+: the file changed after the backup", r.stderr), r.stderr
    shutil.rmtree(copy)

    def edit(copy):
        path = os.path.join(copy, "manifest.json")
        text = open(path).read()
        open(path, "w").write(text.replace('"shards": 2', '"shards": 3', 1))
    r, _ = damaged(backup_dir, tmp, edit)
    assert r.returncode == 1
    assert "manifest.json at byte offset 0: the manifest's own sha256 does not match" in r.stderr


def test_restore_writes_nothing_into_a_non_empty_dir_and_refuses_what_is_not_a_backup(backup_dir, tmp):
    new = os.path.join(tmp, "new")
    os.mkdir(new)
    open(os.path.join(new, "mine"), "w").close()
    r = cli("restore", backup_dir, "--data-dir", new)
    assert r.returncode == 2 and "is not empty" in r.stderr
    assert os.listdir(new) == ["mine"]
    r = cli("restore", tmp, "--data-dir", os.path.join(tmp, "other"))
    assert r.returncode == 2 and "is not a shardq backup: no manifest.json" in r.stderr
    # a good copy restores into an empty directory, under a new service id, key file 0600
    os.unlink(os.path.join(new, "mine"))
    r = cli("restore", backup_dir, "--data-dir", new)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^shard 0: \d+ files?, \d+ records verified; \d+ jobs as of the cut", r.stdout, re.M)
    assert sum(int(n) for n in re.findall(r"(\d+) jobs as of", r.stdout)) == 600 - 9
    assert oct(os.stat(os.path.join(new, "authkey")).st_mode & 0o777) == "0o600"
    meta = json.load(open(os.path.join(new, "shardq.json")))
    old = json.load(open(os.path.join(backup_dir, "shardq.json")))
    assert meta["id"] != old["id"] and meta["restored_from"]["id"] == old["id"]
    # a backup needs a running service: nothing serves the restored dir yet
    r = cli("backup", os.path.join(tmp, "again"), "--data-dir", new)
    assert r.returncode == 1 and "ServiceNotRunning" in r.stderr
    assert not os.path.exists(os.path.join(tmp, "again"))


def test_staged_files_outlive_compaction_and_stale_staging_dirs_go(tmp):
    with Service(data_dir=os.path.join(tmp, "data"), shards=2, config=CONFIG) as svc, svc.connect() as q:
        q.enqueue_many([{"body": b"y" * 200, "queue": "keep"} for _ in range(2000)])
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        stale = os.path.join(svc.data_dir, "shard-0", f"backup-{int(gone.stdout)}-ab")
        os.mkdir(stale)
        before = [s["compactions"] for s in q.stats()["shards"]]
        cuts = q.backup_cuts(f"backup-{os.getpid()}-cd")
        # enqueue and ack until every shard has compacted since its cut: the files it staged are deleted
        while any(s["compactions"] <= b for s, b in zip(q.stats()["shards"], before)):
            q.ack_many(q.dequeue_many("keep", max_jobs=500))
            q.enqueue_many([{"body": b"z" * 200, "queue": "keep"} for _ in range(500)])
        for cut in cuts:
            shard_dir = os.path.join(svc.data_dir, f"shard-{cut['shard']}")
            assert not os.path.exists(os.path.join(shard_dir, cut["files"][0][0]))
            chain = WriteChain()
            for name, size in cut["files"]:
                with open(os.path.join(shard_dir, cut["stage"], name), "rb") as f:
                    LogFile(name, f.read(size), parse_name(name)[1], chain).check()
            assert chain.next_write - 1 == cut["write"]
        r = cli("backup", os.path.join(tmp, "b"), "--data-dir", svc.data_dir)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(stale)  # its backup process is gone
        assert os.path.isdir(os.path.join(svc.data_dir, "shard-0", f"backup-{os.getpid()}-cd"))  # ours lives
        r = cli("backup", os.path.join(tmp, "b"), "--data-dir", svc.data_dir)
        assert r.returncode == 2 and "is not empty" in r.stderr


def test_restore_prints_a_serve_that_runs_beside_the_service_it_was_taken_from(tmp):
    """Issue 44, items 9 and 14: an operator checks a restored copy before switching, while
    the original still serves on the port of the config both read (config/shardq.toml in
    the directory they run in). The command restore prints must start there and then, and
    serve the copy's jobs; it named the taken port before (serve exited 5)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    os.mkdir(os.path.join(tmp, "config"))
    with open(os.path.join(tmp, "config", "shardq.toml"), "w") as f:
        f.write(f'[http]\nlisten = "127.0.0.1:{port}"\n')
    data, dest, new = (os.path.join(tmp, n) for n in ("data", "backup", "restored"))
    with Service(data_dir=data, shards=2, config={"http": {"listen": f"127.0.0.1:{port}"}}) as svc:
        assert svc.http_url() == f"http://127.0.0.1:{port}/"
        with svc.connect() as q:
            jid = q.enqueue(b"check me before switching", queue="billing")
        assert cli("backup", dest, "--data-dir", data, cwd=tmp).returncode == 0
        r = cli("restore", dest, "--data-dir", new, cwd=tmp)
        assert r.returncode == 0, r.stderr
        argv = shlex.split(re.search(r"beside the running service with: (.*)$", r.stdout, re.M)[1])
        assert argv[:2] == ["shardq", "serve"]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(os.path.join(tmp, "beside.log"), "wb") as log:
            beside = subprocess.Popen([sys.executable, "-m", "shardq.cli", *argv[1:]], cwd=tmp, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            def copy_serves():
                assert beside.poll() is None, open(os.path.join(tmp, "beside.log")).read()
                try:
                    with shardq.connect(new, retry_s=0.2) as c:
                        return c.job(jid)
                except shardq.ShardUnavailable:
                    return None
            job = wait_until(copy_serves, 30, 0.05, "the restored copy to serve")
            assert job["queue"] == "billing" and job["state"] == "ready"
            with svc.connect() as q:  # the original serves on, its job untouched
                assert q.job(jid)["state"] == "ready"
        finally:
            kids = psutil.Process(beside.pid).children(recursive=True) if beside.poll() is None else []
            beside.send_signal(signal.SIGTERM)
            try:
                assert beside.wait(20) == 0
            finally:
                for pid in [beside.pid, *(k.pid for k in kids)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def test_the_manifest_times_come_from_the_callers_clock(tmp):
    from shardq.backup.take import backup
    from shardq.clock import FakeClock
    with Service(data_dir=os.path.join(tmp, "data"), shards=1, config=CONFIG) as svc:
        m = backup(svc.data_dir, os.path.join(tmp, "backup"), FakeClock(1234.5))
    assert (m.started, m.finished) == (1234.5, 1234.5)
    with open(os.path.join(tmp, "backup", "manifest.json")) as f:
        written = json.load(f)["manifest"]
    assert (written["started"], written["finished"]) == (1234.5, 1234.5)


@pytest.mark.parametrize("dest_exists", [False, True], ids=["new-dest", "empty-dest"])
def test_a_backup_out_of_space_names_the_file_and_dest_and_leaves_dest_as_it_was(tmp, monkeypatch, capsys,
                                                                                 dest_exists):
    """It said only ``OSError: [Errno 28] No space left on device``. The disk is full for
    what the backup writes into DEST only (os.write of a descriptor open there fails with
    ENOSPC); the data dir, the shards and the sockets write as ever."""
    import errno

    from shardq.cli.main import main as shardq_main
    dest = os.path.join(tmp, "backup")
    if dest_exists:
        os.mkdir(dest, 0o700)
    real_write = os.write
    refused: list[str] = []

    def full_in_dest(fd, data):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(dest + os.sep):
            refused.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with Service(data_dir=os.path.join(tmp, "data"), shards=2, config=CONFIG) as svc:
        with svc.connect() as q:
            q.enqueue_many([{"body": b"x" * 100, "queue": "keep"} for _ in range(50)])
        capsys.readouterr()
        monkeypatch.setattr(os, "write", full_in_dest)
        rc = shardq_main(["backup", dest, "--data-dir", svc.data_dir])
        monkeypatch.undo()
    err = capsys.readouterr().err
    [line] = [l for l in err.splitlines() if l.startswith("error:")]
    assert rc == 1 and refused, err
    assert line.startswith(f"error: OSError: [Errno 28] No space left on device: {refused[0]}: "), line
    assert f"the backup into {dest} stopped" in line, line
    assert ("left it empty, as it was" if dest_exists else f"removed {dest}, which it had made") in line, line
    assert (os.listdir(dest) == []) if dest_exists else not os.path.exists(dest)
