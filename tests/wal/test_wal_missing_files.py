"""A log missing a file: a shard refuses to start, `shardq wal check` says so (exit 1, the
file named, at offset 0), and `shardq wal repair --force` rebuilds the log from the files left.

The finding this answers: with the segment a checkpoint starts at deleted, or the oldest
segment with no checkpoint, `serve` refused the shard as corrupt, but `wal check` printed
`ok` for every file and `wal repair --force` said "nothing to repair": the documented path
gave an all-clear for a shard that would not start. The rules now live in one place
(shardq/wal/layout.py), used by the start and by `wal check`; each shape below is checked
both ways (`wal check` exits 1 iff the shard refuses to start), before and after the repair.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pytest

from shardq.cli.main import main as cli
from shardq.errors import CorruptLog
from shardq.shard.durable import Engine
from shardq.wal.format import checkpoint_name, segment_name
from shardq.wal.log import LOG_END

ROUNDS = 40
ACK_LAG = 2  # a round acks the leases of two rounds before: leases and their acks straddle segments


@dataclass
class History:
    """A shard's log over several segments, closed cleanly, and where each job's enqueue and
    ack were written (segment numbers)."""
    directory: str
    config: object
    checkpoint: int | None
    segments: list[int]
    bodies: dict[int, bytes] = field(default_factory=dict)    # every job enqueued
    live: set[int] = field(default_factory=set)               # the jobs at the end
    enqueued_in: dict[int, int] = field(default_factory=dict)
    leased_in: dict[int, int] = field(default_factory=dict)
    acked_in: dict[int, int] = field(default_factory=dict)
    tokens: set[int] = field(default_factory=set)             # every lease token handed out


def _history(tmp_path, make_config, clock, *, checkpoint: bool, restart_every: int = 0) -> History:
    d = str(tmp_path / "shard-0")
    config = make_config(segment_bytes=4096, compact_min_bytes=1 << 30)
    e = Engine(d, config, clock=clock)
    h = History(d, config, None, [])
    leases: list[list] = []
    for r in range(ROUNDS):
        if restart_every and r > ROUNDS // 4 and r % restart_every == 0:  # each start begins a token epoch
            e.close()
            e = Engine(d, config, clock=clock)
        if checkpoint and r == ROUNDS // 4:
            e.compact()
            h.checkpoint = e.shard.log.segments[0]
        if len(leases) >= ACK_LAG:
            for lease in leases.pop(0):
                e.ack(lease.job_id, lease.token)
                h.acked_in[lease.job_id] = e.shard.log.writer.seq
        for i in range(3):
            body = f"round {r} job {i} ".encode() * 8
            jid = e.enqueue(body, key=f"k{i}" if i < 2 else None)
            h.bodies[jid], h.enqueued_in[jid] = body, e.shard.log.writer.seq
        leases.append(e.dequeue(max_jobs=2))
        h.leased_in.update((lease.job_id, e.shard.log.writer.seq) for lease in leases[-1])
        h.tokens.update(lease.token for lease in leases[-1])
    h.live = set(e.state.jobs)
    h.segments = list(e.shard.log.segments)
    e.close()
    assert len([s for s in h.segments if h.checkpoint is None or s > h.checkpoint]) >= 4, h.segments
    return h


def _cut(h: History, shape: str) -> tuple[set[int], str, str]:
    """Delete the files of ``shape``: (the segments whose records are gone, the path `wal
    check` must name, a name its reason must hold)."""
    d, base, segs = h.directory, h.checkpoint, h.segments
    if shape == "checkpoint-base":       # the segment the checkpoint starts at
        gone, named = {base}, segment_name(base)
    elif shape == "oldest":              # no checkpoint: the oldest segment
        gone, named = {1}, segment_name(1)
    elif shape == "checkpoint":          # the checkpoint: what it held is as good as gone
        os.unlink(os.path.join(d, checkpoint_name(base)))
        return set(range(1, base)), os.path.join(d, segment_name(1)), checkpoint_name(base)
    elif shape == "middle":              # a gap between two segments
        gone, named = {segs[2]}, segment_name(segs[2])
    else:                                # "all-segments": a checkpoint with none of its segments
        gone, named = set(segs), segment_name(base)
    for s in gone:
        os.unlink(os.path.join(d, segment_name(s)))
    return gone, os.path.join(d, named), named


def _refused(h: History) -> CorruptLog | None:
    """What the shard's start says: None if it starts."""
    try:
        Engine(h.directory, h.config).close()
    except CorruptLog as e:
        return e
    return None


def _wal(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["wal", *args])
    return rc, capsys.readouterr().out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _ids(line: str) -> set[int]:
    """The job ids a report line lists (``N (id, id, ...)``; ``none``)."""
    listed = line.split(": ")[-1]
    return set(map(int, re.findall(r"\d+", listed.split("(", 1)[1]))) if "(" in listed else set()


SHAPES = [("checkpoint-base", True), ("oldest", False), ("checkpoint", True), ("middle", True),
          ("all-segments", True)]


@pytest.mark.parametrize("log_end", [True, False], ids=["clean-stop", "crash"])
@pytest.mark.parametrize("shape,checkpoint", SHAPES, ids=[s for s, _ in SHAPES])
def test_a_missing_file_is_reported_by_wal_check_and_repaired(tmp_path, make_config, clock, capsys, shape,
                                                              checkpoint, log_end):
    h = _history(tmp_path, make_config, clock, checkpoint=checkpoint)
    assert _refused(h) is None and _wal(capsys, "check", h.directory)[0] == 0  # the invariant, healthy
    if not log_end:
        os.unlink(os.path.join(h.directory, LOG_END))  # as after a crash: no record of a clean stop
    gone, path, name = _cut(h, shape)

    # The shard refuses, and `wal check` says so, under the same name, at offset 0.
    refused = _refused(h)
    rc, out = _wal(capsys, "check", h.directory)
    assert (refused is not None, rc) == (True, 1), (refused, out)
    assert (refused.path, refused.offset) == (path, 0) and name in refused.reason, refused
    assert f"corrupt {path} records=0 at offset 0: {refused.reason}" in out, out

    # Repair rebuilds the log from the files left, and keeps them in repair-<time>/.
    left = {n: _read(os.path.join(h.directory, n)) for n in os.listdir(h.directory)
            if n.endswith((".wal", ".ckpt")) or n == LOG_END}
    rc, out = _wal(capsys, "repair", h.directory, "--force")
    assert rc == 0, out
    done = out.splitlines()
    assert done[0].startswith(f"{path}: ") and "nothing of" in done[0], done
    [backup] = [os.path.join(h.directory, n) for n in os.listdir(h.directory) if n.startswith("repair-")]
    assert {n: _read(os.path.join(backup, n)) for n in os.listdir(backup)} == left
    assert _refused(h) is None
    assert _wal(capsys, "check", h.directory)[0] == 0  # the invariant, repaired

    e = Engine(h.directory, h.config)
    back = {j: job.body for j, job in e.state.jobs.items()}
    e.close()
    in_gone = {j for j, s in h.enqueued_in.items() if s in gone}
    acked_left = {j for j, s in h.acked_in.items() if s not in gone and (h.checkpoint is None or s >= h.checkpoint
                                                                         or shape == "checkpoint")}
    # Every job of the records left is there, byte for byte; none that they say was acked
    # comes back (their acks are applied even where the lease before them was lost).
    assert {j: b for j, b in back.items() if j in h.live} == {j: h.bodies[j] for j in h.live - in_gone}
    assert not set(back) & acked_left
    # Those whose lease was in a missing file (or that waited there behind a job whose ack
    # was): the repair says it deleted them as their ack says.
    redone = [x for x in done if x.startswith("jobs deleted as an intact record says")]
    expected = {j for j in acked_left if h.leased_in[j] in gone and j not in in_gone}
    assert expected <= (_ids(redone[0]) if redone else set()) <= acked_left
    if shape == "checkpoint-base":
        assert expected, "leases in the missing segment acked after it"
    # Only a job whose ack was in a missing file may come back (at-least-once).
    assert set(back) - h.live <= {j for j, s in h.acked_in.items() if s in gone}
    # The report names exactly the jobs enqueued in the missing files that no record left
    # settles: every live job lost among them (the others were acked in those very files).
    line = next(x for x in done if x.startswith("jobs not recovered"))
    named = _ids(line)
    if shape == "all-segments":  # nothing after them to bound the numbers: the first that may be lost
        assert named == set()
        first = min(in_gone)
        assert f"jobs numbered after job {max(j for j in h.bodies if j < first)} may" in out, out
    else:
        assert named == in_gone - acked_left, (sorted(named ^ (in_gone - acked_left)))
    assert h.live & in_gone <= named or shape == "all-segments"
    # A job enqueued after the repair takes a number after every one that existed, the
    # missing files' included (past what they could hold, where no later enqueue bounds them).
    e = Engine(h.directory, h.config)
    assert e.enqueue(b"after the repair") > max(h.bodies)
    e.close()


def test_after_losing_every_segment_past_a_checkpoint_no_job_number_or_lease_token_is_handed_out_again(
        tmp_path, make_config, clock, capsys):
    """Nothing intact follows the missing segments, so the numbers and token epochs they used
    are unknown: a job enqueued after the repair took the number of one they held (a
    worker's idempotency record for that number then skipped the new job's effect), and the
    next start's epoch was one the lost segments had begun (shards restarted there), so a
    token handed out there was handed out again."""
    h = _history(tmp_path, make_config, clock, checkpoint=True, restart_every=5)
    gone, _, _ = _cut(h, "all-segments")
    assert {j for j, s in h.enqueued_in.items() if s in gone}, "jobs were numbered in the lost segments"
    rc, out = _wal(capsys, "repair", h.directory, "--force")
    assert rc == 0 and "new jobs are numbered from" in out, out
    for _ in range(2):  # the next start and the one after it
        e = Engine(h.directory, h.config)
        job_id = e.enqueue(b"after the repair")
        leases = e.dequeue(max_jobs=100)
        e.close()
        assert job_id > max(h.bodies)
        assert leases and min(lease.token for lease in leases) > max(h.tokens)


def test_a_missing_segment_is_refused_and_repaired_whatever_else_is_damaged(tmp_path, make_config, clock, capsys):
    """Two gaps at once: each is reported under its own name; the start names the first."""
    h = _history(tmp_path, make_config, clock, checkpoint=True)
    os.unlink(os.path.join(h.directory, LOG_END))
    for s in (h.segments[1], h.segments[3], h.segments[4]):
        os.unlink(os.path.join(h.directory, segment_name(s)))
    refused = _refused(h)
    assert refused.path == os.path.join(h.directory, segment_name(h.segments[1]))
    rc, out = _wal(capsys, "check", h.directory)
    assert rc == 1
    corrupt = [x.split()[1] for x in out.splitlines() if x.startswith("corrupt")]
    assert corrupt == [os.path.join(h.directory, segment_name(s)) for s in (h.segments[1], h.segments[3])], out
    assert f"segments {segment_name(h.segments[3])}..{segment_name(h.segments[4])} are missing" in out
    assert _wal(capsys, "repair", h.directory, "--force")[0] == 0
    assert _refused(h) is None and _wal(capsys, "check", h.directory)[0] == 0


def test_wal_repair_without_force_changes_nothing(tmp_path, make_config, clock, capsys):
    h = _history(tmp_path, make_config, clock, checkpoint=True)
    _cut(h, "checkpoint-base")
    before = sorted(os.listdir(h.directory))
    capsys.readouterr()
    assert cli(["wal", "repair", h.directory]) == 2  # a usage error: --force is wanted
    assert "--force" in capsys.readouterr().err and sorted(os.listdir(h.directory)) == before
