"""``shardq wal repair`` for damage in synced data: salvage every record that reads whole.

A damaged log (format 3) still holds, after the damaged bytes, records that read whole
(wal/reader.py finds them by their mark). Repair rebuilds the shard's state from every such
record, in log order, and writes it as one new checkpoint (the compaction's own writer), so
the next start replays exactly what was salvaged. Guarantees:

* every job whose records lie outside the damaged bytes comes back, byte for byte, with its
  state as of the last of its records that survived;
* a missing file (wal/layout.py: the segment a checkpoint starts at, one between two
  others, the oldest with no checkpoint, the checkpoint itself) is damaged bytes nothing is
  left of: the records around it are replayed in order, and its jobs named as below;
* the damaged bytes' jobs are named, never guessed: the enqueues that can still be read in
  them, the job ids missing between the last enqueue before the damage and the first after
  it (a shard numbers its jobs in order), less the jobs an intact record deletes, and the
  jobs whose later operations no longer apply (their enqueue was in the damaged bytes);
* a state change lost with the damaged bytes is undone, never invented: a lost ack brings
  its job back (at-least-once), a lost enqueue is listed, not rebuilt; an operation whose
  job is missing, or not in the state it expects (its lease was in the damaged bytes), is
  dropped and its job named (an ack of a job the checkpoint holds ready with the token of
  its lease that ran out applies: the ack of a lapsed lease, StateCore.lapsed), except one
  that deletes its job (ack, purge, cancel): that is carried out from the state the job is
  in, so a job an intact record says was acked never comes back;
* the next job is numbered after every id named or seen, and, where nothing intact follows
  the damage, past as many as its bytes could hold; the next start's lease-token epoch
  likewise: no new job takes an old one's number, no token is handed out twice;
* the rebuilt state is replayed as the next start will replay it before anything on disk
  changes: a salvage that could not start is refused, the log left as it was;
* the original files are kept in ``<shard dir>/repair-<time>/`` (0700, files 0600), and the
  shard directory's lock is held throughout (a running shard holds it).
"""
from __future__ import annotations

import os
import re
import time

import msgpack

from .. import limits
from ..config import Config
from ..wal import Log
from ..wal.format import CHECKPOINT, HEADERS, RECORD_BYTES_MAX, SEGMENT, checkpoint_name, parse_name, segment_name
from ..wal.layout import LOG_END, Missing, log_files, missing_files, read_log_end
from ..wal.reader import read_intact
from ..wal.repair import _copy_private, _lock, _sync_dir
from ..wal.salvage import format_ids, job_ids_of, readable_ops, scanned_job_ids
from . import ops as O
from .ops import Op
from ..errors import CorruptLog
from .state import JobState, ShardState

_CHECKPOINT_END = "shardq-checkpoint-end"
_HELD = "; enqueues they held: "
_SHARD_DIR = re.compile(r"shard-(\d+)$")
_SHARD_MASK = (1 << limits.JOB_ID_SHARD_BITS) - 1


def _log_files(directory: str) -> tuple[list[tuple[int, str, str]], list[Missing]]:
    """(seq, kind, name) of the files a replay reads (the newest checkpoint, then segments),
    and the runs of segments it needs and lacks (wal/layout.py: the rules replay applies)."""
    found = log_files(os.listdir(directory))
    try:
        end = read_log_end(directory)
    except CorruptLog:
        end = None  # the log's end is unknown; the rebuilt log drops the record
    files = [(found.checkpoint, CHECKPOINT, checkpoint_name(found.checkpoint))] if found.checkpoint is not None else []
    return files + [(s, SEGMENT, segment_name(s)) for s in found.segments], missing_files(directory, found, end)


def salvage(directory: str, *, config: Config | None = None) -> list[str]:
    """Rebuild one shard directory's log from every record that reads whole (see the module
    docstring); returns what was done, line by line. The caller has checked that the log
    has damage and that the user asked for the repair (``--force``)."""
    lock_fd = _lock(directory)
    try:
        return _salvage(directory, config or Config())
    finally:
        os.close(lock_fd)


def _salvage(directory: str, config: Config) -> list[str]:
    m = _SHARD_DIR.search(os.path.basename(os.path.normpath(directory)))
    state = ShardState(int(m.group(1)) if m else 0, config)
    files, missing = _log_files(directory)
    gaps = {run.before: run for run in missing}  # before which segment (None: after the last one)
    done: list[str] = []
    lost: set[int] = set()       # enqueues in the damaged bytes
    orphaned: set[int] = set()   # jobs whose later operations could not be applied
    settled: set[int] = set()    # jobs an intact record deletes (ack, purge, cancel)
    redone: set[int] = set()     # ... though the change it followed was lost: deleted as it says
    # Damaged ranges with no intact enqueue after them in their own file: the first one in
    # a later file bounds them. (line index in done, last job number before, ids read in them,
    # the highest number known in them, how many bytes they could have held)
    open_ranges: list[tuple[int, int, set[int], int, int]] = []
    next_write, records = 1, 0
    segment_bytes = _segment_bytes(directory, config)

    def missing_run(run: Missing) -> None:
        # Nothing of them is left to read: like damaged bytes with no intact enqueue in them,
        # bounded by the first intact enqueue after them, in any later file.
        lo_seq = state.next_seq - 1
        done.append(f"{run.path}: {run.what}; nothing of {'it' if run.first == run.last else 'them'} is left to "
                    f"read{_HELD}none")
        open_ranges.append((len(done) - 1, lo_seq, set(), lo_seq, (run.last - run.first + 1) * segment_bytes))

    for seq, kind, name in files:
        if kind == SEGMENT and seq in gaps:
            missing_run(gaps[seq])
            next_write = 0  # the write numbers before this segment are missing: any goes on
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            data = f.read()
        payloads, bad, last_write = read_intact(path, data, kind, next_write if kind == SEGMENT else 0)
        prior_seq = state.next_seq - 1  # the last job number of the files before this one
        enqueued: list[int] = []  # the job numbers of this file's intact enqueues
        for payload in payloads:
            ops = msgpack.unpackb(payload, raw=False, use_list=True)
            if kind == CHECKPOINT and ops[:1] == [_CHECKPOINT_END]:
                if len(ops) == 3:
                    next_write = ops[2]
                continue
            records += 1
            for op in ops:
                if op and op[0] == O.ENQUEUE and len(op) > O.JOB_ID and isinstance(op[O.JOB_ID], int):
                    enqueued.append(op[O.JOB_ID] >> limits.JOB_ID_SHARD_BITS)
                if op and op[0] in _DELETES and len(op) > O.JOB_ID:
                    settled.add(op[O.JOB_ID])
                todo = _carried_out(state, op)
                if todo is None:
                    orphaned.add(op[O.JOB_ID])
                    continue
                if todo is not op:
                    redone.add(op[O.JOB_ID])
                try:
                    state.apply(todo)
                except Exception as e:  # noqa: BLE001 - a state the guard did not foresee: stop, change nothing
                    raise CorruptLog(path, 0, f"cannot salvage: operation {op!r:.80} does not apply to the "
                                     f"salvaged state ({type(e).__name__}: {e}); the log is left as it was") from None
        if kind == SEGMENT and last_write >= next_write:
            next_write = last_write + 1
        for i, (line, lo_seq, read, _top, _bytes) in reversed(list(enumerate(open_ranges))):
            later = [s for s in enqueued if s > lo_seq]
            if later:  # the first intact enqueue after the damage: exactly the numbers between
                exact = _numbers(lo_seq, min(later), state.shard_index)
                lost = (lost - read) | exact
                done[line] = f"{done[line].split(_HELD)[0]}{_HELD}{format_ids(sorted(exact))}"
                del open_ranges[i]
        for start, end in bad:
            ids, bounded, lo_seq, top = _lost_in(data, start, end, kind, state.shard_index, prior_seq)
            lost |= ids
            done.append(f"{path}: bytes {start}..{end} do not read; dropped{_HELD}{format_ids(sorted(ids))}")
            if not bounded and kind == SEGMENT:
                open_ranges.append((len(done) - 1, lo_seq, ids, top, end - start))
    if None in gaps:  # the newest segments, by the clean stop's record: nothing after them bounds them
        missing_run(gaps[None])
    # A job an intact record deletes is not lost, wherever its enqueue was.
    orphaned -= set(state.jobs) | settled
    lost -= set(state.jobs) | settled
    unbounded = [top << limits.JOB_ID_SHARD_BITS | state.shard_index for _, _, _, top, _ in open_ranges]
    _number_past(state, lost | orphaned | settled | set(unbounded))
    unread = sum(held for *_, held in open_ranges)  # bytes nothing intact follows
    if unread:
        _skip_unread(state, unread)
    _check_snapshot(state, config, directory)
    backup = os.path.join(directory, f"repair-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(backup, mode=0o700, exist_ok=True)
    # The clean stop's record goes too: it speaks of the log replaced (and one that does not
    # read would stop the new log's replay).
    for name in os.listdir(directory):
        if parse_name(name) or name == LOG_END:
            _copy_private(os.path.join(directory, name), backup)
    for name in os.listdir(directory):
        if parse_name(name) or name == LOG_END:
            os.unlink(os.path.join(directory, name))
    _sync_dir(directory)
    log = Log(directory, segment_bytes=config.limits.segment_bytes)
    for _ in log.replay():
        pass
    log.compact(state.snapshot)
    log.close()
    done.append(f"rebuilt {directory} from {records} intact records: {len(state.jobs)} jobs kept, in a new "
                f"checkpoint; originals kept in {backup}")
    where = "the damaged bytes or the missing segments" if missing else "the damaged bytes"
    done.append(f"jobs not recovered (enqueued in {where}): {format_ids(sorted(lost), most=1000)}")
    if unbounded:
        done.append(f"no intact enqueue follows the damage: jobs numbered after job "
                    f"{', '.join(map(str, sorted(unbounded)))} may also have been enqueued in {where}, "
                    "and cannot be named (nothing of them is left to read); new jobs are numbered from "
                    f"{state.next_seq << limits.JOB_ID_SHARD_BITS | state.shard_index} and the next start's lease "
                    f"tokens begin past epoch {state.epoch}, beyond any the {unread} bytes could have held")
    done.append(f"jobs whose later changes no longer applied (their enqueue or lease was damaged): "
                f"{format_ids(sorted(orphaned), most=1000)}")
    if redone:
        done.append(f"jobs deleted as an intact record says (acked, purged or cancelled), though the change "
                    f"before it was lost: {format_ids(sorted(redone), most=1000)}")
    return done


#: The states an operation on an existing job expects (replay may find a lease expired or a
#: delay due: neither is logged). An operation whose job is missing or elsewhere lost a
#: record it depends on (an enqueue, a lease) to the damage: it is dropped, its job named.
_EXPECTS: dict[int, tuple[JobState, ...]] = {
    O.LEASE: (JobState.READY, JobState.DELAYED, JobState.LEASED),
    O.ACK: (JobState.LEASED,), O.RELEASE: (JobState.LEASED,), O.EXTEND: (JobState.LEASED,),
    O.DEAD: (JobState.LEASED, JobState.READY, JobState.DELAYED),
    O.REDRIVE: (JobState.DEAD,), O.PURGE: (JobState.DEAD,),
    O.CANCEL: (JobState.WAITING, JobState.DELAYED, JobState.READY, JobState.LEASED),
}


def _applies(state: ShardState, op: Op) -> bool:
    """False for an operation on a job the salvaged state lacks, or holds in a state the
    operation does not expect (an enqueue whose id is taken counts too)."""
    if not op:
        return True  # names no job: left for apply() to refuse
    code = op[0]
    if code == O.ENQUEUE:
        return len(op) > O.JOB_ID and op[O.JOB_ID] not in state.jobs
    expects = _EXPECTS.get(code)
    if expects is None:
        return True
    job = state.jobs.get(op[O.JOB_ID]) if len(op) > O.JOB_ID and isinstance(op[O.JOB_ID], int) else None
    if job is None:
        return False
    if job.state in expects:
        return True
    # An ack of a lease that ran out while nothing leased the job again (StateCore.lapsed):
    # the checkpoint before it holds the job ready, with that lease's token. (Without a
    # checkpoint in between, replay finds such a job still leased.)
    return code == O.ACK and job.id in state.lapsed


#: Operations that delete their job: a job one of them names is not lost, and it is not
#: brought back even where the change it followed (a lease, a dead-lettering) was lost.
_DELETES = (O.ACK, O.PURGE, O.CANCEL)


def _carried_out(state: ShardState, op: Op) -> Op | None:
    """The operation that carries out ``op`` on the salvaged state: ``op`` itself where it
    applies (:func:`_applies`); for one that deletes a job the state holds in a state it
    does not expect (an ack whose lease, a purge whose dead-lettering, was lost), the
    operation that deletes the job from the state it is in, so an acked job does not come
    back; else None (dropped, its job named)."""
    if _applies(state, op):
        return op
    if not (op and op[0] in _DELETES and len(op) > O.JOB_ID and isinstance(op[O.JOB_ID], int)):
        return None
    job = state.jobs.get(op[O.JOB_ID])
    if job is None:
        return None
    if job.state is JobState.DEAD:
        return [O.PURGE, job.id]
    if job.state is JobState.WAITING:
        return [O.CANCEL, job.id]  # behind its key's head: a cancel takes it out of the line
    return [O.ACK, job.id]  # leased, ready or delayed (as the ack of a lease that ran out)


def _number_past(state: ShardState, named: set[int]) -> None:
    """Number the next job after every id the salvage named or saw deleted: a job enqueued
    after the repair never takes the id of one that existed (a worker's idempotency record,
    a result, the report itself name it)."""
    bits, mine = limits.JOB_ID_SHARD_BITS, state.shard_index
    seqs = [i >> bits for i in named if i & _SHARD_MASK == mine]
    if seqs and max(seqs) >= state.next_seq:
        state.apply([O.META, max(seqs) + 1, state.next_token, state.epoch])


def _segment_bytes(directory: str, config: Config) -> int:
    """The most a missing segment could have held: the configured segment size, or the
    largest segment left if it is larger (a segment is reserved at its size when it starts,
    and the size may have been configured larger then), plus one record over the end."""
    sizes = [os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
             if (parsed := parse_name(n)) is not None and parsed[1] == SEGMENT]
    return max([config.limits.segment_bytes, *sizes]) + RECORD_BYTES_MAX[SEGMENT]


def _skip_unread(state: ShardState, unread: int) -> None:
    """Bytes no intact record follows (damage, missing segments) held enqueues and shard
    starts no record left shows: number the next job, and begin the next lease-token epoch,
    past any they could have held (one enqueue per :data:`_ENQUEUE_BYTES_MIN`, one epoch
    per smallest record), so a job enqueued after the repair never takes the number of one
    enqueued there (a worker's idempotency record names it: the new job's effect would be
    skipped), and no token handed out there is handed out again."""
    seq = state.next_seq + unread // _ENQUEUE_BYTES_MIN + 1
    epoch = state.epoch + unread // _RECORD_BYTES_MIN + 1
    state.apply([O.META, seq, max(state.next_token, epoch << O.TOKEN_EPOCH_BITS), epoch])


def _check_snapshot(state: ShardState, config: Config, directory: str) -> None:
    """Replay the salvaged state's checkpoint into a new state, as the shard's next start
    will, before anything on disk changes: a salvage that would not start is refused."""
    probe = ShardState(state.shard_index, config)
    try:
        probe.replay(msgpack.unpackb(p, raw=False, use_list=True) for p in state.snapshot())
    except Exception as e:  # noqa: BLE001 - whatever it is, the log must stay as it was
        raise CorruptLog(directory, 0, f"cannot salvage: the rebuilt state does not replay ({type(e).__name__}: "
                         f"{e}); the log is left as it was") from None
    if set(probe.jobs) != set(state.jobs):
        raise CorruptLog(directory, 0, "cannot salvage: the rebuilt state does not replay to the same jobs; "
                         "the log is left as it was")


def readable_ops_in(data: bytes, start: int, end: int) -> list[Op]:
    """The operations that still decode in the damaged bytes ``data[start:end]``: from each
    record header found there by its mark (names only: never replayed)."""
    from ..wal.format import HEADERS, RECORD_MARK
    h = HEADERS[3]
    out: list[Op] = []
    pos = start
    while True:
        pos = data.find(RECORD_MARK, pos, end)
        if pos < 0:
            return out
        length = h.unpack_from(data, pos)[1] if pos + h.size <= len(data) else 0
        body = pos + h.size
        out.extend(readable_ops(memoryview(data)[body:min(body + length, len(data))]))
        pos += 1


#: The fewest bytes an enqueue takes in a record (a fixarray of 9 fields: its code, a job id,
#: a queue name, no key, an empty body, priority 0, due now, no dedup id, then its float64
#: creation time): damaged bytes hold at most their length over this many.
_ENQUEUE_BYTES_MIN = 19
#: The fewest bytes a record takes (a format-1 header and a one-byte payload): lost bytes
#: began at most their length over this many shard starts (each logs its token epoch).
_RECORD_BYTES_MIN = min(h.size for h in HEADERS.values()) + 1


def _numbers(lo_seq: int, hi_seq: int, shard: int) -> set[int]:
    """The job ids of this shard numbered after ``lo_seq`` and before ``hi_seq``."""
    return {(s << limits.JOB_ID_SHARD_BITS) | shard for s in range(lo_seq + 1, hi_seq)}


def _lost_in(data: bytes, start: int, end: int, kind: str, shard: int,
             prior_seq: int) -> tuple[set[int], bool, int, int]:
    """The job ids enqueued in the damaged bytes ``[start, end)``, whether that is exact, the
    last job number before them and the highest number they are known to hold. A shard
    numbers its jobs in order, one number per enqueue, so in a segment every number after
    the last intact enqueue before the damage was enqueued in the damaged bytes, up to:
    the first intact enqueue after them (exact; the caller looks in later segments too when
    none follows in this one), else the highest number still read in them (the ids after it
    cannot be known). An id read in bytes that failed their checksum may be garbled: one
    past what the damaged bytes could hold is left out. In a checkpoint (no order), the ids
    that still read in the damaged bytes."""
    bits = limits.JOB_ID_SHARD_BITS
    before = job_ids_of(readable_ops_in(data, 0, start)) if kind == SEGMENT else []
    lo_seq = max([prior_seq] + [i >> bits for i in before])
    if kind == SEGMENT:
        after = [s for i in job_ids_of(readable_ops_in(data, end, len(data))) if (s := i >> bits) > lo_seq]
        if after:
            return _numbers(lo_seq, min(after), shard), True, lo_seq, min(after) - 1
    named = set(job_ids_of(readable_ops_in(data, start, end))) | scanned_job_ids(memoryview(data)[start:end])
    seqs = {i >> bits for i in named if i & _SHARD_MASK == shard and i >> bits > lo_seq}
    if kind != SEGMENT:
        return {(s << bits) | shard for s in seqs}, False, lo_seq, max(seqs, default=lo_seq)
    most = lo_seq + (end - start) // _ENQUEUE_BYTES_MIN + 1
    top = max((s for s in seqs if s <= most), default=lo_seq)
    return _numbers(lo_seq, top + 1, shard), False, lo_seq, top
