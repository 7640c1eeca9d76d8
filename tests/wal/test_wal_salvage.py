"""``shardq wal repair`` on damage in synced data (format 3): every record that reads whole
is kept, only the damaged ones are dropped, and their jobs are named."""
from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys

import pytest

from support.faults import PowerCutFiles
from shardq.errors import CorruptLog, DataDirLocked
from shardq.shard.durable import Engine
from shardq.shard.salvage import salvage
from shardq.wal.format import HEADER, HEADER_BYTES, MAGIC_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(data: bytes) -> list[tuple[int, int]]:
    out, off = [], MAGIC_BYTES
    while off + HEADER_BYTES <= len(data) and (length := HEADER.unpack_from(data, off)[1]):
        out.append((off, off + HEADER_BYTES + length))
        off += HEADER_BYTES + length
    return out


def _build(tmp_path, make_config, clock, n=200):
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=1 << 20)
    files = PowerCutFiles()
    e = Engine(d, config, clock=clock, files=files)
    bodies = {e.enqueue(f"job {i} ".encode() * 30, key=f"k{i % 9}"): f"job {i} ".encode() * 30 for i in range(n)}
    acked = []
    for lease in e.dequeue(max_jobs=5):
        e.ack(lease.job_id, lease.token)
        acked.append(lease.job_id)
    path = e.shard.log.writer.path
    files.kill()
    return d, config, bodies, acked, path


def test_repair_keeps_every_job_outside_the_damaged_bytes_byte_for_byte(tmp_path, make_config, clock):
    d, config, bodies, acked, path = _build(tmp_path, make_config, clock)
    with open(path, "rb") as f:
        data = f.read()
    recs = _records(data)
    at = recs[len(recs) // 3][0] + 100
    at -= at % 512
    damaged = bytearray(data)
    damaged[at:at + 512] = bytes(512)
    with open(path, "wb") as f:
        f.write(damaged)
    with pytest.raises(CorruptLog):
        Engine(d, config, clock=clock)
    # The jobs whose enqueue record overlaps the zeroed sector are the only ones lost.
    e_ids = sorted(bodies)
    hit = [i for i, (s, t) in enumerate(recs) if s < at + 512 and t > at]
    # Record 0 is the start's token epoch; record k (1..200) is the k-th enqueue.
    lost = {e_ids[i - 1] for i in hit if 1 <= i <= len(e_ids)}
    assert lost
    done = salvage(d, config=config)
    text = "\n".join(done)
    assert f"{path}: bytes {recs[hit[0]][0]}.." in text, text
    line = text.split("jobs not recovered (enqueued in the damaged bytes): ")[1].split("\n")[0]
    named = set(map(int, re.findall(r"\d+", line.split("(", 1)[1])))
    assert named == lost, (sorted(named), sorted(lost))
    e = Engine(d, config, clock=clock)
    expected = {j: b for j, b in bodies.items() if j not in lost and j not in acked}
    assert {j: job.body for j, job in e.state.jobs.items()} == expected
    # The originals are kept, readable by the owner only.
    backups = [n for n in os.listdir(d) if n.startswith("repair-")]
    assert len(backups) == 1 and os.stat(os.path.join(d, backups[0])).st_mode & 0o777 == 0o700
    with open(os.path.join(d, backups[0], os.path.basename(path)), "rb") as f:
        assert f.read() == bytes(damaged)
    # Repair -> append -> reread.
    new = e.enqueue(b"after repair")
    e.close()
    e = Engine(d, config, clock=clock)
    assert e.state.jobs[new].body == b"after repair" and len(e.state.jobs) == len(expected) + 1
    e.close()


def test_repair_refuses_while_the_shard_directory_is_locked(tmp_path, make_config, clock):
    d, config, *_ = _build(tmp_path, make_config, clock, n=5)
    fd = os.open(os.path.join(d, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(DataDirLocked):
            salvage(d, config=config)
    finally:
        os.close(fd)


def test_wal_check_shows_the_damaged_range_and_repair_needs_force(tmp_path, make_config, clock):
    d, config, bodies, acked, path = _build(tmp_path, make_config, clock, n=30)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    recs = _records(bytes(data))
    victim = recs[10]  # the 10th enqueue (record 0 is the start's token epoch)
    data[victim[0] + HEADER_BYTES + 5] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)
    run = lambda *a: subprocess.run([sys.executable, "-m", "shardq.cli", "wal", *a], capture_output=True,  # noqa: E731 - a one-line local helper
                                    text=True, cwd=REPO, timeout=60)
    r = run("check", d)
    assert r.returncode == 1
    assert (f"corrupt {path} records=" in r.stdout and f"at offset {victim[0]}: bytes {victim[0]}..{victim[1]} "
            "do not read" in r.stdout and f"intact records after them, at offsets {recs[11][0]}.." in r.stdout), \
        r.stdout
    r = run("repair", d)
    assert r.returncode == 2 and "--force" in r.stderr
    r = run("repair", d, "--force")
    assert r.returncode == 0, r.stderr
    lost = sorted(bodies)[9]
    assert f"jobs not recovered (enqueued in the damaged bytes): 1 ({lost})" in r.stdout, r.stdout
    assert run("check", d).returncode == 0


def _repaired(d, config, clock, bodies) -> tuple[Engine, dict, list[str]]:
    """Run the salvage, reopen the shard, and check every job that came back is the job
    that was enqueued, byte for byte: (engine, {id: body}, what repair said)."""
    done = salvage(d, config=config)
    e = Engine(d, config, clock=clock)
    back = {j: job.body for j, job in e.state.jobs.items()}
    assert all(bodies[j] == b for j, b in back.items())
    return e, back, done


def _refused_then_repaired(d, config, clock, bodies) -> tuple[Engine, dict, list[str]]:
    """The shard refuses its damaged log; then :func:`_repaired`."""
    with pytest.raises(CorruptLog):
        Engine(d, config, clock=clock)
    return _repaired(d, config, clock, bodies)


def _named(done: list[str]) -> set[int]:
    """Every job id repair says it could not recover or could not bring up to date."""
    out: set[int] = set()
    for line in done:
        if line.startswith(("jobs not recovered", "jobs whose later changes")) and "(" in line.split(": ", 1)[1]:
            out |= set(map(int, re.findall(r"\d+", line.split(": ", 1)[1].split("(", 1)[1])))
    return out


def test_repair_salvages_a_segment_whose_magic_is_damaged(tmp_path, make_config, clock):
    """A zeroed first sector takes the file's magic with it: still a format-3 file (its
    records carry their mark), refused, and salvaged like any other damage."""
    d, config, bodies, acked, path = _build(tmp_path, make_config, clock)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[:512] = bytes(512)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptLog) as info:
        Engine(d, config, clock=clock)
    assert info.value.offset == 0 and "intact records after them" in info.value.reason
    e, back, done = _repaired(d, config, clock, bodies)
    assert back
    assert set(bodies) - set(acked) - set(back) <= _named(done)
    e.close()


@pytest.mark.parametrize("seed", range(6))
def test_repair_of_a_misdirected_page_starts_and_names_every_job_it_does_not_bring_back(tmp_path, make_config,
                                                                                          clock, seed):
    """A page of older records written over newer ones: the copy's records read whole but
    belong to earlier writes. Repair skips them, drops what they overwrote, and the shard
    starts with every other job as it was."""
    import random
    rnd = random.Random(seed)
    d, config, bodies, acked, path = _build(tmp_path, make_config, clock)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    end = _records(bytes(data))[-1][1]
    pages = end // 4096
    src, dst = rnd.sample(range(pages), 2)
    data[dst * 4096:(dst + 1) * 4096] = data[src * 4096:(src + 1) * 4096]
    with open(path, "wb") as f:
        f.write(data)
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    assert set(bodies) - set(acked) - set(back) <= _named(done)
    e.close()


def test_a_damaged_checkpoint_record_loses_only_its_own_jobs(tmp_path, make_config, clock):
    """Checkpoint records hold about CHECKPOINT_CHUNK_BYTES of jobs each, so a lost sector
    costs a small share of them, and repair names them."""
    from shardq import limits
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=1 << 22)
    e = Engine(d, config, clock=clock)
    bodies = {e.enqueue(os.urandom(200), key=f"k{i % 50}"): None for i in range(5000)}
    bodies = {j: job.body for j, job in e.state.jobs.items()}
    e.compact()
    e.close()
    ckpt = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".ckpt"))
    with open(ckpt, "rb") as f:
        data = bytearray(f.read())
    assert len(_records(bytes(data))) >= len(data) // limits.CHECKPOINT_CHUNK_BYTES
    at = len(data) // 2 - len(data) // 2 % 512
    data[at:at + 512] = bytes(512)
    with open(ckpt, "wb") as f:
        f.write(data)
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    missing = set(bodies) - set(back)
    assert 0 < len(missing) < len(bodies) // 5, len(missing)
    # Named, but for the jobs whose first bytes lay in the zeroed sector itself (about 250
    # bytes each): nothing is left of them to read.
    assert len(missing - _named(done)) <= 512 // 200 + 1, sorted(missing - _named(done))
    e.close()


@pytest.mark.parametrize("fault", ["cut", "flip"])
def test_a_damaged_checkpoint_trailer_loses_no_job_of_the_segment_after_it(tmp_path, make_config, clock, fault):
    """The trailer (a checkpoint's last record) says which write comes next. Damaged, repair
    once read the next segment expecting write 1, took its first record (which reads whole)
    for damaged bytes and dropped its jobs; every job must come back, none named lost."""
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=1 << 20)
    files = PowerCutFiles()
    e = Engine(d, config, clock=clock, files=files)
    for i in range(100):
        e.enqueue(f"before {i} ".encode() * 20, key=f"k{i % 7}")
    e.compact()
    e.enqueue_many([(f"after {i} ".encode() * 20, f"k{i % 7}", "default", 0.0, 0, None) for i in range(50)])
    for i in range(10):
        e.enqueue(f"single {i} ".encode() * 20)
    bodies = {j: job.body for j, job in e.state.jobs.items()}
    files.kill()
    ckpt = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".ckpt"))
    with open(ckpt, "rb") as f:
        data = bytearray(f.read())
    if fault == "cut":
        del data[-20:]
    else:
        data[-5] ^= 0x40
    with open(ckpt, "wb") as f:
        f.write(data)
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    assert back == bodies, sorted(set(bodies) - set(back))
    assert _named(done) == set(), done
    assert not [line for line in done if ".wal: bytes" in line], done
    e.close()


def _batch_then_acks(tmp_path, make_config, clock, tail_enqueue=False):
    """100 single enqueues, one batch of 50 in one record, then records that enqueue
    nothing (leases and acks of early jobs), and, if ``tail_enqueue``, one more enqueue."""
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=1 << 20)
    files = PowerCutFiles()
    e = Engine(d, config, clock=clock, files=files)
    for i in range(100):
        e.enqueue(f"single {i} ".encode() * 10, key=f"k{i % 5}")
    batch = e.enqueue_many([(f"batch {i} ".encode() * 30, None, "default", 0.0, 0, None) for i in range(50)])
    for lease in e.dequeue(max_jobs=3):
        e.ack(lease.job_id, lease.token)
    if tail_enqueue:
        e.enqueue(b"the last one")
    bodies = {j: job.body for j, job in e.state.jobs.items()}
    path = e.shard.log.writer.path
    files.kill()
    with open(path, "rb") as f:
        data = f.read()
    rec = next((s, t) for s, t in _records(data) if t - s > 5000)  # the batch's record
    return d, config, bodies, batch, path, data, rec


@pytest.mark.parametrize("where", ["middle", "start"])
def test_repair_names_every_job_of_damaged_bytes_with_no_enqueue_after_them(tmp_path, make_config, clock, where):
    """A zeroed sector in the newest segment's last enqueue record, with no enqueue after it
    (the walkthrough's zero-sector-newest-mid): repair named the 48 ids that still read and
    lost 50. A shard numbers its jobs in order: every number from the last intact enqueue
    before the damage to the highest still read in it was enqueued there."""
    d, config, bodies, batch, path, data, (s, t) = _batch_then_acks(tmp_path, make_config, clock)
    at = (s + 2048 if where == "middle" else s + HEADER_BYTES + 512) // 512 * 512
    damaged = bytearray(data)
    damaged[at:at + 512] = bytes(512)
    with open(path, "wb") as f:
        f.write(damaged)
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    assert set(back) == set(bodies) - set(batch)
    line = next(x for x in done if x.startswith("jobs not recovered"))
    assert set(map(int, re.findall(r"\d+", line.split(": ", 1)[1].split("(", 1)[1]))) == set(batch), done
    assert f"no intact enqueue follows the damage: jobs numbered after job {max(batch)} may" in "\n".join(done)
    e.close()


def test_repair_names_exactly_the_jobs_between_the_intact_enqueues_around_the_damage(tmp_path, make_config, clock):
    d, config, bodies, batch, path, data, (s, t) = _batch_then_acks(tmp_path, make_config, clock, tail_enqueue=True)
    damaged = bytearray(data)
    damaged[t - 600:t - 88] = bytes(512)  # the batch's last jobs: no id of theirs is left to read
    with open(path, "wb") as f:
        f.write(damaged)
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    line = next(x for x in done if x.startswith("jobs not recovered"))
    assert set(map(int, re.findall(r"\d+", line.split(": ", 1)[1].split("(", 1)[1]))) == set(batch), done
    assert not [x for x in done if x.startswith("no intact enqueue")], done
    e.close()


def test_damage_at_the_end_of_a_segment_is_bounded_by_the_next_segments_first_enqueue(tmp_path, make_config, clock):
    """No intact enqueue after the damage in its own segment: the first one of a later
    segment bounds it, and the list is exact again."""
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=4096)
    files = PowerCutFiles()
    e = Engine(d, config, clock=clock, files=files)
    for i in range(20):
        e.enqueue(f"single {i} ".encode() * 10)
    batch = e.enqueue_many([(f"batch {i} ".encode() * 30, None, "default", 0.0, 0, None) for i in range(50)])
    path = e.shard.log.writer.path
    e.enqueue(b"in the next segment")
    assert e.shard.log.writer.path != path
    bodies = {j: job.body for j, job in e.state.jobs.items()}
    files.kill()
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size - 600)
        f.write(bytes(512))  # the batch's last jobs: no id of theirs is left to read
    e, back, done = _refused_then_repaired(d, config, clock, bodies)
    assert set(back) == set(bodies) - set(batch)
    line = next(x for x in done if x.startswith("jobs not recovered"))
    assert set(map(int, re.findall(r"\d+", line.split(": ", 1)[1].split("(", 1)[1]))) == set(batch), done
    assert not [x for x in done if x.startswith("no intact enqueue")], done
    e.close()
