"""Power cuts: what was not fsynced may be lost, page by page (``tests/support/faults.py:
PowerCutFiles``), and a shard must still start with every acknowledged operation.

* many seeded runs of an engine workload (single and batch enqueues, retried batches,
  leases, acks, nacks, extends, clock jumps, compactions, rotations of small segments),
  with process kills (nothing lost but the page cache's durability) and power cuts (unsynced
  pages kept, dropped or zeroed; unsynced directory entries undone) at random file calls.
  After each, the reopened shard must equal a reference state machine that ran every
  acknowledged call, with the call in flight either wholly applied or not at all (a batch
  is all or nothing), byte for byte;
* the cases issue 9 names, one test each: a torn final record in a preallocated segment is
  a torn tail, not corruption; a flipped length never drops later acknowledged records;
  replay deletes nothing before the newest checkpoint has been read; and what a restarted
  shard replayed is durable before it answers on top of it.

A failing seed is printed; ``SHARDQ_POWER_CUT_SEEDS=a:b`` runs seeds ``a`` to ``b - 1``.
"""
from __future__ import annotations

import copy
import os
import random
import shutil
import zlib
from collections import Counter

import pytest

from support.faults import DROP, KEEP, PAGE_BYTES, Crash, PowerCutFiles
from shardq.clock import FakeClock
from shardq.errors import CorruptLog, ShardqError
from shardq.shard.durable import Engine
from shardq.shard.state import ShardState
from shardq.types import Lease
from shardq.wal.format import HEADER, MAGIC_BYTES

KiB = 1024


# ---------------------------------------------------------------------------- the reference
class _NoLog:
    """Stands in for a DurableShard: a call's operations are dropped, not logged."""

    def __init__(self, state):
        self.state = state

    def commit(self) -> int:
        self.state.take_batch()
        return 0

    def compact(self) -> bool:
        return True  # (compacted: this harness's disk never fills)


def reference(config, clock) -> Engine:
    """The Engine's own methods over a state machine without a log: what every call would
    do if nothing could be lost."""
    e = Engine.__new__(Engine)
    e.clock, e.state = clock, ShardState(0, config)
    e.shard = _NoLog(e.state)
    return e


def set_state(e: Engine, state) -> None:
    e.state = e.shard.state = state


def digest_at(state, now, digest) -> dict:
    """The state's digest once advanced to ``now`` (leases expire, delays come due). The
    operations that derives stay pending: the next call commits them (or drops them, in the
    reference), the same on both sides."""
    state.advance(now)
    return digest(state)


def outcome(fn):
    """A call's result, or its error's type; bodies by checksum (short failure messages)."""
    try:
        result = fn()
    except ShardqError as e:
        return "error", type(e).__name__
    if isinstance(result, list) and result and isinstance(result[0], Lease):
        result = [lease._replace(body=zlib.crc32(lease.body)) for lease in result]
    return "ok", result


# ---------------------------------------------------------------------------- the workload
def next_call(rng: random.Random, ctx: dict):
    """(name, fn(engine)) of the next call, and what to remember of its result."""
    if ctx.get("resend") is not None and rng.random() < 0.8:
        items, session = ctx["resend"]   # the router resends a batch whose reply was lost
        return "resend", lambda e: e.enqueue_many(items, session=session)
    kind = rng.choices(["enqueue", "batch", "dequeue", "ack", "nack", "extend", "tick", "compact", "stats"],
                       [30, 14, 20, 12, 6, 4, 7, 2, 2])[0]
    leases = ctx["leases"]
    if kind == "enqueue":
        big = rng.random() < 0.3
        body = rng.randbytes(rng.randint(1500, 9000) if big else rng.randint(1, 300))
        key = rng.choice([None, "k0", "k1", "k2", "k3"])
        dedup = f"d{rng.randrange(10)}" if rng.random() < 0.2 else None
        prio, delay = rng.choice([0, 0, 1, 5]), rng.choice([0, 0, 0, 5])
        return kind, lambda e: e.enqueue(body, key=key, priority=prio, delay=delay, dedup_id=dedup)
    if kind == "batch":
        ctx["seq"] += 1
        items = [(rng.randbytes(rng.randint(1, 3000)), rng.choice([None, "k0", "k4"]), "default",
                  0, rng.choice([0, 2]), None) for _ in range(rng.randint(2, 5))]
        session = (7, ctx["seq"], ctx["seq"])
        ctx["last_batch"] = (items, session)
        return kind, lambda e: e.enqueue_many(items, session=session)
    if kind == "dequeue":
        n, vis = rng.randint(1, 3), rng.choice([5.0, 30.0])
        return kind, lambda e: e.dequeue(max_jobs=n, visibility=vis)
    if kind in ("ack", "nack", "extend") and leases:
        lease = leases.pop(rng.randrange(len(leases))) if kind != "extend" else rng.choice(leases)
        if kind == "ack":
            return kind, lambda e: e.ack(lease.job_id, lease.token)
        if kind == "nack":
            delay = rng.choice([0.0, 3.0])
            return kind, lambda e: e.nack(lease.job_id, lease.token, delay=delay, error="flaky")
        return kind, lambda e: e.extend(lease.job_id, lease.token, 20.0)
    if kind == "tick":
        ctx["dt"] = rng.uniform(1, 40)
        return kind, None
    if kind == "compact":
        return kind, lambda e: e.compact()
    return "stats", lambda e: e.stats()


def run_seed(seed: int, directory: str, make_config, digest, steps: int = 70) -> Counter:
    """One seeded run; returns what it exercised. Raises AssertionError naming the seed."""
    rng = random.Random(seed)
    config = make_config(segment_bytes=16 * KiB, compact_min_bytes=48 * KiB, max_deliveries=4)
    clock = FakeClock()
    files = PowerCutFiles()
    real = Engine(directory, config, clock=clock, files=files)
    ref = reference(config, clock)
    set_state(ref, copy.deepcopy(real.state))   # what opening logged (a token epoch, say)
    ctx = {"leases": [], "seq": 0, "resend": None, "last_batch": None}
    seen: Counter = Counter()
    where = f"seed {seed}"
    events: list[str] = []   # the kills and cuts so far, for a failure's message

    def reopen(in_flight: str | None, before) -> Engine:
        try:
            e = Engine(directory, config, clock=clock, files=files)
        except CorruptLog as err:
            raise AssertionError(f"{where}: the shard refuses to start after a power cut: {err}") from err
        torn = e.shard.replay_stats.torn
        seen["torn_tails"] += torn is not None
        now = clock.now()
        got = digest_at(e.state, now, digest)
        if got == digest_at(ref.state, now, digest):
            seen[f"in_flight_{in_flight}_applied" if in_flight else "between_calls"] += 1
        elif before is not None and got == digest_at(before, now, digest):
            set_state(ref, before)
            seen[f"in_flight_{in_flight}_lost"] += 1
        else:
            raise AssertionError(f"{where}: after reopening, the state is neither with nor without the "
                                 f"call in flight ({in_flight}); events: {events[-4:]}")
        # Equal in everything the digest sees. Not in the order of equal-priority ready jobs:
        # a lease that expired while the shard was down is noticed, and requeued, after the
        # jobs replay re-added. Go on from the real state.
        set_state(ref, copy.deepcopy(e.state))
        return e

    for step in range(steps):
        where = f"seed {seed}, step {step}"
        name, call = next_call(rng, ctx)
        if name == "tick":
            clock.advance(ctx["dt"])
            continue
        event = rng.choices([None, "kill", "cut"], [88, 6, 6])[0]
        before = None
        if event:
            # Most calls make 2 file calls (write, fdatasync); a compaction about 20.
            reach = rng.randint(1, 22) if name == "compact" else rng.choice([1, 1, 2, 2, 3, rng.randint(1, 30)])
            files.arm(reach, write_first=rng.random() < 0.7)
            before = copy.deepcopy(ref.state)
        expected = outcome(lambda: call(ref))
        try:
            got = outcome(lambda: call(real))
        except Crash:
            seen[event + "s_mid_call"] += 1
            seen[f"crash_at_{files.crashed_in}"] += 1
            events.append(f"step {step}: {event} in {name} at {files.crashed_in}")
            if event == "cut":
                done = files.power_cut(rng)
                events.append(f"  cut: {done}")
                seen["pages_kept"] += done["pages"][KEEP]
                seen["pages_lost"] += done["pages"][DROP] + done["pages"]["zero"]
                seen["dir_entries_undone"] += done["dirops_undone"]
            else:
                files.kill()
            real = reopen(name, before)
            if name in ("batch", "resend"):
                ctx["resend"] = ctx["last_batch"]   # its reply never came: the router resends it
            continue
        files.disarm()
        assert got == expected, f"{where}: {name} returned {got}, the reference {expected}"
        seen[name] += 1
        seen["rotations"] = max(seen["rotations"], real.shard.log.writer.seq)
        seen["compactions"] += real.shard.compactions - seen["_compactions_here"]
        seen["_compactions_here"] = real.shard.compactions
        if name == "dequeue" and got[0] == "ok":
            ctx["leases"] += [Lease(*lease[:2], b"", *lease[3:]) for lease in got[1]]
        if name in ("batch", "resend"):
            ctx["resend"] = None
        if event:  # armed past the call's last file call: the event comes between calls
            seen[event + "s_between_calls"] += 1
            events.append(f"step {step}: {event} after {name}")
            if event == "cut":
                events.append(f"  cut: {files.power_cut(rng)}")
            else:
                files.kill()
            real = reopen(None, None)
            seen["_compactions_here"] = 0
    # A clean close and a reopen on plain files: the same state again.
    files.kill()
    final = Engine(directory, config, clock=clock)
    assert digest_at(final.state, clock.now(), digest) == digest_at(ref.state, clock.now(), digest), where
    final.close()
    del seen["_compactions_here"]
    return seen


def _seeds(default: range) -> range:
    spec = os.environ.get("SHARDQ_POWER_CUT_SEEDS")
    if not spec:
        return default
    a, b = spec.split(":")
    return range(int(a), int(b))


def _many_seeds(tmp_path, make_config, digest, seeds: range) -> Counter:
    total: Counter = Counter()
    for seed in seeds:
        d = str(tmp_path / f"s{seed}")
        total += run_seed(seed, d, make_config, digest)
        shutil.rmtree(d)
    return total


def _assert_exercised(total: Counter) -> None:
    """The runs must have met what they are meant to test, or they prove nothing."""
    for what in ("cuts_mid_call", "kills_mid_call", "cuts_between_calls", "torn_tails", "pages_lost",
                 "pages_kept", "dir_entries_undone", "in_flight_batch_applied", "in_flight_batch_lost",
                 "in_flight_enqueue_applied", "in_flight_enqueue_lost", "resend", "compactions",
                 "crash_at_write", "crash_at_datasync", "crash_at_rename", "crash_at_unlink"):
        assert total[what] > 0, f"no run exercised {what}: {dict(total)}"
    assert total["rotations"] >= 5, dict(total)


def test_power_cuts_at_random_calls_lose_nothing_acknowledged(tmp_path, make_config, digest):
    total = _many_seeds(tmp_path, make_config, digest, _seeds(range(1, 201)))
    print(dict(total))
    _assert_exercised(total)


@pytest.mark.slow
def test_power_cuts_at_random_calls_lose_nothing_acknowledged_long(tmp_path, make_config, digest):
    total = _many_seeds(tmp_path, make_config, digest, range(1000, 3000))
    print(dict(total))
    _assert_exercised(total)


# ---------------------------------------------------------------------------- the named cases
SEGMENT = 256 * KiB   # preallocated: a lost page of the newest segment reads as zeros


def _pages(start: int, end: int) -> list[int]:
    return list(range(start // PAGE_BYTES, (end - 1) // PAGE_BYTES + 1))


def _lose(pages, how=DROP):
    """A fate: the given pages of the write lost (dropped or zeroed), every other kept."""
    return lambda path, page: how if page in pages else KEEP


def _jobs(engine) -> dict:
    return {jid: bytes(j.body) for jid, j in engine.state.jobs.items()}


@pytest.mark.parametrize("lost", ["first", "middle", "last", "all"])
@pytest.mark.parametrize("how", [DROP, "zero"])
def test_a_torn_final_record_in_a_preallocated_segment_is_a_torn_tail(tmp_path, make_config, clock, lost, how):
    """The newest segment is preallocated, so a page of its last, unsynced write that never
    reached the disk reads as zeros, wherever it is in the record (writeback has no order).
    Before log format 2, a lost first page (the record's header) was refused as mid-log
    corruption ("zero-length record"): the shard never started again."""
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    acked = {e.enqueue(bytes([65 + i]) * (700 * i + 1), key="k"): bytes([65 + i]) * (700 * i + 1) for i in range(4)}
    start = e.shard.log.writer.size
    files.arm(kind="datasync")
    with pytest.raises(Crash):
        e.enqueue(random.Random(1).randbytes(13000), key="k")   # a record over 4 pages
    pages = _pages(start, start + 13000 + 100)
    chosen = {"first": pages[:1], "middle": pages[1:-1], "last": pages[-1:], "all": pages}[lost]
    done = files.power_cut(random.Random(2), fate=_lose(chosen, how))
    assert done["pages"][how] == len(chosen) and done["pages"][KEEP] == len(pages) - len(chosen)

    e = Engine(str(tmp_path), config, clock=clock)   # starts: no CorruptLog
    assert _jobs(e) == acked
    torn = e.shard.replay_stats.torn
    if lost == "all":
        assert torn is None   # only zeros after the last record: preallocated space
    else:
        assert torn is not None and torn.offset == start, torn
    # ... and the log goes on from there.
    jid = e.enqueue(b"after", key="k")
    e.close()
    e = Engine(str(tmp_path), config, clock=clock)
    assert _jobs(e) == {**acked, jid: b"after"} and e.shard.replay_stats.torn is None
    e.close()


def test_a_group_commit_torn_in_its_first_record_keeps_none_of_its_records(tmp_path):
    """The shard process writes the records of several loop iterations with one fdatasync
    (group commit). A lost page inside the first leaves complete records after it: they
    were never acknowledged either (no reply before the fsync), so the tail is torn from the
    first bad record on. Format 1 refused it as a CRC mismatch mid-log."""
    from shardq.wal import Log
    files = PowerCutFiles()
    log = Log(str(tmp_path), segment_bytes=SEGMENT, files=files)
    assert list(log.replay()) == []
    log.commit([b"\x91\x01"])
    start = log.writer.size
    first = b"\x91\xc5" + (9000).to_bytes(2, "big") + bytes(range(256)) * 35 + bytes(40)
    rest = [b"\x91\x02", b"\x91\x03"]
    files.arm(kind="datasync")
    with pytest.raises(Crash):
        log.commit([first, *rest])
    middle_of_first = (start + 4096) // PAGE_BYTES   # a page wholly inside the first record
    files.power_cut(random.Random(3), fate=_lose([middle_of_first]))
    log = Log(str(tmp_path), segment_bytes=SEGMENT)
    assert list(log.replay()) == [[1]]
    assert log.stats.torn is not None and log.stats.torn.offset == start
    log.close()


def _record_offsets(path: str) -> tuple[bytes, list[int]]:
    with open(path, "rb") as f:
        data = f.read()
    offs, off = [], MAGIC_BYTES
    while off < len(data) and data[off:off + HEADER.size] != bytes(HEADER.size):
        offs.append(off)
        off += HEADER.size + HEADER.unpack_from(data, off)[1]
    return data, offs + [off]


@pytest.mark.parametrize("where", ["into the preallocated zeros", "past the end of the file"])
def test_a_flipped_length_never_drops_later_acknowledged_records(tmp_path, make_config, clock, where):
    """One bit of a record's length flipped (bit rot, a bad controller) in the newest,
    preallocated segment. Read as a torn tail, it would silently drop every later record,
    all acknowledged. The intact records after it, written after its fsync returned (format
    3), prove it synced: CorruptLog with file and offset, the file left as it was. The
    length landing in the preallocated zeros was read as torn even in format 2 until the
    reader also checked that length against the header checksum."""
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    for i in range(6):
        e.enqueue(bytes([i + 1]) * 300, key="k")
    path = e.shard.log.writer.path
    files.kill()   # as a killed shard leaves it: the segment still preallocated
    data, offs = _record_offsets(path)
    victim, data_end = offs[1], offs[-1]
    assert len(data) == SEGMENT
    length = HEADER.unpack_from(data, victim)[1]
    ends = {bit: victim + HEADER.size + (length ^ (1 << bit)) for bit in range(32)}
    if where.startswith("into"):
        bit = next(b for b, end in ends.items() if data_end + 512 < end <= len(data))
    else:
        bit = next(b for b, end in ends.items() if end > len(data))
    bad = bytearray(data)
    bad[victim + 4:victim + 8] = (length ^ (1 << bit)).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(CorruptLog) as info:
        Engine(str(tmp_path), config, clock=clock)
    assert (info.value.path, info.value.offset) == (path, victim)
    with open(path, "rb") as f:
        assert f.read() == bytes(bad), "nothing cut"
    assert not [n for n in os.listdir(tmp_path) if ".torn-" in n]


def test_replay_deletes_nothing_before_the_newest_checkpoint_has_been_read(tmp_path, make_config, clock, digest):
    """A compaction crashed after its checkpoint's rename, before it deleted what the
    checkpoint replaces; then the new checkpoint is found damaged. Replay must refuse it
    (CorruptLog) and leave the older checkpoint and segments in place: with them, an
    operator who moves the damaged checkpoint aside gets every acknowledged job back.
    (Before, replay deleted them first, then read the checkpoint.)"""
    config = make_config(segment_bytes=4 * KiB, compact_min_bytes=1 << 30)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    for i in range(8):
        e.enqueue(bytes([i + 1]) * 900, key=f"k{i % 2}")
    e.compact()
    [lease] = e.dequeue(visibility=60)
    for i in range(8):
        e.enqueue(bytes([i + 20]) * 900, key=f"k{i % 3}")
    e.ack(lease.job_id, lease.token)
    before = digest_at(e.state, clock.now(), digest)
    files.arm(kind="unlink")
    with pytest.raises(Crash):
        e.compact()
    files.power_cut(random.Random(4), fate=lambda path, page: KEEP, keep_dirops=lambda d, ops: len(ops))
    names = sorted(os.listdir(tmp_path))
    checkpoints = [n for n in names if n.endswith(".ckpt")]
    assert len(checkpoints) == 2 and sum(n.endswith(".wal") for n in names) >= 3, names
    newest = os.path.join(tmp_path, checkpoints[-1])
    with open(newest, "r+b") as f:   # damage the new checkpoint's first record
        f.seek(MAGIC_BYTES + HEADER.size + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptLog) as info:
        Engine(str(tmp_path), config, clock=clock)
    assert info.value.path == newest
    assert sorted(os.listdir(tmp_path)) == names, "replay deleted files before the checkpoint was read"
    os.rename(newest, str(tmp_path / "damaged-checkpoint"))   # the operator sets it aside
    e = Engine(str(tmp_path), config, clock=clock)
    assert digest_at(e.state, clock.now(), digest) == before
    e.close()


def test_a_batch_resent_after_a_restart_is_durable_before_its_ids_are_returned(tmp_path, make_config, clock):
    """A shard killed after writing a batch, before its fdatasync: the page cache keeps the
    record, the restarted shard replays it, and the client's resend (same session) is
    answered with the batch's ids from the session table, without a new record. Before,
    nothing had made that record durable: a power cut then took back an acknowledged
    batch. Replay now ends with an fdatasync of the newest segment."""
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    e.enqueue(b"first")
    items = [(bytes([i]) * 5000, "k", "default", 0, 0, None) for i in range(1, 4)]
    files.arm(kind="datasync")
    with pytest.raises(Crash):
        e.enqueue_many(items, session=(9, 1, 1))
    files.kill()                                  # a process kill: the page cache survives
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    ids = e.enqueue_many(items, session=(9, 1, 1))   # the resend: acknowledged now
    assert len(ids) == 3
    files.power_cut(random.Random(5), fate=lambda path, page: DROP)   # every unsynced page lost
    e = Engine(str(tmp_path), config, clock=clock)
    assert {jid: _jobs(e).get(jid) for jid in ids} == {jid: body for jid, (body, *_) in zip(ids, items)}
    e.close()


def test_a_segment_created_before_a_kill_is_durable_before_records_are_acknowledged_in_it(
        tmp_path, make_config, clock):
    """A rotation renamed the new segment into place and the shard was killed before the
    directory's fsync. The restarted shard appended to that segment and acknowledged what it
    wrote (its fdatasync covers the file, not the directory entry). A power cut then undid
    the rename, and replay deleted the segment as an unfinished ``.tmp``. Replay now ends
    with an fsync of the directory."""
    config = make_config(segment_bytes=4 * KiB, compact_min_bytes=1 << 30)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    acked = {e.enqueue(bytes([i + 1]) * 1500): bytes([i + 1]) * 1500 for i in range(3)}   # past 4 KiB
    files.arm(kind="sync_dir")
    with pytest.raises(Crash):
        e.enqueue(b"rotates first")   # the rotation's new segment: renamed, not yet synced
    files.kill()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    acked[e.enqueue(b"acknowledged in the new segment")] = b"acknowledged in the new segment"
    files.power_cut(random.Random(6), fate=lambda path, page: KEEP, keep_dirops=lambda d, ops: 0)
    e = Engine(str(tmp_path), config, clock=clock)
    assert _jobs(e) == acked
    e.close()


def test_the_same_append_torn_twice_keeps_both_torn_copies_and_starts(tmp_path, make_config, clock):
    """Torn, restarted, resent, torn again at the same offset: the second torn copy must not
    collide with the first (the shard refused to start with FileExistsError, for good)."""
    config = make_config(segment_bytes=SEGMENT)
    files = PowerCutFiles()
    e = Engine(str(tmp_path), config, clock=clock, files=files)
    first = e.enqueue(b"first")
    body = random.Random(7).randbytes(9000)
    copies = []
    for attempt in range(2):
        at = e.shard.log.writer.size   # where the next append goes
        if copies and not os.path.exists(f"{copies[0]}".rsplit(".torn-", 1)[0] + f".torn-{at}"):
            # A restart that logs a record of its own moved the append: an earlier crash
            # left a torn copy at this offset, then.
            shutil.copyfile(copies[0], copies[0].rsplit(".torn-", 1)[0] + f".torn-{at}")
        files.arm(kind="datasync")
        with pytest.raises(Crash):
            e.enqueue(body, key="k", dedup_id="resent")
        files.power_cut(random.Random(attempt), fate=_lose(_pages(at, at + 1)))   # its header's page
        e = Engine(str(tmp_path), config, clock=clock, files=files)
        assert e.shard.replay_stats.torn.offset == at
        copies.append(sorted(os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if f".torn-{at}" in n)[-1])
    assert copies[1].endswith(".1"), copies   # the second copy beside the first, at the same offset
    with open(copies[1], "rb") as f:
        assert body[-4096:] in f.read()   # the torn write's pages that did reach the disk
    jid = e.enqueue(body, key="k", dedup_id="resent")
    e.close()
    assert _jobs(Engine(str(tmp_path), config, clock=clock)) == {first: b"first", jid: body}


def _reporting_log_with_one_commit(tmp_path, monkeypatch):
    """A log written through the shard process's reporting wrapper with the power-cut model's
    sync log on, after one synced commit: (the sync log, the wrapper, the log, its inode)."""
    import io

    from shardq.shard.report import ReportingFiles, SupervisorPipe
    from shardq.wal.fileio import FAULT_SYNC_LOG_ENV
    from shardq.wal.log import Log

    side = tmp_path / "synced.log"
    monkeypatch.setenv(FAULT_SYNC_LOG_ENV, str(side))
    files = ReportingFiles(SupervisorPipe(io.StringIO()))
    os.mkdir(tmp_path / "shard")
    log = Log(str(tmp_path / "shard"), segment_bytes=1 << 20, files=files)
    list(log.replay())
    log.commit([b"\x91\x01"], sync=True)
    return side, files, log, os.fstat(log.writer.fd).st_ino


def test_a_shard_process_log_keeps_the_sync_hook_of_the_power_cut_model(tmp_path, monkeypatch):
    """The shard process wraps its file calls to report progress and a full disk; the
    wrapper must still go through the hook that records synced sizes, or every power cut
    of `shardq verify --power-cuts` is left alone as "unknown" (and tests nothing)."""

    from shardq.verify.powercut import synced_sizes

    side, files, log, inode = _reporting_log_with_one_commit(tmp_path, monkeypatch)
    log.close()  # writes a sync mark, then seals: truncates and fsyncs
    size = log.writer.size
    assert size > len(b"\x91\x01") + 8 and synced_sizes(str(side)).get(inode) == size and files.bytes_written > 0


def test_a_synced_commit_makes_the_hooks_own_write_and_datasync(tmp_path, monkeypatch):
    """A synced commit is one ``write_sync`` call (wal/fileio.py). Where a subclass changes
    ``write`` or ``datasync`` (the power-cut model's sync log, the test doubles), its own two
    calls are made: the synced size is recorded at the commit, not only at the close, and a
    fault armed for the datasync fires there."""
    import errno

    from support.faults import FaultyFiles
    from shardq.errors import LogFailed
    from shardq.verify.powercut import synced_sizes
    from shardq.wal.log import Log

    side, files, log, inode = _reporting_log_with_one_commit(tmp_path, monkeypatch)
    assert synced_sizes(str(side)).get(inode) == log.writer.size and files.bytes_written > 0
    log.close()

    faulty = FaultyFiles(kinds=("datasync",), error=errno.EIO)
    os.mkdir(tmp_path / "other")
    log = Log(str(tmp_path / "other"), segment_bytes=1 << 20, files=faulty)
    list(log.replay())
    faulty.fail_at = faulty.count + 1  # the next datasync
    with pytest.raises(LogFailed):
        log.commit([b"\x91\x01"], sync=True)
    assert faulty.failed is not None and faulty.failed[0] == "datasync"
    assert [kind for kind, _ in faulty.calls[-2:]] == ["write", "datasync"]
