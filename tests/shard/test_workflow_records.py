"""Workflow records on their home shard (shardq/shard/workflows.py; docs/design.md,
"Workflow records"): put once, ended once, read, listed while running; the same after a
replay of the log and after a checkpoint; a running record kept for ever, an ended one
until its expiry; every input checked at its limit before anything is logged."""
from __future__ import annotations

import msgpack
import pytest

from shardq import limits
from shardq.errors import InvalidJob, NotFound
from shardq.shard.state import ShardState

from conftest import config_from

T0 = 1_000_000.0


class Shard:
    """A ShardState at ``now`` with the log it wrote (msgpack round-tripped)."""

    def __init__(self):
        self.state = ShardState(0, config_from())
        self.now = T0
        self.log: list[list] = []

    def run(self, name: str, *args):
        try:
            return getattr(self.state, name)(*args, self.now)
        finally:
            produced = self.state.take_ops()
            if produced:
                self.log.append(msgpack.unpackb(msgpack.packb(produced), raw=False))

    def replayed(self) -> ShardState:
        again = ShardState(0, config_from())
        again.replay(self.log)
        return again

    def from_checkpoint(self) -> ShardState:
        self.state.advance(self.now)
        chunks = list(self.state.snapshot(limits.CHECKPOINT_CHUNK_BYTES))
        assert all(len(c) <= limits.CHECKPOINT_RECORD_BYTES_MAX for c in chunks)
        again = ShardState(0, config_from())
        again.replay([msgpack.unpackb(c, raw=False) for c in chunks])
        return again


def counted(state: ShardState) -> dict[str, int]:
    """The records kept by state, by a pass over them (what ``workflow_states`` keeps count of)."""
    out = dict.fromkeys(("running", "succeeded", "failed", "cancelled"), 0)
    for w in state.workflows.values():
        out[w.state or "running"] += 1
    return out


def shown(state: ShardState, now: float) -> dict:
    out = {}
    for wf_id in list(state.workflows):
        try:
            out[wf_id] = state.workflow(wf_id, now)
        except NotFound:
            pass
    return out


def test_a_record_is_put_once_ended_once_and_read_the_same_after_replay_and_checkpoint():
    sh = Shard()
    assert sh.run("put_workflow", "wf-a", b"spec-a") == "put"
    sh.now += 1
    assert sh.run("put_workflow", "wf-a", b"other") == "known"   # a re-sent put changes nothing
    assert sh.run("put_workflow", "wf-b", b"spec-b") == "put"
    assert sh.run("put_workflow", "wf-c", b"spec-c") == "put"
    assert sh.state.running_workflows(None, 10) == ["wf-a", "wf-b", "wf-c"]
    assert sh.state.running_workflows("wf-a", 1) == ["wf-b"]
    sh.now += 10
    assert sh.run("end_workflow", "wf-b", "failed", "step 0.1 (t, job 5) failed: boom", 3600.0) == "failed"
    assert sh.run("end_workflow", "wf-b", "succeeded", None, 3600.0) == "failed"  # its first end kept
    assert sh.run("end_workflow", "wf-c", "cancelled", None, 60.0) == "cancelled"
    assert sh.state.running_workflows(None, 10) == ["wf-a"]
    a = sh.state.workflow("wf-a", sh.now)
    assert a == {"spec": b"spec-a", "state": "running", "error": None, "started_at": T0, "ended_at": None,
                 "expires_at": None}
    b = sh.state.workflow("wf-b", sh.now)
    assert (b["state"], b["error"], b["ended_at"], b["expires_at"]) == (
        "failed", "step 0.1 (t, job 5) failed: boom", T0 + 11, T0 + 11 + 3600.0)
    assert sh.state.workflow_states() == {"running": 1, "succeeded": 0, "failed": 1, "cancelled": 1}
    counters = sh.state.workflow_counters()
    assert (counters["workflows_started"], counters["workflows_failed"], counters["workflows_cancelled"],
            counters["workflows_succeeded"]) == (3, 1, 1, 0)
    want = shown(sh.state, sh.now)
    for again in (sh.replayed(), sh.from_checkpoint()):
        assert shown(again, sh.now) == want
        assert again.workflow_states() == counted(again) == sh.state.workflow_states()
    # An ended record goes at its expiry; a running one stays.
    sh.now += 61
    sh.state.advance(sh.now)
    assert set(sh.state.workflows) == {"wf-a", "wf-b"}
    assert sh.state.workflow_states() == counted(sh.state) == {"running": 1, "succeeded": 0, "failed": 1,
                                                                "cancelled": 0}
    with pytest.raises(NotFound, match="wf-c"):
        sh.state.workflow("wf-c", sh.now)
    with pytest.raises(NotFound):
        sh.run("end_workflow", "wf-c", "succeeded", None, 60.0)
    sh.now += 10 * 365 * 86400.0
    sh.state.advance(sh.now)
    assert set(sh.state.workflows) == {"wf-a"}
    assert sh.state.workflow_states() == counted(sh.state)
    assert set(shown(sh.from_checkpoint(), sh.now)) == {"wf-a"}


def test_inputs_are_checked_at_their_limits_and_a_refusal_logs_nothing():
    sh = Shard()
    longest = "w" * limits.BARRIER_ID_BYTES_MAX
    biggest = b"s" * limits.WORKFLOW_SPEC_BYTES_MAX
    assert sh.run("put_workflow", longest, biggest) == "put"
    assert shown(sh.from_checkpoint(), sh.now)[longest]["spec"] == biggest  # one checkpoint record holds it
    logged = len(sh.log)
    for wf_id, spec, match in [(longest + "w", b"", "at most"), ("", b"", "non-empty"), (7, b"", "string"),
                               ("x", biggest + b"s", "at most"), ("x", "text", "bytes")]:
        with pytest.raises(InvalidJob, match=match):
            sh.run("put_workflow", wf_id, spec)
    for state, error, ttl, match in [("done", None, 60.0, "ends"), ("failed", 5, 60.0, "string"),
                                     ("failed", None, 0, "ttl_s"),
                                     ("failed", None, limits.KEEP_RESULT_S_MAX * 2, "ttl_s")]:
        with pytest.raises(InvalidJob, match=match):
            sh.run("end_workflow", longest, state, error, ttl)
    assert len(sh.log) == logged
    long_error = "é" * limits.ERROR_TEXT_BYTES_MAX  # 2 bytes each: cut to the limit
    assert sh.run("end_workflow", longest, "failed", long_error, limits.KEEP_RESULT_S_MAX) == "failed"
    kept = sh.state.workflow(longest, sh.now)["error"]
    assert len(kept.encode("utf-8")) <= limits.ERROR_TEXT_BYTES_MAX and kept == "é" * (limits.ERROR_TEXT_BYTES_MAX // 2)
    with pytest.raises(InvalidJob):
        sh.state.running_workflows(None, limits.BATCH_JOBS_MAX + 1)
    assert sh.state.running_workflows(None, limits.BATCH_JOBS_MAX) == []
