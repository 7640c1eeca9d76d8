"""DeleteMessage with a receipt handle whose visibility timeout has passed, against a real
``shardq serve`` with boto3 (docs/sqs-api.md): as AWS, the most recently received handle
deletes the message even after its visibility expired, while nobody received it again, so
a task that runs past its visibility timeout (Celery's) is not run again and again. A handle
from before a newer receive deletes nothing and the newer one holds; ChangeMessageVisibility
with an expired handle is still refused (AWS: MessageNotInflight)."""
from __future__ import annotations

import botocore.exceptions
import pytest

from support.service import wait_until
from tests.support.sqs_listener import module_fixtures


svc, sqs = module_fixtures()


_n = iter(range(10**6))


def counts(sqs, url) -> tuple[int, int]:
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages",
                                                                  "ApproximateNumberOfMessagesNotVisible"])
    return int(got["Attributes"]["ApproximateNumberOfMessages"]), int(got["Attributes"][
        "ApproximateNumberOfMessagesNotVisible"])


def visible_again(sqs, url, n: int = 1) -> None:
    """Wait (polled, not slept) until ``n`` messages received are visible again."""
    wait_until(lambda: counts(sqs, url) == (n, 0), 20, 0.05, "the received messages to be visible again")


def test_the_latest_handle_deletes_after_its_visibility_expired(sqs):
    url = sqs.create_queue(QueueName=f"late{next(_n)}")["QueueUrl"]
    sqs.send_message_batch(QueueUrl=url, Entries=[{"Id": "a", "MessageBody": "a"}, {"Id": "b", "MessageBody": "b"}])
    got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=2, VisibilityTimeout=1)["Messages"]
    handles = {m["Body"]: m["ReceiptHandle"] for m in got}
    assert sorted(handles) == ["a", "b"]
    visible_again(sqs, url, 2)                    # the task ran past its visibility timeout
    with pytest.raises(sqs.exceptions.MessageNotInflight):
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=handles["a"], VisibilityTimeout=30)
    sqs.delete_message(QueueUrl=url, ReceiptHandle=handles["a"])
    out = sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": "b", "ReceiptHandle": handles["b"]}])
    assert [s["Id"] for s in out["Successful"]] == ["b"] and not out.get("Failed")
    assert counts(sqs, url) == (0, 0)             # deleted, not just answered
    assert "Messages" not in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
    sqs.delete_message(QueueUrl=url, ReceiptHandle=handles["a"])  # again: deleted already, success


def test_a_handle_from_before_a_newer_receive_deletes_nothing(sqs):
    url = sqs.create_queue(QueueName=f"fenced{next(_n)}")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="fenced")
    old = sqs.receive_message(QueueUrl=url, VisibilityTimeout=1)["Messages"][0]["ReceiptHandle"]
    visible_again(sqs, url)
    new = sqs.receive_message(QueueUrl=url, VisibilityTimeout=60, AttributeNames=["ApproximateReceiveCount"])
    (msg,) = new["Messages"]
    assert msg["Attributes"]["ApproximateReceiveCount"] == "2" and msg["ReceiptHandle"] != old
    sqs.delete_message(QueueUrl=url, ReceiptHandle=old)   # AWS: success, and nothing is deleted
    assert counts(sqs, url) == (0, 1)                     # the newer delivery holds
    with pytest.raises(sqs.exceptions.MessageNotInflight):
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=old, VisibilityTimeout=30)
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=msg["ReceiptHandle"], VisibilityTimeout=1)
    visible_again(sqs, url)                               # the newer delivery runs out in turn
    sqs.delete_message(QueueUrl=url, ReceiptHandle=old)   # still nothing: old is fenced for good
    assert counts(sqs, url) == (1, 0)
    sqs.delete_message(QueueUrl=url, ReceiptHandle=msg["ReceiptHandle"])  # the latest handle deletes
    assert counts(sqs, url) == (0, 0)
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)


def test_fifo_the_latest_handle_deletes_late_and_the_group_moves_on(sqs):
    """On a FIFO queue AWS refuses an expired handle (ReceiptHandleIsInvalid); shardq deletes
    with it while nobody received the message again, and the group's next message goes
    (docs/sqs-api.md, "Differences from AWS"). A handle from before a newer receive is still
    refused, as AWS refuses it."""
    url = sqs.create_queue(QueueName=f"late{next(_n)}.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    for i in range(3):
        sqs.send_message(QueueUrl=url, MessageBody=f"m{i}", MessageGroupId="g", MessageDeduplicationId=f"d{i}")
    (m0,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=1)["Messages"]
    assert m0["Body"] == "m0"
    wait_until(lambda: counts(sqs, url) == (3, 0), 20, 0.05, "m0 to be visible again")
    sqs.delete_message(QueueUrl=url, ReceiptHandle=m0["ReceiptHandle"])
    (m1,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=1)["Messages"]
    assert m1["Body"] == "m1"                     # m0 is gone: the group moved on
    wait_until(lambda: counts(sqs, url) == (2, 0), 20, 0.05, "m1 to be visible again")
    (again,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=60)["Messages"]
    assert again["Body"] == "m1"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sqs.delete_message(QueueUrl=url, ReceiptHandle=m1["ReceiptHandle"])
    assert e.value.response["Error"]["Code"] == "ReceiptHandleIsInvalid"
    sqs.delete_message(QueueUrl=url, ReceiptHandle=again["ReceiptHandle"])
    (m2,) = sqs.receive_message(QueueUrl=url)["Messages"]
    assert m2["Body"] == "m2"


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
def test_a_handle_whose_visibility_was_set_to_0_still_deletes_while_nobody_received_it(sqs, fifo):
    """ChangeMessageVisibility 0, then DeleteMessage with the same handle: AWS deletes (it is
    still the most recently received handle); shardq deleted nothing (a nack's token was
    fenced at once). A receive in between fences it, as ever."""
    name = f"cmv0{next(_n)}" + (".fifo" if fifo else "")
    url = sqs.create_queue(QueueName=name, Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"}
                           if fifo else {})["QueueUrl"]
    group = {"MessageGroupId": "g"} if fifo else {}
    sqs.send_message(QueueUrl=url, MessageBody="a", **group)
    h = sqs.receive_message(QueueUrl=url, VisibilityTimeout=30)["Messages"][0]["ReceiptHandle"]
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=h, VisibilityTimeout=0)
    assert counts(sqs, url) == (1, 0)
    sqs.delete_message(QueueUrl=url, ReceiptHandle=h)
    assert counts(sqs, url) == (0, 0)
