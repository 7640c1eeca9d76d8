"""A long backlog under one key keeps FIFO order across the list -> deque switch, through
replay and a checkpoint, and never hides other keys' jobs."""
from shardq.clock import FakeClock
from shardq.shard.durable import Engine
from shardq.shard.state import KEY_LIST_MAX


def test_long_key_backlog_keeps_order_through_replay_and_checkpoint(tmp_path):
    clock = FakeClock()
    e = Engine(str(tmp_path), clock=clock)
    n = KEY_LIST_MAX * 3 + 5
    ids = [e.enqueue(str(i).encode(), key="hot") for i in range(n)]
    other = e.enqueue(b"other", key="cold")
    got = e.dequeue(max_jobs=10)  # one lease per key: the hot head and the cold job
    assert [l.job_id for l in got] == [ids[0], other]
    for l in got:
        e.ack(l.job_id, l.token)
    delivered = [ids[0]]
    for step in range(n - 1):
        if step == n // 3:
            e.compact()
        if step == n // 2:
            e.close()
            e = Engine(str(tmp_path), clock=clock)
        [lease] = e.dequeue(max_jobs=10)
        delivered.append(lease.job_id)
        e.ack(lease.job_id, lease.token)
    assert delivered == ids
    assert e.dequeue() == []
    e.close()
