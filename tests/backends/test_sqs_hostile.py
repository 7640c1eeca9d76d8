"""Hostile and foreign input on the SQS backend, sent with boto3 to the tests' moto server:
messages shardq did not write go to the dead letters with the reason (once) and consumers
go on; redrive ids cannot be forged; redrive by id finds letters past its first page and
leaves no copied letter behind (docs/scale-out.md, "Foreign messages and redrive ids")."""
from __future__ import annotations

import pytest

import shardq
from shardq.backends import sqs_dead, sqs_mapping
from shardq.backends.sqs_mapping import parse_target, queue_names
from support.service import wait_until
from support.sqs_server import fresh_target, raw_client

CONFIG = {"queues": {"default": {"visibility_timeout": 2, "max_deliveries": 3}}}


@pytest.fixture
def target(moto):
    return fresh_target(moto, CONFIG)


@pytest.fixture
def q(target):
    with shardq.connect(target) as client:
        yield client


def _urls(target):
    c = raw_client(target)
    main, dlq = queue_names(parse_target(target).prefix, "default")
    return c, c.get_queue_url(QueueName=main)["QueueUrl"], c.get_queue_url(QueueName=dlq)["QueueUrl"]


def _counts(c, url) -> tuple[int, int]:
    """(visible, hidden) messages of a queue, as SQS counts them."""
    a = c.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    return int(a["ApproximateNumberOfMessages"]), int(a["ApproximateNumberOfMessagesNotVisible"])


def _dead(q, n: int) -> list:
    """Bury ``n`` jobs of distinct keys, in enqueue order; returns their job ids."""
    ids = q.enqueue_many([{"body": b"job %d" % i, "key": f"k{i}"} for i in range(n)])
    leases = []
    while len(leases) < n:
        leases += q.dequeue_many(max_jobs=n, wait=1)
    for lease in sorted(leases, key=lambda l: ids.index(l.job_id)):
        q.bury(lease, "boom")
    return ids


# ---------------------------------------------------------------------------- foreign messages
FOREIGN = {
    "key not UTF-8": dict(MessageGroupId="kx", MessageAttributes={
        "shardq.key": {"DataType": "Binary", "BinaryValue": b"\xff\xfe"}}),
    "key of type String": dict(MessageGroupId="kuser-1", MessageAttributes={
        "shardq.key": {"DataType": "String", "StringValue": "user-1"}}),
    "no key, a keyed group": dict(MessageGroupId="orders"),
    "group does not match the key": dict(MessageGroupId="kuser-2", MessageAttributes={
        "shardq.key": {"DataType": "Binary", "BinaryValue": b"user-1"}}),
    "an attribute shardq does not write": dict(MessageGroupId="u" + "0" * 32, MessageAttributes={
        "traceparent": {"DataType": "String", "StringValue": "00-abc"}}),
    "body attribute of type String": dict(MessageGroupId="u" + "1" * 32, MessageBody="b", MessageAttributes={
        "shardq.body": {"DataType": "String", "StringValue": "x"}}),
}
REASONS = {"key not UTF-8": "not UTF-8", "key of type String": "not of type Binary",
           "no key, a keyed group": "no shardq.key", "group does not match the key": "does not match",
           "an attribute shardq does not write": "traceparent",
           "body attribute of type String": "not of type Binary"}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_foreign_message_is_dead_lettered_once_with_the_reason_and_consumers_go_on(target, q, case):
    c, url, dlq = _urls(target)
    params = {"MessageBody": "foreign", "MessageDeduplicationId": "foreign-1", **FOREIGN[case]}
    c.send_message(QueueUrl=url, **params)
    good = q.enqueue(b"good", key="good")
    leases = q.dequeue_many(max_jobs=10, wait=1)  # before: UnicodeDecodeError / KeyError, or handed out
    assert [(l.job_id, l.body) for l in leases] == [(good, b"good")]
    q.ack(leases[0])
    assert _counts(c, url) == (0, 0)
    (dead,) = q.dead_letters()
    assert dead.body == params["MessageBody"].encode() and dead.key is None
    assert dead.error.startswith("not a shardq message") and REASONS[case] in dead.error
    assert _counts(c, dlq) == (1, 0)


def test_a_body_over_the_queues_limit_is_dead_lettered(target):
    c, url, dlq = _urls(target)
    with shardq.connect(target) as q:
        q.enqueue(b"x" * 2000, key="big")
    c.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": "1024"})
    with shardq.connect(target) as q:  # reads the new limit
        q.enqueue(b"small", key="small")
        leases = q.dequeue_many(max_jobs=10, wait=1)
        assert [l.body for l in leases] == [b"small"]
        (dead,) = q.dead_letters()
        assert "over the queue's limit of 1024" in dead.error and dead.body == b"x" * 2000


def test_a_move_retried_after_a_failed_delete_adds_no_second_dead_letter(target, q, monkeypatch):
    c, url, dlq = _urls(target)
    c.send_message(QueueUrl=url, MessageBody="foreign", MessageGroupId="orders", MessageDeduplicationId="f1")
    call = q.api.call
    failed = []

    def lose_first_delete(op, **params):
        if op == "delete_message" and not failed:
            failed.append(params)
            raise shardq.ShardUnavailable("delete_message: connection reset (test)")
        return call(op, **params)

    monkeypatch.setattr(q.api, "call", lose_first_delete)
    assert q.dequeue(wait=1) is None and failed
    # The foreign message comes back when its 2 s visibility ends, and is moved again.
    wait_until(lambda: q.dequeue(wait=1) is None and _counts(c, url) == (0, 0), 15, 0.05,
               "the second move to delete it")
    assert _counts(c, dlq) == (1, 0)  # the copy of the retried move was deduplicated


# ---------------------------------------------------------------------------- redrive ids
def test_a_forged_redrive_id_gives_no_message_an_existing_job_id(target, q):
    c, url, _ = _urls(target)
    victim = q.enqueue(b"real", key="acct-1")
    group = sqs_mapping.group_id("acct-1")
    key_attr = {"shardq.key": {"DataType": "Binary", "BinaryValue": b"acct-1"}}
    # before: "r<id>." was enough to carry the id; the mac-less and a made-up mac are refused
    for n, dedup in enumerate([f"r{victim}.{'0' * 40}", f"r{victim}.{'1' * 16}.{'2' * 32}"]):
        c.send_message(QueueUrl=url, MessageBody=f"forged {n}", MessageGroupId=group,
                       MessageDeduplicationId=dedup, MessageAttributes=key_attr)
    got = []
    while True:
        leases = q.dequeue_many(max_jobs=10, wait=1)
        if not leases:
            break
        got += [(lease.job_id, lease.body) for lease in leases]
        q.ack_many(leases)
    assert got == [(victim, b"real")]  # before: also (victim, b"forged 0")
    dead = q.dead_letters()
    assert sorted(d.body for d in dead) == [b"forged 0", b"forged 1"]
    assert all(d.job_id != victim and ("does not verify" in d.error or "no form" in d.error) for d in dead)


def test_a_real_redrive_id_replayed_with_another_body_is_refused(target, q):
    c, url, _ = _urls(target)
    (job_id,) = _dead(q, 1)
    assert q.redrive(job_ids=[job_id]) == 1
    (m,) = c.receive_message(QueueUrl=url, MessageSystemAttributeNames=["All"],
                             MessageAttributeNames=["All"], WaitTimeSeconds=1)["Messages"]
    dedup = m["Attributes"]["MessageDeduplicationId"]
    assert dedup.startswith(f"r{job_id}.")
    c.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])  # moto then forgets the id
    c.send_message(QueueUrl=url, MessageBody="replayed", MessageGroupId=m["Attributes"]["MessageGroupId"],
                   MessageDeduplicationId=dedup, MessageAttributes={
                       "shardq.key": {"DataType": "Binary", "BinaryValue": b"k0"}})
    assert q.dequeue(wait=1) is None
    (dead,) = q.dead_letters()
    assert dead.body == b"replayed" and dead.job_id != job_id and "does not verify" in dead.error


def test_redrive_and_bury_need_the_redrive_key_that_init_writes(target, q):
    c, url, dlq = _urls(target)
    assert sqs_mapping.parse_redrive_key(c.list_queue_tags(QueueUrl=dlq)["Tags"]["shardq.redrive-key"])
    c.untag_queue(QueueUrl=dlq, TagKeys=["shardq.redrive-key"])
    with shardq.connect(target) as fresh:
        fresh.enqueue(b"x")
        with pytest.raises(shardq.InvalidConfig, match="sqs init"):
            fresh.bury(fresh.dequeue(wait=1), "boom")
    from support.sqs_server import init_queues
    lines = init_queues(target, CONFIG)
    assert "tag shardq.redrive-key added" in lines[0]
    assert "added" not in init_queues(target, CONFIG)[0]  # an existing key is kept


# ---------------------------------------------------------------------------- redrive by id
def test_redrive_by_id_finds_a_letter_past_a_first_page_whose_hide_ran_out(target, q, monkeypatch):
    """Letters passed over on the first page reappear when their hide ends; the scan used
    to take a page of only those as the end and miss the letters behind them."""
    monkeypatch.setattr(sqs_dead, "LIST_HIDE_S", 2)
    ids = _dead(q, 11)
    c, _, dlq = _urls(target)
    call, pages = q.api.call, []

    def slow_pages(op, **params):
        if op == "receive_message" and params.get("QueueUrl") == dlq and pages:
            # The scan runs past the first page's hide (as a long one does with 30 s).
            wait_until(lambda: q._clock.monotonic() > pages[0] + 2.2, 10, 0.05, "the first page's hide to end")
        t0 = q._clock.monotonic()
        resp = call(op, **params)
        if op == "receive_message" and params.get("QueueUrl") == dlq and not pages:
            pages.append(t0)
            first = [m["Body"] for m in resp.get("Messages", [])]
            assert len(first) == 10 and "job 10" not in first  # the wanted one is behind the first page
        return resp

    monkeypatch.setattr(q.api, "call", slow_pages)
    assert q.redrive(job_ids=[ids[10]]) == 1
    monkeypatch.setattr(q.api, "call", call)
    lease = q.dequeue(wait=1)
    assert lease.job_id == ids[10]
    assert len(q.dead_letters()) == 10


def test_a_failed_delete_is_retried_so_a_later_redrive_cannot_copy_the_letter_again(target, q, monkeypatch):
    monkeypatch.setattr(sqs_dead, "LIST_HIDE_S", 2)
    (job_id,) = _dead(q, 1)
    c, url, dlq = _urls(target)
    call, refused = q.api.call, []

    def refuse_first_delete(op, **params):
        if op == "delete_message_batch" and not refused:  # SQS answers, deletes nothing
            refused.append(params)
            return {"Successful": [], "Failed": [{"Id": e["Id"], "Code": "InternalError", "SenderFault": False,
                                                  "Message": "failed (test)"} for e in params["Entries"]]}
        return call(op, **params)

    monkeypatch.setattr(q.api, "call", refuse_first_delete)
    assert q.redrive(job_ids=[job_id]) == 1 and refused
    assert _counts(c, dlq) == (0, 0)  # before: the letter stayed, for a later redrive to copy again
    assert _counts(c, url)[0] == 1


def test_a_letter_that_cannot_be_deleted_is_named(target, q, monkeypatch):
    monkeypatch.setattr(sqs_dead, "LIST_HIDE_S", 1)
    (job_id,) = _dead(q, 1)
    call = q.api.call

    def refuse_deletes(op, **params):
        if op == "delete_message_batch":
            return {"Successful": [], "Failed": [{"Id": e["Id"], "Code": "InternalError", "SenderFault": False,
                                                  "Message": "failed (test)"} for e in params["Entries"]]}
        return call(op, **params)

    monkeypatch.setattr(q.api, "call", refuse_deletes)
    with pytest.raises(shardq.ShardUnavailable, match=job_id):
        q.redrive(job_ids=[job_id])


def test_a_redrive_whose_letter_comes_back_foreign_still_names_what_it_left(target, q, monkeypatch):
    # The letter is copied, its delete keeps failing, and when it is received again the
    # queue's redrive key is gone (its tag removed meanwhile): it decodes as Foreign. The
    # redrive must still end with ShardUnavailable naming it, not an AttributeError.
    _dead(q, 1)
    monkeypatch.setattr(sqs_dead, "LIST_HIDE_S", 1)
    key_reads = []
    redrive_key = q.api.redrive_key

    def key_then_none(info):
        key_reads.append(info.name)
        return redrive_key(info) if len(key_reads) <= 2 else None  # decode, then the copy's mac

    batch = q.api.batch

    def deletes_fail(op, url, entries, on_fail):
        if op != "delete_message_batch":
            return batch(op, url, entries, on_fail)
        for i in range(len(entries)):
            on_fail(i, shardq.ShardUnavailable("delete_message_batch: connection reset (test)"))

    monkeypatch.setattr(q.api, "redrive_key", key_then_none)
    monkeypatch.setattr(q.api, "batch", deletes_fail)
    with pytest.raises(shardq.ShardUnavailable, match=r"job\(s\) \S+ are back in the queue"):
        q.redrive()
    assert len(key_reads) > 2  # received again after the key went
