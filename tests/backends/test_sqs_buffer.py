"""The per-group head buffer of the SQS backend (pure: times are passed in)."""
from __future__ import annotations

from shardq.backends.sqs_buffer import HeadBuffer, Held
from shardq.backends.sqs_mapping import Incoming


def held(group: str, n: int, deadline: float = 10.0, queue: str = "q") -> Held:
    return Held(queue, Incoming(f"{group}{n}", f"{group}{n}", group, b"", 1, group, f"r-{group}{n}"),
                deadline, 0.0, margin=1.0)


def test_only_the_first_of_a_group_is_handed_out_and_the_rest_follow_acks_in_order():
    b = HeadBuffer(hold_s=5)
    batch = [held("a", 0), held("b", 0), held("a", 1), held("a", 2)]
    assert [h.msg.job_id for h in b.admit(batch, now=0)] == ["a0", "b0"]
    assert len(b) == 2 and b.take_available("q", 0, 10) == []
    b.acked("q", "a", "r-a0", now=1)
    (nxt,) = b.take_available("q", 1, 10)
    assert nxt.msg.job_id == "a1" and b.take_available("q", 1, 10) == []
    b.acked("q", "a", "r-a1", now=2)
    assert [h.msg.job_id for h in b.take_available("q", 2, 10)] == ["a2"]
    b.acked("q", "a", "r-a2", now=3)
    assert len(b) == 0


def test_a_dropped_head_gives_its_followers_back_in_order():
    b = HeadBuffer(hold_s=5)
    b.admit([held("a", 0), held("a", 1), held("a", 2)], now=0)
    assert [h.msg.job_id for h in b.drop("q", "a", "r-a0", now=1)] == ["a1", "a2"]
    assert b.drop("q", "a", "r-a0", now=1) == [] and len(b) == 0


def test_due_extends_followers_of_a_live_head_and_releases_before_the_head_ends():
    b = HeadBuffer(hold_s=5)
    b.admit([held("a", 0, deadline=10), held("a", 1, deadline=10)], now=0)
    assert b.next_due() == 9.0
    b.head_extended("q", "a", "r-a0", 30.0)
    extend, release = b.due(9.5)
    assert [h.msg.job_id for h in extend] == ["a1"] and release == []
    b.extended(extend[0], 20.0)
    assert b.due(15.0) == ([], [])
    extend, _ = b.due(19.5)
    b.extended(extend[0], 40.0)
    extend, release = b.due(29.5)  # the head's lease is about to end: release first
    assert extend == [] and [h.msg.job_id for h in release] == ["a1"]
    assert len(b) == 0 and b.next_due() is None


def test_an_available_follower_nobody_takes_is_released_and_an_expired_one_is_never_handed_out():
    b = HeadBuffer(hold_s=5)
    b.admit([held("a", 0), held("a", 1, deadline=100)], now=0)
    b.acked("q", "a", "r-a0", now=1)
    extend, release = b.due(6.5)
    assert [h.msg.job_id for h in release] == ["a1"]
    b.admit([held("c", 0), held("c", 1, deadline=3)], now=0)
    b.acked("q", "c", "r-c0", now=1)
    assert b.take_available("q", 4, 10) == []  # its own lease ended: SQS has it again


def test_a_redelivered_group_replaces_state_whose_head_lease_ended():
    b = HeadBuffer(hold_s=5)
    b.admit([held("a", 0, deadline=2), held("a", 1, deadline=2)], now=0)
    again = b.admit([held("a", 0, deadline=20)], now=3)
    assert [h.msg.job_id for h in again] == ["a0"] and len(b) == 0
