"""The connection state machine (shardq/client/channel.py) on its own: no socket, no thread,
no event loop; time is a number. Both clients' connections are shells around it, so what
it decides here (ids, frames, merging, deadlines, breaks, orphans, withdrawals) is what
each of them does."""
from __future__ import annotations

import msgpack
import pytest

from shardq import limits
from shardq.client.channel import MERGE_BYTES_MAX, RELEASE, Channel
from shardq.client.core import ConnectionLost
from shardq.errors import Closed, InvalidJob, OutcomeUnknown, ShardUnavailable
from shardq.protocol import wire


def up(**kw) -> Channel:
    chan = Channel(3, 77, retry_s=kw.pop("retry_s", 5.0), **kw)
    chan.connected()
    return chan


def sent(frames: list[bytes]) -> list[list]:
    """The requests of ``frames`` (each its 4-byte length, then a msgpack array)."""
    out = []
    for data in frames:
        assert int.from_bytes(data[:4], "big") == len(data) - 4
        out += msgpack.unpackb(data[4:], raw=False)
    return out


def ok(rid: int, payload: object) -> list:
    return [rid, wire.OK, payload]


def test_requests_of_one_flush_leave_in_one_frame_and_replies_find_their_waiters():
    chan = up()
    a, b = chan.submit("ping", [], "A", 0.0), chan.submit("stats", [], "B", 0.0)
    frames, done = chan.flush(0.0)
    assert len(frames) == 1 and done == []
    assert [(rid, op) for rid, op, _ in sent(frames)] == [(a.rid, "ping"), (b.rid, "stats")]
    assert chan.replies([ok(b.rid, "s"), ok(a.rid, 7), ok(999, "nobody's")]) == [("B", "s", None), ("A", 7, None)]
    assert chan.idle() and chan.replies([ok(a.rid, 8)]) == []  # answered once


def test_a_request_that_cannot_be_encoded_fails_alone():
    chan = up()
    chan.submit("ping", ["\ud800"], "bad", 0.0)  # a lone surrogate: msgpack refuses it
    good = chan.submit("ping", [], "good", 0.0)
    frames, done = chan.flush(0.0)
    assert [w for w, _, e in done if isinstance(e, InvalidJob)] == ["bad"]
    assert [rid for rid, _, _ in sent(frames)] == [good.rid]


def test_frames_are_cut_at_the_frame_limit_at_its_maximum(monkeypatch):
    monkeypatch.setattr(limits, "FRAME_BYTES_MAX", 1000)
    chan = up()
    for i in range(5):
        chan.submit("dequeue", ["q" * 450, None, 1], i, 0.0)
    frames, _ = chan.flush(0.0)
    assert len(frames) == 3 and all(len(f) - 4 <= 1000 for f in frames)
    assert len(sent(frames)) == 5


def test_single_enqueues_and_acks_are_merged_and_their_replies_split():
    chan = up()
    for i in range(3):
        chan.enqueue_part([b"job%d" % i, None, "default", 0, 0, None], f"e{i}")
    chan.ack_part([1 << 10, 5], "a0")
    chan.ack_part([2 << 10, 6], "a1")
    (enq, ack), = [sent(chan.flush(0.0)[0])]
    assert enq[1] == "enqueue" and len(enq[2][0]) == 3 and enq[2][1][0] == 77  # one session of this client
    assert ack[1] == "ack" and ack[2] == [[[1 << 10, 5], [2 << 10, 6]]]
    done = chan.replies([ok(enq[0], [10, 11, 12]), ok(ack[0], [None, ["LeaseLost", "x"]])])
    assert done == [("e0", (10, False), None), ("e1", (11, False), None), ("e2", (12, False), None),
                    ("a0", (None, False), None), ("a1", (["LeaseLost", "x"], False), None)]


def test_a_merge_is_cut_at_the_job_limit_and_at_the_byte_limit():
    chan = up()
    for i in range(limits.BATCH_JOBS_MAX + 1):
        chan.enqueue_part([b"", None, "default", 0, 0, None], i)
    assert [len(r[2][0]) for r in sent(chan.flush(0.0)[0])] == [limits.BATCH_JOBS_MAX, 1]
    big = b"x" * (MERGE_BYTES_MAX // 2)
    for i in range(3):
        chan.enqueue_part([big, None, "default", 0, 0, None], i)
    chan.flush(0.0)  # (the frame limit cuts frames; the merge limit cuts requests)
    assert sorted(len(r.args[0]) for r in chan.pending.values() if r.args[0][0][0] == big) == [1, 2]


def test_a_caller_leaving_a_merged_request_keeps_the_others_items_in_place():
    """A part whose caller left used to be taken out of the merged request's waiters, so
    the next caller got the item before its own (another job's id)."""
    chan = up()
    for name in ("first", "second", "third"):
        chan.enqueue_part([name.encode(), None, "default", 0, 0, None], name)
    (rid, _, _), = sent(chan.flush(0.0)[0])
    chan.forget("first")
    assert chan.replies([ok(rid, [1, 2, 3])]) == [("second", (2, False), None), ("third", (3, False), None)]


def test_a_merged_enqueue_refused_as_a_whole_is_sent_again_item_by_item():
    chan = up()
    chan.enqueue_part([b"1", None, "ok", 0, 0, None], "a")
    chan.enqueue_part([b"2", None, "nope", 0, 0, None], "b")
    (rid, _, _), = sent(chan.flush(0.0)[0])
    assert chan.replies([[rid, wire.ERR, ["UnknownQueue", "nope"]]]) == []
    singles = sent(chan.flush(0.0)[0])
    assert [len(args[0]) for _, _, args in singles] == [1, 1]
    done = chan.replies([ok(singles[0][0], [5]), [singles[1][0], wire.ERR, ["UnknownQueue", "nope"]]])
    assert done[0] == ("a", (5, False), None) and done[1][0] == "b" and type(done[1][2]).__name__ == "UnknownQueue"


def test_a_break_reports_each_engine_call_with_whether_it_was_written():
    chan = up(hold=False)
    written = chan.submit("ping", [], "w", 0.0)
    frames, _ = chan.flush(0.0)
    waiting = chan.submit("ping", [], "u", 0.0)  # queued, not yet written
    done = chan.broken(1.0)
    lost = {w: e.sent for w, _, e in done if isinstance(e, ConnectionLost)}
    assert lost == {"w": True, "u": False} and written.done and waiting.done and not chan.up
    assert isinstance(chan.submit("ping", [], "x", 1.0), ConnectionLost)  # not connected: unsent, at once


def test_a_merged_request_is_decided_by_the_retry_table_and_requeued_with_its_session():
    chan = up()
    chan.enqueue_part([b"j", None, "default", 0, 0, None], "e")
    chan.ack_part([1 << 10, 5], "a")
    first = sent(chan.flush(0.0)[0])
    assert chan.broken(1.0) == []  # both may be re-sent: nothing fails
    assert chan.reconnect_deadline() == 5.0
    chan.connected()
    again = sent(chan.flush(2.0)[0])
    assert [(op, args) for _, op, args in again] == [(op, args) for _, op, args in first]  # same session
    done = chan.replies([ok(again[0][0], [9]), ok(again[1][0], [None])])
    assert done == [("e", (9, True), None), ("a", (None, True), None)]  # re-sent: a JobGone would mean acked
    assert not chan.sessions._open  # the session closed with its answer


def test_a_written_merged_request_past_its_retry_deadline_fails_with_outcome_unknown():
    """Written, then its connection broke past its retry deadline: the shard may have
    applied it (plain ShardUnavailable said it had not)."""
    chan = up(retry_s=1.0)
    chan.ack_part([1 << 10, 5], "a")
    chan.flush(0.0)
    (w, _, e), = chan.broken(2.0)
    assert w == "a" and type(e) is OutcomeUnknown


def test_a_request_past_its_deadline_fails_and_a_written_dequeue_stays_to_release_its_leases():
    chan = up(timeout_s=30.0)
    chan.submit("ping", [], "p", 0.0)
    deq = chan.submit("dequeue", ["q", None, 1], "d", 1.0)
    chan.submit("watch", ["q", 60], "w", 1.0)  # its caller times it
    chan.flush(1.0)
    assert chan.next_deadline() == 30.0 and chan.tick(29.9) == []
    assert [w for w, _, e in chan.tick(31.0) if isinstance(e, ShardUnavailable)] == ["p", "d"]
    assert chan.orphans() and chan.next_deadline() is None
    assert chan.replies([ok(deq.rid, [["row"]])]) == [(RELEASE, [["row"]], None)]
    assert not chan.orphans()


def test_a_waiting_dequeue_nobody_waits_for_is_withdrawn_and_a_late_answer_released():
    chan = up()
    wait = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "w", 0.0)
    chan.flush(0.0)
    chan.abandon(wait, "w")
    (cancel,) = sent(chan.flush(0.0)[0])
    assert cancel[1:] == ["cancel_wait", [wait.rid]] and chan.orphans()
    assert chan.replies([ok(cancel[0], True)]) == [] and not chan.pending  # withdrawn: no reply will come
    # the shard answered first: the withdrawal finds nothing, the leases are released
    wait = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "w2", 0.0)
    chan.flush(0.0)
    chan.abandon(wait, "w2")
    (cancel,) = sent(chan.flush(0.0)[0])
    assert chan.replies([ok(wait.rid, [["row"]]), ok(cancel[0], False)]) == [(RELEASE, [["row"]], None)]
    assert not chan.pending and not chan.orphans()


@pytest.mark.parametrize("op, args", [("dequeue", ["q", None, 1]), ("dequeue_wait", ["q", None, 1, 5.0])])
def test_a_dequeue_whose_waiter_went_before_it_could_abandon_has_its_leases_released(op, args):
    """An asyncio caller cancelled in the loop turn its reply is read in: its future is
    done before it could abandon the request, so the leases go back, not to nobody."""
    cancelled: set[str] = set()
    chan = up(gone=lambda w: w in cancelled)
    req = chan.submit(op, args, "w", 0.0)
    other = chan.submit("ping", [], "p", 0.0)
    chan.flush(0.0)
    cancelled.update(("w", "p"))
    assert chan.replies([ok(req.rid, [["row"]]), ok(other.rid, 7)]) == [(RELEASE, [["row"]], None), ("p", 7, None)]
    assert not chan.pending and not chan.orphans()
    assert chan.abandon(req, "w")  # its caller, resumed: the reply came first, nothing to withdraw
    req = chan.submit(op, args, "v", 0.0)
    chan.flush(0.0)
    cancelled.add("v")
    assert chan.replies([ok(req.rid, [])]) == [("v", [], None)]  # nothing leased: nothing to release


def test_a_waiter_leaving_after_its_reply_was_read_is_told_so_and_nothing_is_withdrawn():
    """A threaded shell settles a reply outside its lock: a caller that leaves in between
    learns that its reply came (it takes or releases the leases), instead of leaving them
    with nobody (the threaded client had a second release path for this)."""
    chan = up()
    wait = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "w", 0.0)
    chan.flush(0.0)
    assert chan.replies([ok(wait.rid, [["row"]])]) == [("w", [["row"]], None)]  # not yet resolved
    assert chan.abandon(wait, "w") is True
    assert chan.flush(0.0) == ([], []) and not chan.orphans()  # no cancel_wait, no release
    other = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "x", 0.0)
    chan.flush(0.0)
    assert chan.abandon(other, "x") is False and chan.orphans()  # not answered: withdrawn


def test_a_request_abandoned_before_it_was_written_is_never_sent():
    chan = up()
    req = chan.submit("ping", [], "p", 0.0)
    chan.abandon(req, "p")
    wait = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "w", 0.0)
    chan.abandon(wait, "w")  # never written: nothing to withdraw
    assert chan.flush(0.0) == ([], []) and chan.idle()


def test_a_break_drops_orphans_and_withdrawals_and_no_connection_fails_what_waits():
    chan = up()
    deq = chan.submit("dequeue", ["q", None, 1], "d", 0.0)
    chan.submit("dequeue", ["q", None, 1], "d2", 0.0)
    chan.flush(0.0)
    chan.abandon(deq, "d")
    done = chan.broken(0.0)
    assert [(w, type(e)) for w, _, e in done] == [("d2", ConnectionLost)] and not chan.orphans()
    chan.submit("ping", [], "p", 0.0)  # hold: waits for the next connection
    assert chan.reconnect_deadline() == 5.0
    (w, _, e), = chan.unreachable(ShardUnavailable("gone"))
    assert w == "p" and str(e) == "shard 3: gone"


def test_closing_fails_a_written_call_with_outcome_unknown_and_the_others_with_closed():
    """A request written before the close may have been applied: Closed told its caller
    that nothing happened (an enqueue tried again then went in twice)."""
    chan = up()
    chan.submit("ping", [], "p", 0.0)
    chan.flush(0.0)
    chan.submit("ping", [], "q", 0.0)
    chan.ack_part([1 << 10, 5], "a")
    assert sorted((w, type(e)) for w, _, e in chan.close()) == [("a", Closed), ("p", OutcomeUnknown),
                                                                 ("q", Closed)]
    assert isinstance(chan.submit("ping", [], "r", 0.0), Closed)


@pytest.mark.parametrize("op", sorted(wire.RETRY))
def test_what_a_break_means_for_a_merged_request_follows_the_retry_table(op):
    chan = up()
    chan.ack_part([1 << 10, 5], "a")  # a merged request stands in; its op is set below
    chan.flush(0.0)
    (req,) = chan.pending.values()
    req.op = op
    done = chan.broken(0.0)
    if wire.RETRY[op] is wire.RESEND:
        assert done == [] and chan.outbox == [req]
    else:
        assert isinstance(done[0][2], OutcomeUnknown)


def test_answered_requests_leave_the_deadline_queue_as_new_ones_come():
    """Every request but a wait has a deadline; an answered one must not stay queued (with
    its bodies) until the timer reaches it, under a steady stream of requests."""
    chan = up(timeout_s=30.0)
    for i in range(1000):
        req = chan.submit("ping", [], i, float(i) / 1000)
        chan.flush(float(i) / 1000)
        assert chan.replies([ok(req.rid, 1)]) == [(i, 1, None)]
    assert len(chan._deadlines) <= 1


def test_the_items_of_a_refused_merge_keep_its_deadline():
    chan = up(timeout_s=30.0)
    chan.enqueue_part([b"1", None, "ok", 0, 0, None], "a")
    chan.enqueue_part([b"2", None, "nope", 0, 0, None], "b")
    (rid, _, _), = sent(chan.flush(10.0)[0])
    chan.replies([[rid, wire.ERR, ["UnknownQueue", "nope"]]])
    chan.flush(20.0)
    assert chan.next_deadline() == 40.0
    assert sorted(w for w, _, e in chan.tick(40.0) if isinstance(e, ShardUnavailable)) == ["a", "b"]


def test_a_flush_with_nothing_left_to_send_writes_no_frame():
    """A withdrawal whose wait was answered meanwhile is dropped at the flush; nothing else
    is queued, so no frame goes (an empty one used to)."""
    chan = up()
    wait = chan.submit("dequeue_wait", ["q", None, 1, 5.0], "w", 0.0)
    chan.flush(0.0)
    chan.abandon(wait, "w")  # queues its cancel_wait
    assert chan.replies([ok(wait.rid, [])]) == []  # answered first, with nothing
    assert chan.flush(0.0) == ([], []) and chan.idle()
