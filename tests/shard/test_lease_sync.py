"""Lease durability as a per-queue policy (issue 10, item 2).

``lease_sync = "batched"`` (the default): a lease's reply does not wait for its fsync; the
record is written before the reply leaves (so a crash of the shard process loses nothing)
and made durable by the next commit. A crash of the machine can lose the delivery counts of
the last window, never a job and never an ack; and a lease token is never handed out twice,
because each shard start logs and fsyncs a new token epoch. ``"strict"``: every lease is
fsynced before it is handed out, as before.
"""
from __future__ import annotations

import os
import random
import signal

import pytest

import shardq
from shardq.clock import FakeClock
from shardq.shard.durable import DurableShard
from shardq.shard import ops

from conftest import config_from
from support.service import Service, restarted, wait_until


def test_a_token_is_never_reused_after_losing_the_unsynced_lease_records(tmp_path):
    """A machine crash loses a batched lease's record (written, not fsynced). Without the
    epoch, the next lease of the same job after the restart got the same token, and the
    old holder's ack was taken as the new delivery's."""
    clock = FakeClock()
    cfg = config_from()
    shard = DurableShard(str(tmp_path), 0, cfg)
    shard.open()
    jid = shard.state.enqueue(b"job", clock.now())
    shard.commit()  # durable, synced
    synced = (shard.log.writer.path, shard.log.writer.size)
    (lease,) = shard.state.dequeue("default", clock.now())
    shard.log.commit(shard.take_payloads(), sync=False)  # batched: written, not synced
    shard.log.writer.close()
    os.truncate(synced[0], synced[1])  # the machine crashed: the unsynced write is gone
    again = DurableShard(str(tmp_path), 0, cfg)
    again.open()
    (lease2,) = again.state.dequeue("default", clock.now())
    assert lease2.job_id == jid and lease2.attempt == 1  # only the delivery count was lost
    assert lease2.token > lease.token
    with pytest.raises(shardq.LeaseLost):
        again.state.ack(jid, lease.token, clock.now())
    again.state.ack(jid, lease2.token, clock.now())


def test_every_open_begins_a_durable_epoch_above_every_token_before(tmp_path):
    cfg = config_from()
    tokens = []
    for _ in range(3):
        shard = DurableShard(str(tmp_path), 0, cfg)
        shard.open()
        epoch = shard.state.epoch
        shard.state.enqueue(b"x", 1.0)
        (lease,) = shard.state.dequeue("default", 1.0)
        tokens.append(lease.token)
        assert lease.token >> ops.TOKEN_EPOCH_BITS == epoch
        shard.commit()
        shard.close()
    assert tokens == sorted(tokens) and len(set(t >> ops.TOKEN_EPOCH_BITS for t in tokens)) == 3


def test_strict_and_batched_in_fsyncs_per_lease_and_ack():
    cfg = {"queues": {"batched": {}, "strict": {"lease_sync": "strict"}}}
    with Service(shards=1, config=cfg) as svc:
        with svc.connect() as q:
            def fsyncs():
                return q.shard_metrics()[0]["fsyncs"]
            for queue in ("batched", "strict"):
                q.enqueue_many([{"body": b"x", "queue": queue} for _ in range(40)])
                before = fsyncs()
                for _ in range(40):
                    q.ack(q.dequeue(queue))
                per_job = (fsyncs() - before) / 40
                if queue == "strict":
                    assert per_job >= 1.9, per_job  # the lease's own fsync, then the ack's
                else:
                    assert per_job <= 1.2, per_job  # the ack's fsync covers the lease too


def test_sigkilled_shards_mid_lease_lose_no_job_keep_key_order_and_never_reuse_a_token():
    """Consumers lease and ack with an idempotent effect table (the idempotent consumer's
    rule: record the effect once per job id, then ack) while shards are SIGKILLed."""
    with Service(shards=2, config={"queue_defaults": {"visibility_timeout": 2}}) as svc:
        rng = random.Random(7)
        keys = [f"k{i}" for i in range(20)]
        with svc.connect(retry_s=20) as q:
            ids = q.enqueue_many([{"body": f"{k}:{n}".encode(), "key": k} for n in range(15) for k in keys])
            effects: dict[int, tuple[str, int]] = {}
            order: dict[str, list[int]] = {k: [] for k in keys}
            seen_tokens: dict[int, set] = {}
            kills = 0
            while len(effects) < len(ids):
                if kills < 4 and len(effects) > (kills + 1) * len(ids) // 6:
                    pids = q.ping()
                    victim = rng.randrange(2)
                    os.kill(pids[victim], signal.SIGKILL)
                    restarted(svc, victim, pids[victim])
                    kills += 1
                try:
                    leases = q.dequeue_many(max_jobs=8, wait=1.0)
                except shardq.ShardUnavailable:
                    continue
                for lease in leases:
                    tokens = seen_tokens.setdefault(lease.job_id, set())
                    assert lease.token not in tokens, "a lease token was handed out twice"
                    tokens.add(lease.token)
                    if lease.job_id not in effects:
                        key, n = lease.body.decode().split(":")
                        effects[lease.job_id] = (key, int(n))
                        order[key].append(int(n))
                for _lease, err in zip(leases, q.ack_many(leases)):
                    assert err is None or isinstance(err, (shardq.LeaseLost, shardq.ShardUnavailable))
            assert kills == 4 and set(effects) == set(ids)
            for k in keys:
                assert order[k] == list(range(15)), (k, order[k])
            st = q.stats()["queues"]["default"]
            assert wait_until(lambda: q.stats()["queues"]["default"]["in_flight"] == 0
                              and q.stats()["queues"]["default"]["ready"] == 0, 10, 0.05, "all acked")
            assert st["dead"] == 0
