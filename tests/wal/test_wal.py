"""The write-ahead log, byte by byte: the codec table, torn tails at every offset,
corruption anywhere else, checkpoints, missing files, and I/O errors at every call.

Corruption tests follow corrupt -> detect -> repair -> append -> reread (etcd repair_test).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil

import msgpack
import pytest

from support.faults import FAULTABLE, FaultyFiles
from shardq import limits
from shardq.errors import Closed, CorruptLog, LogFailed
from shardq.wal import Log
from shardq.wal.format import (CHECKPOINT_MAGIC, HEADER, HEADER_BYTES, HEADERS, MAGIC_BYTES, SEGMENT,
                               SEGMENT_MAGIC, checkpoint_name, frame, header_crc, parse_name, segment_name)
from shardq.wal.log import LOG_END, drop_log_end
from shardq.wal.reader import FileScan


def payload(i: int, pad: int = 0) -> bytes:
    return msgpack.packb([i, "x" * pad])


def open_log(directory, *, segment_bytes=1 << 20, files=None) -> tuple[Log, list]:
    """A replayed log and what it yielded: record numbers, or ("ckpt", [...]) entries."""
    log = Log(str(directory), segment_bytes=segment_bytes, files=files)
    out = []
    for ops in log.replay():
        if ops and ops[0] == "ckpt":
            out = list(ops[1])
        else:
            out.append(ops[0])
    return log, out


def checkpoint_of(records):
    return lambda: iter([msgpack.packb(["ckpt", list(records)])])


def segment_file(directory, seq=1) -> str:
    return os.path.join(str(directory), segment_name(seq))


def record_offsets(data: bytes) -> list[int]:
    """Start offset of each record in a log file, then the end of the last one."""
    offs, off = [], MAGIC_BYTES
    while off < len(data):
        offs.append(off)
        length = HEADER.unpack_from(data, off)[1]
        off += HEADER_BYTES + length
    return offs + [off]


def wframe(i: int, p: bytes) -> bytes:
    """The record of the (i+1)-th write of a log whose writer synced each write before the
    next (a lone caller): write i + 1, synced i."""
    return frame(p, SEGMENT, i + 1, i)


def flip(data: bytes, at: int, mask: int = 0x01) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]


# ---------------------------------------------------------------------------- basics
def test_commit_replay_roundtrip_across_rotations(tmp_path):
    log, got = open_log(tmp_path, segment_bytes=1024)
    assert got == [] and os.listdir(tmp_path) == [segment_name(1)]
    n = 0
    for batch in range(60):
        log.commit([payload(n + k, pad=50) for k in range(batch % 3 + 1)])
        n += batch % 3 + 1
    assert len(log.segments) > 3
    log.close()
    with pytest.raises(Closed):
        log.commit([payload(0)])
    log2, got = open_log(tmp_path, segment_bytes=1024)
    assert got == list(range(n))
    assert log2.stats.records == n and log2.stats.torn is None
    assert log2.stats.segments == len(log.segments)
    log2.commit([payload(n)])
    log2.close()
    assert open_log(tmp_path, segment_bytes=1024)[1] == list(range(n + 1))


def test_commit_before_replay_is_refused(tmp_path):
    with pytest.raises(Closed):
        Log(str(tmp_path), segment_bytes=4096).commit([payload(1)])


def test_file_names_parse():
    assert parse_name(segment_name(12)) == (12, "wal")
    assert parse_name(checkpoint_name(3)) == (3, "ckpt")
    for other in ("1.wal", segment_name(1) + ".tmp", segment_name(1) + ".torn-8", "x.ckpt"):
        assert parse_name(other) is None


def test_unfinished_tmp_files_are_removed(tmp_path):
    log, _ = open_log(tmp_path)
    log.commit([payload(1)])
    log.close()
    for name in (segment_name(2) + ".tmp", checkpoint_name(2) + ".tmp"):
        with open(tmp_path / name, "wb") as f:
            f.write(b"partial")
    log, got = open_log(tmp_path)
    assert got == [1]
    assert sorted(log.stats.removed) == sorted([segment_name(2) + ".tmp", checkpoint_name(2) + ".tmp"])
    assert sorted(os.listdir(tmp_path)) == [segment_name(1)]
    log.close()


# ---------------------------------------------------------------------------- codec table
RECORDS = [payload(0, 5), payload(1, 40), payload(2, 17)]


def _clean() -> tuple[bytes, list[int]]:
    data = SEGMENT_MAGIC + b"".join(wframe(i, p) for i, p in enumerate(RECORDS))
    return data, record_offsets(data)


def _case(fn):
    data, offs = _clean()
    return fn(data, offs)


# name -> (mutated file, offset of the bad spot, True if a torn tail when in the newest segment)
# Format 3: bad bytes are a torn write only when no intact record after them says their
# write was synced; the last write, with nothing after it, cannot be told from one.
TABLE = {
    "truncated header": lambda d, o: (d + wframe(3, payload(3))[:5], o[3], True),
    "header only": lambda d, o: (d + wframe(3, payload(3))[:HEADER_BYTES], o[3], True),
    "truncated payload": lambda d, o: (d + wframe(3, payload(3, 30))[:-3], o[3], True),
    "flipped payload byte in the last record": lambda d, o: (flip(d, o[2] + HEADER_BYTES + 2), o[2], True),
    "flipped CRC of the last record": lambda d, o: (flip(d, o[2] + 9), o[2], True),
    "zero-filled tail": lambda d, o: (d + bytes(4096), o[3], True),
    "zeroed last record": lambda d, o: (d[:o[2]] + bytes(len(d) - o[2]), o[2], True),
    "garbage tail": lambda d, o: (d + b"\xff" * 32, o[3], True),
    "flipped length bit of the last record": lambda d, o: (flip(d, o[2] + 4, 0x01), o[2], True),
    # An intact record after the bad one was written after its fsync returned: damage to
    # synced data, never a torn write.
    "bad record followed by another": lambda d, o: (
        d + flip(wframe(3, payload(3)), HEADER_BYTES + 1) + wframe(4, payload(4)), o[3], False),
    "flipped payload byte mid-log": lambda d, o: (flip(d, o[1] + HEADER_BYTES + 3), o[1], False),
    "flipped CRC mid-log": lambda d, o: (flip(d, o[0] + 8), o[0], False),
    "zero-length record mid-log": lambda d, o: (d[:o[1]] + bytes(HEADER_BYTES) + d[o[1]:], o[1], False),
    "zeroed sector mid-log": lambda d, o: (d[:o[1]] + bytes(o[2] - o[1]) + d[o[2]:], o[1], False),
    "flipped length mid-log": lambda d, o: (flip(d, o[1] + 7, 0x40), o[1], False),
    "flipped write number mid-log": lambda d, o: (flip(d, o[1] + 12, 0x01), o[1], False),
    "bad magic": lambda d, o: (b"NOTSHARD" + d[MAGIC_BYTES:], 0, False),
    "checkpoint magic in a segment": lambda d, o: (CHECKPOINT_MAGIC + d[MAGIC_BYTES:], 0, False),
    "truncated magic": lambda d, o: (d[:5], 0, True),
    "all zeros": lambda d, o: (bytes(len(d)), 0, True),
    "empty file": lambda d, o: (b"", 0, True),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_codec_table_in_the_newest_segment(tmp_path, name, caplog):
    data, bad_at, torn = _case(TABLE[name])
    clean, offs = _clean()
    path = segment_file(tmp_path)
    with open(path, "wb") as f:
        f.write(data)
    if not torn:
        with pytest.raises(CorruptLog) as info:
            open_log(tmp_path)
        assert (info.value.path, info.value.offset) == (path, bad_at)
        assert path in str(info.value) and str(bad_at) in str(info.value)
        return
    with caplog.at_level(logging.INFO, logger="shardq.wal"):
        log, got = open_log(tmp_path)
    kept = [i for i, start in enumerate(offs[:-1]) if offs[i + 1] <= bad_at and i < len(RECORDS)]
    assert got == kept
    zeros_only = data[bad_at:].count(0) == len(data) - bad_at
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if zeros_only and bad_at >= MAGIC_BYTES:
        # Preallocated space after the last record: what every crash leaves. Not a torn
        # write: logged at INFO, nothing kept, nothing reported as dropped.
        assert log.stats.torn is None and not warnings
        assert "preallocated zeros" in caplog.text
    else:
        t = log.stats.torn
        assert (t.path, t.offset, t.dropped_bytes) == (path, bad_at, len(data) - bad_at)
        assert len(warnings) == 1 and "torn tail cut" in warnings[0].getMessage()
    # Torn data is kept beside the segment, readable by the owner only (it holds job
    # bodies); zeros hold nothing to keep.
    backup = f"{path}.torn-{bad_at}"
    if zeros_only:
        assert not os.path.exists(backup)
    else:
        with open(backup, "rb") as f:
            assert f.read() == data[bad_at:]
        assert os.stat(backup).st_mode & 0o777 == 0o600
    # The segment keeps its good records, then zeros: its space is preallocated again.
    good = max(bad_at, MAGIC_BYTES)
    with open(path, "rb") as f:
        now = f.read()
    assert now[:good] == (data[:good] if bad_at >= MAGIC_BYTES else SEGMENT_MAGIC)
    assert now[good:].count(0) == len(now) - good and len(now) == 1 << 20
    # Repair -> append -> reread.
    log.commit([payload(99)])
    log.close()
    log, got = open_log(tmp_path)
    assert got == kept + [99] and log.stats.torn is None
    log.close()


@pytest.mark.parametrize("name", list(TABLE))
def test_codec_table_in_an_older_segment_is_corruption(tmp_path, name):
    data, bad_at, _ = _case(TABLE[name])
    older, newer = segment_file(tmp_path, 1), segment_file(tmp_path, 2)
    with open(older, "wb") as f:
        f.write(data)
    with open(newer, "wb") as f:
        f.write(SEGMENT_MAGIC + frame(payload(50)))
    with pytest.raises(CorruptLog) as info:
        open_log(tmp_path)
    assert (info.value.path, info.value.offset) == (older, bad_at)
    assert not [n for n in os.listdir(tmp_path) if ".torn-" in n], "nothing repaired"


def test_length_is_checked_before_anything_is_allocated():
    length = limits.SEGMENT_RECORD_BYTES_MAX + 1
    data = b"SHQWAL\x00\x02" + HEADERS[2].pack(length, 0, header_crc(length, 0)) + b"abc"
    scan = FileScan("f", data, SEGMENT, tail_may_tear=False)
    with pytest.raises(CorruptLog) as info:
        list(scan)
    assert info.value.offset == MAGIC_BYTES and "exceeds" in info.value.reason


def test_a_flipped_length_mid_log_in_the_newest_segment_is_corruption_not_a_torn_tail(tmp_path):
    """Format 1 read such a length as a torn append and dropped the records after it (with
    a warning). Format 3 finds the intact record after it, written after its write was
    synced: the shard refuses to start and names the file, the offset and the records after
    the damage; nothing is dropped."""
    data, offs = _clean()
    bad = flip(data, offs[1] + 7, 0x40)  # the length's high byte: past the end of the file
    path = segment_file(tmp_path)
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(CorruptLog) as info:
        open_log(tmp_path)
    assert (info.value.path, info.value.offset) == (path, offs[1])
    assert f"1 intact records after them, at offsets {offs[2]}..{offs[2]}" in info.value.reason
    assert "so these bytes were synced" in info.value.reason
    assert not [n for n in os.listdir(tmp_path) if ".torn-" in n]
    with open(path, "rb") as f:
        assert f.read() == bad, "the file is left as it was"


# ---------------------------------------------------------------------------- torn at every offset
def _build_log(directory, commits: int, *, segment_bytes=1 << 20, first: int = 0,
               clean: bool = False) -> list[tuple[str, int, int]]:
    """Commit one record per call; return (segment path, end offset, record number) of each.
    The log is closed (it ends in a sync mark: a record that replays as nothing), then,
    unless ``clean``, left as a crash right after the close leaves it: without the record
    of a clean stop (``log-end.json``), which makes a cut tail corruption, not a torn one."""
    log, _ = open_log(directory, segment_bytes=segment_bytes)
    ends = []
    for i in range(first, first + commits):
        log.commit([payload(i, pad=(i * 7) % 23)])
        ends.append((log.writer.path, log.writer.size, i))
    log.close()
    if not clean:
        assert drop_log_end(str(directory))
    path = log.writer.path
    ends.append((path, os.path.getsize(path), None))
    return ends


@pytest.mark.parametrize("fill", ["truncate", "zeros"])
def test_torn_tail_at_every_byte_of_the_last_records(tmp_path, fill):
    """Cut the newest segment at every offset of its last records (and of its magic): the
    records whose commit returned before the cut survive, nothing after, the torn bytes
    are kept, and the repaired log takes appends."""
    src = tmp_path / "src"
    ends = _build_log(src, 8, segment_bytes=60)  # several segments...
    ends += _build_log(src, 5, first=8)  # ...and a few records in the newest
    newest = ends[-1][0]
    in_newest = [(end, i) for path, end, i in ends if path == newest]
    assert len({p for p, _, _ in ends}) >= 3 and len(in_newest) >= 3
    with open(newest, "rb") as f:
        full = f.read()
    first_in_newest = in_newest[0][1]
    for cut in range(0, len(full)):
        if fill == "zeros" and 0 < cut < MAGIC_BYTES:
            continue  # part of the magic then zeros: the writer never leaves that (tmp + rename)
        d = tmp_path / f"cut{cut}"
        shutil.copytree(src, d)
        target = os.path.join(d, os.path.basename(newest))
        torn = full[:cut] if fill == "truncate" else full[:cut] + bytes(len(full) - cut)
        with open(target, "wb") as f:
            f.write(torn)
        log, got = open_log(d)
        expected = list(range(first_in_newest)) + [i for end, i in in_newest if end <= cut and i is not None]
        assert got == expected, f"cut at {cut}"
        good_end = max([MAGIC_BYTES] + [end for end, _ in in_newest if end <= cut])
        start = good_end if cut >= MAGIC_BYTES else 0
        dropped = torn[start:]
        if (len(torn) > good_end or cut < MAGIC_BYTES) and (dropped.count(0) < len(dropped) or start == 0):
            assert log.stats.torn is not None and log.stats.torn.offset == start
            backups = [n for n in os.listdir(d) if ".torn-" in n]
            assert len(backups) == (0 if dropped.count(0) == len(dropped) else 1)
            for name in backups:
                with open(os.path.join(d, name), "rb") as f:
                    assert torn.endswith(f.read())
        else:
            assert log.stats.torn is None  # nothing after the good records, or only zeros
        log.commit([payload(1000)])
        log.close()
        log, got = open_log(d)
        assert got == expected + [1000], f"cut at {cut}"
        assert log.stats.torn is None
        log.close()
        shutil.rmtree(d)


def test_a_partly_written_multi_record_commit_is_dropped_whole(tmp_path):
    """``Log.commit([a, b])`` is one write: a crash that leaves only its first record drops
    both (the reader holds a write's records until its last one reads), and the log goes
    on after the write before it."""
    log, _ = open_log(tmp_path)
    log.commit([payload(0)])
    log.commit([payload(1), payload(2, pad=50)])
    end = log.writer.size
    log.writer.close()  # a kill: no sync mark, no seal
    path = segment_file(tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:end - 10])
    log, got = open_log(tmp_path)
    assert got == [0]
    log.commit([payload(3)])
    log.close()
    assert open_log(tmp_path)[1] == [0, 3]


# ---------------------------------------------------------------------------- corruption elsewhere
def test_a_flipped_byte_anywhere_in_an_older_segment_is_corruption(tmp_path):
    src = tmp_path / "src"
    ends = _build_log(src, 8, segment_bytes=120)
    first = segment_file(src, 1)
    with open(first, "rb") as f:
        data = f.read()
    offs = record_offsets(data)
    assert len(offs) >= 3 and len({p for p, _, _ in ends}) >= 2
    for at in range(len(data)):
        d = tmp_path / "case"
        shutil.copytree(src, d)
        with open(os.path.join(d, segment_name(1)), "wb") as f:
            f.write(flip(data, at, 0x10))
        with pytest.raises(CorruptLog) as info:
            open_log(d)
        record_start = max([0] + [o for o in offs[:-1] if o <= at]) if at >= MAGIC_BYTES else 0
        assert info.value.path == os.path.join(d, segment_name(1))
        assert info.value.offset == record_start, f"byte {at}"
        shutil.rmtree(d)


def _log_with_checkpoint(directory):
    log, _ = open_log(directory)
    for i in range(5):
        log.commit([payload(i, pad=20)])
    log.compact(checkpoint_of(range(5)))
    log.commit([payload(5)])
    log.close()
    ckpts = [n for n in os.listdir(directory) if n.endswith(".ckpt")]
    assert len(ckpts) == 1
    return os.path.join(str(directory), ckpts[0])


def test_checkpoint_replay_and_files_it_replaces(tmp_path):
    ckpt = _log_with_checkpoint(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([checkpoint_name(2), segment_name(2), LOG_END])
    log, got = open_log(tmp_path)
    assert got == list(range(6))
    assert log.stats.checkpoint == os.path.basename(ckpt)
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(2), segment_name(2)]  # the record is read once
    log.close()


def test_a_flipped_byte_anywhere_in_a_checkpoint_is_corruption(tmp_path):
    src = tmp_path / "src"
    ckpt = _log_with_checkpoint(src)
    with open(ckpt, "rb") as f:
        data = f.read()
    offs = record_offsets(data)
    for at in range(len(data)):
        d = tmp_path / "case"
        shutil.copytree(src, d)
        target = os.path.join(d, os.path.basename(ckpt))
        with open(target, "wb") as f:
            f.write(flip(data, at, 0x04))
        with pytest.raises(CorruptLog) as info:
            open_log(d)
        record_start = max([0] + [o for o in offs[:-1] if o <= at]) if at >= MAGIC_BYTES else 0
        assert (info.value.path, info.value.offset) == (target, record_start), f"byte {at}"
        shutil.rmtree(d)


@pytest.mark.parametrize("keep", ["no trailer", "half a record"])
def test_a_truncated_checkpoint_is_corruption(tmp_path, keep):
    ckpt = _log_with_checkpoint(tmp_path)
    with open(ckpt, "rb") as f:
        data = f.read()
    offs = record_offsets(data)
    cut = offs[-2] if keep == "no trailer" else offs[-2] + 3
    with open(ckpt, "wb") as f:
        f.write(data[:cut])
    with pytest.raises(CorruptLog) as info:
        open_log(tmp_path)
    assert info.value.path == ckpt


def test_a_missing_middle_segment_is_corruption(tmp_path):
    _build_log(tmp_path, 10, segment_bytes=50)
    names = sorted(os.listdir(tmp_path))
    assert len(names) >= 3
    os.unlink(tmp_path / names[1])
    with pytest.raises(CorruptLog) as info:
        open_log(tmp_path)
    assert info.value.path == str(tmp_path / names[1])


def test_a_missing_segment_after_the_checkpoint_is_corruption(tmp_path):
    log, _ = open_log(tmp_path, segment_bytes=100)
    for i in range(3):
        log.commit([payload(i, pad=100)])
    log.compact(checkpoint_of(range(3)))
    for i in range(3, 6):
        log.commit([payload(i, pad=100)])
    log.close()
    segs = sorted(n for n in os.listdir(tmp_path) if n.endswith(".wal"))
    base = [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")][0].replace(".ckpt", ".wal")
    assert segs[0] == base and len(segs) >= 2
    os.unlink(tmp_path / base)
    with pytest.raises(CorruptLog):
        open_log(tmp_path, segment_bytes=100)


def test_a_missing_first_segment_without_a_checkpoint_is_corruption(tmp_path):
    """With no checkpoint the log starts at segment 1 (compaction always leaves a checkpoint
    behind), so a missing ``…0001.wal`` is lost data, not a fresh start."""
    _build_log(tmp_path, 10, segment_bytes=50)
    names = sorted(os.listdir(tmp_path))
    assert names[0] == segment_name(1) and len(names) >= 3
    os.unlink(tmp_path / names[0])
    with pytest.raises(CorruptLog) as info:
        open_log(tmp_path, segment_bytes=100)
    assert info.value.path == str(tmp_path / names[0])


def test_leftovers_of_an_interrupted_compaction_are_removed(tmp_path):
    """A crash after the new checkpoint's rename but before the old files were deleted."""
    log, _ = open_log(tmp_path, segment_bytes=100)
    for i in range(4):
        log.commit([payload(i, pad=60)])
    log.compact(checkpoint_of(range(4)))
    log.commit([payload(4)])
    saved = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    log.compact(checkpoint_of(range(5)))
    log.commit([payload(5)])
    log.close()
    for name, data in saved.items():  # put back what the second compaction deleted
        if not (tmp_path / name).exists():
            (tmp_path / name).write_bytes(data)
    log, got = open_log(tmp_path, segment_bytes=100)
    assert got == list(range(6))
    assert sorted(log.stats.removed) == sorted(n for n in saved if n not in os.listdir(tmp_path))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]) == 1
    log.close()


# ---------------------------------------------------------------------------- I/O errors
def _log_workload(log: Log, committed: list, attempt: list):
    """Commits that cross rotations (segment_bytes=256) and two compactions."""
    n = 0
    for step in range(24):
        if step in (9, 17):
            attempt[:] = ["compact"]
            log.compact(checkpoint_of(list(committed)))
            continue
        batch = [n + k for k in range(step % 2 + 1)]
        attempt[:] = batch
        log.commit([payload(i, pad=40) for i in batch])
        committed.extend(batch)
        n += len(batch)


def test_an_io_error_at_any_call_fails_the_log_and_loses_nothing_committed(tmp_path):
    counter = FaultyFiles()
    log, _ = open_log(tmp_path / "count", segment_bytes=256, files=counter)
    start = counter.count
    _log_workload(log, [], [])
    total = counter.count - start
    kinds = [k for k, _ in counter.calls if k in FAULTABLE][-total:]
    assert {"create", "write", "datasync", "fsync", "rename", "sync_dir", "unlink"} <= set(kinds)
    log.close()
    for n in range(1, total + 1):
        for err in (errno.ENOSPC, errno.EIO):
            d = tmp_path / f"f{n}-{err}"
            files = FaultyFiles(error=err)
            log, _ = open_log(d, segment_bytes=256, files=files)
            files.fail_at = files.count + n
            committed, attempt = [], []
            with pytest.raises(LogFailed):
                _log_workload(log, committed, attempt)
            assert files.failed[0] == kinds[n - 1]
            for _ in range(2):  # and ever after, with no fsync retried
                with pytest.raises(LogFailed):
                    log.commit([payload(10**6)])
                with pytest.raises(LogFailed):
                    log.compact(checkpoint_of(committed))
                with pytest.raises(LogFailed):
                    log.sync()
                with pytest.raises(LogFailed):
                    log.mark()
                assert not log.mark_pending and not log.mark_wanted  # the shard's loop never tries
            assert files.syncs_after_failure() == []
            log.close()
            log, got = open_log(d, segment_bytes=256)
            # A torn multi-record commit may leave its complete leading records (see
            # test_a_partly_written_multi_record_commit_keeps_its_complete_records).
            tried = [a for a in attempt if a != "compact"]
            where = f"{errno.errorcode[err]} at call {n} ({kinds[n - 1]})"
            assert got in [committed + tried[:k] for k in range(len(tried) + 1)], where
            log.commit([payload(10**6)])
            log.close()
            assert open_log(d, segment_bytes=256)[1] == got + [10**6]
