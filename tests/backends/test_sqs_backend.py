"""The SQS backend's own logic, against a real moto server: the head buffer, local fencing,
refused features, limits at their maximum, batching, throttling, stats, ids."""
from __future__ import annotations

import logging
import os
import time
from collections import Counter

import pytest

import shardq
from shardq import limits
from shardq.backends import sqs_mapping
from shardq.backends.sqs import SqsQueue
from shardq.consumer.idempotency import SqliteStore
from support.service import wait_until
from support.sqs_server import fresh_target, init_queues, raw_client
from support.task_apps import make_app

CONFIG = {"queues": {"default": {"visibility_timeout": 2, "max_deliveries": 3,
                                 "max_body_bytes": limits.SQS_MESSAGE_BYTES_MAX}}}


@pytest.fixture
def target(moto):
    return fresh_target(moto, CONFIG)


@pytest.fixture
def q(target):
    with shardq.connect(target) as client:
        yield client


def count_requests(q) -> Counter:
    """Requests this client sends, by operation (a botocore event hook: retries count too)."""
    counts: Counter = Counter()
    q.client.meta.events.register("before-send.sqs",
                                  lambda event_name, **kw: counts.update([event_name.rsplit(".", 1)[-1]]))
    return counts


# ---------------------------------------------------------------------------- the head buffer
def test_followers_are_handed_out_from_the_buffer_without_a_receive(q):
    q.enqueue_many([{"body": f"{i}".encode(), "key": "a"} for i in range(4)])
    counts = count_requests(q)
    first = q.dequeue_many(max_jobs=10, wait=1)
    assert [l.body for l in first] == [b"0"]
    assert counts["ReceiveMessage"] == 1 and len(q._buffer) == 3
    bodies = [b"0"]
    q.ack(first[0])
    for expect in (b"1", b"2", b"3"):
        (lease,) = q.dequeue_many(max_jobs=1)
        assert (lease.body, lease.attempt) == (expect, 1)  # one receive, one delivery
        q.ack(lease)
        bodies.append(lease.body)
    assert counts["ReceiveMessage"] == 1
    assert bodies == [b"0", b"1", b"2", b"3"]


def test_followers_stay_hidden_while_the_head_is_extended(target, q):
    q.enqueue_many([{"body": f"{i}".encode(), "key": "a"} for i in range(3)])
    (head,) = q.dequeue_many(max_jobs=10, wait=1)
    other = shardq.connect(target)
    try:
        # Hold the head for three of its 2 s leases; the keeper extends the followers.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            head = q.extend(head, 2)
            assert other.dequeue_many(max_jobs=10, wait=0.5) == []
        q.ack(head)
        (nxt,) = q.dequeue_many(max_jobs=10)
        assert (nxt.body, nxt.attempt) == (b"1", 1)
    finally:
        other.close()


def test_a_nacked_head_releases_its_followers_and_the_key_comes_back_in_order(target, q):
    q.enqueue_many([{"body": f"{i}".encode(), "key": "a"} for i in range(3)])
    (head,) = q.dequeue_many(max_jobs=10, wait=1)
    q.nack(head)
    assert len(q._buffer) == 0
    other = shardq.connect(target)
    try:
        got = []
        while len(got) < 3:
            for lease in wait_until(lambda: other.dequeue_many(max_jobs=1, wait=0.5), 10, 0.01, "a job"):
                got.append((lease.body, lease.attempt))
                other.ack(lease)
        # A released follower spent one receive: SQS counts receives (docs/scale-out.md).
        assert got == [(b"0", 2), (b"1", 2), (b"2", 2)]
    finally:
        other.close()


def test_a_head_that_runs_out_releases_followers_first_so_the_head_comes_back_first(target, q):
    q.enqueue_many([{"body": f"{i}".encode(), "key": "a"} for i in range(3)])
    (head,) = q.dequeue_many(max_jobs=10, wait=1)
    wait_until(lambda: len(q._buffer) == 0, 5, 0.02, "the keeper to release the followers")
    other = shardq.connect(target)
    try:
        again = wait_until(lambda: other.dequeue(wait=0.5), 10, 0.01, "the head again")
        assert (again.body, again.attempt) == (b"0", 2)
        with pytest.raises(shardq.LeaseLost):
            q.ack(head)
    finally:
        other.close()


def test_close_releases_the_buffer(target):
    q = shardq.connect(target)
    q.enqueue_many([{"body": f"{i}".encode(), "key": "a"} for i in range(3)])
    (head,) = q.dequeue_many(max_jobs=10, wait=1)
    q.ack(head)
    q.close()
    with shardq.connect(target) as other:
        lease = other.dequeue(wait=1)
        assert lease.body == b"1"


# ---------------------------------------------------------------------------- fencing
def test_ack_after_the_local_deadline_is_refused_without_a_request(q):
    q.enqueue(b"x")
    lease = q.dequeue(wait=1, visibility=1)
    counts = count_requests(q)
    wait_until(lambda: time.time() >= lease.deadline, 5, 0.05, "the deadline")
    for call in (q.ack, lambda l: q.extend(l, 5), q.nack):
        with pytest.raises(shardq.LeaseLost):
            call(lease)
    assert isinstance(q.ack_many([lease])[0], shardq.LeaseLost)
    assert sum(counts.values()) == 0


class _LateClock:
    """The client's clock, moved on by ``shift`` seconds the moment a receive is answered:
    a long poll answered late, or a process stopped (SIGSTOP) while it was answered."""

    def __init__(self, clock, api, shift: float):
        self.clock, self.late = clock, 0.0
        real = api.call

        def call(op, **kw):
            answer = real(op, **kw)
            if op == "receive_message":
                self.late = shift
            return answer
        api.call = call

    def now(self) -> float:
        return self.clock.now() + self.late

    def monotonic(self) -> float:
        return self.clock.monotonic() + self.late


def test_a_receive_answered_late_but_within_its_deadline_restarts_the_visibility(q):
    q.enqueue(b"x")
    q._clock = _LateClock(q._clock, q.api, 1.2)  # over half the 2 s visibility, under its margin
    counts = count_requests(q)
    before = time.time()
    lease = q.dequeue(wait=1)
    assert lease is not None and lease.body == b"x"
    assert counts["ChangeMessageVisibilityBatch"] == 1
    assert lease.deadline >= before + 1.2 + 2  # counted from the change, on the client's clock
    q.ack(lease)


def test_a_receive_answered_after_another_consumer_took_the_message_hands_out_nothing(q, target):
    """Found by the worker-fault run: a worker stopped (SIGSTOP) while its receive was
    answered wakes past the visibility timeout, after SQS handed the message to another
    consumer. Restarting the visibility with its stale handle must fail (AWS refuses it; the
    tests' moto is made to), and the message must not be handed out a second time."""
    q.enqueue(b"x", key="k")
    with shardq.connect(target) as other:
        real = q.api.call
        taken = []

        def call(op, **kw):
            answer = real(op, **kw)
            if op == "receive_message" and answer.get("Messages") and not taken:
                # held back until the visibility (2 s) ends and another consumer takes it
                taken.append(wait_until(lambda: other.dequeue(wait=1), 10, 0, "the redelivery"))
            return answer

        q.api.call = call
        counts = count_requests(q)
        assert q.dequeue(wait=1) is None
        assert counts["ChangeMessageVisibilityBatch"] == 1  # tried, and refused
        (lease,) = taken
        assert (lease.body, lease.attempt) == (b"x", 2)
        assert q.dequeue() is None  # still held by the other consumer, not by q
        other.ack(lease)


def test_server_side_invalid_handle_is_lease_lost_per_entry(q):
    q.enqueue_many([{"body": b"a"}, {"body": b"b"}])
    leases = q.dequeue_many(max_jobs=2, wait=1)
    bogus = leases[0]._replace(token="not-a-receipt-handle")
    results = q.ack_many([leases[0], bogus, leases[1]])
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], shardq.LeaseLost)


def test_extend_and_visibility_round_up_to_whole_seconds(q):
    q.enqueue(b"x")
    t0 = time.time()
    lease = q.dequeue(wait=1, visibility=0.2)
    assert t0 + 1 - 0.01 <= lease.deadline <= time.time() + 1
    lease = q.extend(lease, 1.5)
    assert lease.deadline >= t0 + 2 - 0.01
    q.ack(lease)


# ---------------------------------------------------------------------------- refused features
@pytest.mark.parametrize("kw,feature", [({"delay": 5}, "delay"), ({"priority": 3}, "priority")])
def test_features_sqs_fifo_lacks_are_refused_by_name(q, kw, feature):
    with pytest.raises(shardq.Unsupported, match=f"(?s){feature}.*sqs backend"):
        q.enqueue(b"x", **kw)
    with pytest.raises(shardq.Unsupported, match=feature):
        q.enqueue_many([{"body": b"ok"}, {"body": b"x", **kw}])
    assert q.stats()["queues"]["default"]["ready"] == 0  # nothing was sent


def test_results_and_workflows_are_refused_with_the_reason_and_nothing_is_sent(q):
    app, kept, plain = make_app(q)

    with pytest.raises(shardq.Unsupported, match="keeps none"):
        kept.send()
    with pytest.raises(shardq.Unsupported, match="keeps no results"):
        shardq.chain(plain.s(), plain.s()).send()
    with pytest.raises(shardq.Unsupported, match="keeps none"):
        app.result("any-id", timeout=1)
    assert q.stats()["queues"]["default"]["ready"] == 0  # nothing was sent
    plain.send(1)  # a task that keeps nothing is sent as before
    assert q.stats()["queues"]["default"]["ready"] == 1


def test_nack_delay_past_the_12_hour_limit_is_refused(q):
    q.enqueue(b"x")
    lease = q.dequeue(wait=1)
    with pytest.raises(shardq.Unsupported, match="12 h"):
        q.nack(lease, delay=limits.SQS_VISIBILITY_S_MAX + 1)
    q.nack(lease, delay=1)  # still ours, and a short delay works
    assert q.dequeue() is None
    assert wait_until(lambda: q.dequeue(wait=0.5), 10, 0.01, "the delayed job").attempt == 2


def test_nack_error_text_is_logged_not_kept(q, caplog):
    q.enqueue(b"x")
    lease = q.dequeue(wait=1)
    with caplog.at_level(logging.INFO, logger="shardq.sqs"):
        q.nack(lease, error="ValueError: boom")
    assert "ValueError: boom" in caplog.text


# ---------------------------------------------------------------------------- limits
def test_binary_body_at_the_limit_counts_its_attribute(q):
    overhead = len(sqs_mapping.BINARY_BODY_MARK) + len(sqs_mapping.ATTR_BODY) + len("Binary")
    body = os.urandom(limits.SQS_MESSAGE_BYTES_MAX - overhead - 1) + b"\xff"  # not UTF-8
    job_id = q.enqueue(body)
    lease = q.dequeue(wait=2)
    assert lease.job_id == job_id and lease.body == body
    q.ack(lease)
    with pytest.raises(shardq.InvalidJob, match="as SQS counts"):
        q.enqueue(body + b"\xff")


def test_key_and_body_share_the_limit(q):
    key = "k" * 512  # the longest key shardq allows: its group id is hashed, the key rides along
    overhead = len(sqs_mapping.ATTR_KEY) + len("Binary") + len(key)
    body = b"x" * (limits.SQS_MESSAGE_BYTES_MAX - overhead)
    q.enqueue(body, key=key)
    lease = q.dequeue(wait=2)
    assert (lease.key, lease.body == body) == (key, True)
    q.ack(lease)
    with pytest.raises(shardq.InvalidJob):
        q.enqueue(body + b"x", key=key)


def test_batches_are_cut_at_10_entries_and_1_mib(q):
    counts = count_requests(q)
    q.enqueue_many([{"body": b"x"} for _ in range(25)])
    assert counts["SendMessageBatch"] == 3
    big = b"y" * (400 * 1024)
    q.enqueue_many([{"body": big} for _ in range(3)])  # 2 fit in 1 MiB, the third does not
    assert counts["SendMessageBatch"] == 5
    leases = []
    while len(leases) < 28:
        leases += q.dequeue_many(max_jobs=28, wait=1)
    counts.clear()
    assert q.ack_many(leases) == [None] * 28
    assert counts["DeleteMessageBatch"] == 3


def _fail_on_sqs_side(q, monkeypatch, ids: list[str], code="InternalError", sender_fault=False) -> list:
    """The next SendMessageBatch sends all but the entries ``ids`` to the server and reports
    those as failed (listed last first: SQS does not sort them), as SQS does when it fails
    entries on its side. Returns the bodies of every SendMessageBatch, per call."""
    call, calls = q.api.call, []

    def send_some(op, **params):
        if op != "send_message_batch":
            return call(op, **params)
        entries = params["Entries"]
        calls.append([e["MessageBody"] for e in entries])
        if len(calls) > 1:
            return call(op, **params)
        sent = [e for e in entries if e["Id"] not in ids]
        resp = dict(call(op, **dict(params, Entries=sent))) if sent else {"Successful": []}
        resp["Failed"] = [{"Id": i, "Code": code, "SenderFault": sender_fault, "Message": "failed"}
                          for i in reversed(ids)]
        return resp

    monkeypatch.setattr(q.api, "call", send_some)
    return calls


def _drain(q, n: int) -> list[bytes]:
    bodies = []
    while len(bodies) < n:
        for lease in q.dequeue_many(max_jobs=10, wait=1):
            bodies.append(lease.body)
            q.ack(lease)
    return bodies


def test_entries_sqs_fails_on_its_side_are_resent_in_input_order_with_their_ids(q, monkeypatch):
    calls = _fail_on_sqs_side(q, monkeypatch, ["1", "2"])
    ids = q.enqueue_many([{"body": b"%d" % i, "key": f"k{i}"} for i in range(4)])
    assert calls == [["0", "1", "2", "3"], ["1", "2"]]  # the failed ones again, in input order
    assert all(ids) and len(set(ids)) == 4
    assert sorted(_drain(q, 4)) == [b"0", b"1", b"2", b"3"]  # each once: same dedup ids


def test_an_entry_refused_for_its_content_raises_and_is_not_resent(q, monkeypatch):
    calls = _fail_on_sqs_side(q, monkeypatch, ["0"], code="InvalidMessageContents", sender_fault=True)
    with pytest.raises(shardq.ShardqError, match="InvalidMessageContents"):
        q.enqueue_many([{"body": b"0", "key": "a"}, {"body": b"1", "key": "b"}])
    assert len(calls) == 1


def test_a_later_job_of_a_key_accepted_while_an_earlier_one_failed_is_logged(q, monkeypatch, caplog):
    """What SQS does to a message group when it fails one entry of a batch on its side is
    not documented; if it accepts a later entry of the group, the failed one can only land
    behind it. The client says so, naming the group (docs/scale-out.md)."""
    _fail_on_sqs_side(q, monkeypatch, ["0"])
    with caplog.at_level(logging.WARNING, logger="shardq.sqs"):
        q.enqueue_many([{"body": b"first", "key": "a"}, {"body": b"second", "key": "a"},
                        {"body": b"other", "key": "b"}])
    warned = [r.getMessage() for r in caplog.records if "re-sent behind it" in r.getMessage()]
    assert len(warned) == 1 and repr(sqs_mapping.group_id("a")) in warned[0]
    assert [b for b in _drain(q, 3) if b != b"other"] == [b"second", b"first"]


def test_waits_longer_than_one_long_poll_loop(q, monkeypatch):
    monkeypatch.setattr(limits, "SQS_WAIT_S_MAX", 1)  # one long poll = 1 s here, 20 s on SQS
    counts = count_requests(q)
    t0 = time.monotonic()
    assert q.dequeue(wait=2.5) is None
    assert time.monotonic() - t0 >= 2.5
    assert counts["ReceiveMessage"] >= 3


# ---------------------------------------------------------------------------- throttling
class _Raw:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **kw):
        yield self.body


def _throttle(q, times: int) -> Counter:
    """Answer the next ``times`` SendMessage requests with SQS's throttling error."""
    from botocore.awsrequest import AWSResponse
    counts: Counter = Counter()

    def handler(request, **kw):
        counts["sent"] += 1
        if counts["throttled"] < times:
            counts["throttled"] += 1
            body = b'{"__type":"com.amazonaws.sqs#ThrottlingException","message":"Rate exceeded"}'
            return AWSResponse(request.url, 400, {"x-amzn-query-error": "Throttling;Sender",
                                                  "Content-Type": "application/x-amz-json-1.0"}, _Raw(body))
        return None
    q.client.meta.events.register("before-send.sqs.SendMessage", handler)
    return counts


def test_throttling_is_retried_with_backoff(target):
    with SqsQueue(target, max_attempts=3) as q:
        counts = _throttle(q, 2)
        job_id = q.enqueue(b"x")
        assert counts["sent"] == 3 and isinstance(job_id, str)


def test_throttling_that_persists_is_shard_unavailable(target):
    with SqsQueue(target, max_attempts=2) as q:
        counts = _throttle(q, 100)
        with pytest.raises(shardq.ShardUnavailable, match="Throttl"):
            q.enqueue(b"x")
        assert counts["sent"] == 2


def test_a_server_that_is_gone_is_shard_unavailable():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with SqsQueue(f"sqs://us-east-1/p?endpoint=http://127.0.0.1:{port}", max_attempts=1) as q:
        with pytest.raises(shardq.ShardUnavailable):
            q.enqueue(b"x")


# ---------------------------------------------------------------------------- admin and ids
def test_stats_are_labelled_approximate(q):
    q.enqueue_many([{"body": b"a"}, {"body": b"b"}])
    q.dequeue(wait=1)
    st = q.stats()
    assert st["approximate"] is True and st["backend"] == "sqs"
    c = st["queues"]["default"]
    assert (c["ready"], c["in_flight"], c["dead"], c["approximate"]) == (1, 1, 0, True)


def test_dead_letters_report_max_deliveries_and_no_error_text(q):
    job_id = q.enqueue(b"poison", key="p")
    for _ in range(3):
        lease = wait_until(lambda: q.dequeue(wait=0.5), 10, 0.01, "a delivery")
        q.nack(lease, error="boom")
    assert q.dequeue(wait=0.5) is None
    (dead,) = q.dead_letters()
    assert (dead.job_id, dead.attempts, dead.error) == (job_id, 3, None)
    assert q.dead_letters() == [dead]  # listing twice changes nothing
    with pytest.raises(shardq.Unsupported, match="by job id.*sqs backend"):
        q.purge_dead_letters(job_ids=[job_id])  # SQS cannot pick dead letters to delete
    assert q.dead_letters() == [dead]  # refused: nothing deleted
    assert q.purge_dead_letters() == 1 and q.dead_letters() == []


def test_unknown_queue_says_how_to_create_it(q):
    with pytest.raises(shardq.UnknownQueue, match="shardq sqs init"):
        q.enqueue(b"x", queue="nope")
    with pytest.raises(shardq.InvalidJob, match="letters, digits"):
        q.enqueue(b"x", queue="has_underscore")


@pytest.mark.parametrize("bad", ["sqs://", "sqs://us-east-1/", "sqs://us-east-1/p?nope=1",
                                 "sqs://us-east-1/p?endpoint=ftp://x", "sqs://us-east-1/bad.prefix"])
def test_bad_targets_are_invalid_config(bad):
    with pytest.raises(shardq.InvalidConfig):
        shardq.connect(bad)


def test_service_id_binds_the_idempotency_store(target, q, tmp_path):
    assert q.service_id.startswith("sqs:us-east-1:127.0.0.1:") and q.service_id.endswith(
        ":" + sqs_mapping.parse_target(target).prefix)
    store = SqliteStore(tmp_path / "effects.sqlite")
    try:
        store.bind(q.service_id)
        with pytest.raises(shardq.InvalidConfig):
            store.bind("sqs:us-east-1:elsewhere:other")
    finally:
        store.close()


def test_init_is_idempotent_and_refuses_what_sqs_cannot_hold(moto):
    target = moto.target()
    cfg = {"queues": {"default": {"visibility_timeout": 2.5, "max_deliveries": 1000}}}
    assert [line.split(":")[0].split()[0] for line in init_queues(target, cfg)] == ["created", "created"]
    assert [line.split()[0] for line in init_queues(target, cfg)] == ["unchanged", "unchanged"]
    cfg["queues"]["default"]["max_deliveries"] = 4
    lines = init_queues(target, cfg)
    assert lines[0].startswith("unchanged") and lines[1].startswith("updated") and "maxReceiveCount" in lines[1]
    with shardq.connect(target) as q:
        assert q.queue_config()["visibility_timeout"] == 3  # rounded up: SQS counts whole seconds
        assert q.queue_config()["max_deliveries"] == 4
    with pytest.raises(shardq.InvalidConfig, match="max_deliveries"):
        init_queues(target, {"queues": {"x": {"max_deliveries": 1001}}})
    with pytest.raises(shardq.Unsupported, match="dedup_window"):
        init_queues(target, {"queues": {"x": {"dedup_window": 60}}})
    with pytest.raises(shardq.Unsupported, match="max_body_bytes"):
        init_queues(target, {"queues": {"x": {"max_body_bytes": limits.SQS_MESSAGE_BYTES_MAX + 1}}})
    assert raw_client(target).list_queues(QueueNamePrefix=sqs_mapping.parse_target(target).prefix + "-x") \
        .get("QueueUrls", []) == []  # refused before anything was created


def test_a_job_at_the_size_limit_can_be_redriven_with_its_id(q):
    body = b"z" * limits.SQS_MESSAGE_BYTES_MAX  # text: the whole limit is the body
    job_id = q.enqueue(body)
    for _ in range(3):
        q.nack(wait_until(lambda: q.dequeue(wait=0.5), 10, 0.01, "a delivery"))
    assert q.dequeue(wait=0.5) is None
    assert q.redrive(job_ids=[job_id]) == 1  # the copy carries the id in its dedup id: no extra bytes
    lease = q.dequeue(wait=1)
    assert (lease.job_id, lease.attempt, lease.body == body) == (job_id, 1, True)
    q.ack(lease)
