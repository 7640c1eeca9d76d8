"""A lease and its ack through the shard loop, as figure C and M's consumers make them:
the rows of a ``dequeue`` reply (wire.LeaseRow; the usual one-lease dequeue is built on a
path of its own in process.py ``_dequeue``, and its row is the one the general path builds
for a dequeue of several, field by field), and the fdatasync metrics the loop's count of
log operations feeds (committer.py ``_observe``)."""
from __future__ import annotations

import os

import pytest

from shardq.protocol import wire
from shardq.shard.committer import Committer
from shardq.shard.durable import DurableShard
from shardq.shard.process import ShardServer

NOW = 1000.0


@pytest.fixture
def server(tmp_path, make_config):
    shard = DurableShard(str(tmp_path / "s"), 0, make_config())
    shard.open()
    srv = ShardServer(shard, str(tmp_path / "sock"), b"k" * 32)
    srv.committer = Committer(shard.log, 4)  # _dequeue reads what is durable from it
    yield srv
    srv.committer.stop()
    srv._poller.close()
    os.close(srv._wake_r)
    os.close(srv._wake_w)
    shard.close()


def expected_row(server: ShardServer, row: wire.LeaseRow) -> wire.LeaseRow:
    job, (token, deadline) = server.state.jobs[row.job_id], server.state.inflight[row.job_id]
    return wire.LeaseRow(job.id, job.key, job.body, job.attempts, token, deadline, job.priority,
                         server.state.queues["default"].prioritized)


@pytest.mark.parametrize("prioritized", [False, True])
def test_one_lease_and_several_make_the_same_rows(server, prioritized):
    prios = [3, 3, 1, 0] if prioritized else [0, 0, 0, 0]
    server.state.enqueue_many([[b"body-%d" % i, f"k{i}" if i % 2 else None, "default", 0, p, None]
                               for i, p in enumerate(prios)], NOW)
    one = server._execute(None, 1, "dequeue", ["default", 30, 1], NOW, len(server.state._ops))
    several = server._execute(None, 2, "dequeue", ["default", 30, 3], NOW, len(server.state._ops))
    assert one[:2] == [1, wire.OK] and several[:2] == [2, wire.OK], (one, several)
    assert len(one[2]) == 1 and len(several[2]) == 3
    rows = one[2] + several[2]
    assert all(type(r) is wire.LeaseRow for r in rows)
    assert rows == [expected_row(server, r) for r in rows]
    assert [r.body for r in rows] == [b"body-0", b"body-1", b"body-2", b"body-3"]  # queue order
    assert {r.uses_priorities for r in rows} == {prioritized}
    assert [r.priority for r in rows] == prios


def test_the_commit_metrics_count_every_lease_and_ack_written(tmp_path):
    """Each lease (batched: written, unsynced) and its ack (written and fdatasynced) is one
    log operation; the ack's fdatasync covers both, so N lease + ack pairs through the loop
    make N fdatasyncs of 2 operations each. (``fsyncs`` is ``commit_seconds``' count by
    definition, so it is checked by what the operations' histogram saw.)"""
    from bench.probes.shard_path import Loop
    loop = Loop(str(tmp_path), preload=50)
    try:
        committer = loop.server.committer
        fsyncs, ops_before = committer.fsyncs, committer.commit_ops.snapshot()
        for _ in range(50):
            loop.lease_ack()
        assert loop.failures == 0
        ops = committer.commit_ops.snapshot()
        assert committer.fsyncs - fsyncs == ops["count"] - ops_before["count"] == 50
        assert ops["sum"] - ops_before["sum"] == 100
        assert ops["counts"][1] - ops_before["counts"][1] == 50  # the bucket of 2 (1 < n <= 2)
    finally:
        loop.close()
