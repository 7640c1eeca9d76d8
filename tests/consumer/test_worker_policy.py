"""The consumer policy on its own (no queue, no thread, no clock): the table every worker
driver settles by. The drivers' behaviour is tested once for all of them in
tests/consumer/test_worker_drivers.py; this pins the rules they share."""
from __future__ import annotations

import random

import pytest

from shardq.consumer import policy as policy_mod
from shardq.consumer.handling import BURY, DONE, DUPLICATE, EXPIRED, FAILED, LOST, RETRY, backoff_delay, error_text
from shardq.consumer.policy import (ACK, BURY_NOW, NACK, NOTHING, Answer, Burst, Outbox, Policy, Settle,
                                    UnavailableBackoff, burst_for)
from shardq.errors import Cancelled, Closed, InvalidConfig, JobGone, LeaseLost, OutcomeUnknown, ShardUnavailable
from shardq.types import Lease


class TopRng:
    def uniform(self, a, b):
        return b


def lease(attempt: int = 1, deadline: float = 100.0) -> Lease:
    return Lease(7, None, b"", "default", attempt, 1, deadline)


def make(can_bury: bool = True) -> Policy:
    p = Policy(backoff_base_s=1.0, backoff_cap_s=10.0, rng=TopRng(), can_bury=can_bury)
    p.configure({"visibility_timeout": 30, "max_deliveries": 4})
    return p


@pytest.mark.parametrize("outcome, error, delay, attempt, lost, expected", [
    (DONE, None, None, 1, False, Settle(ACK, "succeeded")),
    (DUPLICATE, None, None, 1, False, Settle(ACK, "duplicates")),
    (FAILED, "E: x", None, 1, False, Settle(NACK, "failed", 1.0, "E: x")),    # full jitter, at its top
    (FAILED, "E: x", None, 3, False, Settle(NACK, "failed", 4.0, "E: x")),
    (FAILED, "E: x", None, 4, False, Settle(NACK, "failed", 0.0, "E: x")),    # last delivery: no delay
    (RETRY, "why", 2.5, 1, False, Settle(NACK, "failed", 2.5, "why")),
    (RETRY, "why", -1.0, 1, False, Settle(NACK, "failed", 0.0, "why")),       # clamped
    (RETRY, "why", None, 2, False, Settle(NACK, "failed", 2.0, "why")),
    (BURY, "no", None, 1, False, Settle(BURY_NOW, "failed", 0.0, "no")),
    (FAILED, "E: x", None, 1, True, Settle(NOTHING, "failed")),              # lease lost: send nothing
    (DONE, None, None, 1, True, Settle(ACK, "succeeded")),                  # lease lost: a late ack
    (DUPLICATE, None, None, 1, True, Settle(ACK, "duplicates")),
    (LOST, None, None, 1, False, Settle(NOTHING, "lost")),
    (EXPIRED, None, None, 1, False, Settle(NOTHING, "expired")),
])
def test_each_outcome_settles_as_the_table_says(outcome, error, delay, attempt, lost, expected):
    assert make().settle(outcome, error, delay, lease(attempt), lost=lost) == expected


def test_a_queue_that_cannot_bury_gets_a_nack_without_delay():
    assert make(can_bury=False).settle(BURY, "no", None, lease(), lost=False) == Settle(NACK, "failed", 0.0, "no")


def test_the_commit_margin_is_one_second_or_a_tenth_of_the_lease():
    p = make()
    assert p.may_commit(False, 100.0, 98.9) and not p.may_commit(False, 100.0, 99.0)
    assert not p.may_commit(True, 100.0, 0.0)
    p.configure({"visibility_timeout": 5})
    assert p.may_commit(False, 100.0, 99.49) and not p.may_commit(False, 100.0, 99.5)


@pytest.mark.parametrize("settle, exc, expected", [
    (Settle(ACK, "succeeded"), None, Answer(False, "succeeded")),
    (Settle(ACK, "succeeded"), ShardUnavailable("down"), Answer(True)),
    (Settle(ACK, "succeeded"), OutcomeUnknown("sent, no answer"), Answer(True)),
    (Settle(ACK, "duplicates"), JobGone("an earlier try landed"), Answer(False, "duplicates")),
    (Settle(ACK, "succeeded"), LeaseLost("expired"), Answer(False, "lost")),
    (Settle(NACK, "failed", 1.0, "E"), None, Answer(False)),
    (Settle(NACK, "failed", 1.0, "E"), ShardUnavailable("down"), Answer(True)),
    (Settle(BURY_NOW, "failed", 0.0, "E"), LeaseLost("expired"), Answer(False)),
    (Settle(BURY_NOW, "failed", 0.0, "E"), Closed("closed"), Answer(False)),
])
def test_the_queues_answer_to_a_settlement(settle, exc, expected):
    assert make().answer(settle, lease(), exc) == expected


@pytest.mark.parametrize("exc, says", [
    (LeaseLost("job 7: lease 1 expired"),
     "ack failed (LeaseLost: job 7: lease 1 expired); the queue will redeliver it"),
    (Cancelled("job 7 was cancelled while leased"), "cancelled while it ran; removed, not redelivered"),
])
def test_an_ack_that_did_not_land_says_whether_the_job_comes_back(exc, says, caplog):
    """A cancelled job's ack deletes it (Cancelled is a LeaseLost): the log must not promise
    a redelivery that never comes. Both count as lost."""
    with caplog.at_level("INFO", logger=policy_mod.log.name):
        assert make().answer(Settle(ACK, "succeeded"), lease(), exc) == Answer(False, "lost")
    assert [r.getMessage() for r in caplog.records] == [f"job 7: {says}"]


def test_the_outbox_gives_up_what_outlived_its_lease():
    box = Outbox()
    ack, nack = Settle(ACK, "succeeded"), Settle(NACK, "failed", 1.0, "E")
    box.put("a", ack, lease(deadline=10.0))
    box.put("b", nack, lease(deadline=10.0))
    box.put("c", ack, lease(deadline=20.0))
    assert box.take(9.0) == ([("a", ack), ("b", nack), ("c", ack)], []) and len(box) == 0
    for job, d in (("a", 10.0), ("b", 10.0), ("c", 20.0)):
        box.put(job, ack if job != "b" else nack, lease(deadline=d))
    assert box.take(10.0) == ([("c", ack)], [("a", "lost"), ("b", None)])


def test_the_unavailable_backoff_doubles_to_its_cap_and_resets():
    b = UnavailableBackoff()
    assert b.s == 0.0 and b.retry_s == policy_mod.UNAVAILABLE_BACKOFF_S_MIN
    waits = [b.failed() for _ in range(8)]
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    b.reset()
    assert b.s == 0.0 and b.failed() == 0.1


# ---------------------------------------------------------------------------- burst
def test_burst_is_done_when_each_queue_found_nothing_while_its_worker_held_nothing():
    b = Burst(["a"])
    t = b.asking()
    assert not b.answered("a", t, held=1, found=0)  # it still held a job when it asked
    t = b.asking()
    assert not b.answered("a", t, held=0, found=2)  # found jobs
    b.busy("a")                                     # full: asked nothing this turn
    t = b.asking()
    assert b.answered("a", t, held=0, found=0) and b.done
    assert b.answered("a", b.asking(), held=0, found=5) and b.done  # done stays done


def test_burst_asks_every_queue_again_after_any_worker_held_a_job():
    """Queue a's job sends a job to queue b: b's earlier "found nothing" is stale once a's
    worker held a job after b asked, so b must ask again before the group is done."""
    b = Burst(["a", "b"])
    tb = b.asking()
    ta = b.asking()
    assert not b.answered("a", ta, held=0, found=1)   # a leases the job that sends to b
    assert not b.answered("b", tb, held=0, found=0)   # b asked before that: stale
    assert not b.answered("a", b.asking(), held=1, found=0)
    assert not b.answered("a", b.asking(), held=0, found=0)  # a drained; b's answer is old
    assert not b.answered("b", b.asking(), held=0, found=1)  # b finds the job a sent
    assert not b.answered("b", b.asking(), held=1, found=0)
    assert not b.answered("b", b.asking(), held=0, found=0)
    assert b.answered("a", b.asking(), held=0, found=0)      # both asked after the last busy turn


def test_burst_arguments():
    shared = Burst(["a", "b"])
    assert burst_for(False, "a") is None and burst_for(None, "a") is None
    assert burst_for(shared, "a") is shared
    assert isinstance(burst_for(True, "a"), Burst)
    with pytest.raises(InvalidConfig, match="no queue"):
        Burst([])


# ---------------------------------------------------------------------------- backoff and error text (handling)
def test_backoff_delay_is_full_jitter_capped():
    top = TopRng()
    assert [backoff_delay(a, 1.0, 10.0, top) for a in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(10_000, 1.0, 300.0, top) == 300.0
    rng = random.Random(1)
    samples = [backoff_delay(3, 1.0, 300.0, rng) for _ in range(200)]
    assert all(0 <= s <= 4 for s in samples) and min(samples) < 1 and max(samples) > 3


def test_error_text():
    assert error_text(ValueError("boom")) == "ValueError: boom"
    assert len(error_text(ValueError("é" * 5000)).encode()) <= 2048
