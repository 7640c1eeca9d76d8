"""docs/upgrades.md, followed with real ``shardq serve`` processes as far as one version of
the code allows: an upgrade replays a data dir of every log format shardq has written
(fixtures in tests/fixtures/wal-formats/) and writes the current format from then on; a data
dir of a format this version does not read is refused and left as it was (what an older
version meets after an upgrade, simulated by a number above this version's); a router and
a serve of different wire versions do not talk (simulated by patching the version in the
processes of one side)."""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

import shardq
from support.service import REPO, Service, short_tmpdir, wait_until
from shardq.clock import FakeClock
from shardq.config import parse
from shardq.datadir import DataDir
from shardq.shard.durable import Engine
from shardq.wal.format import CHECKPOINT, FORMAT, HEADERS, MAGIC_BYTES, MAGICS, SEGMENT
from support.wal_fixtures import CONFIG, FIXTURES, jobs_of

READY, DEAD = 2, 4  # JobState values in expected-jobs.json
SERVE_CONFIG = {"queues": {"other": {}}}


def expected_jobs() -> list:
    with open(os.path.join(FIXTURES, "expected-jobs.json")) as f:
        return json.load(f)


def write_fixture(directory: str) -> list:
    """Write the scenario of tests/fixtures/wal-formats/README.md with this version's writer
    into ``directory`` (the fixture of the current format; run it when the format changes)
    and return the jobs it leaves. The newest segment is not closed: its preallocated zeros
    are cut to 512 bytes, as a crash would leave them."""
    e = Engine(directory, parse(CONFIG), clock=FakeClock(1_000_000.0))
    for i in range(40):
        e.enqueue(f"body {i}".encode() * (i % 7 + 1), key=f"k{i % 5}")
    for _ in range(6):
        (lease,) = e.dequeue()
        e.ack(lease.job_id, lease.token)
    e.compact()
    for i in range(30):
        e.enqueue(bytes(range(256)) + str(i).encode(), queue="other", priority=i % 3)
    (nacked,) = e.dequeue("other")
    (buried,) = e.dequeue("other")
    e.nack(nacked.job_id, nacked.token, error="boom")
    e.bury(buried.job_id, buried.token, error="dead")
    e.enqueue(b"tail job", key="k9")
    jobs = jobs_of(e)
    newest = os.path.join(directory, max(n for n in os.listdir(directory) if n.endswith(".wal")))
    with open(newest, "rb") as f:
        data = f.read()
    with open(newest, "wb") as f:
        f.write(data[:len(data.rstrip(b"\0")) + 512])
    return jobs


def data_dir_of(fixture: str) -> str:
    """A one-shard data dir whose shard holds the fixture's log (the metadata and the key
    file as ``serve`` makes them: the key's mode 0600 does not survive git)."""
    path = os.path.join(short_tmpdir("squp"), "data")
    DataDir(path).init(1)
    shutil.copytree(os.path.join(FIXTURES, fixture), os.path.join(path, "shard-0"))
    return path


def files_of(path: str) -> dict:
    """The log and the metadata of a data dir (or the files of a shard dir): name -> bytes."""
    out = {}
    for root, _dirs, names in os.walk(path):
        for n in names:
            if n.endswith((".wal", ".ckpt")) or n == "shardq.json" or ".torn-" in n:
                with open(os.path.join(root, n), "rb") as f:
                    out[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return out


def magic_of(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(MAGIC_BYTES)


def drain(q, queue: str) -> list:
    """Lease and ack every job of ``queue``; the leases in the order they came."""
    got = []
    while leases := q.dequeue_many(queue, max_jobs=100):
        got += leases
        assert q.ack_many(leases) == [None] * len(leases)
    return got


def cleanup(svc: Service) -> None:
    svc.stop()
    svc.log.close()
    shutil.rmtree(os.path.dirname(svc.data_dir), ignore_errors=True)


# --------------------------------------------------------------------------- upgrade
@pytest.mark.parametrize("fixture", [f"v{n}" for n in sorted(HEADERS)])
def test_an_upgrade_replays_each_log_format_through_serve(fixture):
    data = data_dir_of(fixture)
    backup = data + ".before-upgrade"
    shutil.copytree(data, backup)  # upgrade step 3, with serve stopped
    before = set(os.listdir(os.path.join(data, "shard-0")))
    expected = expected_jobs()
    svc = Service(data_dir=data, shards=1, config=SERVE_CONFIG)
    try:
        svc.start()  # step 5: this version on the old data dir
        with svc.connect() as q:
            dead = q.dead_letters("other")
            assert [(d.job_id, d.attempts, d.error) for d in dead] == \
                [(j[0], j[4], "dead") for j in expected if j[5] == DEAD]
            leased = drain(q, "default") + drain(q, "other")
            want = {j[0]: j for j in expected if j[5] != DEAD}
            assert sorted(l.job_id for l in leased) == sorted(want)
            for l in leased:
                _id, queue, key, body, attempts, _state = want[l.job_id]
                assert (l.queue, l.key, l.body.hex(), l.attempt) == (queue, key, body, attempts + 1)
            by_key = collections.defaultdict(list)
            for l in leased:
                by_key[l.key].append(l.job_id)
            assert all(ids == sorted(ids) for key, ids in by_key.items() if key is not None)  # per-key FIFO
            q.enqueue(b"after the upgrade", key="k0")
        assert svc.stop() == 0
        shard = os.path.join(data, "shard-0")
        newest = max(n for n in os.listdir(shard) if n.endswith(".wal"))
        assert magic_of(os.path.join(shard, newest)) == MAGICS[(SEGMENT, FORMAT)]
        if fixture != f"v{FORMAT}":
            assert newest not in before  # an older format's newest segment is sealed, never appended to

        svc.log.close()
        svc.start()  # and again: what the upgraded version wrote replays
        with svc.connect() as q:
            assert [l.body for l in drain(q, "default")] == [b"after the upgrade"]
            assert drain(q, "other") == [] and [d.job_id for d in q.dead_letters("other")] == [dead[0].job_id]
        assert svc.stop() == 0
        # the backup is the data dir as the older version left it: the way back (docs/upgrades.md)
        assert files_of(os.path.join(backup, "shard-0")) == files_of(os.path.join(FIXTURES, fixture))
    finally:
        cleanup(svc)
        shutil.rmtree(backup, ignore_errors=True)


# --------------------------------------------------------------------------- refused, unchanged
def serve_once(data: str) -> subprocess.CompletedProcess:
    cfg = data + ".toml"
    with open(cfg, "w") as f:
        f.write('[http]\nlisten = ""\n[queues.other]\n')
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardq.cli", "serve", "--config", cfg, "--data-dir", data,
                           "--shards", "1"], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def test_a_log_of_a_later_format_is_refused_and_left_as_it_was():
    data = data_dir_of(f"v{FORMAT}")
    try:
        shard = os.path.join(data, "shard-0")
        newest = os.path.join(shard, max(n for n in os.listdir(shard) if n.endswith(".wal")))
        later = MAGICS[(SEGMENT, FORMAT)][:-1] + bytes([FORMAT + 1])  # what the next format would write
        with open(newest, "r+b") as f:
            f.write(later)
        before = files_of(data)
        r = serve_once(data)
        assert r.returncode == 1, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: ShardUnavailable: no shard could start: shard 0: corrupt log {newest} "
                               f"at offset 0: written by a newer shardq (log format {FORMAT + 1}"), last
        assert files_of(data) == before
    finally:
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)


def test_a_data_dir_of_a_later_metadata_format_is_refused_and_left_as_it_was():
    data = data_dir_of(f"v{FORMAT}")
    try:
        meta = os.path.join(data, "shardq.json")
        with open(meta) as f:
            m = json.load(f)
        m["format"] += 1
        with open(meta, "w") as f:
            json.dump(m, f)
        before = files_of(data)
        r = serve_once(data)
        assert r.returncode == 5, r.stderr[-3000:]
        assert f"InvalidConfig: {data}: unsupported format {m['format']}" in r.stderr.strip().splitlines()[-1]
        assert files_of(data) == before
    finally:
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)


# --------------------------------------------------------------------------- the handshake
SITECUSTOMIZE = textwrap.dedent("""\
    # Every Python process started with this directory on PYTHONPATH speaks another wire version.
    import os
    if os.environ.get("SHARDQ_TEST_WIRE_VERSION"):
        from shardq.protocol import sockio
        sockio.WIRE_VERSION = int(os.environ["SHARDQ_TEST_WIRE_VERSION"])
        sockio.ADMITTED = sockio._ADMITTED_PREFIX + b" wire=%d" % sockio.WIRE_VERSION
    """)


def other_wire_env(tmp_path, version: int) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dict(os.environ, SHARDQ_TEST_WIRE_VERSION=str(version),
                PYTHONPATH=os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")]))


ENQUEUE = "import shardq; shardq.connect({data!r}, retry_s=60).enqueue(b'x', key='k')"


def test_a_router_and_a_serve_of_different_wire_versions_do_not_talk(tmp_path):
    ahead = other_wire_env(tmp_path, 2)
    # A router one version ahead of serve (its apps upgraded first).
    with Service(shards=1) as svc:
        r = subprocess.run([sys.executable, "-c", ENQUEUE.format(data=svc.data_dir)], env=ahead,
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 1
        assert ("shardq.errors.ProtocolError: shard 0: the shard speaks wire=1, this client wire=2: "
                "upgrade the apps that embed the router together with serve") in r.stderr, r.stderr[-3000:]
        with svc.connect() as q:
            assert q.dequeue("default") is None  # refused before any request

    # A serve one version ahead of the router (serve upgraded first).
    data = os.path.join(short_tmpdir("squp"), "data")
    cfg = data + ".toml"
    with open(cfg, "w") as f:
        f.write('[http]\nlisten = ""\n')
    log_path = data + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shardq.cli", "serve", "--config", cfg, "--data-dir", data,
                                 "--shards", "1"], stdout=log, stderr=subprocess.STDOUT, env=ahead,
                                stdin=subprocess.DEVNULL)
    try:
        def ready():
            assert proc.poll() is None, open(log_path).read()[-3000:]
            return "event=ready" in open(log_path).read()
        wait_until(ready, 30, 0.02, "serve ready")
        with pytest.raises(shardq.ProtocolError, match="the shard speaks wire=2, this client wire=1: upgrade"):
            with shardq.connect(data, retry_s=60) as q:
                q.enqueue(b"x", key="k")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        e = Engine(os.path.join(data, "shard-0"), parse({}), clock=FakeClock(0.0))
        assert e.state.jobs == {}  # refused before any request
        e.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)


# --------------------------------------------------------------------------- fixtures
def test_every_log_format_has_a_fixture(tmp_path):
    """Each format the code reads has a fixture written in it, and the fixture of the
    current one is what this version's writer makes of the scenario. When FORMAT changes,
    write the new fixture with write_fixture (tests/fixtures/wal-formats/README.md)."""
    assert sorted(HEADERS) == list(range(1, FORMAT + 1))
    for n in HEADERS:
        d = os.path.join(FIXTURES, f"v{n}")
        assert os.path.isdir(d), f"no fixture of log format {n}: write it with write_fixture"
        for name in os.listdir(d):
            kind = CHECKPOINT if name.endswith(".ckpt") else SEGMENT
            assert magic_of(os.path.join(d, name)) == MAGICS[(kind, n)], (n, name)
        assert any(name.endswith(".ckpt") for name in os.listdir(d)), f"v{n} holds no checkpoint"
    assert write_fixture(str(tmp_path / "now")) == expected_jobs()


@pytest.mark.parametrize("command", [["wal", "check"], ["wal", "repair", "--force"]])
def test_wal_check_and_repair_refuse_a_later_format_and_change_nothing(command):
    """A newer file is not damage: repair would salvage it in this version's format."""
    data = data_dir_of(f"v{FORMAT}")
    try:
        shard = os.path.join(data, "shard-0")
        newest = os.path.join(shard, max(n for n in os.listdir(shard) if n.endswith(".wal")))
        with open(newest, "r+b") as f:
            f.write(MAGICS[(SEGMENT, FORMAT)][:-1] + bytes([FORMAT + 1]))
        before = files_of(data)
        r = subprocess.run([sys.executable, "-m", "shardq", *command[:2], shard, *command[2:]],
                           capture_output=True, text=True, timeout=60, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO), stdin=subprocess.DEVNULL)
        assert r.returncode != 0, r.stdout + r.stderr
        assert "NewerFormat" in r.stderr and f"log format {FORMAT + 1}" in r.stderr, r.stdout + r.stderr
        assert files_of(data) == before
    finally:
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
