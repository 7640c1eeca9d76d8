"""A lease handed back with delivered=False (a worker's unstarted prefetch) does not count
towards max_deliveries, survives replay, and still needs the live token."""
import pytest

from shardq.clock import FakeClock
from shardq.config import parse
from shardq.errors import LeaseLost
from shardq.shard.durable import Engine


def test_undelivered_release_does_not_use_up_deliveries(tmp_path):
    clock = FakeClock()
    cfg = parse({"queues": {"default": {"max_deliveries": 2}}})
    e = Engine(str(tmp_path), cfg, clock=clock)
    jid = e.enqueue(b"x", key="k")
    for _ in range(5):  # five unstarted prefetches, released: never a real delivery
        [lease] = e.dequeue()
        e.state.nack(lease.job_id, lease.token, clock.now(), delivered=False)
        e.shard.commit()
    e.close()
    e = Engine(str(tmp_path), cfg, clock=clock)  # replay keeps the count
    [lease] = e.dequeue()
    assert lease.attempt == 1
    e.nack(lease.job_id, lease.token)            # a real delivery that failed
    [lease] = e.dequeue()
    assert lease.attempt == 2
    with pytest.raises(LeaseLost):
        e.state.nack(lease.job_id, lease.token + 1, clock.now(), delivered=False)
    e.nack(lease.job_id, lease.token)            # second real failure: dead letter
    assert [d.job_id for d in e.dead_letters()] == [jid]
    e.close()
