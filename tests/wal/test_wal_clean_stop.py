"""After a clean stop the log's end is known (``log-end.json``): a log found shorter than
that, a segment missing or the newest one cut, lost bytes no crash explains, and replay,
``wal check`` and the shard refuse it with ``CorruptLog`` naming the file and offset. A torn
tail is tolerated only where a crash may have left it: no record (a crash, or a data dir of
an earlier version), or past the recorded end."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import msgpack
import pytest

from shardq.errors import CorruptLog
from shardq.shard.durable import Engine
from shardq.wal import Log
from shardq.wal import repair as wal_repair
from shardq.wal.format import MAGIC_BYTES, checkpoint_name, segment_name
from shardq.wal.log import LOG_END, LogEnd, drop_log_end, read_log_end

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _open(directory, segment_bytes=1 << 20) -> tuple[Log, list]:
    log = Log(str(directory), segment_bytes=segment_bytes)
    got = [ops[0] for ops in log.replay() if ops]
    return log, got


def _cleanly_stopped(directory, commits=12, segment_bytes=200) -> tuple[list[int], list[int]]:
    """A log of ``commits`` records over several segments, closed cleanly; (segments, the
    end offset of each record of the newest one)."""
    log, _ = _open(directory, segment_bytes)
    ends = []
    for i in range(commits):
        log.commit([msgpack.packb([i, "x" * (i % 5 * 9)])])
        ends.append((log.writer.seq, log.writer.size))
    log.close()
    segments = sorted({s for s, _ in ends})
    assert len(segments) >= 3
    return segments, [e for s, e in ends if s == segments[-1]]


def _wal_check(path):
    return subprocess.run([sys.executable, "-m", "shardq.cli", "wal", "check", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_a_clean_close_records_the_end_and_the_next_replay_takes_it_once(tmp_path):
    segments, _ = _cleanly_stopped(tmp_path)
    newest = os.path.join(str(tmp_path), segment_name(segments[-1]))
    end = read_log_end(str(tmp_path))
    assert end == LogEnd(segments[-1], os.path.getsize(newest), end.write) and end.write >= 12
    log, got = _open(tmp_path)
    assert got == list(range(12))
    assert not os.path.exists(os.path.join(str(tmp_path), LOG_END))  # deleted before any append
    log.commit([msgpack.packb([12])])
    log.close()
    assert read_log_end(str(tmp_path)).write == end.write + 2  # the commit, then the close's sync mark


@pytest.mark.parametrize("fill", ["truncate", "zeros"])
def test_after_a_clean_stop_the_newest_segment_cut_anywhere_is_refused_not_cut(tmp_path, fill):
    """The walkthrough cut the newest segment in half after a clean stop: replay cut it as a
    torn tail ("in flight at a crash") and `wal check` said "torn" and exited 0."""
    src = tmp_path / "src"
    segments, ends = _cleanly_stopped(src)
    name = segment_name(segments[-1])
    with open(src / name, "rb") as f:
        full = f.read()
    assert ends[-1] < len(full)  # the close's sync mark ends it
    for cut in range(len(full)):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(src, d)
        torn = full[:cut] if fill == "truncate" else full[:cut] + bytes(len(full) - cut)
        with open(d / name, "wb") as f:
            f.write(torn)
        with pytest.raises(CorruptLog) as info:
            _open(d)
        record = max([MAGIC_BYTES] + [e for e in ends if e <= cut]) if cut >= MAGIC_BYTES else 0
        assert (info.value.path, info.value.offset) == (str(d / name), record), f"cut at {cut}"
        if not (fill == "zeros" and 0 < cut < MAGIC_BYTES):  # else a bad magic: refused as ever
            assert f"clean stop recorded this file's records ending at offset {len(full)}" in info.value.reason
        with open(d / name, "rb") as f:
            assert f.read() == torn, "the file is left as it was"
        assert not [n for n in os.listdir(d) if ".torn-" in n]
        assert os.path.exists(d / LOG_END)
        report = wal_repair.check(str(d))[-1]
        assert (report.path, report.status, report.offset) == (str(d / name), "corrupt", record), f"cut at {cut}"
        shutil.rmtree(d)


def test_after_a_clean_stop_a_missing_newest_segment_is_refused_and_named(tmp_path):
    """The walkthrough deleted the newest segment after a clean stop: `wal check` said ok and
    `serve` started without its jobs."""
    segments, _ = _cleanly_stopped(tmp_path)
    newest = os.path.join(str(tmp_path), segment_name(segments[-1]))
    os.unlink(newest)
    with pytest.raises(CorruptLog) as info:
        _open(tmp_path)
    assert (info.value.path, info.value.offset) == (newest, 0)
    assert "segment missing" in info.value.reason and f"ending in {segment_name(segments[-1])}" in info.value.reason
    assert sorted(os.listdir(tmp_path)) == sorted([segment_name(s) for s in segments[:-1]] + [LOG_END])
    r = _wal_check(tmp_path)
    assert r.returncode == 1 and f"corrupt {newest} records=0 at offset 0: segment missing" in r.stdout, r.stdout
    # Two gone: the first missing one is named, and the range.
    os.unlink(os.path.join(str(tmp_path), segment_name(segments[-2])))
    with pytest.raises(CorruptLog) as info:
        _open(tmp_path)
    assert info.value.path == os.path.join(str(tmp_path), segment_name(segments[-2]))
    assert f"{segment_name(segments[-2])}..{segment_name(segments[-1])}" in info.value.reason
    # `wal repair --force` accepts the loss explicitly: the record goes, the log opens as it is.
    with pytest.raises(PermissionError):
        wal_repair.repair(str(tmp_path), force=False)
    done = wal_repair.repair(str(tmp_path), force=True)
    assert "accepted" in done[0] and LOG_END in done[0], done
    assert all(r.status == "ok" for r in wal_repair.check(str(tmp_path)))
    log, got = _open(tmp_path)
    assert got and got == list(range(len(got)))
    log.close()


def test_after_a_clean_stop_a_missing_segment_after_the_checkpoint_is_refused(tmp_path):
    """The only segment after a checkpoint gone: before the record, a new one was created
    in its place and the shard started without that segment's records."""
    log, _ = _open(tmp_path)
    log.commit([msgpack.packb([0])])
    log.compact(lambda: iter([msgpack.packb(["ckpt", [0]])]))
    log.commit([msgpack.packb([1])])
    log.close()
    os.unlink(os.path.join(str(tmp_path), segment_name(2)))
    with pytest.raises(CorruptLog) as info:
        _open(tmp_path)
    assert (info.value.path, info.value.offset) == (os.path.join(str(tmp_path), segment_name(2)), 0)


def test_a_shard_stopped_cleanly_refuses_to_start_without_its_newest_segment(tmp_path, make_config, clock):
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=4096)
    e = Engine(d, config, clock=clock)
    for i in range(60):
        e.enqueue(b"job %d " % i * 20)
    e.close()
    newest = max(n for n in os.listdir(d) if n.endswith(".wal"))
    os.truncate(os.path.join(d, newest), os.path.getsize(os.path.join(d, newest)) // 2)
    with pytest.raises(CorruptLog) as info:
        Engine(d, config, clock=clock)
    assert info.value.path == os.path.join(d, newest) and "clean stop" in info.value.reason
    r = _wal_check(d)
    assert r.returncode == 1 and f"corrupt {os.path.join(d, newest)}" in r.stdout, r.stdout


def test_without_the_record_a_cut_tail_is_still_a_torn_one(tmp_path):
    """A crash (no clean close), or a data dir written before the record existed: the torn
    tail is cut, as before. And once a cleanly stopped log is reopened, its record is gone:
    a crash after that is a crash."""
    segments, ends = _cleanly_stopped(tmp_path)
    newest = os.path.join(str(tmp_path), segment_name(segments[-1]))
    assert drop_log_end(str(tmp_path))  # as an earlier version, or a crash, leaves it
    os.truncate(newest, ends[-1] - 3)
    log, got = _open(tmp_path)
    assert log.stats.torn is not None and log.stats.torn.offset == ends[-2]
    assert got == list(range(11))
    log.close()
    log, got = _open(tmp_path)  # a clean close again: the record is back, and taken
    log.commit([msgpack.packb([11])])
    size = log.writer.size
    log.writer.close()  # killed: no close, no record
    os.truncate(newest, size - 3)
    log, got = _open(tmp_path)
    assert log.stats.torn is not None and got == list(range(11))
    log.close()


def test_a_torn_tail_past_the_recorded_end_is_still_cut(tmp_path):
    """A shardq that does not know the record (an earlier version, run after this one
    stopped) may append to the same segment and crash: the bytes past the recorded end are
    a crash's, and cut; only the recorded ones are held to."""
    _, ends = _cleanly_stopped(tmp_path)
    record = (tmp_path / LOG_END).read_bytes()
    log, _ = _open(tmp_path)
    log.commit([msgpack.packb([12])])
    log.commit([msgpack.packb([13])])
    size = log.writer.size
    log.writer.close()  # killed
    (tmp_path / LOG_END).write_bytes(record)
    newest = log.writer.path
    os.truncate(newest, size - 2)
    log, got = _open(tmp_path)
    assert log.stats.torn is not None and got == list(range(13))
    log.close()


def test_a_record_older_than_the_checkpoint_refuses_nothing(tmp_path):
    """The log went on and was compacted since the record was written (by a shardq that
    does not keep it): the segment it names is gone, on purpose."""
    _cleanly_stopped(tmp_path)
    record = (tmp_path / LOG_END).read_bytes()
    log, got = _open(tmp_path, segment_bytes=200)
    log.compact(lambda: iter([msgpack.packb(["ckpt", got])]))
    log.commit([msgpack.packb([99])])
    log.writer.close()  # killed: no new record
    (tmp_path / LOG_END).write_bytes(record)
    assert all(r.status == "ok" for r in wal_repair.check(str(tmp_path)))
    log, got = _open(tmp_path)
    assert got[-1] == 99 and not os.path.exists(tmp_path / LOG_END)
    log.close()


def test_a_damaged_record_is_refused_and_repair_drops_it(tmp_path):
    _cleanly_stopped(tmp_path)
    (tmp_path / LOG_END).write_text(json.dumps({"format": 1, "segment": "x"}))
    with pytest.raises(CorruptLog) as info:
        _open(tmp_path)
    assert info.value.path == str(tmp_path / LOG_END)
    assert [r.status for r in wal_repair.check(str(tmp_path)) if r.path.endswith(LOG_END)] == ["corrupt"]
    done = wal_repair.repair(str(tmp_path), force=True)
    assert "accepted" in done[0] and not os.path.exists(tmp_path / LOG_END)
    log, got = _open(tmp_path)
    assert got == list(range(12))
    log.close()


def test_an_empty_directory_with_a_record_is_a_new_log(tmp_path):
    """`wal repair` (the salvage) moves every log file aside and rebuilds the log in the
    same directory: the record of the log it replaced refuses nothing there."""
    _cleanly_stopped(tmp_path)
    for n in os.listdir(tmp_path):
        if n != LOG_END:
            os.unlink(tmp_path / n)
    log, got = _open(tmp_path)
    assert got == [] and sorted(os.listdir(tmp_path)) == [segment_name(1)]
    log.close()


def test_salvage_after_a_clean_stop_rebuilds_a_log_that_opens(tmp_path, make_config, clock):
    """Damage found after a clean stop: the salvage keeps every intact job, and the log it
    writes opens (the record of the damaged log does not outlive it)."""
    from shardq.shard.salvage import salvage
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=1 << 20)
    e = Engine(d, config, clock=clock)
    bodies = {e.enqueue(b"job %d " % i * 30): b"job %d " % i * 30 for i in range(40)}
    e.close()
    newest = os.path.join(d, segment_name(1))
    with open(newest, "r+b") as f:
        f.seek(2048)
        f.write(bytes(512))
    with pytest.raises(CorruptLog):
        Engine(d, config, clock=clock)
    done = salvage(d, config=config)
    e = Engine(d, config, clock=clock)
    assert {j: job.body for j, job in e.state.jobs.items()}.items() <= bodies.items()
    assert len(e.state.jobs) >= 30, done
    e.close()
    assert read_log_end(d) is not None and checkpoint_name(2) in os.listdir(d)
