"""Damage to synced log data is refused, never cut as a torn tail (format 3).

The finding this answers: 200 jobs enqueued and acknowledged one by one, then one 512-byte
block in the middle of the newest segment zeroed (a lost sector). The format-2 reader took
it for a torn last write and cut it and everything after it: 135 acknowledged jobs gone.
Here each damage of that class is refused with file, offset and what lies after it, and
only the writes no later record vouches for may be cut (docs/design.md, "Damage and torn
writes").
"""
from __future__ import annotations

import logging
import os

import pytest

from support.faults import PowerCutFiles
from shardq.errors import CorruptLog
from shardq.shard.durable import Engine
from shardq.wal.format import HEADER_BYTES, MAGIC_BYTES

SEGMENT = 1 << 20


def _filled(tmp_path, make_config, clock, n=200, mark=False):
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    ids = [e.enqueue(f"job {i} ".encode() * 20, key=f"k{i % 7}") for i in range(n)]
    if mark:
        e.shard.log.mark()  # what an idle shard writes
    path, end = e.shard.log.writer.path, e.shard.log.writer.size
    files.kill()  # a SIGKILL: no close, no seal; the segment stays preallocated
    with open(path, "rb") as f:
        data = f.read()
    return config, ids, path, data, end


def _damage(path, data, at, new):
    bad = bytearray(data)
    bad[at:at + len(new)] = new
    with open(path, "wb") as f:
        f.write(bad)
    return bytes(bad)


DAMAGE = {
    "zeroed 512 B sector": lambda data, at: bytes(512),
    "zeroed 4 KiB page": lambda data, at: bytes(4096),
    "flipped bit": lambda data, at: bytes([data[at] ^ 0x10]),
    "misdirected page": lambda data, at: data[MAGIC_BYTES:MAGIC_BYTES + 4096],
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_in_the_middle_of_synced_data_is_refused_with_its_range(tmp_path, make_config, clock, kind):
    config, ids, path, data, end = _filled(tmp_path, make_config, clock)
    at = MAGIC_BYTES + (end - MAGIC_BYTES) // 3
    at -= at % 512  # a sector
    bad = _damage(path, data, at, DAMAGE[kind](data, at))
    with pytest.raises(CorruptLog) as info:
        Engine(str(tmp_path), config, clock=clock)
    err = info.value
    assert err.path == path and err.offset <= at < end
    assert "intact records after them" in err.reason and "so these bytes were synced" in err.reason
    with open(path, "rb") as f:
        assert f.read() == bad, "nothing cut"
    assert not [n for n in os.listdir(tmp_path) if ".torn-" in n]


def test_damage_to_the_last_write_of_an_idle_shard_is_refused(tmp_path, make_config, clock):
    """The sync mark an idle shard writes vouches for its last write."""
    config, ids, path, data, end = _filled(tmp_path, make_config, clock, n=20, mark=True)
    mark_bytes = HEADER_BYTES + 1
    last_write = end - mark_bytes
    start = data.rfind(b"SQr\x03", MAGIC_BYTES, last_write)
    _damage(path, data, start + HEADER_BYTES + 3, b"\xff")
    with pytest.raises(CorruptLog) as info:
        Engine(str(tmp_path), config, clock=clock)
    assert info.value.offset == start and "so these bytes were synced" in info.value.reason


def test_damage_to_the_last_write_with_nothing_after_it_is_cut_and_named(tmp_path, make_config, clock, caplog):
    """The residual risk, stated in docs/design.md: bytes of the last write with no record
    after them read as a write a crash tore. Cut, kept beside the segment, and logged with
    the job ids they held; every earlier job stays."""
    config, ids, path, data, end = _filled(tmp_path, make_config, clock, n=20)
    start = data.rfind(b"SQr\x03", MAGIC_BYTES, end)
    _damage(path, data, end - 15, bytes([data[end - 15] ^ 0xFF]))  # in the body: its job id still reads
    with caplog.at_level(logging.WARNING, logger="shardq.wal"):
        e = Engine(str(tmp_path), config, clock=clock)
    assert sorted(e.state.jobs) == ids[:-1]
    msg = caplog.records[-1].getMessage()
    assert "torn tail cut" in msg and f"enqueues readable in the cut bytes: 1 ({ids[-1]})" in msg
    assert os.path.exists(f"{path}.torn-{start}")
    e.close()


def test_writes_in_flight_at_a_power_cut_are_torn_even_with_a_later_write_intact(tmp_path, make_config, clock):
    """Two unsynced writes; the power cut loses the first one's page and keeps the second:
    the second was issued before the first was synced, so nothing proves the first durable.
    Both go (neither was acknowledged), and everything synced before them stays."""
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    kept = [e.enqueue(b"synced %d" % i) for i in range(3)]
    log = e.shard.log
    before = log.writer.size
    log.commit([b"\x91\x90"], sync=False)  # an empty operation list: replays as nothing
    middle = log.writer.size
    log.commit([b"\x91\x90"], sync=False)
    path = log.writer.path
    files.kill()
    with open(path, "rb") as f:
        data = f.read()
    _damage(path, data, before, bytes(middle - before))
    e = Engine(str(tmp_path), config, clock=clock)
    assert sorted(e.state.jobs) == kept
    assert e.shard.replay_stats.torn is not None and e.shard.replay_stats.torn.offset == before
    e.close()
