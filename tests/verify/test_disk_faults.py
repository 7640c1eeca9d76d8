"""``shardq verify --disk-faults``: damage to synced log data, drawn and applied as the
campaign does; its verdicts proven able to fail; then the short campaign against real
processes, which must lose nothing."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import types

import pytest

from conftest import config_from
from support.service import REPO, short_tmpdir
from shardq.errors import ShardqError
from shardq.shard.durable import Engine
from shardq.verify import build_parser, settle_defaults
from shardq.verify import main as verify_main
from shardq.verify.diskcampaign import KEPT, LOSS, REFUSED, Campaign, Found, judge, replay_command, tally
from shardq.verify.diskfaults import PAGE_BYTES, SECTOR_BYTES, Damage, candidates, choose, draw
from shardq.verify.plan import DISK_KINDS, DISK_TARGETS, DiskFault, disk_plan, fingerprint
from shardq.verify.powercut import synced_sizes
from shardq.wal.fileio import SyncLoggingFiles


def _changed(data: bytes, writes) -> bytes:
    out = bytearray(data)
    for offset, new in writes:
        out[offset:offset + len(new)] = new
    return bytes(out)


# ---------------------------------------------------------------- the damage itself
@pytest.mark.parametrize("kind", DISK_KINDS)
def test_each_kind_changes_synced_bytes_only_and_always_some(kind):
    for seed in range(200):
        rng = random.Random(seed)
        data = rng.randbytes(rng.randint(5000, 20000))
        synced = rng.randint(4700, len(data))
        writes, details = draw(kind, data, synced, rng)
        after = _changed(data, writes)
        assert after != data, (seed, kind)
        assert after[synced:] == data[synced:] and len(after) == len(data)
        assert all(0 <= o and o + len(b) <= synced for o, b in writes)
        if kind in ("zero_sector", "zero_page"):
            unit = SECTOR_BYTES if kind == "zero_sector" else PAGE_BYTES
            (offset, new), = writes
            assert offset % unit == 0 and new == bytes(len(new))
            assert len(new) == min(unit, synced - offset)
        elif kind == "bit_flip":
            (offset, new), = writes
            assert new[0] ^ data[offset] == 1 << details["bit"]
        else:
            target, page = writes[0]
            source = details["source"]
            assert target % PAGE_BYTES == 0 and source % PAGE_BYTES == 0 and target != source
            assert page == data[source:source + len(page)]
            if details["lost_original"]:
                assert writes[1] == (source, bytes(len(page)))
                assert after[source:source + len(page)] == bytes(len(page))
            else:
                assert len(writes) == 1


def test_a_fault_that_would_change_nothing_is_not_made():
    zeros = bytes(3 * PAGE_BYTES)
    assert draw("zero_sector", zeros, len(zeros), random.Random(1)) is None
    assert draw("zero_page", zeros, len(zeros), random.Random(1)) is None
    same_pages = b"x" * (3 * PAGE_BYTES)
    assert draw("misdirected", same_pages, len(same_pages), random.Random(1)) is None
    # too few synced bytes to hold two pages: no misdirected write, whatever is after them
    data = random.Random(2).randbytes(3 * PAGE_BYTES)
    assert draw("misdirected", data, PAGE_BYTES, random.Random(1)) is None
    # one non-zero sector among zeros is the one a zeroing draw must land on
    one = bytearray(zeros)
    one[5 * SECTOR_BYTES + 7] = 1
    (offset, new), = draw("zero_sector", bytes(one), len(one), random.Random(3))[0]
    assert offset == 5 * SECTOR_BYTES and new == bytes(SECTOR_BYTES)


def test_the_plan_is_fixed_by_the_seed_and_every_kind_meets_every_target():
    a, b, c = disk_plan(7, 3), disk_plan(7, 3), disk_plan(8, 3)
    assert a == b and fingerprint(a) == fingerprint(b) != fingerprint(c)
    assert sorted((f.kind, f.target) for f in a) == sorted((k, t) for k in DISK_KINDS for t in DISK_TARGETS)
    assert len(disk_plan(7, 10)) == 40


def test_the_replay_line_runs_the_same_campaign():
    a = settle_defaults(build_parser().parse_args(["--disk-faults", "--seed", "9", "--shards", "3",
                                                   "--faults-per-kind", "4", "--json", "x.json"]))
    again = build_parser().parse_args(replay_command(a).split()[2:])
    assert (again.disk_faults, again.seed, again.shards, again.faults_per_kind) == (True, 9, 3, 4)
    assert disk_plan(again.seed, again.faults_per_kind) == disk_plan(a.seed, a.faults_per_kind)


def test_files_and_their_synced_bytes_come_from_the_sync_hook(tmp_path):
    """A real log written through the hook: the newest segment's synced size is where its
    last synced record ends; sealed segments and checkpoints are whole; without a note of
    the newest segment it is never chosen; every draw stays inside the synced bytes."""
    side = str(tmp_path / "synced.log")
    shard_dir = str(tmp_path / "shard-0")
    rng = random.Random(5)
    eng = Engine(shard_dir, config_from(segment_bytes=8192, compact_min_bytes=1 << 20),
                 files=SyncLoggingFiles(side))
    try:
        for _ in range(30):
            eng.enqueue(rng.randbytes(300))
        eng.compact()
        for _ in range(60):
            eng.enqueue(rng.randbytes(300), key="k")
        while eng.shard.log.writer.size < PAGE_BYTES + 1000:  # room for a misdirected page
            eng.enqueue(rng.randbytes(300), key="k")
        found = candidates(shard_dir, synced_sizes(side))
        (newest, synced), = found["newest_segment"]
        assert synced == eng.shard.log.writer.size and newest == eng.shard.log.writer.path
        assert len(found["sealed_segment"]) >= 2 and len(found["checkpoint"]) == 1
        for path, size in found["sealed_segment"] + found["checkpoint"]:
            assert size == os.path.getsize(path)
        assert candidates(shard_dir, {})["newest_segment"] == []
        for seed in range(40):
            kind = DISK_KINDS[seed % len(DISK_KINDS)]
            shard, damage, writes = choose(kind, "newest_segment", [shard_dir], side, random.Random(seed))
            assert shard == 0 and damage.path == newest and damage.synced == synced
            assert all(o + len(b) <= synced for o, b in writes)
            assert damage.ranges == [(o, o + len(b)) for o, b in writes]
    finally:
        eng.close()


# ---------------------------------------------------------------- the verdict
def _damage(path="/d/shard-1/0000000000000003.wal", end=5000):
    return Damage("zero_sector", "sealed_segment", path, 9000, [(end - 512, end)])


def _up(jobs=3):
    return {"available": True, "status": "ready", "jobs": jobs}


def _refused(path="/d/shard-1/0000000000000003.wal", offset=4400, kind="corrupt_log"):
    return {"available": False, "status": "failed", "reason_kind": kind,
            "reason": f"corrupt log {path} at offset {offset}: CRC mismatch"}


@pytest.mark.parametrize("shards, found, verdict, said", [
    ([_up(), _up()], {0: Found([], [], 0), 1: Found([], [], 0)}, KEPT, ""),
    ([_up(), _refused()], {0: Found([], [], 0)}, REFUSED, "CRC mismatch"),
    ([_up(), _up()], {0: Found([], [], 0), 1: Found([7, 9], [], 0)}, LOSS, "2 acknowledged jobs missing"),
    ([_up(), _up()], {0: Found([], [], 0), 1: Found([], [4], 0)}, LOSS, "1 with another body"),
    ([_up(), _up(4)], {0: Found([], [], 0), 1: Found([], [], 1)}, LOSS, "1 more jobs than live"),
    ([_up(), _refused(path="/d/shard-1/0000000000000004.wal")], {0: Found([], [], 0)}, LOSS, "another file"),
    ([_up(), _refused(offset=5001)], {0: Found([], [], 0)}, LOSS, "after the damage"),
    ([_up(), _refused(kind="exit")], {0: Found([], [], 0)}, LOSS, "not as a corrupt log"),
    ([{"available": False, "error": "down"}, _refused()], {}, LOSS, "undamaged shard 0 is down"),
    ([_up(), _refused()], {0: Found([3], [], 0)}, LOSS, "undamaged shard 0"),
])
def test_the_verdict_is_kept_or_refused_only_when_nothing_acknowledged_went_unseen(shards, found, verdict, said):
    got, why = judge(1, _damage(), shards, found)
    assert got == verdict and said in why


def test_job_lookups_that_fail_count_as_missing():
    class Down:
        def job(self, job_id):
            raise ShardqError("gone")
    c = Campaign.__new__(Campaign)
    c.live = {1 << 10: b"a"}  # job ids carry their shard in the low bits: shard 0
    assert c.found(Down(), 0, {"jobs": 1}).missing == [1 << 10]


def test_the_counts_table_adds_up():
    outcomes = [types.SimpleNamespace(kind="bit_flip", target="checkpoint", verdict=REFUSED, torn_cut=False,
                                      repair={"started": True, "back": 3, "expected": 5}),
                types.SimpleNamespace(kind="bit_flip", target="checkpoint", verdict=LOSS, torn_cut=True,
                                      repair=None)]
    row = tally(outcomes)["bit_flip/checkpoint"]
    assert (row["faults"], row[REFUSED], row[LOSS], row["repaired_some"], row["torn_cut"]) == (2, 1, 1, 1, 1)


@pytest.mark.parametrize("argv, said", [
    (["--disk-faults", "--shards", "1"], "at least 2 shards"),
    (["--disk-faults", "--faults-per-kind", "0"], "at least 1"),
    (["--disk-faults", "--power-cuts"], "campaign of its own"),
])
def test_options_the_campaign_cannot_use_are_refused(argv, said, capsys):
    assert verify_main(argv) == 2
    assert said in capsys.readouterr().err


# ---------------------------------------------------------------- real processes
class _AckingCampaign(Campaign):
    """Instead of damaging a file, acks one acknowledged job of the chosen shard on the
    copy (a job gone without a refusal, as a silent cut leaves it)."""

    def apply_fault(self, damage, writes):
        import shardq
        from shardq.client.router import shard_of_job
        shard = int(os.path.basename(os.path.dirname(damage.path)).split("-")[1])
        proc = self.start(self.fault_dir, "acking.log", hook=False)
        with shardq.connect(self.fault_dir, retry_s=5) as q:
            leases = q.dequeue_many("default", max_jobs=100, visibility=60)
            mine = next(lease for lease in leases if shard_of_job(lease.job_id) == shard)
            q.ack(mine)
            for lease in leases:
                if lease is not mine:
                    q.nack(lease)
        self.kill(proc)


def test_an_acknowledged_job_missing_after_the_fault_is_a_loss():
    parent = short_tmpdir("sqdf")
    a = types.SimpleNamespace(seed=3, shards=2, faults_per_kind=1, data_dir=os.path.join(parent, "data"),
                              keep=False, json=None)
    c = _AckingCampaign(a)
    try:
        out = c.phase(1, DiskFault("bit_flip", "newest_segment", 11))
        assert out.verdict == LOSS, out
        assert "1 acknowledged jobs missing" in out.why and out.repair is None
    finally:
        c.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


def test_the_short_campaign_keeps_or_refuses_every_fault(tmp_path):
    """The CI setting: 3 faults of each kind, each kind once in the newest segment, once in
    a sealed one and once in a checkpoint. No fault may be a loss."""
    report = tmp_path / "disk.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "shardq.cli", "verify", "--disk-faults", "--seed", "20261203",
                           "--faults-per-kind", "3", "--json", str(report)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path), check=False)
    out = proc.stdout + proc.stderr
    rep = json.loads(report.read_text()) if report.exists() else None
    kept = [line for line in proc.stdout.splitlines() if line.startswith("data dir and logs kept in")]
    try:
        assert rep is not None, out[-4000:]
        losses = [f for f in rep["faults"] if f["verdict"] == LOSS]
        assert not losses, json.dumps(losses, indent=1)[:4000]
        assert proc.returncode == 0 and rep["passed"] and "VERDICT: PASS" in proc.stdout, out[-4000:]
        assert set(rep["counts"]) == {f"{k}/{t}" for k in DISK_KINDS for t in DISK_TARGETS}
        for f in rep["faults"]:
            assert f["verdict"] in (KEPT, REFUSED)
            if f["verdict"] == REFUSED:
                assert f["repair"] is not None and "corrupt log" in f["why"]
    finally:
        for line in kept:
            shutil.rmtree(os.path.dirname(line.split()[-3]), ignore_errors=True)

