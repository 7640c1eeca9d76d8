"""SIGKILL of the whole service (supervisor, shards, the SQS listener) under load over the
SQS API: no answered SendMessage is lost, no answered DeleteMessage comes undone, and each
FIFO group comes back in the order its sends were answered."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from tests.support.service import short_tmpdir, wait_until
from tests.support.sqs_listener import client, sqs_service, sqs_url

GROUPS = 4


@pytest.fixture
def data_dir():
    d = os.path.join(short_tmpdir(), "data")
    yield d
    shutil.rmtree(os.path.dirname(d), ignore_errors=True)


def test_kill_9_under_load_loses_no_answered_send_and_undoes_no_delete(data_dir):
    sent: list[str] = []                                  # standard queue: answered sends
    deleted: list[str] = []                               # answered deletes
    deleting: list[str] = []                              # deletes sent (answered or cut by the kill)
    fifo_sent: dict[str, list[int]] = {f"g{k}": [] for k in range(GROUPS)}
    stop = threading.Event()

    with sqs_service(data_dir=data_dir) as svc:
        url = sqs_url(svc)
        setup = client(url)
        # short visibility: what was in flight at the kill is received again soon after the restart
        std = setup.create_queue(QueueName="dur", Attributes={"VisibilityTimeout": "1"})["QueueUrl"]
        fifo = setup.create_queue(QueueName="dur.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]

        def produce(n: int) -> None:
            c, i = client(url), 0
            while not stop.is_set():
                body = f"p{n}-{i}"
                try:
                    c.send_message_batch(QueueUrl=std, Entries=[{"Id": "a", "MessageBody": body + "a"},
                                                                {"Id": "b", "MessageBody": body + "b"}])
                except Exception:  # noqa: BLE001 - the kill: this answer never came
                    return
                sent.extend((body + "a", body + "b"))
                i += 1

        def produce_group(g: str) -> None:
            c, i = client(url), 0
            while not stop.is_set():
                try:
                    c.send_message(QueueUrl=fifo, MessageBody=f"{g}-{i}", MessageGroupId=g,
                                   MessageDeduplicationId=f"{g}-{i}")
                except Exception:  # noqa: BLE001 - the kill
                    return
                fifo_sent[g].append(i)
                i += 1

        def consume() -> None:
            c = client(url)
            while not stop.is_set():
                try:
                    for m in c.receive_message(QueueUrl=std, MaxNumberOfMessages=10).get("Messages", []):
                        deleting.append(m["Body"])
                        c.delete_message(QueueUrl=std, ReceiptHandle=m["ReceiptHandle"])
                        deleted.append(m["Body"])
                except Exception:  # noqa: BLE001 - the kill
                    return

        threads = [threading.Thread(target=produce, args=(n,)) for n in range(2)]
        threads += [threading.Thread(target=produce_group, args=(f"g{k}",)) for k in range(GROUPS)]
        threads += [threading.Thread(target=consume)]
        for t in threads:
            t.start()
        wait_until(lambda: len(sent) >= 200 and len(deleted) >= 50 and all(len(v) >= 10 for v in fifo_sent.values()),
                   30, what="load over the SQS API")
        svc.kill_all()  # mid-load: requests in flight on every thread
        stop.set()
        for t in threads:
            t.join(30)
        answered_sent, answered_deleted, tried = set(sent), set(deleted), set(deleting)
        answered_fifo = {g: list(v) for g, v in fifo_sent.items()}

        svc.start()  # the same data dir: replay
        c = client(sqs_url(svc))
        drained: list[str] = []

        def left() -> int:
            a = c.get_queue_attributes(QueueUrl=std, AttributeNames=["All"])["Attributes"]
            return sum(int(a[k]) for k in ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                                           "ApproximateNumberOfMessagesDelayed"))
        while True:
            msgs = c.receive_message(QueueUrl=std, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
            if not msgs and not left():
                break
            drained += [m["Body"] for m in msgs]
            c.delete_message_batch(QueueUrl=std, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                          for i, m in enumerate(msgs)])
        groups: dict[str, list[int]] = {g: [] for g in fifo_sent}
        while True:
            msgs = c.receive_message(QueueUrl=fifo, MaxNumberOfMessages=10, AttributeNames=["MessageGroupId"]
                                     ).get("Messages", [])
            if not msgs:
                break
            for m in msgs:
                g, i = m["Body"].split("-")
                groups[g].append(int(i))
            c.delete_message_batch(QueueUrl=fifo, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                           for i, m in enumerate(msgs)])

    lost = answered_sent - tried - set(drained)  # a delete cut by the kill may have been done
    assert not lost, f"{len(lost)} answered sends lost, e.g. {sorted(lost)[:5]}"
    back = answered_deleted & set(drained)
    assert not back, f"{len(back)} deleted messages came back, e.g. {sorted(back)[:5]}"
    for g, want in answered_fifo.items():
        got = groups[g]
        # every answered send, in order; at most the one send in flight at the kill after them
        assert got[:len(want)] == want and len(got) - len(want) <= 1, (g, want[-3:], got[-4:])
    assert len(answered_sent) >= 200 and len(drained) > 0 and len(tried - answered_deleted) <= 1
